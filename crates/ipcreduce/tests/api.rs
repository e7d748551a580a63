//! The library API's argument checks, on a one-rank host communicator (no GPU, no peers):
//! bad calls get clear errors and write nothing.

use ipcreduce::bootstrap::RankInfo;
use ipcreduce::{Algorithm, BackendChoice, Communicator, Config, DType, Error, ReduceOp};
use std::ffi::c_void;

fn single_rank() -> Communicator {
    let dir = std::env::temp_dir().join(format!("ipcreduce-api-{}", std::process::id()));
    let info = RankInfo::new(0, 1, dir.join("s.sock"), "api-test", None).unwrap();
    let opts = Config {
        backend: BackendChoice::Host,
        ..Config::default()
    };
    Communicator::with_rank_info(info, &opts).unwrap()
}

fn invalid(res: ipcreduce::Result<()>) -> String {
    match res {
        Err(e @ Error::InvalidArgument { .. }) => e.to_string(),
        other => panic!("expected an invalid-argument error, got {other:?}"),
    }
}

/// A raw all-reduce of f32 with `Auto`.
fn call(
    comm: &mut Communicator,
    s: *const c_void,
    r: *mut c_void,
    n: usize,
) -> ipcreduce::Result<()> {
    // SAFETY: the tests pass pointers the checks refuse, or live buffers of `n` f32.
    unsafe {
        comm.all_reduce_raw(
            s,
            r,
            n,
            DType::F32,
            ReduceOp::Sum,
            Algorithm::Auto,
            std::ptr::null_mut(),
        )
    }
}

/// After a refused call, the communicator is aborted with that error as the reason: later
/// calls fail at once with `Aborted` naming it (every rank would see the same).
fn assert_dead_with(comm: &mut Communicator, first: &str) {
    assert!(comm.is_aborted(), "not aborted after: {first}");
    let mut buf = vec![1.0f32; 8];
    match comm.all_reduce_host_in_place(&mut buf, ReduceOp::Sum, Algorithm::Auto) {
        Err(e @ Error::Aborted { rank: 0, .. }) => {
            assert!(e.to_string().contains(first), "{e} lacks '{first}'")
        }
        other => panic!("expected Aborted after '{first}', got {other:?}"),
    }
    assert!(buf.iter().all(|v| *v == 1.0), "a refused call wrote");
    match comm.async_error() {
        Some(Error::Aborted { reason, .. }) => assert!(reason.contains(first), "{reason}"),
        other => panic!("expected the abort as the async error, got {other:?}"),
    }
}

#[test]
fn bad_pointers_and_counts_are_refused_write_nothing_and_abort() {
    let mut out = vec![7.0f32; 64];
    let src = vec![1.0f32; 64];
    let (s, r) = (
        src.as_ptr().cast::<c_void>(),
        out.as_mut_ptr().cast::<c_void>(),
    );
    // A float pointer one byte off is not aligned to its element size.
    let odd = r.cast::<u8>().wrapping_add(1).cast::<c_void>();
    // Overlapping but different buffers.
    let shifted = r.cast::<f32>().wrapping_add(4).cast::<c_void>();
    let cases: [(*const c_void, *mut c_void, usize, &str); 5] = [
        (std::ptr::null(), r, 64, "null buffer pointer"),
        (s, std::ptr::null_mut(), 64, "null buffer pointer"),
        (s, odd, 16, "aligned to the float element size"),
        (r, shifted, 32, "send and recv overlap"),
        // A count whose byte size overflows.
        (s, r, usize::MAX / 2, "overflows the address space"),
    ];
    for (send, recv, n, why) in cases {
        let mut comm = single_rank();
        let e = invalid(call(&mut comm, send, recv, n));
        assert!(
            e.starts_with("rank 0: invalid argument to all_reduce: ") && e.contains(why),
            "{e} lacks '{why}'"
        );
        assert_dead_with(&mut comm, why);
    }
    assert!(
        out.iter().all(|v| *v == 7.0),
        "a refused call wrote to the output"
    );

    // Slices of different lengths: a call that cannot even be described aborts too.
    let mut comm = single_rank();
    let e =
        invalid(comm.all_reduce_host(&src[..10], &mut out[..11], ReduceOp::Sum, Algorithm::Auto));
    assert!(e.contains("send has 10 elements, recv 11"), "{e}");
    assert_dead_with(&mut comm, "send has 10 elements, recv 11");
}

#[test]
fn count_zero_is_a_call_that_needs_no_buffer() {
    let mut comm = single_rank();
    let mut out = vec![7.0f32; 64];
    let src = vec![1.0f32; 64];
    // Any pointers, null included: nothing is read or written.
    call(&mut comm, std::ptr::null(), std::ptr::null_mut(), 0).unwrap();
    call(&mut comm, src.as_ptr().cast(), out.as_mut_ptr().cast(), 0).unwrap();
    let mut none: [f32; 0] = [];
    comm.reduce_scatter_host(&[], &mut none, ReduceOp::Sum)
        .unwrap();
    comm.all_gather_host(&[], &mut none).unwrap();
    assert!(out.iter().all(|v| *v == 7.0));
    // With one rank the all-reduce is a copy; the communicator is still usable.
    comm.all_reduce_host(&src, &mut out, ReduceOp::Sum, Algorithm::Auto)
        .unwrap();
    assert!(out.iter().all(|v| *v == 1.0));
    assert!(!comm.is_aborted());
}

#[test]
fn nccl_is_refused_on_the_host_backend_with_a_reason() {
    let mut comm = single_rank();
    let why = comm
        .unavailable(Algorithm::Nccl)
        .expect("NCCL must be unavailable on host");
    assert!(why.contains("NCCL is cuda-only"), "{why}");
    // Asking anyway is a failed call like any other: refused, and the communicator aborted
    // (a peer would be waiting in the same call). `unavailable` is the way to ask first.
    let mut buf = vec![1.0f32; 8];
    let res = comm.all_reduce_host_in_place(&mut buf, ReduceOp::Sum, Algorithm::Nccl);
    let e = invalid(res);
    assert!(
        e.starts_with("rank 0: invalid argument to all_reduce")
            && e.contains("runs oneshot or twoshot, not nccl"),
        "{e}"
    );
    assert!(buf.iter().all(|v| *v == 1.0));
    assert_dead_with(&mut comm, "not nccl");
}

#[test]
fn out_of_range_world_sizes_are_configuration_errors() {
    let dir = std::env::temp_dir();
    for (rank, world) in [(0, 0), (2, 2), (0, 65)] {
        let err = RankInfo::new(rank, world, dir.join("x.sock"), "job", None).unwrap_err();
        assert!(
            matches!(err, Error::Config(_)),
            "rank {rank} world {world}: {err}"
        );
    }
}

#[test]
fn abort_makes_the_communicator_unusable_and_is_reported_asynchronously() {
    let mut comm = single_rank();
    assert!(comm.async_error().is_none());
    let mut buf = vec![1.0f32; 8];
    comm.all_reduce_host_in_place(&mut buf, ReduceOp::Sum, Algorithm::Auto)
        .unwrap();
    // A watchdog on another thread aborts it.
    let handle = comm.abort_handle();
    assert!(handle.error().is_none());
    std::thread::spawn(move || handle.abort("watchdog: step took too long"))
        .join()
        .unwrap();
    match comm.async_error() {
        Some(e @ Error::Aborted { .. }) => {
            assert!(e.is_fatal());
            assert!(e.to_string().contains("watchdog"), "{e}");
        }
        other => panic!("expected an abort, got {other:?}"),
    }
    let res = comm.all_reduce_host_in_place(&mut buf, ReduceOp::Sum, Algorithm::Auto);
    match res {
        Err(e @ Error::Aborted { rank: 0, .. }) => assert!(
            e.to_string().contains("watchdog: step took too long"),
            "{e}"
        ),
        other => panic!("expected Aborted naming the watchdog, got {other:?}"),
    }
    // Dropping an aborted communicator is quick and quiet.
    let t0 = std::time::Instant::now();
    drop(comm);
    assert!(t0.elapsed() < std::time::Duration::from_secs(2));
}

#[test]
fn bad_variable_values_are_configuration_errors_naming_the_variable() {
    // Through a Config: the process environment is shared by the tests of this binary.
    let cfg = Config {
        backend: BackendChoice::Host,
        ..Config::default()
    };
    let err = cfg
        .resolve_with(|k| (k == "IPCREDUCE_TIMEOUT_MS").then(|| "30s".to_string()))
        .unwrap_err();
    assert!(matches!(err, Error::Config(_)) && err.to_string().contains("IPCREDUCE_TIMEOUT_MS"));
}

/// Setting a variable while other threads run is a data race in a user's process: the
/// library never does (NCCL is configured through ncclConfig_t, see backend/cuda/nccl.rs).
#[test]
fn library_sources_never_set_environment_variables() {
    fn walk(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    let mut files = Vec::new();
    walk(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        &mut files,
    );
    assert!(files.len() > 20, "found only {} sources", files.len());
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        for needle in ["set_var(", "remove_var("] {
            assert!(!text.contains(needle), "{} calls {needle}", f.display());
        }
    }
}

#[test]
fn the_host_backend_has_no_device_and_no_stream() {
    let comm = single_rank();
    assert_eq!(comm.cuda_device(), None);
    assert!(comm.cuda_stream().is_none());
}

#[test]
fn registered_buffers_are_refused_on_the_host_backend_with_a_reason() {
    let mut comm = single_rank();
    let err = invalid(comm.alloc(4096).map(drop));
    assert!(
        err.contains("cuda backend") && err.contains("host_buffer"),
        "{err}"
    );
    // SAFETY: refused before the pointer is used.
    let err = invalid(unsafe { comm.register(0x1000, 4096) }.map(drop));
    assert!(err.contains("register"), "{err}");
    assert_eq!(comm.last_path(), None);
    // Refused alike on every rank before anything collective starts: still usable.
    assert!(!comm.is_aborted());
    let mut buf = vec![1.0f32; 8];
    comm.all_reduce_host_in_place(&mut buf, ReduceOp::Sum, Algorithm::Auto)
        .unwrap();
}
