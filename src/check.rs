//! `ipcreduce check`: randomized correctness sweep against the float64 reference.

/// Placeholder so the CLI compiles; the real arguments come with the sweep.
#[derive(clap::Args, Debug)]
pub struct CheckArgs {}

/// Placeholder: the sweep is not written yet.
pub fn run(args: CheckArgs) -> i32 {
    let _ = args;
    eprintln!("not implemented");
    2
}
