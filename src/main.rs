use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "ipcreduce", version, about = "All-reduce between GPUs or processes of one machine")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Benchmark all-reduce (nccl-tests style), every result checked.
    Bench(ipcreduce::bench::BenchArgs),
    /// Randomized correctness sweep.
    Check(ipcreduce::check::CheckArgs),
}

fn main() {
    let cli = Cli::parse();
    let code = match cli.cmd {
        Cmd::Bench(a) => ipcreduce::bench::run(a),
        Cmd::Check(a) => ipcreduce::check::run(a),
    };
    std::process::exit(code);
}
