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
