//! The `ipcreduce` command: `launch`, `bench`, `fused-bench`, `check`, `overlap`, `model`, `topo`, `warmup`.

mod bench;
mod check;
mod cli;
mod faults;
mod fused_bench;
mod gpu;
mod harness;
mod launch;
mod model;
mod overlap;
mod plot;
mod progress;
mod report;
mod split;
mod topo;
mod trace;
mod tune;
mod warmup;

use clap::{Parser, Subcommand};
use std::ffi::OsString;
use std::process::ExitCode;
use std::time::Duration;

#[derive(Parser, Debug)]
#[command(
    name = "ipcreduce",
    // The commit too: device scripts record it (a copied tree's git may be stale there).
    version = concat!(env!("CARGO_PKG_VERSION"), " (", env!("IPCREDUCE_GIT_COMMIT"), ")"),
    about = "All-reduce between the GPUs or processes of one machine"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Start N ranks of a command with the job's variables (IPCREDUCE_*, RANK, WORLD_SIZE...)
    Launch {
        /// Number of ranks (on this host, with --nnodes).
        #[arg(short = 'n', long = "nproc")]
        n: usize,
        /// Number of hosts in the job; one launcher runs on each.
        #[arg(long, default_value_t = 1)]
        nnodes: usize,
        /// This host's index among the job's hosts (0 runs rank 0).
        #[arg(long, default_value_t = 0)]
        node_rank: usize,
        /// Rank 0's HOST:PORT, reachable from every host (needed with --nnodes > 1).
        #[arg(long)]
        master: Option<String>,
        /// Seconds the other ranks get to stop by themselves after one failed.
        #[arg(long, default_value_t = 5.0)]
        grace: f64,
        /// Prefix every line of the ranks' output with `[rank N] ` (as mpirun's --tag-output).
        #[arg(long)]
        tag_output: bool,
        /// Ranks whose output reaches the terminal, comma separated (e.g. 0); the others write
        /// to per-rank logs (rank-N.log), printed only when that rank fails. Default: all.
        #[arg(long, value_delimiter = ',')]
        show: Option<Vec<usize>>,
        /// Keep the per-rank logs of the ranks left out of --show in this directory (default:
        /// a private directory removed at the end).
        #[arg(long)]
        log_dir: Option<std::path::PathBuf>,
        /// The command and its arguments.
        #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
        cmd: Vec<OsString>,
    },
    /// Time all-reduce, nccl-tests style.
    Bench(crate::bench::BenchArgs),
    /// Time the fused all-reduce + residual add + RMSNorm against the unfused sequence (CUDA
    /// graphs, every result checked).
    FusedBench(crate::fused_bench::FusedBenchArgs),
    /// Check all-reduce results against a float64 reference.
    Check(crate::check::CheckArgs),
    /// Training-loop benchmark: compute overlapped with bucketed all-reduce, ipcreduce vs NCCL
    Overlap(crate::overlap::OverlapArgs),
    /// Plot latency and bus bandwidth against size from bench JSON files.
    Plot(crate::plot::PlotArgs),
    /// Print the bandwidth goals table (Markdown) from bench and overlap JSON files.
    Report(crate::report::ReportArgs),
    /// Scale model: hierarchical (ipcreduce inside nodes, NCCL between) against flat NCCL
    Model(crate::model::ModelArgs),
    /// For every pair of ranks: P2P access, the link (NVML), the mapping test, auto's path
    Topo(crate::topo::TopoArgs),
    /// Measure this machine and write the tuning table that `auto` consults.
    Tune(crate::tune::TuneArgs),
    /// Jobs across nodes (cuda): the hierarchical all-reduce's time per step (intra-node
    /// reduce-scatter, NCCL between nodes, intra-node all-gather) beside flat NCCL.
    Split(crate::split::SplitArgs),
    /// Compile every kernel variant `auto` can pick for this machine into the kernel cache
    /// (IPCREDUCE_CACHE_DIR), so that jobs start without compiling: for images and CI.
    Warmup(crate::warmup::WarmupArgs),
    /// Provoke failures (mismatch, timeout, killed rank, create/destroy cycles) and check that
    /// every rank reports them.
    #[command(hide = true)]
    Faults(crate::faults::FaultArgs),
    /// Read what the ranks recorded: `trace summarize` lines up their flight records.
    Trace(crate::trace::TraceArgs),
}

/// Logs go to stderr, filtered by IPCREDUCE_LOG, else RUST_LOG, else warnings only; in colour
/// only on a terminal and without NO_COLOR (https://no-color.org), so that redirected logs
/// hold no escape codes.
fn init_logging() {
    use std::io::IsTerminal;
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("IPCREDUCE_LOG")
        .or_else(|_| EnvFilter::try_from_default_env())
        .unwrap_or_else(|_| EnvFilter::new("warn"));
    let colour = colour(
        std::io::stderr().is_terminal(),
        std::env::var_os("NO_COLOR").as_deref(),
    );
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(colour)
        .with_writer(std::io::stderr)
        .init();
}

/// Colour on a terminal unless NO_COLOR is set to anything but the empty string.
fn colour(terminal: bool, no_color: Option<&std::ffi::OsStr>) -> bool {
    terminal && no_color.is_none_or(|v| v.is_empty())
}

fn exit(code: i32) -> ExitCode {
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}

fn main() -> ExitCode {
    init_logging();
    let cli = Cli::parse();
    match cli.command {
        Cmd::Launch {
            n,
            nnodes,
            node_rank,
            master,
            grace,
            tag_output,
            show,
            log_dir,
            cmd,
        } => {
            let Some((program, args)) = cmd.split_first() else {
                eprintln!("error: launch needs a command");
                return ExitCode::from(2);
            };
            if n == 0 {
                let flag = crate::cli::typed_flag(Some('n'), "nproc");
                eprintln!("error: {flag} 0: a job needs at least one rank");
                return ExitCode::from(2);
            }
            let output = crate::launch::Output {
                tag: tag_output,
                show,
                log_dir,
                progress: None,
            };
            if !grace.is_finite() || grace < 0.0 {
                eprintln!("error: --grace must be a non-negative number of seconds");
                return ExitCode::from(2);
            }
            let grace = Duration::from_secs_f64(grace);
            let master = master.map(|m| ipcreduce::bootstrap::Master::parse(&m, "--master"));
            let nodes = match master.transpose() {
                Ok(master) => crate::launch::Nodes {
                    nnodes,
                    node_rank,
                    master,
                },
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::from(2);
                }
            };
            match crate::launch::spawn_ranks_on(&nodes, n, program, args, &[], grace, &output) {
                Ok(code) => exit(code),
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::from(1)
                }
            }
        }
        Cmd::Bench(args) => exit(crate::bench::run(args)),
        Cmd::FusedBench(args) => exit(crate::fused_bench::run(args)),
        Cmd::Check(args) => exit(crate::check::run(args)),
        Cmd::Overlap(args) => exit(crate::overlap::run(args)),
        Cmd::Plot(args) => exit(crate::plot::run(args)),
        Cmd::Report(args) => exit(crate::report::run(args)),
        Cmd::Tune(args) => exit(crate::tune::run(args)),
        Cmd::Faults(args) => exit(crate::faults::run(args)),
        Cmd::Model(args) => exit(crate::model::run(args)),
        Cmd::Topo(args) => exit(crate::topo::run(args)),
        Cmd::Split(args) => exit(crate::split::run(args)),
        Cmd::Trace(args) => exit(crate::trace::run(args)),
        Cmd::Warmup(args) => exit(crate::warmup::run(args)),
    }
}

#[cfg(test)]
mod tests {
    use std::ffi::OsStr;

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        assert!(super::colour(true, None));
        assert!(super::colour(true, Some(OsStr::new(""))));
        assert!(!super::colour(true, Some(OsStr::new("1"))));
        assert!(!super::colour(false, None));
        assert!(!super::colour(false, Some(OsStr::new("1"))));
    }
}
