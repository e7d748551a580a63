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

#[test]
fn bad_pointers_and_counts_are_refused_and_nothing_is_written() {
    let mut comm = single_rank();
    let mut out = vec![7.0f32; 64];
    let src = vec![1.0f32; 64];
    let (s, r) = (
        src.as_ptr().cast::<c_void>(),
        out.as_mut_ptr().cast::<c_void>(),
    );
    let call = |comm: &mut Communicator, s: *const c_void, r: *mut c_void, n: usize, d: DType| unsafe {
        comm.all_reduce_raw(
            s,
            r,
            n,
            d,
            ReduceOp::Sum,
            Algorithm::Auto,
            std::ptr::null_mut(),
        )
    };

    let e = invalid(call(&mut comm, std::ptr::null(), r, 64, DType::F32));
    assert!(e.contains("null"), "{e}");
    let e = invalid(call(&mut comm, s, std::ptr::null_mut(), 64, DType::F32));
    assert!(e.contains("null"), "{e}");
    // A float pointer one byte off is not aligned to its element size.
    let odd = unsafe { r.cast::<u8>().add(1).cast::<c_void>() };
    let e = invalid(call(&mut comm, s, odd, 16, DType::F32));
    assert!(e.contains("aligned"), "{e}");
    // Overlapping but different buffers.
    let shifted = unsafe { r.cast::<f32>().add(4).cast::<c_void>() };
    let e = invalid(call(&mut comm, r, shifted, 32, DType::F32));
    assert!(e.contains("overlap"), "{e}");
    // A count whose byte size overflows.
    let e = invalid(call(&mut comm, s, r, usize::MAX / 2, DType::F32));
    assert!(e.contains("overflows"), "{e}");
    assert!(
        out.iter().all(|v| *v == 7.0),
        "a refused call wrote to the output"
    );

    // Zero elements is a valid no-op, as in NCCL.
    call(&mut comm, s, r, 0, DType::F32).unwrap();
    assert!(out.iter().all(|v| *v == 7.0));

    // Slices of different lengths.
    let e =
        invalid(comm.all_reduce_host(&src[..10], &mut out[..11], ReduceOp::Sum, Algorithm::Auto));
    assert!(e.contains("10") && e.contains("11"), "{e}");

    // With one rank the all-reduce is a copy; the communicator still works after the refusals.
    comm.all_reduce_host(&src, &mut out, ReduceOp::Sum, Algorithm::Auto)
        .unwrap();
    assert!(out.iter().all(|v| *v == 1.0));
}

#[test]
fn nccl_is_refused_on_the_host_backend_with_a_reason() {
    let mut comm = single_rank();
    let why = comm
        .unavailable(Algorithm::Nccl)
        .expect("NCCL must be unavailable on host");
    assert!(why.to_lowercase().contains("cuda"), "{why}");
    let mut buf = vec![1.0f32; 8];
    let res = comm.all_reduce_host_in_place(&mut buf, ReduceOp::Sum, Algorithm::Nccl);
    assert!(res.is_err(), "NCCL on host must fail");
    assert!(buf.iter().all(|v| *v == 1.0));
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
    assert!(matches!(res, Err(Error::Aborted { .. })), "{res:?}");
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
}
