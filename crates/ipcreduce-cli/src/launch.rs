//! `ipcreduce launch -n N -- CMD...`: starts N ranks of a command with the job's variables set.
//!
//! Each job gets a fresh private directory (mode 0700) holding rank 0's socket, a random job
//! id and a random 128-bit secret, so ranks of different jobs can never meet and other users
//! cannot reach the socket. When one rank fails, the others get a grace period to notice
//! (the bootstrap's liveness aborts them) and are then terminated, then killed.
//!
//! A job spanning hosts runs one launcher per host (`--nnodes N --node-rank I --master
//! HOST:PORT`): node I's ranks are I*n .. I*n+n-1 and meet the others over TCP at the
//! master. Those launchers cannot agree on a random secret, so it comes from the
//! environment (`IPCREDUCE_SECRET`, the same on every host), and the job id is derived
//! from the master unless `IPCREDUCE_JOB_ID` is set.
//!
//! The ranks' output passes through the launcher a whole line at a time (optionally tagged
//! with the rank, as `mpirun --tag-output`), so the lines of several ranks never mix; ranks
//! left out of `--show` write to per-rank logs instead, printed when that rank fails.

use ipcreduce::bootstrap::{Master, MAX_WORLD};
use ipcreduce::error::{Error, Result};
use nix::sys::signal::{self, SaFlags, SigAction, SigHandler, SigSet, Signal};
use nix::unistd::Pid;
use rand::RngCore;
use std::ffi::{OsStr, OsString};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{mpsc, Mutex};
use std::time::{Duration, Instant};

/// How long the other ranks may take to stop on their own after one failed.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(5);
/// How long SIGTERM gets before SIGKILL.
const TERM_GRACE: Duration = Duration::from_secs(2);
/// Child status polling period.
const TICK: Duration = Duration::from_millis(10);
/// How long the last lines of the ranks' output may take to arrive after they exited (a
/// process the rank left behind may hold its pipe open for ever).
const DRAIN: Duration = Duration::from_secs(2);

/// Where the ranks' output goes.
#[derive(Clone, Debug, Default)]
pub struct Output {
    /// Prefix every line with `[rank N] `.
    pub tag: bool,
    /// The (global) ranks whose output reaches the launcher's stdout and stderr; None: all.
    /// The others write to `rank-N.log`, printed when that rank fails.
    pub show: Option<Vec<usize>>,
    /// Where the per-rank logs go (kept); None: a private directory removed at the end.
    pub log_dir: Option<PathBuf>,
    /// The bar that rank 0's progress lines feed (see `progress`), drawn on our stderr.
    pub progress: Option<crate::progress::Bar>,
}

impl Output {
    fn shows(&self, rank: usize) -> bool {
        self.show.as_ref().is_none_or(|s| s.contains(&rank))
    }
}

/// True inside a rank started by `ipcreduce launch` or torchrun: `bench`/`check` use it to
/// decide whether to re-launch themselves.
pub fn in_rank() -> bool {
    let set = |k| std::env::var_os(k).is_some_and(|v| !v.is_empty());
    set("IPCREDUCE_RANK") || set("RANK")
}

/// Where this launcher's ranks sit in a job that may span hosts.
#[derive(Clone, Debug)]
pub struct Nodes {
    pub nnodes: usize,
    pub node_rank: usize,
    /// Rank 0's TCP address; required when `nnodes > 1`.
    pub master: Option<Master>,
}

impl Nodes {
    /// A job on this host alone.
    pub fn single() -> Nodes {
        Nodes {
            nnodes: 1,
            node_rank: 0,
            master: None,
        }
    }

    /// Checks the node settings against `n` ranks per node.
    fn check(&self, n: usize) -> Result<()> {
        if self.nnodes == 0 || self.node_rank >= self.nnodes {
            return Err(Error::Config(format!(
                "--node-rank {} must be below --nnodes {}",
                self.node_rank, self.nnodes
            )));
        }
        if self.nnodes > 1 && self.master.is_none() {
            return Err(Error::Config(format!(
                "--nnodes {} needs --master HOST:PORT (rank 0's host, reachable from every node)",
                self.nnodes
            )));
        }
        match n.checked_mul(self.nnodes) {
            Some(w) if w <= MAX_WORLD => Ok(()),
            _ => Err(Error::Config(format!(
                "{} nodes of {n} ranks exceed the limit of {MAX_WORLD} ranks",
                self.nnodes
            ))),
        }
    }
}

/// How the ranks of a job find each other, as their environment says it.
struct Meeting {
    /// The private directory of a single-host job (holds the socket), removed at the end.
    _dir: Option<PrivateDir>,
    vars: Vec<(&'static str, String)>,
    job_id: String,
}

impl Meeting {
    fn new(nodes: &Nodes) -> Result<Meeting> {
        let Some(master) = nodes.master.as_ref().filter(|_| nodes.nnodes > 1) else {
            let dir = PrivateDir::create()?;
            let socket = dir.path.join("rank0.sock");
            let job_id = format!("launch-{}", random_hex(8));
            return Ok(Meeting {
                vars: vec![
                    ("IPCREDUCE_SOCKET", socket.display().to_string()),
                    ("IPCREDUCE_JOB_ID", job_id.clone()),
                    ("IPCREDUCE_SECRET", random_hex(16)),
                ],
                _dir: Some(dir),
                job_id,
            });
        };
        let env = |k| std::env::var(k).ok().filter(|v| !v.is_empty());
        let secret = env("IPCREDUCE_SECRET").ok_or_else(|| {
            Error::Config(
                "a job across hosts needs IPCREDUCE_SECRET in every node's launcher environment \
                 (the same hexadecimal string everywhere, e.g. from `openssl rand -hex 16`): \
                 it is the job's only credential over TCP"
                    .into(),
            )
        })?;
        let job_id = env("IPCREDUCE_JOB_ID").unwrap_or_else(|| job_id_for(master));
        Ok(Meeting {
            vars: vec![
                ("IPCREDUCE_MASTER", master.to_string()),
                ("IPCREDUCE_JOB_ID", job_id.clone()),
                ("IPCREDUCE_SECRET", secret),
            ],
            _dir: None,
            job_id,
        })
    }
}

/// The job id every node derives alike from the master: `launch-<host>-<port>`, the host
/// reduced to the characters job ids allow.
fn job_id_for(m: &Master) -> String {
    let host: String = m
        .host
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .take(40)
        .collect();
    format!("launch-{host}-{}", m.port)
}

/// Starts `n` ranks of `program args...`, waits for all of them and returns the exit code of
/// the first that failed (128 + signal number for a signal), or 0. See [`spawn_ranks_with`].
#[cfg(test)]
pub fn spawn_ranks(
    n: usize,
    program: &OsStr,
    args: &[OsString],
    extra_env: &[(String, String)],
) -> Result<i32> {
    spawn_ranks_with(n, program, args, extra_env, DEFAULT_GRACE)
}

/// [`spawn_ranks`] with the grace period the other ranks get after a failure.
#[cfg(test)]
pub fn spawn_ranks_with(
    n: usize,
    program: &OsStr,
    args: &[OsString],
    extra_env: &[(String, String)],
    grace: Duration,
) -> Result<i32> {
    spawn_ranks_on(
        &Nodes::single(),
        n,
        program,
        args,
        extra_env,
        grace,
        &Output::default(),
    )
}

/// [`spawn_ranks_with`] for node `nodes.node_rank` of a job of `nodes.nnodes` hosts with `n`
/// ranks each, their output going where `output` says.
pub fn spawn_ranks_on(
    nodes: &Nodes,
    n: usize,
    program: &OsStr,
    args: &[OsString],
    extra_env: &[(String, String)],
    grace: Duration,
    output: &Output,
) -> Result<i32> {
    if n == 0 {
        return Err(Error::Config(
            "a job needs at least one rank (0 asked)".into(),
        ));
    }
    if n > MAX_WORLD {
        return Err(Error::Config(format!(
            "a job has at most {MAX_WORLD} ranks ({n} asked)"
        )));
    }
    nodes.check(n)?;
    let meeting = Meeting::new(nodes)?;
    let world = n * nodes.nnodes;

    // NCCL with ranks sharing a GPU needs each rank to look like its own host: the launcher
    // says so in each child's environment (the library never sets variables in a process).
    let nccl_shared_gpu = ipcreduce::Config::default().resolve()?.nccl_shared_gpu();
    let _signals = SignalGuard::install();
    let cores = core_binding(n);
    let logs = Logs::new(nodes, n, output)?;
    let (done_tx, done_rx) = mpsc::channel();
    let mut forwarders = 0;
    let mut ranks: Vec<Rank> = Vec::with_capacity(n);
    for r in 0..n {
        let global = nodes.node_rank * n + r;
        let mut cmd = Command::new(program);
        match logs.file(global)? {
            Some((out, err)) => cmd.stdout(out).stderr(err),
            None => cmd.stdout(Stdio::piped()).stderr(Stdio::piped()),
        };
        cmd.args(args)
            .stdin(Stdio::null())
            .env("IPCREDUCE_RANK", global.to_string())
            .env("IPCREDUCE_WORLD_SIZE", world.to_string())
            .env("IPCREDUCE_LOCAL_RANK", r.to_string())
            .envs(meeting.vars.iter().map(|(k, v)| (k, v)))
            .env("RANK", global.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", r.to_string())
            .env("LOCAL_WORLD_SIZE", n.to_string())
            .env("GROUP_RANK", nodes.node_rank.to_string());
        // A job with a log directory keeps its flight records there too (ipcreduce::flight).
        if let Some(dir) = &output.log_dir {
            if std::env::var_os("IPCREDUCE_FLIGHT_DIR").is_none() {
                cmd.env("IPCREDUCE_FLIGHT_DIR", dir);
            }
        }
        if nccl_shared_gpu {
            let job_id = &meeting.job_id;
            cmd.env("NCCL_HOSTID", format!("{job_id}-rank-{global}"));
            for (k, v) in [("NCCL_SOCKET_IFNAME", "lo"), ("NCCL_IB_DISABLE", "1")] {
                if std::env::var_os(k).is_none() {
                    cmd.env(k, v);
                }
            }
        }
        for (k, v) in extra_env {
            cmd.env(k, v);
        }
        die_with_parent(&mut cmd);
        if let Some(cores) = &cores {
            bind_to_core(&mut cmd, cores[r]);
        }
        match cmd.spawn() {
            Ok(mut child) => {
                let tag = output.tag.then(|| format!("[rank {global}] "));
                let bar = output.progress.clone();
                if let Some(out) = child.stdout.take() {
                    forward(out, false, tag.clone(), bar.clone(), done_tx.clone());
                    forwarders += 1;
                }
                if let Some(err) = child.stderr.take() {
                    forward(err, true, tag, bar, done_tx.clone());
                    forwarders += 1;
                }
                ranks.push(Rank {
                    child,
                    global,
                    status: None,
                });
            }
            Err(e) => {
                kill_all(&mut ranks, Signal::SIGKILL);
                reap_all(&mut ranks);
                let name = program.to_string_lossy();
                return Err(if e.kind() == std::io::ErrorKind::NotFound {
                    Error::Config(format!("cannot start `{name}`: program not found"))
                } else {
                    Error::io(format!("starting rank {global} (`{name}`)"), e)
                });
            }
        }
    }
    let code = supervise(&mut ranks, grace);
    // The ranks are gone: their last lines are in the pipes (bounded: see DRAIN).
    let until = Instant::now() + DRAIN;
    for _ in 0..forwarders {
        let left = until.saturating_duration_since(Instant::now());
        if done_rx.recv_timeout(left).is_err() {
            break;
        }
    }
    if let Some(bar) = &output.progress {
        bar.finish();
    }
    logs.print_failed(&ranks);
    Ok(code)
}

struct Rank {
    child: Child,
    /// The rank in the whole job.
    global: usize,
    status: Option<ExitStatus>,
}

/// Copies a rank's stdout or stderr to ours a whole line at a time (one write under the
/// stream's lock, so lines of different ranks never mix), optionally tagged; says on `done`
/// when the rank's end closed. With a progress bar, rank 0's progress lines feed it and the
/// other lines are written while it is hidden.
fn forward(
    from: impl Read + Send + 'static,
    to_stderr: bool,
    tag: Option<String>,
    bar: Option<crate::progress::Bar>,
    done: mpsc::Sender<()>,
) {
    std::thread::spawn(move || {
        let mut from = BufReader::new(from);
        let mut line = Vec::new();
        loop {
            line.clear();
            line.extend_from_slice(tag.as_deref().unwrap_or("").as_bytes());
            let start = line.len();
            match from.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
            if line.len() > start && !line.ends_with(b"\n") {
                line.push(b'\n');
            }
            if bar
                .as_ref()
                .is_some_and(|b| !to_stderr && b.take(&line[start..]))
            {
                continue;
            }
            // A closed stdout of ours (e.g. `| head`) must not stop the rank: drop the line.
            let write = || {
                if to_stderr {
                    std::io::stderr().lock().write_all(&line)
                } else {
                    let mut out = std::io::stdout().lock();
                    out.write_all(&line).and_then(|()| out.flush())
                }
            };
            let _ = match &bar {
                Some(b) => b.suspend(write),
                None => write(),
            };
        }
        let _ = done.send(());
    });
}

/// The per-rank logs of the ranks left out of `Output::show`.
struct Logs {
    /// Where they are; None when every rank is shown.
    dir: Option<PathBuf>,
    /// The private directory holding them when no log directory was given.
    _private: Option<PrivateDir>,
    show: Output,
}

impl Logs {
    fn new(nodes: &Nodes, n: usize, output: &Output) -> Result<Logs> {
        let first = nodes.node_rank * n;
        let hidden = (first..first + n).any(|g| !output.shows(g));
        let (dir, private) = match (&output.log_dir, hidden) {
            (_, false) => (None, None),
            (Some(d), true) => {
                std::fs::create_dir_all(d)
                    .map_err(|e| Error::io(format!("creating {}", d.display()), e))?;
                (Some(d.clone()), None)
            }
            (None, true) => {
                let p = PrivateDir::create()?;
                (Some(p.path.clone()), Some(p))
            }
        };
        Ok(Logs {
            dir,
            _private: private,
            show: output.clone(),
        })
    }

    fn path(&self, global: usize) -> Option<PathBuf> {
        self.dir
            .as_ref()
            .filter(|_| !self.show.shows(global))
            .map(|d| d.join(format!("rank-{global}.log")))
    }

    /// The rank's stdout and stderr (one file: its lines stay in order), if it is not shown.
    fn file(&self, global: usize) -> Result<Option<(std::fs::File, std::fs::File)>> {
        let Some(path) = self.path(global) else {
            return Ok(None);
        };
        let what = || format!("creating {}", path.display());
        let out = std::fs::File::create(&path).map_err(|e| Error::io(what(), e))?;
        let err = out.try_clone().map_err(|e| Error::io(what(), e))?;
        Ok(Some((out, err)))
    }

    /// Prints the log of every hidden rank that failed, tagged with its rank.
    fn print_failed(&self, ranks: &[Rank]) {
        for rank in ranks {
            let Some(st) = rank.status.filter(|s| !s.success()) else {
                continue;
            };
            let Some(path) = self.path(rank.global) else {
                continue;
            };
            let text = std::fs::read(&path).unwrap_or_default();
            let mut err = std::io::stderr().lock();
            let _ = writeln!(
                err,
                "ipcreduce launch: rank {}'s output ({}; it {}):",
                rank.global,
                path.display(),
                describe(st)
            );
            // Tagged always: these lines come after the other ranks' and must say whose they are.
            for line in String::from_utf8_lossy(&text).lines() {
                let _ = writeln!(err, "[rank {}] {line}", rank.global);
            }
        }
    }
}

/// Exit code as a shell reports it.
fn exit_code(st: ExitStatus) -> i32 {
    match (st.code(), st.signal()) {
        (Some(c), _) => c,
        (None, Some(s)) => 128 + s,
        (None, None) => 1,
    }
}

fn describe(st: ExitStatus) -> String {
    match (st.code(), st.signal()) {
        (Some(c), _) => format!("exited with code {c}"),
        (None, Some(s)) => {
            let name = Signal::try_from(s).map(|s| s.as_str()).unwrap_or("?");
            format!("was killed by signal {s} ({name})")
        }
        (None, None) => format!("ended ({st})"),
    }
}

/// Waits for every rank; after the first failure (or a signal to us), gives the others
/// `grace`, then SIGTERM, then SIGKILL. Returns the first failure's code or 0.
fn supervise(ranks: &mut [Rank], grace: Duration) -> i32 {
    enum Phase {
        Running,
        Grace(Instant),
        Terminated(Instant),
        Killed,
    }
    let mut phase = Phase::Running;
    let mut first_failure: Option<i32> = None;
    loop {
        for rank in ranks.iter_mut() {
            if rank.status.is_some() {
                continue;
            }
            // An error here means the child is already reaped; treat it as gone.
            let st = match rank.child.try_wait() {
                Ok(Some(st)) => st,
                Ok(None) => continue,
                Err(_) => ExitStatus::from_raw(1 << 8),
            };
            rank.status = Some(st);
            if !st.success() && first_failure.is_none() {
                eprintln!("ipcreduce launch: rank {} {}", rank.global, describe(st));
                first_failure = Some(exit_code(st));
            }
        }
        if ranks.iter().all(|r| r.status.is_some()) {
            return first_failure.unwrap_or(0);
        }
        if let Some(sig) = SignalGuard::take() {
            eprintln!("ipcreduce launch: got signal {sig}; stopping the ranks");
            first_failure.get_or_insert(128 + sig);
            // Ctrl-C already reached the whole process group; anything else is for us alone.
            if let Ok(s) = Signal::try_from(sig) {
                if s != Signal::SIGINT {
                    kill_all(ranks, s);
                }
            }
        }
        let now = Instant::now();
        phase = match phase {
            Phase::Running if first_failure.is_some() => {
                let left = ranks.iter().filter(|r| r.status.is_none()).count();
                eprintln!("ipcreduce launch: giving the other {left} rank(s) {grace:?} to stop");
                Phase::Grace(now + grace)
            }
            Phase::Grace(until) if now >= until => {
                kill_all(ranks, Signal::SIGTERM);
                Phase::Terminated(now + TERM_GRACE)
            }
            Phase::Terminated(until) if now >= until => {
                kill_all(ranks, Signal::SIGKILL);
                Phase::Killed
            }
            p => p,
        };
        std::thread::sleep(TICK);
    }
}

fn kill_all(ranks: &mut [Rank], sig: Signal) {
    for rank in ranks.iter_mut().filter(|r| r.status.is_none()) {
        // Only our own unreaped children, so the pid cannot have been reused.
        let _ = signal::kill(Pid::from_raw(rank.child.id() as i32), sig);
    }
}

fn reap_all(ranks: &mut [Rank]) {
    for rank in ranks.iter_mut().filter(|r| r.status.is_none()) {
        rank.status = rank.child.wait().ok();
    }
}

/// One core per rank when there are at least as many usable cores as ranks, like mpirun's
/// default binding: ranks that spin-wait for each other must not be stacked on one core by the
/// scheduler (two ranks on one core turn a 0.3 us handoff into a 20 us one).
/// `IPCREDUCE_BIND=none` turns it off.
fn core_binding(n: usize) -> Option<Vec<usize>> {
    if std::env::var("IPCREDUCE_BIND").is_ok_and(|v| v == "none" || v == "0") {
        return None;
    }
    let cores = usable_cores();
    (cores.len() >= n).then(|| cores[..n].to_vec())
}

/// The cores this process may run on (its affinity mask); empty when it cannot be read.
pub fn usable_cores() -> Vec<usize> {
    let Ok(allowed) = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)) else {
        return Vec::new();
    };
    (0..nix::sched::CpuSet::count())
        .filter(|&c| allowed.is_set(c).unwrap_or(false))
        .collect()
}

fn bind_to_core(cmd: &mut Command, core: usize) {
    let mut set = nix::sched::CpuSet::new();
    if set.set(core).is_err() {
        return;
    }
    // SAFETY: the closure runs between fork and exec and only makes one system call.
    unsafe {
        cmd.pre_exec(move || {
            // Best effort: a refused binding leaves the rank where the scheduler puts it.
            let _ = nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set);
            Ok(())
        });
    }
}

/// Children get SIGTERM if `launch` itself dies (even by SIGKILL): ranks must not outlive
/// their launcher holding GPU memory.
fn die_with_parent(cmd: &mut Command) {
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: the closure runs between fork and exec and only makes async-signal-safe calls.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGTERM as libc::c_ulong,
                0,
                0,
                0,
            ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            // The launcher may have died before prctl took effect.
            if libc::getppid() != parent {
                return Err(std::io::Error::other("launcher exited"));
            }
            Ok(())
        });
    }
}

fn random_hex(bytes: usize) -> String {
    let mut b = vec![0u8; bytes];
    rand::rngs::OsRng.fill_bytes(&mut b);
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The job's private directory, removed with everything in it when dropped.
struct PrivateDir {
    path: PathBuf,
}

impl PrivateDir {
    fn create() -> Result<PrivateDir> {
        // Socket paths are limited to 107 bytes: a deep $TMPDIR falls back to /tmp.
        let tmp = std::env::temp_dir();
        let base = if tmp.as_os_str().len() <= 60 {
            tmp
        } else {
            PathBuf::from("/tmp")
        };
        Self::create_in(&base)
    }

    fn create_in(base: &Path) -> Result<PrivateDir> {
        let mut last = None;
        for _ in 0..8 {
            let path = base.join(format!("ipcreduce-{}", random_hex(8)));
            // create, not create_all: the directory must be new, hence ours and private.
            match std::fs::DirBuilder::new().mode(0o700).create(&path) {
                Ok(()) => return Ok(PrivateDir { path }),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last = Some(e),
                Err(e) => {
                    return Err(Error::io(
                        format!("creating a private directory in {}", base.display()),
                        e,
                    ))
                }
            }
        }
        Err(Error::io(
            format!("creating a private directory in {}", base.display()),
            last.unwrap_or_else(|| std::io::Error::other("name collisions")),
        ))
    }
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.path) {
            if e.kind() != std::io::ErrorKind::NotFound {
                eprintln!(
                    "ipcreduce launch: cannot remove {}: {e}",
                    self.path.display()
                );
            }
        }
    }
}

/// Signal number caught while supervising (0 = none).
static CAUGHT: AtomicI32 = AtomicI32::new(0);
/// Previous dispositions, held while any launch is supervising (several may run at once in
/// one process, e.g. in tests).
static INSTALLED: Mutex<(usize, Vec<(Signal, SigAction)>)> = Mutex::new((0, Vec::new()));
const CAUGHT_SIGNALS: [Signal; 3] = [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP];

extern "C" fn on_signal(sig: libc::c_int) {
    CAUGHT.store(sig, Ordering::SeqCst);
}

/// Catches SIGINT/SIGTERM/SIGHUP while ranks run, so `launch` stops its ranks instead of
/// leaving them orphaned; restores the previous handlers when dropped.
struct SignalGuard;

impl SignalGuard {
    fn install() -> SignalGuard {
        let mut g = INSTALLED.lock().unwrap_or_else(|e| e.into_inner());
        if g.0 == 0 {
            let action = SigAction::new(
                SigHandler::Handler(on_signal),
                SaFlags::SA_RESTART,
                SigSet::empty(),
            );
            for s in CAUGHT_SIGNALS {
                // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
                if let Ok(old) = unsafe { signal::sigaction(s, &action) } {
                    g.1.push((s, old));
                }
            }
        }
        g.0 += 1;
        SignalGuard
    }

    fn take() -> Option<i32> {
        match CAUGHT.swap(0, Ordering::SeqCst) {
            0 => None,
            s => Some(s),
        }
    }
}

impl Drop for SignalGuard {
    fn drop(&mut self) {
        let mut g = INSTALLED.lock().unwrap_or_else(|e| e.into_inner());
        g.0 -= 1;
        if g.0 == 0 {
            for (s, old) in g.1.drain(..) {
                // SAFETY: restores the disposition that was there before us.
                let _ = unsafe { signal::sigaction(s, &old) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str) -> Vec<OsString> {
        vec!["-c".into(), script.into()]
    }

    #[test]
    fn zero_ranks_and_missing_programs_are_clear_errors() {
        let e = spawn_ranks(0, OsStr::new("true"), &[], &[]).unwrap_err();
        assert!(e.to_string().contains("at least one rank"), "{e}");
        let e = spawn_ranks(65, OsStr::new("true"), &[], &[]).unwrap_err();
        assert!(e.to_string().contains("at most 64 ranks (65 asked)"), "{e}");
        let e = spawn_ranks(2, OsStr::new("/no/such/ipcreduce-prog"), &[], &[]).unwrap_err();
        assert!(e.to_string().contains("not found"), "{e}");
    }

    #[test]
    fn exit_codes() {
        assert_eq!(spawn_ranks(3, OsStr::new("true"), &[], &[]).unwrap(), 0);
        let code = spawn_ranks_with(
            2,
            OsStr::new("sh"),
            &sh("[ \"$IPCREDUCE_RANK\" = 1 ] && exit 9; exit 0"),
            &[],
            Duration::from_millis(100),
        )
        .unwrap();
        assert_eq!(code, 9);
        let code = spawn_ranks_with(
            1,
            OsStr::new("sh"),
            &sh("kill -9 $$"),
            &[],
            Duration::from_millis(100),
        )
        .unwrap();
        assert_eq!(code, 128 + 9);
    }

    #[test]
    fn extra_env_reaches_the_ranks() {
        let code = spawn_ranks(
            2,
            OsStr::new("sh"),
            &sh("[ \"$FOO\" = bar ] && [ \"$LOCAL_WORLD_SIZE\" = 2 ]"),
            &[("FOO".into(), "bar".into())],
        )
        .unwrap();
        assert_eq!(code, 0);
    }

    #[test]
    fn node_settings_are_checked() {
        let m = Master::parse("127.0.0.1:1", "--master").unwrap();
        let nodes = |nnodes, node_rank, master: Option<&Master>| Nodes {
            nnodes,
            node_rank,
            master: master.cloned(),
        };
        let e = nodes(2, 2, Some(&m)).check(1).unwrap_err().to_string();
        assert!(
            e.contains("--node-rank 2") && e.contains("--nnodes 2"),
            "{e}"
        );
        let e = nodes(2, 0, None).check(1).unwrap_err().to_string();
        assert!(e.contains("--master"), "{e}");
        let e = nodes(9, 0, Some(&m)).check(8).unwrap_err().to_string();
        assert!(e.contains("9 nodes of 8 ranks") && e.contains("64"), "{e}");
        assert!(nodes(8, 7, Some(&m)).check(8).is_ok());
        assert!(Nodes::single().check(4).is_ok());
    }

    #[test]
    fn job_ids_from_the_master_are_valid_and_alike() {
        let m = Master::parse("[fd00::1]:29400", "--master").unwrap();
        let id = job_id_for(&m);
        assert_eq!(id, "launch-fd00--1-29400");
        let info = ipcreduce::bootstrap::RankInfo::new(0, 1, "/s", id, None);
        assert!(info.is_ok(), "{info:?}");
    }

    #[test]
    fn private_dirs_are_fresh_and_removed() {
        let d = PrivateDir::create().unwrap();
        let p = d.path.clone();
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        std::fs::write(p.join("x"), b"y").unwrap();
        drop(d);
        assert!(!p.exists());
    }
}
