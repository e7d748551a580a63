//! `ipcreduce warmup` as a user runs it where there is no GPU: it refuses without `--arch`,
//! refuses bad values once with exit status 2, and with `--arch sm_90` compiles CUBINs into the
//! cache directory (NVRTC, no GPU), which a second run finds.

use std::path::PathBuf;
use std::process::{Command, Output};

fn warmup(args: &[&str], dir: &std::path::Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ipcreduce"))
        .arg("warmup")
        .args(args)
        .env("IPCREDUCE_CACHE_DIR", dir)
        .output()
        .expect("run ipcreduce warmup")
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ipcreduce-warmup-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Whether this machine has an NVIDIA GPU, decided apart from the command's own checks.
fn gpu_machine() -> bool {
    std::path::Path::new("/dev/nvidiactl").exists()
}

fn assert_refused(args: &[&str], message: &str) {
    let dir = scratch("refused");
    let out = warmup(args, &dir);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{args:?}:\n{stdout}{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{args:?}: one line\n{stderr}");
    assert!(
        stderr.starts_with("error: ") && stderr.contains(message),
        "{args:?}: {message:?}\n{stderr}"
    );
    assert!(stdout.is_empty(), "{args:?}: {stdout}");
    assert!(!dir.exists(), "{args:?}: the cache directory was made");
}

#[test]
fn without_a_gpu_warmup_asks_for_an_architecture() {
    if gpu_machine() {
        eprintln!("skipped: this machine has a GPU");
        return;
    }
    assert_refused(&[], "no CUDA GPU on this machine: give --arch sm_XX");
}

#[test]
fn bad_values_are_refused_once() {
    assert_refused(
        &["--arch", "compute_90"],
        "--arch compute_90: a real GPU architecture",
    );
    assert_refused(&["--arch", "sm_9x"], "--arch sm_9x");
    assert_refused(
        &["--world", "9", "--arch", "sm_90"],
        "--world 9: 1 to 8 ranks",
    );
    assert_refused(&["--world", "0", "--arch", "sm_90"], "--world 0");
    assert_refused(
        &["--only", "nope", "--arch", "sm_90"],
        "--only nope: not a kernel group (ll, ll12, staged, zerocopy, zerocopy16, ce, scatter_gather, fused)",
    );
    assert_refused(&["-j", "0", "--arch", "sm_90"], "--jobs 0");
}

#[test]
fn warmup_for_sm_90_fills_the_cache_and_a_second_run_finds_it() {
    if !ipcreduce::backend::cuda::kernels::nvrtc_for_tests() {
        return;
    }
    let dir = scratch("fill");
    let args = [
        "--arch",
        "sm_90",
        "--world",
        "2",
        "--only",
        "ce",
        "--driver-version",
        "13000",
        "-j",
        "2",
    ];
    let out = warmup(&args, &dir);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    // The copy-engine file: 3 dtypes x 3 ops at world class 2.
    assert!(
        stdout.contains("# warmup: 9 kernel variants for sm_90 (world-size classes 2;"),
        "{stdout}"
    );
    assert_eq!(stdout.matches(": compiled in ").count(), 9, "{stdout}");
    assert!(stdout.contains("9 compiled, 0 already cached"), "{stdout}");
    assert!(stdout.contains("[  9/9] sm_90 ce w2 "), "{stdout}");
    let files = |ext: &str| {
        std::fs::read_dir(&dir)
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .path()
                    .extension()
                    .is_some_and(|x| x == ext)
            })
            .count()
    };
    assert_eq!(files("bin"), 9);
    // Every file is an ELF image (a CUBIN) behind the cache's header.
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "bin") {
            let b = std::fs::read(&p).unwrap();
            assert!(b.windows(4).any(|w| w == b"\x7fELF"), "{}", p.display());
        }
    }
    let again = warmup(&args, &dir);
    let (stdout, stderr) = text(&again);
    assert_eq!(again.status.code(), Some(0), "{stdout}{stderr}");
    assert!(stdout.contains("0 compiled, 9 already cached"), "{stdout}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_cache_directory_that_cannot_be_written_fails_warmup() {
    if !ipcreduce::backend::cuda::kernels::nvrtc_for_tests() {
        return;
    }
    let base = scratch("unwritable");
    std::fs::create_dir_all(&base).unwrap();
    std::fs::write(base.join("file"), b"").unwrap();
    let out = warmup(
        &["--arch", "sm_90", "--world", "2", "--only", "ce", "-j", "2"],
        &base.join("file/kernels"),
    );
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
    assert!(stderr.contains("nothing could be stored"), "{stderr}");
    assert_eq!(
        stderr.matches("warning: kernel cache directory").count(),
        1,
        "one warning: {stderr}"
    );
    let _ = std::fs::remove_dir_all(&base);
}
