//! Config shared by `bench` and `check`, and how they start their ranks.

use crate::launch;
use ipcreduce::backend;
use ipcreduce::bootstrap::MAX_WORLD;
use ipcreduce::types::{BackendChoice, BackendKind};
use ipcreduce::{Communicator, Config};

/// Config common to the commands that run collectives.
#[derive(clap::Args, Debug, Clone)]
pub struct RankArgs {
    /// Data plane: cuda (GPUs through CUDA IPC), host (processes through shared memory), or
    /// auto (cuda when every rank can use a GPU, host otherwise).
    #[arg(long, default_value = "auto", value_parser = parse_backend)]
    pub backend: BackendChoice,
    /// Number of ranks to start (default: one per GPU on cuda; on host one per core, at most
    /// 4). More ranks than GPUs share GPUs round-robin (run MPS for that).
    #[arg(long)]
    pub ranks: Option<usize>,
    /// Trace every rank's calls into DIR (`IPCREDUCE_TRACE=DIR` for the ranks): one file per
    /// rank at its close, with the kernels' phase stamps on cuda; `ipcreduce trace export`,
    /// `summarize` and `plot` read them.
    #[arg(long, value_name = "DIR")]
    pub trace: Option<std::path::PathBuf>,
}

fn parse_backend(s: &str) -> Result<BackendChoice, String> {
    s.parse()
}

/// A command line the ranks must not start with: the message names the flag as typed; the
/// command prints it once and exits with [`USAGE`].
pub type Usage = String;

/// Exit status of a refused command line (as clap's own parse errors).
pub const USAGE: i32 = 2;

/// Prints a refused command line once and returns [`USAGE`].
pub fn refuse(msg: &str) -> i32 {
    eprintln!("error: {msg}");
    USAGE
}

/// How the user spelled an option on this command line: `--long` when typed so, else `-s`
/// (or `--long` for options without a short form), so that errors quote what was typed.
pub fn typed_flag(short: Option<char>, long: &str) -> String {
    let long_flag = format!("--{long}");
    for a in std::env::args().skip(1) {
        if a == "--" {
            break;
        }
        if a == long_flag || a.starts_with(&format!("{long_flag}=")) {
            return long_flag;
        }
        if let Some(s) = short {
            if !a.starts_with("--") && a.starts_with(&format!("-{s}")) {
                return format!("-{s}");
            }
        }
    }
    short.map_or(long_flag, |s| format!("-{s}"))
}

/// Cores this process may run on (what `launch` binds ranks to).
pub fn usable_cores() -> usize {
    launch::usable_cores().len().max(1)
}

/// Ranks on the host backend when `--ranks` is not given: one per core, at most 4. More ranks
/// than cores would make every wait yield its core to a peer, and times meaningless.
pub fn host_default_ranks(cores: usize) -> usize {
    cores.clamp(1, 4)
}

/// Default world size for a backend choice on this machine, and why, in words.
pub fn default_ranks(choice: BackendChoice) -> (usize, String) {
    let gpus = || {
        backend::cuda::usable()
            .ok()
            .and_then(|_| cudarc::driver::safe::CudaContext::device_count().ok())
            .map(|n| n.max(1) as usize)
    };
    let host = || {
        let cores = usable_cores();
        let n = host_default_ranks(cores);
        (
            n,
            format!(
                "the host backend's default: one rank per core, at most 4 ({cores} core{} here)",
                if cores == 1 { "" } else { "s" }
            ),
        )
    };
    let per_gpu = |n: usize| (n, format!("one rank per GPU ({n} here)"));
    match choice {
        BackendChoice::Host => host(),
        BackendChoice::Cuda => per_gpu(gpus().unwrap_or(1)),
        _ => gpus().map_or_else(host, per_gpu),
    }
}

/// Checks what every command that starts ranks takes, before any rank starts: the rank count,
/// and that `--backend cuda` has a GPU.
pub fn check_rank_args(args: &RankArgs) -> Result<(), Usage> {
    if let Some(n) = args.ranks {
        if n == 0 {
            return Err("--ranks 0: a job needs at least one rank".into());
        }
        if n > MAX_WORLD {
            return Err(format!("--ranks {n}: at most {MAX_WORLD} ranks"));
        }
    }
    if args.backend == BackendChoice::Cuda {
        if let Err(e) = backend::cuda::usable() {
            return Err(format!(
                "--backend cuda: {e}; --backend host runs the same collectives between \
                 processes through shared memory"
            ));
        }
    }
    Ok(())
}

/// When not already a rank, starts the ranks (this same command, N times) and returns their
/// exit status; when a rank, returns None and the caller goes on. The rank arguments are
/// checked first (a refused one exits with [`USAGE`] before any rank starts); without
/// `--ranks`, rank 0's header says how many ranks the default gave and why, and a job with
/// more ranks than cores says its times are not representative.
pub fn relaunch_unless_rank(args: &RankArgs) -> Option<i32> {
    relaunch_with_progress(args, false)
}

/// [`relaunch_unless_rank`], drawing rank 0's progress (see `progress`) when `progress` and
/// the command runs on a terminal.
pub fn relaunch_with_progress(args: &RankArgs, progress: bool) -> Option<i32> {
    if launch::in_rank() {
        return None;
    }
    if let Err(e) = check_rank_args(args) {
        return Some(refuse(&e));
    }
    let n = match args.ranks {
        Some(n) => n,
        None => {
            let (n, why) = default_ranks(args.backend);
            println!(
                "# {n} rank{}: {why}; --ranks N for another count",
                plural(n)
            );
            n
        }
    };
    let cores = usable_cores();
    if n > cores {
        println!(
            "# {n} ranks on {cores} core{}: waiting ranks yield their core to the others, so \
             times are not representative (--ranks {cores} or fewer for timing)",
            plural(cores)
        );
    }
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("error: cannot find this program to start ranks: {e}");
            return Some(2);
        }
    };
    let rest: Vec<_> = std::env::args_os().skip(1).collect();
    let bar = crate::progress::wanted(progress).then(crate::progress::Bar::new);
    let mut env: Vec<(String, String)> = bar
        .iter()
        .map(|_| (crate::progress::ENV.to_string(), "1".to_string()))
        .collect();
    if let Some(dir) = &args.trace {
        env.push(("IPCREDUCE_TRACE".into(), dir.display().to_string()));
    }
    let output = launch::Output {
        progress: bar,
        ..launch::Output::default()
    };
    let nodes = launch::Nodes::single();
    match launch::spawn_ranks_on(
        &nodes,
        n,
        exe.as_os_str(),
        &rest,
        &env,
        launch::DEFAULT_GRACE,
        &output,
    ) {
        Ok(code) => Some(code),
        Err(e) => {
            eprintln!("error: {e}");
            Some(2)
        }
    }
}

fn plural(n: usize) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
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
