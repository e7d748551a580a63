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
use ipcreduce::bootstrap::{Bootstrap, RankInfo};
use ipcreduce::error::Error;
use ipcreduce::types::{Algorithm, BackendKind, DType, ReduceOp};
use ipcreduce::{Communicator, Config};
use std::path::{Path, PathBuf};
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
    call_then(comm, count, dtype, algo, None)
}

/// [`one_call`], creating `inside` once this rank is inside the collective: on the host
/// backend once the calling thread is seen asleep in its wait for a peer (FUTEX_WAIT, read
/// from procfs by a watching thread, since the call itself only returns at the end); on cuda
/// once the kernel is launched (the launch returns, the wait is the synchronize after it).
fn call_then(
    comm: &mut Communicator,
    count: usize,
    dtype: DType,
    algo: Algorithm,
    inside: Option<&Path>,
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
    let res = match (inside, comm.backend()) {
        (None, _) => comm.test_run(&call).and_then(|_| comm.synchronize()),
        (Some(marker), BackendKind::Host) => {
            let watcher = mark_when_blocked(marker, Some(libc::SYS_futex));
            let res = comm.test_run(&call).and_then(|_| comm.synchronize());
            watcher.finish();
            res
        }
        (Some(marker), _) => {
            // A path whose launch itself waits on the host for its peers shows blocked in
            // a syscall before it returns; any other launch returns with the kernel queued.
            let watcher = mark_when_blocked(marker, None);
            let res = comm.test_run(&call).and_then(|_| {
                touch(marker);
                comm.synchronize()
            });
            watcher.finish();
            res
        }
    };
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
        Err(e @ Error::Mismatch { .. }) => {
            Ok(format!("{}: {e} (after {:?})", kind(&e), started.elapsed()))
        }
        // A rank that found the mismatch and left first passes the cause on: that is what a
        // slower rank (more ranks than cores) may see first.
        Err(e @ Error::Aborted { .. }) if e.to_string().contains(" vs ") => {
            Ok(format!("{}: {e} (after {:?})", kind(&e), started.elapsed()))
        }
        Err(e) => Err(format!("expected a mismatch error, got {}: {e}", kind(&e))),
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
                    "expected a timeout naming rank {culprit}, got {}: {text}",
                    kind(&e)
                ));
            }
            if took > limit * 2 + Duration::from_secs(1) {
                return Err(format!(
                    "timeout fired after {took:?}, limit {limit:?}: {text}"
                ));
            }
            Ok(format!("{}: {text} (after {took:?})", kind(&e)))
        }
    }
}

fn kill(args: &FaultArgs, info: RankInfo) -> Result<String, String> {
    let (rank, culprit) = (info.rank, info.world - 1);
    let marker = |r: usize| {
        // Next to the job's socket: a directory of this user's that every rank of the (one
        // host) job sees; the job id keeps concurrent jobs apart.
        info.socket
            .with_file_name(format!("{}.faults-inside.{r}", info.job_id))
    };
    let markers: Vec<PathBuf> = (0..culprit).map(marker).collect();
    let mut comm =
        Communicator::with_rank_info(info.clone(), &options(args, Duration::from_secs(30)))
            .map_err(|e| format!("init: {e}"))?;
    if rank == culprit {
        // Die without a word once every other rank is inside the collective, waiting for us.
        let until = Instant::now() + Duration::from_secs(10);
        while !markers.iter().all(|m| m.exists()) {
            if Instant::now() > until {
                let missing: Vec<_> = (0..culprit).filter(|&r| !markers[r].exists()).collect();
                return Err(format!("ranks {missing:?} never got inside the collective"));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        // SAFETY: raising a signal on ourselves.
        unsafe { libc::raise(libc::SIGKILL) };
        unreachable!("SIGKILL returned");
    }
    let _ = std::fs::remove_file(&markers[rank]);
    let started = Instant::now();
    let res = call_then(
        &mut comm,
        1 << 20,
        DType::F32,
        args.algo,
        Some(&markers[rank]),
    );
    let took = started.elapsed();
    // Since this rank got inside: the death came after every rank's marker, ours included.
    let inside_for = std::fs::metadata(&markers[rank])
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.elapsed().ok());
    let _ = std::fs::remove_file(&markers[rank]);
    let died = format!("rank {culprit} died");
    let text = match res {
        Ok(()) => return Err("the call completed although a rank died".into()),
        Err(e) => {
            died_error(&e, rank, culprit, &died)?;
            format!("{}: {e}", kind(&e))
        }
    };
    // Noticed within 2 s of the death (the liveness connections, not the 30 s timeout); the
    // death follows this rank's marker by the time the other ranks take to get inside.
    match inside_for {
        None => return Err(format!("no marker of rank {rank} was made: {text}")),
        Some(d) if d > Duration::from_millis(2500) => {
            return Err(format!(
                "noticed {d:?} after getting inside (call {took:?}): {text}"
            ))
        }
        Some(_) => {}
    }
    // The communicator must stay unusable, refusing with the cause.
    match one_call(&mut comm, 16, DType::F32, args.algo) {
        Err(e @ Error::Aborted { .. }) if e.to_string().contains(&died) => Ok(format!(
            "{text} (after {took:?}); later calls refused: {}: {e}",
            kind(&e)
        )),
        Err(e) => Err(format!(
            "a call after the death: expected Aborted with \"{died}\", got {}: {e}",
            kind(&e)
        )),
        Ok(()) => Err("a call after the death succeeded".into()),
    }
}

/// A survivor's error for a peer's death: Aborted or PeerLost, of this rank, saying that
/// the culprit died (not any error that happens to mention it, such as a timeout).
fn died_error(e: &Error, rank: usize, culprit: usize, died: &str) -> Result<(), String> {
    let text = e.to_string();
    let ok = match e {
        Error::Aborted { rank: r, reason } => *r == rank && reason.contains(died),
        Error::PeerLost { rank: r, peer, .. } => *r == rank && *peer == culprit,
        _ => false,
    };
    if !ok || !text.contains(died) {
        return Err(format!(
            "expected Aborted or PeerLost of rank {rank} saying \"{died}\", got {}: {text}",
            kind(e)
        ));
    }
    Ok(())
}

/// The error's kind, printed in the PASS/FAIL lines so that tests read it, not only the text.
fn kind(e: &Error) -> &'static str {
    match e {
        Error::Config(_) => "Config",
        Error::InvalidArgument { .. } => "InvalidArgument",
        Error::Bootstrap { .. } => "Bootstrap",
        Error::PeerLost { .. } => "PeerLost",
        Error::Timeout { .. } => "Timeout",
        Error::Mismatch { .. } => "Mismatch",
        Error::Aborted { .. } => "Aborted",
        Error::CudaUnavailable(_) => "CudaUnavailable",
        _ => "other",
    }
}

/// Creates `path` (empty); a failure shows as the culprit's "never got inside".
fn touch(path: &Path) {
    let _ = std::fs::write(path, b"");
}

/// Watches the calling thread from another one and creates `marker` once the caller is seen
/// blocked in syscall `nr` (any syscall for None): on the host backend the one place a
/// collective sleeps is its wait for a peer, in FUTEX_WAIT after a short spin, so the caller
/// is then inside the collective.
fn mark_when_blocked(marker: &Path, nr: Option<i64>) -> Watch {
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::syscall(libc::SYS_gettid) };
    let marker = marker.to_path_buf();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop2 = stop.clone();
    let handle = std::thread::spawn(move || {
        let file = format!("/proc/self/task/{tid}/syscall");
        let until = Instant::now() + Duration::from_secs(10);
        while !stop2.load(std::sync::atomic::Ordering::SeqCst) && Instant::now() < until {
            // "running" (not in a syscall) does not parse: only a blocked thread counts.
            let seen = std::fs::read_to_string(&file)
                .ok()
                .and_then(|t| t.split_whitespace().next()?.parse::<i64>().ok());
            if seen.is_some() && (nr.is_none() || seen == nr) {
                touch(&marker);
                return;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    });
    Watch { stop, handle }
}

struct Watch {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    handle: std::thread::JoinHandle<()>,
}

impl Watch {
    fn finish(self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let _ = self.handle.join();
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

/// The footprint once every rank has torn its communicator down: ranks share the GPU under
/// MPS and the free-memory figure is device-wide, so each rank first waits in a barrier of a
/// bootstrap of its own, which it enters only after its communicator is dropped (and which
/// is gone again before the count).
fn footprint(backend: BackendKind, info: &RankInfo) -> Result<Footprint, String> {
    let mut b = Bootstrap::connect(info.clone(), Duration::from_secs(30))
        .map_err(|e| format!("footprint: bootstrap: {e}"))?;
    b.barrier()
        .map_err(|e| format!("footprint: barrier after teardown: {e}"))?;
    drop(b);
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
    Ok(Footprint {
        fds: count("/proc/self/fd"),
        maps,
        gpu_free_mib,
    })
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
    let before = footprint(backend, &info)?;
    let started = Instant::now();
    for i in 1..=args.cycles {
        cycle(i)?;
    }
    let after = footprint(backend, &info)?;
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
