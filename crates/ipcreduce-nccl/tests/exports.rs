//! libipcreduce_nccl.so against a real libnccl.so.2 (PyPI's `nvidia-nccl-cu13`, no GPU
//! needed): every symbol the real one exports is exported by ours, and the calls that need no
//! GPU are forwarded (their results compared with the real library's own).
//!
//! The real library: `IPCREDUCE_TEST_NCCL_LIB`, else `target/nccl-wheel/nvidia/nccl/lib/`
//! (where `.ci/run` installs the pinned wheel). Without it the tests say so and pass, unless
//! `IPCREDUCE_REQUIRE_REAL_NCCL=1` (CI), where they fail.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::PathBuf;
use std::process::Command;

/// `target/<profile>/`, where cargo puts the cdylib beside `deps/` (this test's folder).
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().to_path_buf()
}

/// The .so the same cargo run built with this test (in `deps/`, beside the test; the copy in
/// `target/<profile>/` is refreshed by `cargo build` only).
fn ours() -> PathBuf {
    let p = profile_dir().join("deps/libipcreduce_nccl.so");
    assert!(p.is_file(), "{} not built", p.display());
    p
}

fn real() -> Option<PathBuf> {
    let p = match std::env::var_os("IPCREDUCE_TEST_NCCL_LIB") {
        Some(p) => PathBuf::from(p),
        None => profile_dir()
            .parent()
            .unwrap()
            .join("nccl-wheel/nvidia/nccl/lib/libnccl.so.2"),
    };
    if p.is_file() {
        return Some(p);
    }
    let required = std::env::var("IPCREDUCE_REQUIRE_REAL_NCCL").as_deref() == Ok("1");
    assert!(
        !required,
        "IPCREDUCE_REQUIRE_REAL_NCCL=1 but no real NCCL at {} (set IPCREDUCE_TEST_NCCL_LIB)",
        p.display()
    );
    eprintln!("no real NCCL at {}: test skipped", p.display());
    None
}

/// Dynamic symbols `path` defines (`nm -D --defined-only`), by name.
fn exports(path: &PathBuf) -> Vec<String> {
    let out = Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(path)
        .output()
        .expect("nm runs (binutils)");
    assert!(out.status.success(), "nm {}: {:?}", path.display(), out);
    let mut names: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // "address type name"; code symbols only (T, W, i).
            (f.len() == 3 && matches!(f[1], "T" | "W" | "i" | "R" | "D")).then(|| f[2].to_string())
        })
        .collect();
    names.sort();
    names.dedup();
    names
}

#[test]
fn every_real_export_is_ours_and_nothing_else() {
    let Some(real) = real() else { return };
    let theirs = exports(&real);
    let mine = exports(&ours());
    // NCCL 2.28 exports about 50 entry points, each with its pnccl twin.
    assert!(
        theirs.len() > 80,
        "few exports in {}: {theirs:?}",
        real.display()
    );
    let missing: Vec<&String> = theirs.iter().filter(|s| !mine.contains(s)).collect();
    assert!(missing.is_empty(), "not exported by ours: {missing:?}");
    // Ours adds one marker (how a copy of it under NCCL's name is told from the real one).
    let extra: Vec<&String> = mine.iter().filter(|s| !theirs.contains(s)).collect();
    assert_eq!(extra, ["ipcreduce_nccl_forwarder"], "exported by ours only");
}

/// Runs the scenario `name` in a child process (the real library is found once per process)
/// with `env`, and checks it passed.
fn run_child(name: &str, env: &[(&str, String)]) {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        "child",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .env("IPCREDUCE_NCCL_TEST_SCENARIO", name)
    .env_remove("IPCREDUCE_NCCL")
    .env_remove("IPCREDUCE_NCCL_LIB");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.contains("1 passed"),
        "scenario {name} failed:\n{text}"
    );
}

#[test]
fn forwards_to_the_real_library() {
    let Some(real) = real() else { return };
    let path = real.to_string_lossy().into_owned();
    run_child(
        "forward",
        &[("IPCREDUCE_NCCL_LIB", path.clone()), ("REAL", path)],
    );
}

#[test]
fn finds_the_real_library_on_the_search_path_past_a_copy_of_itself() {
    let Some(real) = real() else { return };
    // A folder first on the path holding ours under NCCL's name, as a user might set it up.
    let dir = std::env::temp_dir().join(format!("ipcreduce-nccl-search-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let copy = dir.join("libnccl.so.2");
    let _ = std::fs::remove_file(&copy);
    std::fs::copy(ours(), &copy).unwrap();
    let path = format!("{}:{}", dir.display(), real.parent().unwrap().display());
    let r = real.to_string_lossy().into_owned();
    run_child("search", &[("LD_LIBRARY_PATH", path), ("REAL", r)]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn groups_balance_like_nccls() {
    let Some(real) = real() else { return };
    let path = real.to_string_lossy().into_owned();
    run_child(
        "group",
        &[("IPCREDUCE_NCCL_LIB", path.clone()), ("REAL", path)],
    );
}

#[test]
fn absent_real_library_is_a_system_error_with_its_reason() {
    // Needs no real library at all.
    run_child(
        "absent",
        &[("IPCREDUCE_NCCL_LIB", "/nonexistent/libnccl.so.2".into())],
    );
}

#[test]
fn bad_mode_refuses_communicators_but_forwards_queries() {
    let Some(real) = real() else { return };
    let path = real.to_string_lossy().into_owned();
    run_child(
        "bad-mode",
        &[
            ("IPCREDUCE_NCCL_LIB", path.clone()),
            ("REAL", path),
            ("IPCREDUCE_NCCL", "fast".into()),
        ],
    );
}

/// A loaded library and its symbols.
struct Lib(*mut c_void);

impl Lib {
    fn open(path: &str) -> Lib {
        let c = CString::new(path).unwrap();
        // SAFETY: a C string; local binding, resolved now.
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        assert!(!h.is_null(), "dlopen {path}");
        Lib(h)
    }

    /// # Safety
    /// `F` must be the symbol's C signature.
    unsafe fn get<F: Copy>(&self, name: &str) -> F {
        let c = CString::new(name).unwrap();
        // SAFETY: a live handle.
        let p = unsafe { libc::dlsym(self.0, c.as_ptr()) };
        assert!(!p.is_null(), "{name} missing");
        // SAFETY: the caller names the type.
        unsafe { std::mem::transmute_copy(&p) }
    }
}

type Version = unsafe extern "C" fn(*mut c_int) -> c_int;
type ErrStr = unsafe extern "C" fn(c_int) -> *const c_char;
type LastErr = unsafe extern "C" fn(*mut c_void) -> *const c_char;
type UniqueId = unsafe extern "C" fn(*mut [u8; 128]) -> c_int;
type InitRank = unsafe extern "C" fn(*mut *mut c_void, c_int, [u8; 128], c_int) -> c_int;

fn text(p: *const c_char) -> String {
    assert!(!p.is_null());
    // SAFETY: the libraries return C strings.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// The real library's version code.
fn v_real(real: &Lib) -> u32 {
    // SAFETY: nccl.h's signature.
    unsafe {
        let f: Version = real.get("ncclGetVersion");
        let mut v = 0;
        assert_eq!(f(&mut v), 0);
        v as u32
    }
}

/// The scenarios, run only as the child of the tests above.
#[test]
#[ignore = "run by the other tests in a child process"]
fn child() {
    let scenario = std::env::var("IPCREDUCE_NCCL_TEST_SCENARIO").expect("a scenario");
    let me = Lib::open(&ours().to_string_lossy());
    // SAFETY: nccl.h's signatures.
    unsafe {
        let version: Version = me.get("ncclGetVersion");
        let err_str: ErrStr = me.get("ncclGetErrorString");
        let last: LastErr = me.get("ncclGetLastError");
        let init: InitRank = me.get("ncclCommInitRank");
        let mut v = 0;
        match scenario.as_str() {
            "search" => {
                // Ours runs first: the copy of ours first on the path must be passed over.
                assert_eq!(version(&mut v), 0);
                let real_path = CString::new(std::env::var("REAL").unwrap()).unwrap();
                let loaded = libc::dlopen(real_path.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
                assert!(
                    !loaded.is_null(),
                    "ours loaded the real library from the path"
                );
                let real_version: Version = Lib(loaded).get("ncclGetVersion");
                let mut rv = 0;
                assert_eq!(real_version(&mut rv), 0);
                assert_eq!(v, rv);
            }
            "group" => {
                type Group = unsafe extern "C" fn() -> c_int;
                let real = Lib::open(&std::env::var("REAL").unwrap());
                let (start, end): (Group, Group) =
                    (me.get("ncclGroupStart"), me.get("ncclGroupEnd"));
                // An empty group, nested or not, is fine (NCCL's too).
                assert_eq!(start(), 0);
                assert_eq!(start(), 0);
                assert_eq!(end(), 0);
                assert_eq!(end(), 0);
                // A group with a call that is not ours opens at the real NCCL: the same
                // results as the real library's own start, call and end.
                type MemFree = unsafe extern "C" fn(*mut c_void) -> c_int;
                let (real_start, real_free): (Group, MemFree) =
                    (real.get("ncclGroupStart"), real.get("ncclMemFree"));
                let real_end: Group = real.get("ncclGroupEnd");
                let theirs = [real_start(), real_free(std::ptr::null_mut()), real_end()];
                let free: MemFree = me.get("ncclMemFree");
                let mine = [start(), free(std::ptr::null_mut()), end()];
                assert_eq!(mine, theirs, "start, ncclMemFree(NULL), end");
                // And it was the real group: after ours' start and call, the real library's
                // own end closes it (ours' end, forwarded, then finds none open).
                // (ncclMemFree fails without a GPU; the group calls do not.)
                assert_eq!(
                    [theirs[0], theirs[2]],
                    [0, 0],
                    "the real library takes the group"
                );
                assert_eq!([start(), free(std::ptr::null_mut())], [0, theirs[1]]);
                assert_eq!(real_end(), 0, "ours opened the group at the real NCCL");
                assert_ne!(end(), 0, "no real group was left open");
                // A collective ipcreduce cannot take (no communicator of ours) inside a group
                // goes to the real group: NCCL's own results, and the group open there.
                type AllReduce = unsafe extern "C" fn(
                    *const c_void,
                    *mut c_void,
                    usize,
                    c_int,
                    c_int,
                    *mut c_void,
                    *mut c_void,
                ) -> c_int;
                let real_ar: AllReduce = real.get("ncclAllReduce");
                let my_ar: AllReduce = me.get("ncclAllReduce");
                let null = std::ptr::null_mut();
                let ar = |f: AllReduce| f(null, null, 16, 7, 0, null, 0x10 as *mut c_void);
                let theirs = [real_start(), ar(real_ar), real_end()];
                let mine = [start(), ar(my_ar), end()];
                assert_eq!(mine, theirs, "start, ncclAllReduce(comm NULL), end");
                assert_ne!(theirs[1], 0, "NCCL refuses a null communicator");
                // The real end answers as it does after that call (NCCL reports the group's
                // failure there), not as for an end without a start.
                let unbalanced = real_end();
                assert_ne!(
                    unbalanced, theirs[2],
                    "an end without a start answers otherwise"
                );
                assert_eq!([start(), ar(my_ar)], [0, theirs[1]]);
                assert_eq!(
                    real_end(),
                    theirs[2],
                    "ours opened the group at the real NCCL"
                );
                assert_eq!(end(), unbalanced, "no real group was left open");
                // ncclGroupSimulateEnd ends the group, at NCCL and here alike.
                #[repr(C)]
                struct SimInfo {
                    size: usize,
                    magic: u32,
                    version: u32,
                    estimated: f32,
                }
                let sim = || SimInfo {
                    size: std::mem::size_of::<SimInfo>(),
                    magic: 0x7468_5283,
                    version: v_real(&real),
                    estimated: -1.0,
                };
                type Simulate = unsafe extern "C" fn(*mut SimInfo) -> c_int;
                let real_sim: Simulate = real.get("ncclGroupSimulateEnd");
                let my_sim: Simulate = me.get("ncclGroupSimulateEnd");
                let (mut a, mut b) = (sim(), sim());
                let theirs = [real_start(), real_sim(&mut a)];
                let mine = [start(), my_sim(&mut b)];
                assert_eq!(mine, theirs, "start, simulate");
                assert_eq!(theirs[0], 0);
                // One end too many: NCCL's own answer, whatever it is, and not success.
                let theirs = real_end();
                assert_ne!(theirs, 0, "the real NCCL refuses an unbalanced end");
                assert_eq!(end(), theirs, "ours forwards the unbalanced end");
            }
            "forward" | "bad-mode" => {
                let real = Lib::open(&std::env::var("REAL").unwrap());
                let real_version: Version = real.get("ncclGetVersion");
                let mut rv = 0;
                assert_eq!(real_version(&mut rv), 0);
                assert_eq!(version(&mut v), 0);
                assert_eq!(v, rv, "ours reports the real library's version");
                assert!(v >= 22800, "an NCCL 2.28 or later: {v}");
                let real_err: ErrStr = real.get("ncclGetErrorString");
                for code in 0..8 {
                    assert_eq!(text(err_str(code)), text(real_err(code)), "code {code}");
                }
                // The profiling twins are the same entry points.
                let pversion: Version = me.get("pncclGetVersion");
                let mut pv = 0;
                assert_eq!(pversion(&mut pv), 0);
                assert_eq!(pv, rv);
                if scenario == "forward" {
                    // ncclGetUniqueId needs a network interface, not a GPU: ours and the
                    // real one agree on the result either way.
                    let real_uid: UniqueId = real.get("ncclGetUniqueId");
                    let uid: UniqueId = me.get("ncclGetUniqueId");
                    let (mut a, mut b) = ([0u8; 128], [0u8; 128]);
                    let (ra, rb) = (real_uid(&mut a), uid(&mut b));
                    assert_eq!(rb, ra, "ncclGetUniqueId through ours");
                    if ra == 0 {
                        assert!(b.iter().any(|x| *x != 0), "an id was written");
                        // A world of one without a GPU: ours returns the real library's
                        // result and its message (a CUDA failure here, success on a GPU).
                        let real_init: InitRank = real.get("ncclCommInitRank");
                        let real_last: LastErr = real.get("ncclGetLastError");
                        let (mut c1, mut c2) = (std::ptr::null_mut(), std::ptr::null_mut());
                        let theirs = real_init(&mut c1, 1, a, 0);
                        let their_text = text(real_last(std::ptr::null_mut()));
                        let mine = init(&mut c2, 1, b, 0);
                        assert_eq!(mine, theirs, "ncclCommInitRank's result");
                        assert_eq!(text(last(std::ptr::null_mut())), their_text);
                        assert_eq!(c1.is_null(), c2.is_null());
                    }
                } else {
                    let mut comm = std::ptr::null_mut();
                    let r = init(&mut comm, 2, [0u8; 128], 0);
                    assert_eq!(r, 4, "ncclInvalidArgument for IPCREDUCE_NCCL=fast");
                    let e = text(last(std::ptr::null_mut()));
                    assert!(e.contains("IPCREDUCE_NCCL=fast"), "{e}");
                    assert!(comm.is_null());
                }
            }
            "absent" => {
                assert_eq!(version(&mut v), 2, "ncclSystemError");
                let e = text(last(std::ptr::null_mut()));
                assert!(
                    e.contains("/nonexistent/libnccl.so.2") && e.contains("IPCREDUCE_NCCL_LIB"),
                    "{e}"
                );
                assert!(text(err_str(2)).contains("system error"));
                let mut comm = std::ptr::null_mut();
                assert_eq!(init(&mut comm, 2, [0u8; 128], 0), 2);
            }
            other => panic!("unknown scenario {other}"),
        }
    }
}
