//! `ipcreduce check`: randomized correctness sweep against the float64 reference.
//!
//! Every rank draws the same sequence of cases from the seed: size (1 element up to
//! `--max-bytes`, most of them small, odd sizes included), dtype, op, algorithm, in place or
//! not, and a start offset that breaks 16-byte alignment. A case passes when every rank's
//! output is within tolerance everywhere, nothing outside the output was written, all ranks'
//! outputs are bitwise equal, and (for messages up to 16 MiB) one-shot and two-shot give
//! bitwise the same result. The last line is `N passed, N failed`.

use crate::cli::{join, parse_size, refuse, relaunch_with_progress, typed_flag, RankArgs, Usage};
use crate::harness::{gather_u64, run_checked, Buffers};
use ipcreduce::backend::Call;
use ipcreduce::error::Result;
use ipcreduce::types::{Algorithm, BackendKind, DType, ReduceOp};
use ipcreduce::Communicator;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

#[derive(clap::Args, Debug, Clone)]
pub struct CheckArgs {
    #[command(flatten)]
    pub ranks: RankArgs,
    /// Number of random cases.
    #[arg(long, default_value_t = 500)]
    pub cases: usize,
    /// Seed of the case sequence and the data.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Largest message (default 256M on cuda, 8M on host).
    #[arg(long, value_parser = parse_size)]
    pub max_bytes: Option<usize>,
    /// Algorithms to draw from, comma separated (auto, oneshot, twoshot).
    #[arg(short = 'a', long = "algo", default_value = "auto,oneshot,twoshot")]
    pub algos: String,
    /// Use registered (zero-copy) buffers (cuda backend).
    #[arg(long)]
    pub registered: bool,
    /// Print every case, not only failures.
    #[arg(short, long)]
    pub verbose: bool,
}

/// One drawn case.
#[derive(Debug, Clone, Copy)]
struct Case {
    count: usize,
    dtype: DType,
    op: ReduceOp,
    algo: Algorithm,
    in_place: bool,
    offset: usize,
    seed: u64,
}

pub fn run(args: CheckArgs) -> i32 {
    if let Err(e) = check_args(&args) {
        return refuse(&e);
    }
    if let Some(code) = relaunch_with_progress(&args.ranks, true) {
        return code;
    }
    match check(&args) {
        Ok((_, 0)) => 0,
        Ok(_) => 1,
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    }
}

fn draw(
    rng: &mut SmallRng,
    index: usize,
    max_bytes: usize,
    algos: &[Algorithm],
    seed: u64,
) -> Case {
    let dtype = DType::ALL[rng.gen_range(0..3)];
    let max_count = (max_bytes / dtype.size()).max(1);
    let count = match index {
        0 => 1,
        1 => max_count,
        _ => {
            // Log-uniform within a bucket; most cases small so thousands of them run quickly.
            let hi = match rng.gen_range(0..100) {
                0..=59 => 4096,
                60..=89 => 1 << 18,
                90..=98 => 1 << 22,
                _ => max_count,
            }
            .min(max_count);
            let exp = rng.gen_range(0.0..=(hi as f64).log2());
            let c = 2f64.powf(exp) as usize;
            // Half the time nudge it off powers of two.
            (c + if rng.gen_bool(0.5) {
                rng.gen_range(0..=7)
            } else {
                0
            })
            .clamp(1, max_count)
        }
    };
    let op = match rng.gen_range(0..10) {
        0..=5 => ReduceOp::Sum,
        6..=7 => ReduceOp::Max,
        _ => ReduceOp::Min,
    };
    let offset = if rng.gen_bool(0.3) {
        rng.gen_range(1..16 / dtype.size()) * dtype.size()
    } else {
        0
    };
    Case {
        count,
        dtype,
        op,
        algo: algos[rng.gen_range(0..algos.len())],
        in_place: rng.gen_bool(0.4),
        offset,
        seed: seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ index as u64,
    }
}

/// The algorithms of `-a`: auto, oneshot, twoshot (NCCL's results are not ours to check).
fn parse_algos(list: &str) -> Result<Vec<Algorithm>, Usage> {
    let flag = typed_flag(Some('a'), "algo");
    let algos: Vec<Algorithm> = list
        .split(',')
        .map(|s| s.trim().parse())
        .collect::<std::result::Result<_, String>>()
        .map_err(|e| format!("{flag} {list}: {e}"))?;
    if algos.is_empty() || algos.contains(&Algorithm::Nccl) {
        return Err(format!(
            "{flag} {list}: check draws from auto, oneshot and twoshot"
        ));
    }
    Ok(algos)
}

/// Refuses, before any rank starts, a command line that would check nothing or fail in every
/// rank.
fn check_args(args: &CheckArgs) -> Result<(), Usage> {
    parse_algos(&args.algos)?;
    if args.cases == 0 {
        return Err("--cases 0: nothing to check (at least one case)".into());
    }
    let widest = DType::ALL.iter().map(|d| d.size()).max().unwrap_or(4);
    if let Some(b) = args.max_bytes.filter(|b| *b < widest) {
        return Err(format!(
            "--max-bytes {b}: the cases draw every dtype, so it must hold one element of \
             {widest} bytes"
        ));
    }
    Ok(())
}

/// Returns (passed, failed).
fn check(args: &CheckArgs) -> Result<(usize, usize)> {
    let algos = parse_algos(&args.algos).map_err(ipcreduce::Error::Config)?;
    let mut comm = join(&args.ranks, false)?;
    let rank = comm.rank();
    let max_bytes = args.max_bytes.unwrap_or(match comm.backend() {
        BackendKind::Cuda => 256 << 20,
        _ => 8 << 20,
    });
    if rank == 0 {
        println!(
            "# check: {} cases, seed {}, up to {} bytes, world {}{}",
            args.cases,
            args.seed,
            max_bytes,
            comm.world(),
            if args.registered {
                ", registered buffers"
            } else {
                ""
            }
        );
    }
    let bufs = if args.registered {
        Buffers::registered(&mut comm, max_bytes.max(4))?
    } else {
        Buffers::new(&mut comm, max_bytes.max(4))?
    };
    let mut rng = SmallRng::seed_from_u64(args.seed);
    let (mut passed, mut failed) = (0, 0);
    // Cases per data path the backend reported (cuda: LL, staged, zero-copy...).
    let mut paths = std::collections::BTreeMap::<&'static str, usize>::new();
    let started = std::time::Instant::now();
    let mut progress = crate::progress::Reporter::new(rank, args.cases as u64, "cases");
    for i in 0..args.cases {
        let case = draw(&mut rng, i, max_bytes, &algos, args.seed);
        match run_case(&mut comm, &bufs, &case, &mut paths) {
            Ok(None) => {
                passed += 1;
                if args.verbose && rank == 0 {
                    println!("ok   case {i}: {case:?}");
                }
            }
            Ok(Some(why)) => {
                failed += 1;
                if rank == 0 {
                    println!("FAIL case {i}: {case:?}: {why}");
                }
            }
            Err(e) => {
                // The communicator may be unusable now: count the rest as failed and stop.
                let rest = args.cases - i;
                eprintln!("rank {rank}: case {i} ({case:?}) failed with an error: {e}");
                failed += rest;
                break;
            }
        }
        progress.step(i as u64 + 1);
        if rank == 0 && (i + 1) % 500 == 0 {
            println!(
                "# {} cases, {passed} passed, {failed} failed, {:.1} s",
                i + 1,
                started.elapsed().as_secs_f64()
            );
        }
    }
    bufs.free(&mut comm);
    if rank == 0 {
        if !paths.is_empty() {
            let list: Vec<String> = paths.iter().map(|(p, n)| format!("{p} {n}")).collect();
            println!("# paths run: {}", list.join(", "));
        }
        println!("{passed} passed, {failed} failed");
    }
    Ok((passed, failed))
}

/// Runs one case on every rank; Some(reason) when it failed anywhere.
fn run_case(
    comm: &mut Communicator,
    bufs: &Buffers,
    case: &Case,
    paths: &mut std::collections::BTreeMap<&'static str, usize>,
) -> Result<Option<String>> {
    let call = Call {
        send: bufs.send,
        recv: if case.in_place { bufs.send } else { bufs.recv },
        count: case.count,
        dtype: case.dtype,
        op: case.op,
        algo: case.algo,
        offset: case.offset,
    };
    let out = run_checked(comm, &call, case.seed)?;
    let path = comm.last_path();
    if let Some(p) = path {
        *paths.entry(p.name).or_default() += 1;
    }
    let on =
        |p: Option<ipcreduce::PathInfo>| p.map_or(String::new(), |p| format!(" on {}", p.name));
    let wrong = gather_u64(comm, out.wrong as u64)?;
    if let Some((r, w)) = wrong.iter().enumerate().find(|(_, w)| **w > 0) {
        return Ok(Some(format!(
            "rank {r}: {w} wrong elements or guard bytes{}",
            on(path)
        )));
    }
    let prints = gather_u64(comm, out.fingerprint)?;
    if let Some(r) = prints.iter().position(|p| *p != prints[0]) {
        return Ok(Some(format!(
            "rank {r}'s output differs bitwise from rank 0's{}",
            on(path)
        )));
    }
    // One-shot and two-shot must agree bitwise: rerun with the other one on the same data.
    let bytes = case.count * case.dtype.size();
    if bytes <= 16 << 20 {
        // What ran, as the backend says (auto's rule differs for registered buffers), else as
        // the plan says.
        let ran = match path {
            Some(p) if p.name.starts_with("twoshot") => Algorithm::TwoShot,
            Some(p) if p.name.starts_with("oneshot") => Algorithm::OneShot,
            _ => comm.resolve(case.algo, bytes),
        };
        let other = if ran == Algorithm::OneShot {
            Algorithm::TwoShot
        } else {
            Algorithm::OneShot
        };
        let again = run_checked(
            comm,
            &Call {
                algo: other,
                ..call
            },
            case.seed,
        )?;
        let same = gather_u64(
            comm,
            (again.fingerprint == out.fingerprint && again.wrong == 0) as u64,
        )?;
        if let Some(r) = same.iter().position(|s| *s == 0) {
            return Ok(Some(format!(
                "rank {r}: {other}{} differs bitwise from {ran}{}",
                on(comm.last_path()),
                on(path)
            )));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cases_are_reproducible_and_cover_the_space() {
        let algos = [Algorithm::Auto, Algorithm::OneShot, Algorithm::TwoShot];
        let draw_all = || {
            let mut rng = SmallRng::seed_from_u64(5);
            (0..2000)
                .map(|i| draw(&mut rng, i, 256 << 20, &algos, 5))
                .collect::<Vec<_>>()
        };
        let (a, b) = (draw_all(), draw_all());
        assert!(a
            .iter()
            .zip(&b)
            .all(|(x, y)| format!("{x:?}") == format!("{y:?}")));
        assert_eq!(a[0].count, 1);
        assert_eq!(a[1].count * a[1].dtype.size(), 256 << 20);
        assert!(a.iter().any(|c| c.in_place) && a.iter().any(|c| !c.in_place));
        assert!(a.iter().any(|c| c.offset % 16 != 0));
        assert!(a.iter().any(|c| c.count % 8 != 0));
        assert!(a
            .iter()
            .all(|c| c.offset < 16 && c.offset % c.dtype.size() == 0));
        for d in DType::ALL {
            assert!(a.iter().any(|c| c.dtype == d));
        }
        // The big ones are rare: the sweep must stay quick.
        let big = a
            .iter()
            .filter(|c| c.count * c.dtype.size() > 16 << 20)
            .count();
        assert!(big < 40, "{big} cases above 16 MiB");
    }
}
