//! Config shared by `bench` and `check`, and how they start their ranks.

use crate::launch;
use ipcreduce::backend;
use ipcreduce::types::{BackendChoice, BackendKind};
use ipcreduce::{Communicator, Config};

/// Config common to the commands that run collectives.
#[derive(clap::Args, Debug, Clone)]
pub struct RankArgs {
    /// Data plane: cuda (GPUs through CUDA IPC), host (processes through shared memory), or
    /// auto (cuda when every rank can use a GPU, host otherwise).
    #[arg(long, default_value = "auto", value_parser = parse_backend)]
    pub backend: BackendChoice,
    /// Number of ranks to start (default: one per GPU on cuda, 4 on host). More ranks than
    /// GPUs share GPUs round-robin (run MPS for that).
    #[arg(long)]
    pub ranks: Option<usize>,
}

fn parse_backend(s: &str) -> Result<BackendChoice, String> {
    s.parse()
}

/// Default world size for a backend choice on this machine.
pub fn default_ranks(choice: BackendChoice) -> usize {
    let gpus = || {
        backend::cuda::usable()
            .ok()
            .and_then(|_| cudarc::driver::safe::CudaContext::device_count().ok())
            .map(|n| n.max(1) as usize)
    };
    match choice {
        BackendChoice::Host => 4,
        BackendChoice::Cuda => gpus().unwrap_or(1),
        _ => gpus().unwrap_or(4),
    }
}

/// When not already a rank, starts the ranks (this same command, N times) and returns their
/// exit status; when a rank, returns None and the caller goes on.
pub fn relaunch_unless_rank(args: &RankArgs) -> Option<i32> {
    if launch::in_rank() {
        return None;
    }
    let n = args.ranks.unwrap_or_else(|| default_ranks(args.backend));
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("error: cannot find this program to start ranks: {e}");
            return Some(2);
        }
    };
    let rest: Vec<_> = std::env::args_os().skip(1).collect();
    match launch::spawn_ranks(n, exe.as_os_str(), &rest, &[]) {
        Ok(code) => Some(code),
        Err(e) => {
            eprintln!("error: {e}");
            Some(2)
        }
    }
}

/// Joins the job as a rank; rank 0 says which backend was picked and why.
pub fn join(args: &RankArgs, with_nccl: bool) -> ipcreduce::Result<Communicator> {
    let opts = Config {
        backend: args.backend,
        with_nccl,
        ..Config::default()
    };
    let comm = Communicator::init(&opts)?;
    if comm.rank() == 0 {
        let why = match (args.backend, comm.backend()) {
            (BackendChoice::Auto, BackendKind::Host) => match backend::cuda::usable() {
                Err(e) => format!(" (auto: {e})"),
                Ok(()) => " (auto: not every rank can use CUDA)".to_string(),
            },
            (BackendChoice::Auto, BackendKind::Cuda) => " (auto: every rank has a GPU)".into(),
            _ => String::new(),
        };
        println!(
            "# ipcreduce {} backend: {}{why}, world {}",
            env!("CARGO_PKG_VERSION"),
            comm.backend(),
            comm.world()
        );
        for (r, d) in comm.meta().devices.iter().enumerate() {
            println!("#   rank {r}: {d}");
        }
    }
    Ok(comm)
}

/// Parses sizes like 8, 64K, 32M, 1G (powers of 1024).
pub fn parse_size(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let m = match c.to_ascii_uppercase() {
                'K' => 1usize << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                'B' => 1,
                _ => return Err(format!("bad size suffix in '{s}' (use K, M or G)")),
            };
            (&s[..i], m)
        }
        _ => (s, 1),
    };
    num.parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| format!("bad size '{s}'"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("8").unwrap(), 8);
        assert_eq!(parse_size("64K").unwrap(), 64 << 10);
        assert_eq!(parse_size("32m").unwrap(), 32 << 20);
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        assert!(parse_size("1T").is_err());
        assert!(parse_size("x").is_err());
    }
}
