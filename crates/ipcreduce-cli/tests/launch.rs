//! `ipcreduce launch` as users run it: the real binary starting real processes.

use std::collections::HashSet;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_ipcreduce");
const ROLE: &str = "IPCREDUCE_TEST_ROLE";

/// Runs `ipcreduce launch` with `args`, killing it if it outlives `within`.
fn launch(args: &[&str], within: Duration) -> (Output, Duration) {
    let t0 = Instant::now();
    let mut child = Command::new(BIN)
        .arg("launch")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start ipcreduce");
    // Output is small: reading after exit cannot deadlock on a full pipe.
    loop {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        if t0.elapsed() > within {
            let _ = child.kill();
            panic!("ipcreduce launch {args:?} ran past {within:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let out = child.wait_with_output().unwrap();
    (out, t0.elapsed())
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn gone(pid: i32) -> bool {
    // Signal 0 probes existence; launch reaped its children, so their pids are free.
    unsafe { libc::kill(pid, 0) != 0 }
}

#[test]
fn ranks_get_distinct_ranks_and_one_secret() {
    let script = "echo \"$IPCREDUCE_RANK $RANK $LOCAL_RANK $IPCREDUCE_LOCAL_RANK $WORLD_SIZE \
                  $IPCREDUCE_WORLD_SIZE $LOCAL_WORLD_SIZE $IPCREDUCE_SOCKET $IPCREDUCE_JOB_ID \
                  $IPCREDUCE_SECRET $(stat -c %a \"$(dirname \"$IPCREDUCE_SOCKET\")\")\"";
    let (out, _) = launch(
        &["-n", "3", "--", "sh", "-c", script],
        Duration::from_secs(20),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let rows: Vec<Vec<String>> = stdout
        .lines()
        .map(|l| l.split_whitespace().map(str::to_string).collect())
        .collect();
    assert_eq!(rows.len(), 3, "{stdout}");
    let mut ranks = HashSet::new();
    for row in &rows {
        assert_eq!(row.len(), 11, "{stdout}");
        let r = &row[0];
        assert!(ranks.insert(r.clone()), "duplicate rank {r}");
        // RANK, LOCAL_RANK, IPCREDUCE_LOCAL_RANK equal IPCREDUCE_RANK on one host.
        assert!(row[1..4].iter().all(|x| x == r), "{row:?}");
        assert!(row[4..7].iter().all(|x| x == "3"), "{row:?}");
        // Same socket, job and secret for everyone.
        assert_eq!(row[7..10], rows[0][7..10], "{stdout}");
        assert_eq!(row[10], "700", "socket directory mode");
    }
    assert_eq!(ranks, HashSet::from(["0".into(), "1".into(), "2".into()]));
    let secret = &rows[0][9];
    assert!(
        secret.len() == 32 && secret.chars().all(|c| c.is_ascii_hexdigit()),
        "secret {secret:?} is not 128 bits of hex"
    );
    let dir = PathBuf::from(&rows[0][7]);
    let dir = dir.parent().unwrap();
    assert!(!dir.exists(), "{} left behind", dir.display());

    // Another job, another secret and job id.
    let (out2, _) = launch(
        &["-n", "1", "--", "sh", "-c", script],
        Duration::from_secs(20),
    );
    let row2: Vec<String> = text(&out2.stdout)
        .split_whitespace()
        .map(str::to_string)
        .collect();
    assert_ne!(row2[9], *secret);
    assert_ne!(row2[8], rows[0][8]);
}

#[test]
fn failing_rank_stops_the_others() {
    // Rank 1 fails; rank 0 would sleep for a minute; rank 2 even ignores SIGTERM, so launch
    // must fall back to SIGKILL.
    let script = "echo \"$$ $(dirname \"$IPCREDUCE_SOCKET\")\"; \
                  case $IPCREDUCE_RANK in \
                    1) sleep 0.2; exit 7;; \
                    2) trap '' TERM; exec sleep 60;; \
                    *) exec sleep 60;; \
                  esac";
    let (out, took) = launch(
        &["-n", "3", "--grace", "0.3", "--", "sh", "-c", script],
        Duration::from_secs(20),
    );
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(7), "{stderr}");
    assert!(stderr.contains("rank 1 exited with code 7"), "{stderr}");
    // 0.2 s until the failure + 0.3 s grace + 2 s SIGTERM-to-SIGKILL, plus slack.
    assert!(took < Duration::from_secs(6), "took {took:?}");
    let stdout = text(&out.stdout);
    let mut dirs = HashSet::new();
    for line in stdout.lines() {
        let (pid, dir) = line.split_once(' ').unwrap();
        assert!(gone(pid.parse().unwrap()), "rank process {pid} survived");
        dirs.insert(dir.to_string());
    }
    assert_eq!(dirs.len(), 1, "{stdout}");
    for d in dirs {
        assert!(!PathBuf::from(&d).exists(), "{d} left behind");
    }
}

#[test]
fn launch_errors_are_clear() {
    let (out, _) = launch(&["-n", "0", "--", "true"], Duration::from_secs(10));
    assert!(!out.status.success());
    let e = text(&out.stderr);
    assert!(
        e.contains("error:") && e.contains("at least one rank"),
        "{e}"
    );

    let (out, _) = launch(
        &["-n", "2", "--", "/no/such/ipcreduce-program"],
        Duration::from_secs(10),
    );
    assert!(!out.status.success());
    let e = text(&out.stderr);
    assert!(e.contains("error:") && e.contains("not found"), "{e}");

    let (out, _) = launch(
        &["-n", "2", "--", "sh", "-c", "kill -9 $$"],
        Duration::from_secs(20),
    );
    assert_eq!(out.status.code(), Some(128 + 9));
}

/// `launch` + `RankInfo::from_env` + the bootstrap, end to end: this test binary is the rank.
#[test]
fn launched_ranks_bootstrap_together() {
    if std::env::var(ROLE).is_ok() {
        let info = ipcreduce::bootstrap::RankInfo::from_env().expect("rank info");
        assert!(info.secret.is_some());
        let mut b = ipcreduce::bootstrap::Bootstrap::connect(info, Duration::from_secs(10))
            .expect("connect");
        let all = b.all_gather(&[b.rank() as u8]).expect("all_gather");
        let want: Vec<Vec<u8>> = (0..b.world()).map(|r| vec![r as u8]).collect();
        assert_eq!(all, want);
        b.barrier().expect("barrier");
        println!("\n@@ OK {} of {}", b.rank(), b.world());
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let mut child = Command::new(BIN)
        .args(["launch", "-n", "4", "--"])
        .arg(&exe)
        .args([
            "--exact",
            "launched_ranks_bootstrap_together",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE, "rank")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while child.try_wait().unwrap().is_none() {
        assert!(t0.elapsed() < Duration::from_secs(20), "job hung");
        std::thread::sleep(Duration::from_millis(10));
    }
    let out = child.wait_with_output().unwrap();
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    let oks: HashSet<&str> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("@@ OK "))
        .collect();
    assert_eq!(
        oks,
        HashSet::from(["0 of 4", "1 of 4", "2 of 4", "3 of 4"]),
        "{stdout}"
    );
}
