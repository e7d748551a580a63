//! `ipcreduce launch -n N -- CMD...`: starts N ranks of a command with the job's variables set.

use crate::error::{Error, Result};
use std::ffi::{OsStr, OsString};

/// Placeholder until the launcher lands.
pub fn spawn_ranks(
    n: usize,
    program: &OsStr,
    args: &[OsString],
    extra_env: &[(String, String)],
) -> Result<i32> {
    let _ = (n, program, args, extra_env);
    Err(Error::Config("launch not implemented".into()))
}

pub fn in_rank() -> bool {
    std::env::var_os("IPCREDUCE_RANK").is_some() || std::env::var_os("RANK").is_some()
}
