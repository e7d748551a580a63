//! The command line as a user runs it, on the host backend (no GPU needed): `check`, `bench`
//! and the fault scenarios, each with real processes started by `ipcreduce launch`.

use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn command(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ipcreduce"));
    c.args(args)
        // A rank's variables from an outer launcher would make the command skip its own launch.
        .env_remove("IPCREDUCE_RANK")
        .env_remove("RANK");
    c
}

fn ipcreduce(args: &[&str]) -> Output {
    command(args).output().expect("run ipcreduce")
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Whether this machine has an NVIDIA GPU, decided apart from the library's own checks.
fn gpu_machine() -> bool {
    std::path::Path::new("/dev/nvidiactl").exists()
}

/// A refused command line: exit 2, the message once on stderr, nothing on stdout (no rank
/// started, so no header), and no launcher line.
fn assert_refused(args: &[&str], message: &str) {
    let out = ipcreduce(args);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    let all = text(&out);
    assert_eq!(out.status.code(), Some(2), "{args:?}:\n{all}");
    assert_eq!(
        stderr.matches(message).count(),
        1,
        "{args:?}: {message:?}\n{all}"
    );
    assert_eq!(stderr.lines().count(), 1, "{args:?}: one line\n{all}");
    assert!(stderr.starts_with("error: "), "{args:?}:\n{all}");
    assert!(stdout.is_empty(), "{args:?}: a rank started\n{all}");
    assert!(!all.contains("ipcreduce launch"), "{args:?}:\n{all}");
}

#[test]
fn bad_command_lines_are_refused_once_before_any_rank_starts() {
    let cases: &[(&[&str], &str)] = &[
        (&["bench", "-b", "1G", "-e", "8"], "error: -b is 1073741824 B (1 GiB), larger than -e (8 B): no size to run"),
        (&["bench", "--minbytes", "64", "--maxbytes", "8"], "--minbytes is 64 B, larger than --maxbytes (8 B)"),
        (&["bench", "--ranks", "0"], "error: --ranks 0: a job needs at least one rank"),
        (&["bench", "--ranks", "9"], "--ranks 9: bench checks exact results for at most 8 ranks"),
        (&["check", "--ranks", "0"], "error: --ranks 0: a job needs at least one rank"),
        (&["bench", "-f", "0"], "error: -f 0: each size is the previous one times this factor, so it must be at least 2"),
        (&["bench", "--stepfactor", "1"], "error: --stepfactor 1: each size"),
        (&["bench", "-n", "0"], "error: -n 0: each size needs at least one timed call"),
        (&["bench", "--iters", "0"], "error: --iters 0: each size"),
        (&["bench", "-b", "0"], "error: -b 0: not a whole number of float elements (4 bytes each); take a multiple of 4, e.g. -b 4"),
        (&["bench", "-b", "6", "-e", "64"], "error: -b 6: not a whole number of float elements (4 bytes each); take a multiple of 4, e.g. -b 8"),
        (&["bench", "-b", "2", "-d", "all"], "error: -b 2: not a whole number of float elements"),
        (&["bench", "-d", "foo"], "error: -d foo: unknown dtype 'foo'"),
        (&["bench", "--datatype", "f64"], "error: --datatype f64: unknown dtype 'f64'"),
        (&["bench", "-a", "bogus"], "error: -a bogus: unknown algorithm 'bogus'"),
        (&["bench", "--algo", "nccl,nccl-shm"], "error: --algo nccl,nccl-shm: nccl and nccl-shm cannot run in one process"),
        (&["bench", "--backend", "bogus"], "unknown backend 'bogus' (expected auto, cuda or host)"),
        (&["check", "-a", "nccl"], "error: -a nccl: check draws from auto, oneshot and twoshot"),
        (&["check", "--algo", "threeshot"], "error: --algo threeshot: unknown algorithm 'threeshot'"),
        (&["check", "--cases", "0"], "error: --cases 0: nothing to check"),
        (&["check", "--max-bytes", "2"], "error: --max-bytes 2: the cases draw every dtype"),
        (&["launch", "-n", "0", "--", "true"], "error: -n 0: a job needs at least one rank"),
        (&["launch", "--nproc", "0", "--", "true"], "error: --nproc 0: a job needs at least one rank"),
    ];
    for (args, message) in cases {
        if args.contains(&"--backend") {
            // clap's own refusal: exit 2, and a hint line after the message.
            let out = ipcreduce(args);
            let all = text(&out);
            assert_eq!(out.status.code(), Some(2), "{all}");
            assert_eq!(all.matches(message).count(), 1, "{all}");
            assert!(
                out.stdout.is_empty() && !all.contains("ipcreduce launch"),
                "{all}"
            );
            continue;
        }
        assert_refused(args, message);
    }
    if gpu_machine() {
        return;
    }
    // No GPU: cuda is refused in one line that says what the host backend does instead.
    for cmd in ["bench", "check"] {
        assert_refused(
            &[cmd, "--backend", "cuda", "--ranks", "2"],
            "error: --backend cuda: CUDA backend unavailable: ",
        );
    }
    for args in [&["topo"][..], &["topo", "--ranks", "2"]] {
        assert_refused(
            args,
            "error: topo: no usable GPU here (CUDA backend unavailable: ",
        );
        let all = text(&ipcreduce(args));
        assert!(all.contains("The host backend"), "{all}");
    }
}

/// The cores the test may run on, counted apart from the CLI (its affinity mask).
fn cores() -> usize {
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: fills the set for this process.
    let r = unsafe { libc::sched_getaffinity(0, std::mem::size_of_val(&set), &mut set) };
    assert_eq!(r, 0, "sched_getaffinity");
    // SAFETY: reads the set filled above.
    unsafe { libc::CPU_COUNT(&set) as usize }
}

#[test]
fn the_host_default_fits_the_machine_and_says_so() {
    let cores = cores();
    let want = cores.clamp(1, 4);
    let out = ipcreduce(&[
        "bench",
        "--backend",
        "host",
        "-e",
        "64",
        "-n",
        "2",
        "-w",
        "1",
    ]);
    let all = text(&out);
    assert!(out.status.success(), "{all}");
    let s = if cores == 1 { "" } else { "s" };
    let line = format!(
        "# {want} rank{}: the host backend's default: one rank per core, at most 4 ({cores} core{s} here)",
        if want == 1 { "" } else { "s" }
    );
    assert!(all.starts_with(&line), "{all}");
    assert!(all.contains(&format!("world {want}\n")), "{all}");
    assert!(!all.contains("times are not representative"), "{all}");
    // The legend: what the time is, over how many calls, what auto:1s means; host rows have
    // no cuda columns.
    assert!(
        all.contains("# time(us): mean per call over 2 timed calls after 1 warm-up calls, of the slowest rank"),
        "{all}"
    );
    assert!(
        all.contains("auto:1s / auto:2s is auto, which ran one-shot / two-shot"),
        "{all}"
    );
    let header = all
        .lines()
        .find(|l| l.contains("time(us)") && l.contains("size"))
        .unwrap();
    for col in ["ctas", "reg", "mode"] {
        assert!(!header.split_whitespace().any(|c| c == col), "{header}");
    }
    let row = all
        .lines()
        .find(|l| l.trim_start().starts_with("8 "))
        .unwrap();
    // size count type redop algo path time algbw busbw #wrong
    assert_eq!(row.split_whitespace().count(), 10, "{row}");

    // More ranks than cores: said, once, before the ranks start.
    let over = (cores + 1).to_string();
    if cores < 8 {
        let out = ipcreduce(&[
            "check",
            "--backend",
            "host",
            "--ranks",
            &over,
            "--cases",
            "3",
        ]);
        let all = text(&out);
        assert!(out.status.success(), "{all}");
        let line = format!("# {over} ranks on {cores} core");
        assert_eq!(all.matches(&line).count(), 1, "{all}");
        assert!(all.contains("times are not representative"), "{all}");
    }
}

#[test]
fn progress_is_drawn_only_for_a_terminal() {
    // Off a terminal (the test's pipes) the command asks its ranks for no progress lines.
    let out = ipcreduce(&["check", "--backend", "host", "--ranks", "2", "--cases", "5"]);
    let all = text(&out);
    assert!(out.status.success(), "{all}");
    assert!(!all.contains("@@ipcreduce-progress"), "{all}");
    // Asked (as a launching command on a terminal asks): rank 0 alone reports, and the last
    // case always; an outer launcher without a bar passes the lines through.
    let out = command(&["launch", "-n", "2", "--", env!("CARGO_BIN_EXE_ipcreduce")])
        .args(["check", "--backend", "host", "--cases", "5"])
        .env("IPCREDUCE_PROGRESS", "1")
        .output()
        .expect("run ipcreduce");
    let all = text(&out);
    assert!(out.status.success(), "{all}");
    assert_eq!(
        all.matches("@@ipcreduce-progress 5 5 cases\n").count(),
        1,
        "{all}"
    );
    let lines = all
        .lines()
        .filter(|l| l.starts_with("@@ipcreduce-progress "));
    assert!(lines.clone().count() <= 5, "{all}");
    assert!(lines.clone().all(|l| l.ends_with(" 5 cases")), "{all}");
}

#[test]
fn check_passes_on_the_host_backend_at_several_world_sizes() {
    for ranks in ["2", "3", "4", "8"] {
        let out = ipcreduce(&[
            "check",
            "--backend",
            "host",
            "--ranks",
            ranks,
            "--cases",
            "150",
            "--max-bytes",
            "2M",
        ]);
        let all = text(&out);
        assert!(out.status.success(), "world {ranks}:\n{all}");
        assert!(
            all.contains("150 passed, 0 failed"),
            "world {ranks}:\n{all}"
        );
    }
}

#[test]
fn bench_prints_a_checked_table_and_json() {
    let dir = std::env::temp_dir().join(format!("ipcreduce-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("bench.json");
    let out = ipcreduce(&[
        "bench",
        "--backend",
        "host",
        "--ranks",
        "2",
        "-b",
        "8",
        "-e",
        "256K",
        "-f",
        "8",
        "-d",
        "all",
        "-n",
        "5",
        "-w",
        "2",
        "--json",
        json.to_str().unwrap(),
    ]);
    let all = text(&out);
    assert!(out.status.success(), "{all}");
    assert!(all.contains("backend: host"), "{all}");
    assert!(all.contains("nccl: unavailable"), "{all}");
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(doc["meta"]["backend"], "host");
    assert_eq!(doc["meta"]["world"], 2);
    let rows = doc["rows"].as_array().unwrap();
    // 8 B .. 256 KiB by 8: 6 sizes, 3 dtypes, auto/oneshot/twoshot.
    assert_eq!(rows.len(), 6 * 3 * 3, "{all}");
    for row in rows {
        assert_eq!(row["wrong"], 0, "{row}");
        assert!(row["time_us"].as_f64().unwrap() > 0.0, "{row}");
        assert_eq!(row["mode"], "eager");
        // Every call checked: 2 warm-up, then 7 rounds of back-to-back calls, each at least
        // the 5 asked for (more for small messages, up to 20,000 per round).
        assert_eq!(row["rounds"], 7, "{row}");
        let calls = row["calls"].as_u64().unwrap();
        assert!((2 + 7 * 5..=2 + 7 * 20_000).contains(&calls), "{row}");
        let (lo, mid, hi) = (
            row["time_min_us"].as_f64().unwrap(),
            row["time_us"].as_f64().unwrap(),
            row["time_max_us"].as_f64().unwrap(),
        );
        assert!(lo <= mid && mid <= hi, "{row}");
        assert_eq!(row["registered"], false, "{row}");
        assert_eq!(row["path"], row["ran"], "{row}");
        let gross = row["gross_us"].as_f64().unwrap();
        assert!(gross >= row["time_us"].as_f64().unwrap(), "{row}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bench_takes_nccl_shm_and_refuses_it_beside_nccl() {
    let dir = std::env::temp_dir().join(format!("ipcreduce-cli-shm-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("bench.json");
    let out = command(&["bench", "--backend", "host", "--ranks", "2", "-e", "64"])
        .args(["-n", "2", "-w", "1", "-a", "auto,nccl-shm"])
        .args(["--json", json.to_str().unwrap()])
        .env_remove("NCCL_P2P_DISABLE")
        .output()
        .expect("run ipcreduce");
    let all = text(&out);
    assert!(out.status.success(), "{all}");
    // The host backend has no NCCL: the column is left out, saying why; the ranks set
    // NCCL_P2P_DISABLE for it before their first NCCL init, and the JSON says so.
    assert!(all.contains("nccl: unavailable"), "{all}");
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(doc["meta"]["nccl_p2p_disable"], "1", "{doc}");
    assert!(doc["rows"]
        .as_array()
        .unwrap()
        .iter()
        .all(|r| r["nccl"].is_null()));
    std::fs::remove_dir_all(&dir).ok();

    let both: Vec<&str> = "bench --backend host --ranks 2 -a nccl,nccl-shm"
        .split(' ')
        .collect();
    let out = ipcreduce(&both);
    let all = text(&out);
    assert!(!out.status.success(), "{all}");
    assert!(all.contains("cannot run in one process"), "{all}");
}

#[test]
fn auto_says_why_it_picked_its_backend() {
    let gpu = ipcreduce::backend::cuda::usable().is_ok();
    let out = ipcreduce(&["bench", "--ranks", "2", "-e", "64", "-n", "2", "-w", "1"]);
    let all = text(&out);
    assert!(out.status.success(), "{all}");
    if gpu {
        assert!(
            all.contains("backend: cuda (auto: every rank has a GPU)"),
            "{all}"
        );
        return;
    }
    assert!(
        all.contains("backend: host (auto: CUDA backend unavailable"),
        "{all}"
    );
    // Asking for cuda where there is none is a clear error, not a panic.
    let out = ipcreduce(&["check", "--backend", "cuda", "--ranks", "2", "--cases", "1"]);
    let all = text(&out);
    assert!(!out.status.success());
    assert!(all.contains("CUDA backend unavailable"), "{all}");
    assert!(!all.contains("panicked"), "{all}");
}

/// Runs a fault scenario; returns the PASS/FAIL lines.
fn faults(scenario: &str, ranks: &str, extra: &[&str]) -> (Vec<String>, Vec<String>, String) {
    let mut args = vec![
        "faults",
        "--backend",
        "host",
        "--ranks",
        ranks,
        "--scenario",
        scenario,
    ];
    args.extend_from_slice(extra);
    let out = ipcreduce(&args);
    let all = text(&out);
    let pass = all
        .lines()
        .filter(|l| l.starts_with("PASS"))
        .map(String::from)
        .collect();
    let fail = all
        .lines()
        .filter(|l| l.starts_with("FAIL"))
        .map(String::from)
        .collect();
    (pass, fail, all)
}

#[test]
fn mismatched_calls_fail_on_every_rank() {
    for scenario in ["mismatch-count", "mismatch-dtype"] {
        for algo in ["oneshot", "twoshot"] {
            let (pass, fail, all) = faults(scenario, "4", &["-a", algo]);
            assert_eq!(
                (pass.len(), fail.len()),
                (4, 0),
                "{scenario} {algo}:\n{all}"
            );
            // Each rank says what differs: its own mismatch error, or the cause passed on by
            // the rank that found it first.
            // The kind is printed first: a mismatch, or the abort carrying it.
            assert!(
                pass.iter()
                    .all(|l| l.contains(": Mismatch: ") || l.contains(": Aborted: ")),
                "{all}"
            );
            assert!(pass.iter().all(|l| l.contains(" vs ")), "{all}");
            assert!(
                pass.iter()
                    .any(|l| l.contains(": Mismatch: ") && l.contains("does not match")),
                "{all}"
            );
        }
    }
}

#[test]
fn a_missing_rank_times_out_and_is_named() {
    let (pass, fail, all) = faults("timeout", "4", &["--timeout-ms", "800"]);
    assert_eq!((pass.len(), fail.len()), (4, 0), "{all}");
    assert!(
        pass.iter()
            .filter(|l| l.contains(": Timeout: ") && l.contains("waiting for peer rank 3"))
            .count()
            == 3,
        "{all}"
    );
}

#[test]
fn a_killed_rank_is_named_by_the_survivors_within_two_seconds() {
    let started = Instant::now();
    let (pass, fail, all) = faults("kill", "4", &[]);
    // The killed rank prints nothing; the three survivors pass.
    assert_eq!((pass.len(), fail.len()), (3, 0), "{all}");
    for r in 0..3 {
        let line = pass
            .iter()
            .find(|l| l.starts_with(&format!("PASS kill rank {r}: ")))
            .unwrap_or_else(|| panic!("no PASS line of rank {r}:\n{all}"));
        // The death, as an abort or a lost peer, of this rank and naming the culprit; the
        // later call refused as aborted with the same cause.
        let rest = &line[format!("PASS kill rank {r}: ").len()..];
        assert!(
            rest.starts_with(&format!("Aborted: rank {r}: "))
                || rest.starts_with(&format!("PeerLost: rank {r}: peer rank 3 ")),
            "{line}"
        );
        assert!(rest.contains("rank 3 died"), "{line}");
        assert!(
            rest.contains(&format!("later calls refused: Aborted: rank {r}: ")),
            "{line}"
        );
    }
    // Noticed through the liveness connections, far inside the 30 s timeout: the survivors
    // get inside within a second, then the death is seen within 2 s.
    assert!(started.elapsed() < Duration::from_secs(10), "{all}");
}

#[test]
fn create_destroy_cycles_leak_nothing() {
    let (pass, fail, all) = faults("cycles", "2", &["--cycles", "1000"]);
    assert_eq!((pass.len(), fail.len()), (2, 0), "{all}");
}
