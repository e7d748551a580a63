//! The on-disk kernel cache (backend/cuda/kernel_cache.rs) between processes: two processes
//! asking for the same key at once, damaged files, a directory that cannot be written, and a
//! real kernel variant compiled to CUBIN through it (NVRTC, no GPU).

use ipcreduce::backend::cuda::kernels::cache::{Cache, Outcome};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// Set in the child processes of `two_processes_asking_at_once_compile_once`: the cache
/// directory to use.
const CHILD_DIR: &str = "IPCREDUCE_TEST_CACHE_CHILD_DIR";
const KEY: &str = "test key\noptions -DX=1\n";

fn payload() -> Vec<u8> {
    (0..64 * 1024u32).map(|i| (i % 251) as u8).collect()
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "ipcreduce-kcache-test-{}-{name}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Appends one line to `dir/compiles` (the processes' record of who ran the compiler), then
/// takes a while, as a real compilation does, so the other process surely asks meanwhile.
fn slow_compile(dir: &Path) -> ipcreduce::Result<Vec<u8>> {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("compiles"))
        .unwrap();
    writeln!(f, "{}", std::process::id()).unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    Ok(payload())
}

/// The child's side: one request, its outcome printed for the parent.
#[test]
fn child_requests_the_key() {
    let Some(dir) = std::env::var_os(CHILD_DIR) else {
        return; // Only as a child of the test below.
    };
    let dir = PathBuf::from(dir);
    // Both children start, then wait for the go file, so they ask at (nearly) the same time.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !dir.join("go").exists() {
        assert!(Instant::now() < deadline, "no go file in {}", dir.display());
        std::thread::sleep(Duration::from_millis(1));
    }
    let (bytes, outcome) = Cache::at(&dir)
        .get(KEY, || slow_compile(&dir))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(&bytes[..], &payload()[..], "the payload differs");
    println!("OUTCOME {outcome:?}");
}

#[test]
fn two_processes_asking_at_once_compile_once() {
    if std::env::var_os(CHILD_DIR).is_some() {
        return;
    }
    let dir = scratch("two");
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..2)
        .map(|_| {
            Command::new(&exe)
                .args([
                    "--exact",
                    "child_requests_the_key",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(CHILD_DIR, &dir)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    std::fs::write(dir.join("go"), b"").unwrap();
    let mut outcomes = Vec::new();
    for c in children {
        let out = c.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(
            out.status.success(),
            "child failed: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        // (The harness may print the test's name on the same line.)
        let line = text
            .lines()
            .find_map(|l| l.find("OUTCOME ").map(|at| l[at..].trim().to_string()))
            .unwrap_or_else(|| panic!("no outcome in {text}"));
        outcomes.push(line);
    }
    let compiles = std::fs::read_to_string(dir.join("compiles")).unwrap();
    assert_eq!(
        compiles.lines().count(),
        1,
        "both processes compiled: {outcomes:?}"
    );
    outcomes.sort();
    assert_eq!(
        outcomes,
        ["OUTCOME Compiled { replaced: false }", "OUTCOME Waited"],
        "one compiles, the other waits for its file"
    );
    // And the file is whole for a third reader.
    let (b, o) = Cache::at(&dir)
        .get(KEY, || panic!("compiled again"))
        .unwrap();
    assert_eq!((&b[..], o), (&payload()[..], Outcome::Disk));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_truncated_or_damaged_file_is_compiled_again_never_loaded() {
    let dir = scratch("corrupt");
    let cache = Cache::at(&dir);
    let count = std::cell::Cell::new(0);
    let compile = || {
        count.set(count.get() + 1);
        Ok(payload())
    };
    let (_, o) = cache.get(KEY, compile).unwrap();
    assert_eq!(o, Outcome::Compiled { replaced: false });
    let file = cache.path_of(KEY);
    let whole = std::fs::read(&file).unwrap();
    // Truncated (a torn write of a process that died), one byte flipped, empty.
    let mut flipped = whole.clone();
    let mid = flipped.len() / 2;
    flipped[mid] ^= 0x40;
    for (what, damaged) in [
        ("truncated", whole[..whole.len() - 100].to_vec()),
        ("flipped", flipped),
        ("empty", Vec::new()),
    ] {
        std::fs::write(&file, &damaged).unwrap();
        let before = count.get();
        let (b, o) = cache.get(KEY, compile).unwrap();
        assert_eq!(count.get(), before + 1, "{what}: not compiled again");
        assert_eq!(o, Outcome::Compiled { replaced: true }, "{what}");
        assert_eq!(
            &b[..],
            &payload()[..],
            "{what}: the damaged bytes were used"
        );
        assert_eq!(std::fs::read(&file).unwrap(), whole, "{what}: not replaced");
    }
    let (_, o) = cache.get(KEY, || panic!("compiled again")).unwrap();
    assert_eq!(o, Outcome::Disk);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_directory_that_cannot_be_written_falls_back_to_memory_with_a_warning() {
    let dir = scratch("readonly");
    // A "directory" below a regular file cannot be created, even by root (for whom a
    // read-only mode is no obstacle).
    std::fs::write(dir.join("file"), b"").unwrap();
    let unusable = dir.join("file/kernels");
    let (b, o) = Cache::at(&unusable).get(KEY, || Ok(payload())).unwrap();
    assert_eq!(&b[..], &payload()[..]);
    match o {
        Outcome::Uncached { why } => {
            assert!(
                why.contains(&unusable.display().to_string())
                    && why.contains("kept in memory")
                    && why.contains("IPCREDUCE_CACHE_DIR"),
                "{why}"
            );
        }
        o => panic!("{o:?}"),
    }
    // A read-only directory (where the mode binds, i.e. not as root): files in it are still
    // read, new ones are compiled and kept in memory.
    let ro = dir.join("ro");
    let (_, o) = Cache::at(&ro).get(KEY, || Ok(payload())).unwrap();
    assert_eq!(o, Outcome::Compiled { replaced: false });
    set_mode(&ro, 0o555);
    let (_, o) = Cache::at(&ro)
        .get(KEY, || panic!("compiled again"))
        .unwrap();
    assert_eq!(o, Outcome::Disk, "a read-only cache is still read");
    if !nix::unistd::geteuid().is_root() {
        let (_, o) = Cache::at(&ro).get("another key", || Ok(vec![1])).unwrap();
        assert!(matches!(o, Outcome::Uncached { .. }), "{o:?}");
    }
    set_mode(&ro, 0o755);
    let _ = std::fs::remove_dir_all(&dir);
}

fn set_mode(p: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// A real variant through the cache: compiled once to a CUBIN for sm_90, then read back.
#[test]
fn a_kernel_variant_is_compiled_once_then_read_from_the_cache() {
    use ipcreduce::backend::cuda::kernels::{nvrtc_for_tests, variants};
    use ipcreduce::backend::cuda::paths::CudaPath;
    use ipcreduce::{DType, ReduceOp};
    if !nvrtc_for_tests() {
        return;
    }
    let dir = scratch("variant");
    let v = variants::Variant::of(CudaPath::OneShotLl, 2, DType::F32, ReduceOp::Sum);
    let t = variants::Target::here("sm_90").unwrap();
    let key = variants::key(v, &t);
    let cache = Cache::at(&dir);
    let (first, o) = cache
        .get(&key, || variants::compile_cubin(v, &t.arch))
        .unwrap();
    assert_eq!(o, Outcome::Compiled { replaced: false });
    assert_eq!(&first[..4], b"\x7fELF");
    let (again, o) = cache.get(&key, || panic!("compiled again")).unwrap();
    assert_eq!((o, &again[..]), (Outcome::Disk, &first[..]));
    // Another op is another key, and another file.
    let max = variants::Variant {
        op: ReduceOp::Max,
        ..v
    };
    assert_ne!(cache.path_of(&variants::key(max, &t)), cache.path_of(&key));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A lock holder that never finishes is waited for no longer than the bound; then the waiter
/// compiles itself.
#[test]
fn a_stuck_lock_holder_is_waited_for_a_bounded_time() {
    use nix::fcntl::{Flock, FlockArg};
    let dir = scratch("stuck");
    let cache = Cache {
        dir: dir.clone(),
        wait: Duration::from_millis(300),
    };
    let lock_file = std::fs::File::create(cache.path_of(KEY).with_extension("lock")).unwrap();
    let _held = Flock::lock(lock_file, FlockArg::LockExclusiveNonblock)
        .map_err(|(_, e)| e)
        .unwrap();
    let start = Instant::now();
    let (b, o) = cache.get(KEY, || Ok(payload())).unwrap();
    let took = start.elapsed();
    assert!(o.compiled(), "{o:?}");
    assert_eq!(&b[..], &payload()[..]);
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(10),
        "waited {took:?} for a bound of 300 ms"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_killed_writers_temporary_file_is_removed_by_the_next_writer_of_its_key() {
    let dir = scratch("leftovers");
    let cache = Cache::at(&dir);
    let stem = |key: &str| {
        let p = cache.path_of(key);
        p.file_stem().unwrap().to_str().unwrap().to_string()
    };
    let hour_ago = std::time::SystemTime::now() - Duration::from_secs(3600);
    let make = |name: String, old: bool| {
        let p = dir.join(name);
        let f = std::fs::File::create(&p).unwrap();
        if old {
            f.set_modified(hour_ago).unwrap();
        }
        p
    };
    // A writer of KEY killed an hour ago, one writing it right now, and a killed writer of
    // another key.
    let killed = make(format!("{}.tmp.4242.0", stem(KEY)), true);
    let live = make(format!("{}.tmp.4243.0", stem(KEY)), false);
    let other = make(format!("{}.tmp.4244.0", stem("another key")), true);
    let (b, o) = cache.get(KEY, || Ok(payload())).unwrap();
    assert_eq!(
        (&b[..], o),
        (&payload()[..], Outcome::Compiled { replaced: false })
    );
    assert!(
        !killed.exists(),
        "the killed writer's file of this key was left"
    );
    assert!(live.exists(), "a file being written right now was removed");
    assert!(
        other.exists(),
        "another key's file was removed by this key's writer"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
