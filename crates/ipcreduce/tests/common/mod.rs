//! Support shared by the multi-process tests. Each test re-runs its own test binary as the
//! ranks (`--exact <test> --nocapture`) with a role variable set; the test function sees the
//! variable and plays the rank instead of the parent. Ranks report on stdout with lines that
//! start `@@ `; their stderr carries the library's log, which some tests inspect.

// Each test binary uses its own subset of these helpers.
#![allow(dead_code)]

pub mod chain;
pub mod cuda;
pub mod fused_ref;
pub mod ll_sizes;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::DirBuilderExt;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The secret every test job uses (tests that need a wrong one override the variable).
pub const SECRET: &str = "0123456789abcdef0123456789abcdef";

/// A rank's report line, read by the parent.
pub fn say(msg: impl std::fmt::Display) {
    println!("@@ {msg}");
    let _ = std::io::stdout().flush();
}

/// A job's rendezvous settings, in a fresh private directory removed on drop.
pub struct Job {
    pub dir: PathBuf,
    pub socket: PathBuf,
    pub job_id: String,
    pub secret: String,
}

impl Job {
    /// `prefix` names the test file, `tag` the test: both end up in the directory and job id.
    pub fn new(prefix: &str, tag: &str) -> Job {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let dir = std::env::temp_dir().join(format!(
            "ipcreduce-{prefix}-{tag}-{}-{nanos}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::DirBuilder::new().mode(0o700).create(&dir).unwrap();
        Job {
            socket: dir.join("s.sock"),
            dir,
            job_id: format!("{prefix}-{tag}"),
            secret: SECRET.into(),
        }
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// How to start one rank.
pub struct Spawn<'a> {
    /// The test function the child runs (`--exact`).
    pub test: &'a str,
    /// The variable that tells the child it is a rank, and the role it plays.
    pub role_var: &'a str,
    pub role: &'a str,
    pub world: usize,
    /// More variables, set last (they may override the job's).
    pub extra: &'a [(&'a str, &'a str)],
    /// Keep the child's stdin open until [`Rank::wait`]: ranks that must stay in the job until
    /// the parent heard every rank read it to its end.
    pub hold: bool,
}

/// A rank process and what it says.
pub struct Rank {
    pub rank: usize,
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
    stdout: Arc<Mutex<String>>,
    stderr: Arc<Mutex<String>>,
    /// The stdout and stderr readers: joined (after the process exited) before their text
    /// is read, so nothing the process wrote last is missed.
    readers: Vec<std::thread::JoinHandle<()>>,
    status: Option<ExitStatus>,
}

impl Rank {
    pub fn spawn(spec: &Spawn<'_>, job: &Job, rank: usize) -> Rank {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args([
            "--exact",
            spec.test,
            "--nocapture",
            "--test-threads=1",
            "--include-ignored",
        ])
        .env(spec.role_var, spec.role)
        .env("IPCREDUCE_RANK", rank.to_string())
        .env("IPCREDUCE_WORLD_SIZE", spec.world.to_string())
        .env("IPCREDUCE_SOCKET", &job.socket)
        .env("IPCREDUCE_JOB_ID", &job.job_id)
        .env("IPCREDUCE_SECRET", &job.secret)
        // The parent's own settings must not leak into the ranks.
        .env_remove("IPCREDUCE_LOCAL_RANK")
        .env_remove("IPCREDUCE_ALGO")
        .env_remove("IPCREDUCE_TIMEOUT_MS")
        .env_remove("RUST_LOG")
        .stdin(if spec.hold {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        for (k, v) in spec.extra {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn rank");
        let (tx, lines) = mpsc::channel();
        let stdout = Arc::new(Mutex::new(String::new()));
        let stderr = Arc::new(Mutex::new(String::new()));
        let (out, all) = (child.stdout.take().unwrap(), stdout.clone());
        let out_reader = std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                all.lock().unwrap().push_str(&format!("{line}\n"));
                // libtest's "test name ... " may precede our message on the same line.
                if let Some(at) = line.find("@@ ") {
                    let _ = tx.send(line[at + 3..].to_string());
                }
            }
        });
        let (mut err, all) = (child.stderr.take().unwrap(), stderr.clone());
        let err_reader = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = err.read_to_string(&mut s);
            all.lock().unwrap().push_str(&s);
        });
        let stdin = child.stdin.take();
        Rank {
            rank,
            child,
            stdin,
            lines,
            stdout,
            stderr,
            readers: vec![out_reader, err_reader],
            status: None,
        }
    }

    /// Once the process has exited, waits for the readers to collect the last of what it
    /// wrote (they end at end-of-file). While it runs, the text so far is what there is.
    fn settle(&mut self) {
        if self.status.is_none() && !self.has_exited() {
            return;
        }
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
    }

    /// What the rank printed, for failure messages.
    pub fn diag(&mut self) -> String {
        self.settle();
        format!(
            "rank {} (status {:?})\n--- stdout ---\n{}--- stderr ---\n{}",
            self.rank,
            self.status,
            self.stdout.lock().unwrap(),
            self.stderr.lock().unwrap()
        )
    }

    /// The next `@@` message.
    pub fn next(&mut self, within: Duration) -> String {
        match self.lines.recv_timeout(within) {
            Ok(m) => m,
            Err(_) => panic!("no message within {within:?} from {}", self.diag()),
        }
    }

    /// The next `@@` message, or None when none came within `within`.
    pub fn try_next(&mut self, within: Duration) -> Option<String> {
        self.lines.recv_timeout(within).ok()
    }

    /// The next `@@` message starting with `tag`, without the tag (others are skipped).
    pub fn expect(&mut self, tag: &str, within: Duration) -> String {
        let until = Instant::now() + within;
        loop {
            let left = until.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(m) if m.starts_with(tag) => return m[tag.len()..].trim().to_string(),
                Ok(_) => {}
                Err(_) => panic!("no {tag} within {within:?} from {}", self.diag()),
            }
        }
    }

    /// Releases a held rank (closes its stdin) and waits for it to exit.
    pub fn wait(&mut self, within: Duration) -> ExitStatus {
        self.stdin.take();
        let until = Instant::now() + within;
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                self.status = Some(st);
                return st;
            }
            if Instant::now() > until {
                let _ = self.child.kill();
                panic!("did not exit within {within:?}: {}", self.diag());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Whether the process has exited (without waiting).
    pub fn has_exited(&mut self) -> bool {
        if let Some(st) = self.child.try_wait().unwrap() {
            self.status = Some(st);
        }
        self.status.is_some()
    }

    /// SIGKILL.
    pub fn kill(&mut self) {
        self.child.kill().unwrap();
    }

    pub fn wait_ok(&mut self, within: Duration) {
        let st = self.wait(within);
        assert!(st.success(), "failed: {}", self.diag());
    }

    /// Everything the rank wrote to stderr: all of it once the process exited.
    pub fn stderr(&mut self) -> String {
        self.settle();
        self.stderr.lock().unwrap().clone()
    }

    /// Writes `line` to a held rank's stdin (a go-ahead the rank waits for).
    pub fn send_line(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().expect("a held rank (Spawn::hold)");
        writeln!(stdin, "{line}").expect("write to the rank's stdin");
        stdin.flush().expect("flush the rank's stdin");
    }
}

impl Drop for Rank {
    fn drop(&mut self) {
        // A failing test must not leave ranks behind.
        if self.status.is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Starts ranks 0..world of `spec`.
pub fn spawn_world(spec: &Spawn<'_>, job: &Job) -> Vec<Rank> {
    (0..spec.world).map(|r| Rank::spawn(spec, job, r)).collect()
}
