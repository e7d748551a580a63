//! `ipcreduce bench`: nccl-tests-style timing table, every timed size checked.

/// Placeholder so the CLI compiles; the real arguments come with the benchmark.
#[derive(clap::Args, Debug)]
pub struct BenchArgs {}

/// Placeholder: the benchmark is not written yet.
pub fn run(args: BenchArgs) -> i32 {
    let _ = args;
    eprintln!("not implemented");
    2
}
