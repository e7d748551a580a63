//! NCCL beside ipcreduce: the baseline the benchmark compares against, on the same buffers, in
//! the same processes, with the unique id passed over our bootstrap.

use crate::bootstrap::Bootstrap;
use crate::error::{Error, Result};
use crate::types::{DType, ReduceOp};
use cudarc::nccl::{result as nr, sys as ns};
use std::ffi::c_void;

pub struct Nccl {
    comm: ns::ncclComm_t,
    rank: usize,
}

// SAFETY: an NCCL communicator may be used from any thread, one at a time (we hold &mut).
unsafe impl Send for Nccl {}

/// Whether libnccl can be loaded.
pub fn present() -> bool {
    // SAFETY: only probes dlopen.
    unsafe { ns::is_culib_present() }
}

/// NCCL's version as "2.28.3".
pub fn version() -> Option<String> {
    if !present() {
        return None;
    }
    nr::get_nccl_version().ok().map(|v| {
        let v = v as u32;
        format!("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100)
    })
}

impl Nccl {
    /// Collective: builds an NCCL communicator over the same ranks. `shared_gpu`: ranks share
    /// GPUs (MPS); NCCL then only runs if each rank pretends to be its own host.
    pub fn init(boot: &mut Bootstrap, shared_gpu: bool) -> Result<Nccl> {
        let rank = boot.rank();
        let err = |op: &str, detail: String| Error::Cuda {
            rank,
            op: op.into(),
            detail,
        };
        if !present() {
            // Still take part in the exchange below so no rank waits forever.
            boot.all_gather(&[0])?;
            return Err(err("NCCL init", "libnccl.so not found".into()));
        }
        if shared_gpu {
            // NCCL refuses two ranks on one GPU unless each believes it is on its own host;
            // it then talks over loopback sockets (a functional baseline, not a fast one).
            std::env::set_var("NCCL_HOSTID", format!("ipcreduce-rank-{rank}"));
            std::env::set_var("NCCL_SOCKET_IFNAME", "lo");
            std::env::set_var("NCCL_IB_DISABLE", "1");
        }
        // Never let NCCL use NVLink multicast.
        std::env::set_var("NCCL_NVLS_ENABLE", "0");
        let id = if rank == 0 {
            nr::get_uniqueid().map_err(|e| err("ncclGetUniqueId", format!("{e:?}")))?
        } else {
            // SAFETY: plain bytes, overwritten below.
            unsafe { std::mem::zeroed() }
        };
        // SAFETY: ncclUniqueId is 128 plain bytes.
        let raw: [u8; 128] = unsafe { std::mem::transmute(id) };
        let all = boot.all_gather(if rank == 0 { &raw } else { &[0] })?;
        let root: [u8; 128] = all[0]
            .as_slice()
            .try_into()
            .map_err(|_| err("NCCL id exchange", "rank 0 sent no NCCL id".into()))?;
        // SAFETY: 128 plain bytes back into the id.
        let id: ns::ncclUniqueId = unsafe { std::mem::transmute(root) };
        let mut comm = std::ptr::null_mut();
        // SAFETY: collective init; every rank calls it with the same id.
        unsafe { nr::comm_init_rank(&mut comm, boot.world() as i32, id, rank as i32) }
            .map_err(|e| err("ncclCommInitRank", format!("{e:?}")))?;
        Ok(Nccl { comm, rank })
    }

    /// Enqueues an all-reduce on `stream`.
    ///
    /// # Safety
    /// Device pointers valid for `count` elements on the communicator's device.
    pub unsafe fn all_reduce(
        &mut self,
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<()> {
        let dt = match dtype {
            DType::F32 => ns::ncclDataType_t::ncclFloat32,
            DType::F16 => ns::ncclDataType_t::ncclFloat16,
            DType::Bf16 => ns::ncclDataType_t::ncclBfloat16,
        };
        let o = match op {
            ReduceOp::Sum => ns::ncclRedOp_t::ncclSum,
            ReduceOp::Max => ns::ncclRedOp_t::ncclMax,
            ReduceOp::Min => ns::ncclRedOp_t::ncclMin,
        };
        nr::all_reduce(
            send,
            recv,
            count,
            dt,
            o,
            self.comm,
            stream as ns::cudaStream_t,
        )
        .map(|_| ())
        .map_err(|e| Error::Cuda {
            rank: self.rank,
            op: format!("ncclAllReduce({count} x {dtype})"),
            detail: format!("{e:?}"),
        })
    }
}

impl Drop for Nccl {
    fn drop(&mut self) {
        // SAFETY: destroys the communicator we created, once.
        if let Err(e) = unsafe { nr::comm_destroy(self.comm) } {
            tracing::warn!(rank = self.rank, "ncclCommDestroy failed: {e:?}");
        }
    }
}
