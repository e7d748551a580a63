//! `ipcreduce faults`: provokes the failures a job must survive and checks that every rank
//! fails loudly, quickly and naming the culprit, on whichever backend is picked. Used by the
//! tests (host backend) and the device scripts (cuda backend).
//!
//! Scenarios (the last rank is the culprit):
//! - `mismatch-count`, `mismatch-dtype`: it calls with another count / dtype; every rank must
//!   get an error that says what differs (a mismatch error, or the abort it caused).
//! - `timeout`: it never calls; the others must get a timeout naming it, after about the
//!   timeout (`--timeout-ms`).
//! - `kill`: it dies (SIGKILL) while the others wait inside a collective; they must get an
//!   error naming it within 2 s, long before the (30 s) timeout.
//! - `cycles`: every rank creates and destroys a communicator `--cycles` times; file
//!   descriptors, memory mappings and (cuda) device memory must end where they started.
//!
//! Each rank prints `PASS <scenario> rank R: ...` or `FAIL ...` and exits 0 or 1.

use crate::cli::{relaunch_unless_rank, RankArgs};
use ipcreduce::backend::Call;
use ipcreduce::bootstrap::RankInfo;
use ipcreduce::error::Error;
use ipcreduce::types::{Algorithm, BackendKind, DType, ReduceOp};
use ipcreduce::{Communicator, Config};
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug, Clone)]
pub struct FaultArgs {
    #[command(flatten)]
    pub ranks: RankArgs,
    /// mismatch-count, mismatch-dtype, timeout, kill or cycles.
    #[arg(long)]
    pub scenario: String,
    /// Bound on waits for the timeout scenario (ms).
    #[arg(long, default_value_t = 1000)]
    pub timeout_ms: u64,
    /// Create/destroy cycles for the cycles scenario.
    #[arg(long, default_value_t = 1000)]
    pub cycles: usize,
    /// Algorithm of the collectives (auto, oneshot, twoshot).
    #[arg(short = 'a', long = "algo", default_value = "auto")]
    pub algo: Algorithm,
}

pub fn run(args: FaultArgs) -> i32 {
    if let Some(code) = relaunch_unless_rank(&args.ranks) {
        return code;
    }
    let info = match RankInfo::from_env() {
        Ok(i) => i,
        Err(e) => {
            eprintln!("error: {e}");
            return 2;
        }
    };
    let (rank, world) = (info.rank, info.world);
    let culprit = world - 1;
    let outcome = match args.scenario.as_str() {
        "mismatch-count" | "mismatch-dtype" => mismatch(&args, info),
        "timeout" => timeout(&args, info),
        "kill" => kill(&args, info),
        "cycles" => cycles(&args, info),
        other => Err(format!("unknown scenario '{other}'")),
    };
    match outcome {
        Ok(msg) => {
            println!(
                "PASS {} rank {rank}{}: {msg}",
                args.scenario,
                role(rank, culprit)
            );
            0
        }
        Err(msg) => {
            println!(
                "FAIL {} rank {rank}{}: {msg}",
                args.scenario,
                role(rank, culprit)
            );
            1
        }
    }
}

fn role(rank: usize, culprit: usize) -> &'static str {
    if rank == culprit {
        " (culprit)"
    } else {
        ""
    }
}

fn options(args: &FaultArgs, timeout: Duration) -> Config {
    Config {
        backend: args.ranks.backend,
        timeout: Some(timeout),
        ..Config::default()
    }
}

/// One all-reduce of `count` elements on backend buffers, then a wait for its completion.
fn one_call(
    comm: &mut Communicator,
    count: usize,
    dtype: DType,
    algo: Algorithm,
) -> ipcreduce::Result<()> {
    let bytes = count * 4; // room for the largest dtype
    let send = comm.test_alloc(bytes)?;
    let recv = comm.test_alloc(bytes)?;
    let data = vec![0x3Cu8; count * dtype.size()]; // 1.0-ish in every dtype; values don't matter
    comm.test_write(send, &data)?;
    let call = Call {
        send,
        recv,
        count,
        dtype,
        op: ReduceOp::Sum,
        algo,
        offset: 0,
    };
    let res = comm.test_run(&call).and_then(|_| comm.synchronize());
    comm.test_free(send);
    comm.test_free(recv);
    res
}

fn mismatch(args: &FaultArgs, info: RankInfo) -> Result<String, String> {
    let (rank, culprit) = (info.rank, info.world - 1);
    let mut comm = Communicator::with_rank_info(info, &options(args, Duration::from_secs(10)))
        .map_err(|e| format!("init: {e}"))?;
    let (mut count, mut dtype) = (4096usize, DType::F32);
    if rank == culprit {
        match args.scenario.as_str() {
            "mismatch-count" => count += 8,
            _ => dtype = DType::Bf16,
        }
    }
    let started = Instant::now();
    match one_call(&mut comm, count, dtype, args.algo) {
        Ok(()) => Err("the mismatched call succeeded".into()),
        Err(e @ Error::Mismatch { .. }) => Ok(format!("{e} (after {:?})", started.elapsed())),
        // A rank that found the mismatch and left first passes the cause on: that is what a
        // slower rank (more ranks than cores) may see first.
        Err(e @ Error::Aborted { .. }) if e.to_string().contains(" vs ") => {
            Ok(format!("{e} (after {:?})", started.elapsed()))
        }
        Err(e) => Err(format!("expected a mismatch error, got: {e}")),
    }
}

fn timeout(args: &FaultArgs, info: RankInfo) -> Result<String, String> {
    let (rank, culprit) = (info.rank, info.world - 1);
    let limit = Duration::from_millis(args.timeout_ms);
    let mut comm = Communicator::with_rank_info(info, &options(args, limit))
        .map_err(|e| format!("init: {e}"))?;
    if rank == culprit {
        // Never call; stay alive past the others' deadline so they see a timeout, not a death.
        std::thread::sleep(limit * 3 + Duration::from_secs(1));
        return Ok("skipped the call".into());
    }
    let started = Instant::now();
    let res = one_call(&mut comm, 1024, DType::F32, args.algo);
    let took = started.elapsed();
    // Stay in the job a while: leaving at once would show slower survivors a departed rank
    // instead of the timeout this scenario is about.
    std::thread::sleep(limit);
    drop(comm);
    match res {
        Ok(()) => Err("the call completed without the culprit".into()),
        Err(e) => {
            let text = e.to_string();
            if !matches!(e, Error::Timeout { peer, .. } if peer == culprit) {
                return Err(format!(
                    "expected a timeout naming rank {culprit}, got: {text}"
                ));
            }
            if took > limit * 2 + Duration::from_secs(1) {
                return Err(format!(
                    "timeout fired after {took:?}, limit {limit:?}: {text}"
                ));
            }
            Ok(format!("{text} (after {took:?})"))
        }
    }
}

fn kill(args: &FaultArgs, info: RankInfo) -> Result<String, String> {
    let (rank, culprit) = (info.rank, info.world - 1);
    let mut comm = Communicator::with_rank_info(info, &options(args, Duration::from_secs(30)))
        .map_err(|e| format!("init: {e}"))?;
    if rank == culprit {
        // Let the others get inside the collective, then die without a word.
        std::thread::sleep(Duration::from_millis(300));
        // SAFETY: raising a signal on ourselves.
        unsafe { libc::raise(libc::SIGKILL) };
        unreachable!("SIGKILL returned");
    }
    let started = Instant::now();
    let res = one_call(&mut comm, 1 << 20, DType::F32, args.algo);
    let took = started.elapsed();
    let text = match res {
        Ok(()) => return Err("the call completed although a rank died".into()),
        Err(e) => e.to_string(),
    };
    if !text.contains(&format!("rank {culprit}")) {
        return Err(format!("error does not name rank {culprit}: {text}"));
    }
    // 300 ms until the death, then at most 2 s to notice.
    if took > Duration::from_millis(2300) {
        return Err(format!("noticed only after {took:?}: {text}"));
    }
    // The communicator must stay unusable, with a clear error.
    match one_call(&mut comm, 16, DType::F32, args.algo) {
        Err(Error::Aborted { .. }) => Ok(format!("{text} (after {took:?}); later calls refused")),
        Err(e) => Ok(format!("{text} (after {took:?}); later call: {e}")),
        Ok(()) => Err("a call after the death succeeded".into()),
    }
}

/// Counts of this process's resources that a communicator must give back.
#[derive(Debug, PartialEq, Eq, Clone, Copy)]
struct Footprint {
    fds: usize,
    maps: usize,
    /// Free device memory in MiB (cuda), rounded: the driver's own pools move by pages.
    gpu_free_mib: Option<u64>,
}

fn footprint(backend: BackendKind) -> Footprint {
    // Ranks share the GPU under MPS and the free-memory figure is device-wide: let every rank
    // finish tearing down its communicator first.
    std::thread::sleep(Duration::from_millis(500));
    let count = |p: &str| std::fs::read_dir(p).map(|d| d.count()).unwrap_or(0);
    let maps = std::fs::read_to_string("/proc/self/maps")
        .map(|s| s.lines().count())
        .unwrap_or(0);
    let gpu_free_mib = (backend == BackendKind::Cuda).then(|| {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: writes two integers; the context is current (a communicator just ran).
        unsafe { cudarc::driver::sys::cuMemGetInfo_v2(&mut free, &mut total) };
        (free >> 20) as u64
    });
    Footprint {
        fds: count("/proc/self/fd"),
        maps,
        gpu_free_mib,
    }
}

fn cycles(args: &FaultArgs, info: RankInfo) -> Result<String, String> {
    let opts = options(args, Duration::from_secs(30));
    let cycle = |i: usize| -> Result<BackendKind, String> {
        let mut comm = Communicator::with_rank_info(info.clone(), &opts)
            .map_err(|e| format!("cycle {i}: init: {e}"))?;
        one_call(&mut comm, 256, DType::F32, args.algo).map_err(|e| format!("cycle {i}: {e}"))?;
        Ok(comm.backend())
    };
    // The first cycle loads what stays for the life of the process (driver, kernels).
    let backend = cycle(0)?;
    let before = footprint(backend);
    let started = Instant::now();
    for i in 1..=args.cycles {
        cycle(i)?;
    }
    let after = footprint(backend);
    let gpu_ok = match (before.gpu_free_mib, after.gpu_free_mib) {
        (Some(b), Some(a)) => a + 2 >= b,
        _ => true,
    };
    if before.fds != after.fds || before.maps != after.maps || !gpu_ok {
        return Err(format!(
            "after {} cycles: {before:?} -> {after:?}",
            args.cycles
        ));
    }
    Ok(format!(
        "{} cycles in {:.1} s, footprint unchanged: {after:?}",
        args.cycles,
        started.elapsed().as_secs_f64()
    ))
}
