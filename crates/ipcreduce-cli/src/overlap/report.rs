//! The table and the JSON report.

use super::*;

pub(super) fn mib(bytes: usize) -> f64 {
    bytes as f64 / f64::from(1 << 20)
}

pub(super) fn print_header(
    args: &OverlapArgs,
    plan: &Plan,
    comm: &Communicator,
    gpu: &Gpu,
    cal: &Calibration,
) {
    let (first, last) = (plan.buckets[0], plan.buckets[plan.buckets.len() - 1]);
    println!(
        "# overlap: {} steps (+{} warm-up), {:.1} MiB of {} gradients in {} buckets of {:.1} MiB (last {:.1} MiB), sum",
        args.steps,
        args.warmup,
        mib(args.grad_bytes),
        DTYPE.name(),
        plan.buckets.len(),
        mib(first.bytes),
        mib(last.bytes)
    );
    if args.compute_us == 0 {
        println!("# compute: none (--compute-us 0): the steps time the all-reduce alone");
    } else {
        println!(
            "# compute: {} us per step asked; {} pieces of {} FMA rounds x {} blocks x {} threads, {:.1} us each alone (rank 0); all pieces alone: {:.3} ms (slowest rank)",
            args.compute_us,
            plan.buckets.len(),
            cal.piece_iters,
            gpu.blocks,
            COMPUTE_THREADS,
            cal.piece_us,
            cal.compute_step_ms
        );
    }
    println!(
        "# auto runs {} for a full bucket, {} for the last; times are each step's slowest rank",
        comm.resolve(Algorithm::Auto, first.bytes),
        comm.resolve(Algorithm::Auto, last.bytes)
    );
    println!(
        "# gradients in {} buffers; communication stream priority {} (lower is higher); exposed = mean step - mean compute-only step",
        if gpu.registered { "registered (zero-copy)" } else { "plain (staged)" },
        gpu.comm_priority
    );
    println!(
        "# {:>18} {:>7} {:>9} {:>10} {:>9} {:>9} {:>9} {:>10} {:>11} {:>7}",
        "algo",
        "steps",
        "mean(ms)",
        "median(ms)",
        "p99(ms)",
        "min(ms)",
        "max(ms)",
        "stddev(ms)",
        "exposed(ms)",
        "#wrong"
    );
}

pub(super) fn algo_label(r: &Row) -> String {
    if r.steps == 0 {
        "compute-only".into()
    } else if r.algo == Algorithm::Auto {
        format!("auto:{}", r.ran)
    } else {
        r.algo.name().to_string()
    }
}

pub(super) fn print_row(r: &Row) {
    let s = &r.step_ms;
    println!(
        "  {:>18} {:>7} {:>9.3} {:>10.3} {:>9.3} {:>9.3} {:>9.3} {:>10.3} {:>11.3} {:>7}",
        algo_label(r),
        r.steps,
        s.mean,
        s.median,
        s.p99,
        s.min,
        s.max,
        s.stddev,
        r.exposed_ms,
        r.wrong
    );
}

#[derive(Debug, serde::Serialize)]
pub(super) struct Meta {
    #[serde(flatten)]
    pub(super) run: RunMeta,
    /// The options as run (bucket size after rounding to the element).
    pub(super) args: serde_json::Value,
}

pub(super) fn write_json(doc: &serde_json::Value, path: &std::path::Path) -> Result<()> {
    let text = serde_json::to_string_pretty(doc).map_err(|e| Error::Config(e.to_string()))?;
    std::fs::write(path, text).map_err(|e| Error::io(format!("writing {}", path.display()), e))
}

pub(super) fn args_json(args: &OverlapArgs, plan: &Plan) -> serde_json::Value {
    let last = plan.buckets[plan.buckets.len() - 1];
    serde_json::json!({
        "steps": args.steps,
        "warmup": args.warmup,
        "grad_bytes": args.grad_bytes,
        "bucket_bytes": plan.buckets[0].bytes,
        "last_bucket_bytes": last.bytes,
        "buckets": plan.buckets.len(),
        "dtype": DTYPE,
        "op": ReduceOp::Sum,
        "compute_us": args.compute_us,
        "buffers": if args.plain { "plain" } else { "registered" },
        "algos": plan.algos,
        "seed": args.seed,
    })
}

pub(super) fn report_json(
    meta: &Meta,
    cal: &Calibration,
    compute_only: &Stats,
    rows: &[Row],
    ratio: Option<f64>,
) -> serde_json::Value {
    serde_json::json!({
        "meta": meta,
        "calibration": cal,
        "compute_only_ms": compute_only,
        "rows": rows,
        "nccl_over_ipcreduce_mean": ratio,
    })
}
