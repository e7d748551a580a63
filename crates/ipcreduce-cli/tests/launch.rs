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
    // Rank 1 fails only once rank 2 has set its trap (a file in the job's directory, polled
    // at most 10 s), so SIGTERM can never have been what stopped rank 2.
    let script = "d=$(dirname \"$IPCREDUCE_SOCKET\"); echo \"$$ $d\"; \
                  case $IPCREDUCE_RANK in \
                    1) i=0; while [ ! -e \"$d/trapped\" ]; do \
                         i=$((i+1)); [ $i -gt 1000 ] && exit 9; sleep 0.01; done; exit 7;; \
                    2) trap '' TERM; : > \"$d/trapped\"; exec sleep 60;; \
                    *) exec sleep 60;; \
                  esac";
    let (out, took) = launch(
        &["-n", "3", "--grace", "0.3", "--", "sh", "-c", script],
        Duration::from_secs(20),
    );
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(7), "{stderr}");
    assert!(stderr.contains("rank 1 exited with code 7"), "{stderr}");
    // The 0.3 s grace, then 2 s from SIGTERM to SIGKILL: rank 2 ignores SIGTERM, so the job
    // cannot end before SIGKILL, and must end soon after it.
    assert!(
        took >= Duration::from_millis(2300),
        "took {took:?}: rank 2 was stopped before the SIGKILL fallback"
    );
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

#[test]
fn output_reaches_the_terminal_a_whole_line_at_a_time() {
    // Each rank writes half a line, waits until every rank has written its half (files in a
    // shared directory: no sleep stands in for the order), then ends the line. A launcher that
    // passed bytes through as they came would mix the halves ("okok  21").
    let dir = std::env::temp_dir().join(format!("ipcreduce-lines-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let script = format!(
        "printf ok; touch {d}/$IPCREDUCE_RANK; \
         while [ $(ls {d} | wc -l) -lt 3 ]; do sleep 0.01; done; \
         echo \" $IPCREDUCE_RANK\"; echo \"err $IPCREDUCE_RANK\" >&2; printf 'last'",
        d = dir.display()
    );
    let (out, _) = launch(
        &["-n", "3", "--", "sh", "-c", &script],
        Duration::from_secs(20),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let mut lines: Vec<String> = text(&out.stdout).lines().map(String::from).collect();
    lines.sort();
    // A last line without its newline comes whole too.
    assert_eq!(
        lines,
        ["last", "last", "last", "ok 0", "ok 1", "ok 2"],
        "{lines:?}"
    );
    let mut errs: Vec<String> = text(&out.stderr).lines().map(String::from).collect();
    errs.sort();
    assert_eq!(errs, ["err 0", "err 1", "err 2"]);
    std::fs::remove_dir_all(&dir).unwrap();

    // --tag-output: every line says whose it is.
    let (out, _) = launch(
        &[
            "-n",
            "2",
            "--tag-output",
            "--",
            "sh",
            "-c",
            "echo a $RANK; echo b $RANK >&2",
        ],
        Duration::from_secs(20),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let mut lines: Vec<String> = text(&out.stdout).lines().map(String::from).collect();
    lines.sort();
    assert_eq!(lines, ["[rank 0] a 0", "[rank 1] a 1"]);
    let mut errs: Vec<String> = text(&out.stderr).lines().map(String::from).collect();
    errs.sort();
    assert_eq!(errs, ["[rank 0] b 0", "[rank 1] b 1"]);
}

#[test]
fn hidden_ranks_write_logs_printed_only_when_they_fail() {
    let script = "echo out $RANK; echo err $RANK >&2; [ $RANK = 2 ] && exit 3; exit 0";
    let (out, _) = launch(
        &["-n", "3", "--show", "0", "--", "sh", "-c", script],
        Duration::from_secs(20),
    );
    assert_eq!(out.status.code(), Some(3));
    assert_eq!(text(&out.stdout), "out 0\n");
    let stderr = text(&out.stderr);
    // (Rank 0's line and the launcher's own about rank 2 come in either order.)
    assert!(stderr.lines().any(|l| l == "err 0"), "{stderr}");
    // Rank 2 failed: its log, both streams in order, tagged; rank 1 passed: nothing of it.
    assert!(
        stderr.contains("ipcreduce launch: rank 2 exited with code 3"),
        "{stderr}"
    );
    assert!(
        stderr.contains("ipcreduce launch: rank 2's output ("),
        "{stderr}"
    );
    assert!(
        stderr.contains("[rank 2] out 2\n[rank 2] err 2\n"),
        "{stderr}"
    );
    assert!(!stderr.contains(" 1\n"), "{stderr}");

    // --log-dir keeps every hidden rank's log; all passing: nothing printed but rank 0.
    let dir = std::env::temp_dir().join(format!("ipcreduce-logs-{}", std::process::id()));
    let (out, _) = launch(
        &[
            "-n",
            "3",
            "--show",
            "0",
            "--log-dir",
            dir.to_str().unwrap(),
            "--",
            "sh",
            "-c",
            "echo out $RANK",
        ],
        Duration::from_secs(20),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "out 0\n");
    assert_eq!(text(&out.stderr), "");
    for r in [1, 2] {
        let log = std::fs::read_to_string(dir.join(format!("rank-{r}.log"))).unwrap();
        assert_eq!(log, format!("out {r}\n"));
    }
    assert!(!dir.join("rank-0.log").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A rank of the end-to-end tests: joins, checks an all-gather, says who it is.
fn play_bootstrap_rank() {
    let info = ipcreduce::bootstrap::RankInfo::from_env().expect("rank info");
    assert!(info.secret.is_some());
    let tcp = info.master.is_some();
    if let (Ok(dir), Some(m)) = (std::env::var("LAUNCH_TEST_REFUSED_DIR"), &info.master) {
        // Node 1 of the two-launcher test: nobody may listen yet, so the bootstrap's connect
        // must take its retry path; say so before connecting, the parent then starts node 0.
        let addr = format!("{}:{}", m.host, m.port);
        match std::net::TcpStream::connect(&addr) {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {}
            other => panic!(
                "rank {}: {addr} before node 0 started: {other:?}",
                info.rank
            ),
        }
        std::fs::write(format!("{dir}/refused.{}", info.rank), b"").unwrap();
    }
    let mut b =
        ipcreduce::bootstrap::Bootstrap::connect(info, Duration::from_secs(10)).expect("connect");
    let all = b.all_gather(&[b.rank() as u8]).expect("all_gather");
    let want: Vec<Vec<u8>> = (0..b.world()).map(|r| vec![r as u8]).collect();
    assert_eq!(all, want);
    b.barrier().expect("barrier");
    let l = b.layout();
    println!(
        "\n@@ OK {} of {} node {} local {} tcp {tcp}",
        b.rank(),
        b.world(),
        l.node(),
        l.local_rank()
    );
}

/// Starts `ipcreduce launch ARGS -- <this test binary as ranks of test>` with `env`.
fn launch_test_ranks(test: &str, args: &[&str], env: &[(&str, &str)]) -> std::process::Child {
    let exe = std::env::current_exe().unwrap();
    Command::new(BIN)
        .arg("launch")
        .args(args)
        .arg("--")
        .arg(&exe)
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(ROLE, "rank")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// The ranks' `@@ OK` lines, once the launcher `child` exited successfully (bounded).
fn oks_of(child: std::process::Child) -> Vec<String> {
    let t0 = Instant::now();
    let mut child = child;
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            panic!("job hung");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let out = child.wait_with_output().unwrap();
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    stdout
        .lines()
        .filter_map(|l| l.strip_prefix("@@ OK "))
        .map(str::to_string)
        .collect()
}

/// `launch` + `RankInfo::from_env` + the bootstrap, end to end: this test binary is the rank.
#[test]
fn launched_ranks_bootstrap_together() {
    if std::env::var(ROLE).is_ok() {
        return play_bootstrap_rank();
    }
    let test = "launched_ranks_bootstrap_together";
    let oks: HashSet<String> = oks_of(launch_test_ranks(test, &["-n", "4"], &[]))
        .into_iter()
        .collect();
    let want: HashSet<String> = (0..4)
        .map(|r| format!("{r} of 4 node 0 local {r} tcp false"))
        .collect();
    assert_eq!(oks, want);
}

/// Two launchers, as on two hosts (`IPCREDUCE_HOST_ID` tells them apart), make one job of
/// 2 x 2 ranks over TCP on loopback.
#[test]
fn two_launchers_make_one_job_over_tcp() {
    if std::env::var(ROLE).is_ok() {
        return play_bootstrap_rank();
    }
    let test = "two_launchers_make_one_job_over_tcp";
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let master = format!("127.0.0.1:{port}");
    let secret = "00112233445566778899aabbccddeeff";
    let dir = std::env::temp_dir().join(format!("ipcreduce-launch-refused-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let refused_dir = dir.to_str().unwrap();
    let node = |i: &'static str, host: &'static str| {
        let args = [
            "-n",
            "2",
            "--nnodes",
            "2",
            "--node-rank",
            i,
            "--master",
            &master,
        ];
        let mut env = vec![("IPCREDUCE_SECRET", secret), ("IPCREDUCE_HOST_ID", host)];
        if i == "1" {
            env.push(("LAUNCH_TEST_REFUSED_DIR", refused_dir));
        }
        launch_test_ranks(test, &args, &env)
    };
    // Node 1 first: its ranks find nobody listening (each says so in a file), so they wait,
    // bounded, for rank 0; only then is node 0 started.
    let n1 = node("1", "host-b");
    let until = Instant::now() + Duration::from_secs(20);
    while (2..4).any(|r| !dir.join(format!("refused.{r}")).exists()) {
        assert!(
            Instant::now() < until,
            "node 1's ranks never tried to connect"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let n0 = node("0", "host-a");
    let mut oks = oks_of(n0);
    oks.extend(oks_of(n1));
    oks.sort();
    let want: Vec<String> = (0..4)
        .map(|r| format!("{r} of 4 node {} local {} tcp true", r / 2, r % 2))
        .collect();
    assert_eq!(oks, want);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_launcher_across_hosts_needs_a_master_and_a_secret() {
    let (out, _) = launch(
        &["-n", "1", "--nnodes", "2", "--", "true"],
        Duration::from_secs(10),
    );
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("--master"),
        "{}",
        text(&out.stderr)
    );
    // (The test's own environment has no IPCREDUCE_SECRET.)
    let (out, _) = launch(
        &[
            "-n",
            "1",
            "--nnodes",
            "2",
            "--master",
            "127.0.0.1:9",
            "--",
            "true",
        ],
        Duration::from_secs(10),
    );
    assert!(!out.status.success());
    let e = text(&out.stderr);
    assert!(e.contains("IPCREDUCE_SECRET"), "{e}");
}
