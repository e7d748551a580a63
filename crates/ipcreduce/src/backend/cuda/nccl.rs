//! NCCL beside ipcreduce: the baseline the benchmark compares against, on the same buffers, in
//! the same processes, with the unique id passed over our bootstrap.
//!
//! NCCL runs inside the user's process, so it is configured only through `ncclConfig_t`
//! (`ncclCommInitRankConfig`): the library sets no environment variable (that would race with
//! other threads and change the application's own NCCL). The communicator is blocking, as NCCL
//! is by default and as users run it: in non-blocking mode NCCL hands every call to a
//! background job, and an eager all-reduce cost 30-39 us instead of 10-12 us on two H200s
//! (measured 2026-11-30), which would make the comparison unfair. Its init is collective and
//! starts only once every rank has joined our bootstrap (the id exchange); an aborted
//! communicator is ended with `ncclCommAbort`, which does not wait for peers.

use crate::abort::AbortState;
use crate::bootstrap::Bootstrap;
use crate::error::{Error, Result};
use crate::types::{DType, ReduceOp};
use cudarc::nccl::{result as nr, sys as ns};
use std::ffi::{c_void, CStr, CString};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub struct Nccl {
    comm: ns::ncclComm_t,
    rank: usize,
    timeout: Duration,
    abort: Arc<AbortState>,
    /// Drop ends the communicator with ncclCommAbort (never waits for peers).
    abort_on_drop: bool,
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

/// `NCCL_CONFIG_UNDEF_INT`: "NCCL decides".
const UNDEF_INT: i32 = i32::MIN;
/// `NCCL_VERSION(2, 28, 0)`: the layout of cudarc's `ncclConfig_t`.
const CONFIG_VERSION: u32 = 22800;

/// `NCCL_CONFIG_INITIALIZER`, then our choices: blocking (NCCL's default), a name for
/// NCCL's logs, and the socket transport when ranks share a GPU (NCCL then treats each rank
/// as its own host and talks over loopback).
fn config(name: &CStr, net: Option<&CStr>) -> ns::ncclConfig_t {
    // SAFETY: a plain C struct; all fields are set below or are integers/pointers for which
    // zero is then replaced by NCCL's "undefined" marker.
    let mut c: ns::ncclConfig_t = unsafe { std::mem::zeroed() };
    c.size = std::mem::size_of::<ns::ncclConfig_t>();
    c.magic = 0xcafe_beef;
    c.version = CONFIG_VERSION;
    c.blocking = 1;
    c.cgaClusterSize = UNDEF_INT;
    c.minCTAs = UNDEF_INT;
    c.maxCTAs = UNDEF_INT;
    c.netName = net.map_or(std::ptr::null(), CStr::as_ptr);
    c.splitShare = UNDEF_INT;
    c.trafficClass = UNDEF_INT;
    c.commName = name.as_ptr();
    c.collnetEnable = UNDEF_INT;
    c.CTAPolicy = UNDEF_INT;
    c.shrinkShare = UNDEF_INT;
    c.nvlsCTAs = UNDEF_INT;
    c.nChannelsPerNetPeer = UNDEF_INT;
    c.nvlinkCentricSched = UNDEF_INT;
    c.graphUsageMode = UNDEF_INT;
    c.numRmaCtx = UNDEF_INT;
    c.maxP2pPeers = UNDEF_INT;
    c
}

fn describe(r: ns::ncclResult_t) -> String {
    // SAFETY: NCCL returns a static string.
    let p = unsafe { ns::ncclGetErrorString(r) };
    if p.is_null() {
        format!("{r:?}")
    } else {
        // SAFETY: non-null, NUL-terminated, static.
        format!("{r:?}: {}", unsafe { CStr::from_ptr(p) }.to_string_lossy())
    }
}

impl Nccl {
    /// Collective: builds an NCCL communicator over the same ranks. `shared_gpu`: ranks share
    /// GPUs (MPS); NCCL then only runs when every rank has its own `NCCL_HOSTID` in its
    /// environment (`ipcreduce launch` sets one with `IPCREDUCE_NCCL_SHARED_GPU=1`).
    pub fn init(boot: &mut Bootstrap, shared_gpu: bool) -> Result<Nccl> {
        let rank = boot.rank();
        let err = |op: &str, detail: String| Error::Cuda {
            rank,
            op: op.into(),
            detail,
        };
        // Every rank takes part in both exchanges, whatever it finds, so none waits in vain.
        let host_id = std::env::var("NCCL_HOSTID").unwrap_or_default();
        let ids = boot.all_gather(host_id.as_bytes())?;
        let ok = boot.all_gather(&[present() as u8])?;
        if let Some(peer) = ok.iter().position(|v| v != &[1]) {
            let who = if peer == rank { "here" } else { "on that rank" };
            return Err(err(
                "NCCL init",
                format!("libnccl.so not found {who} (rank {peer})"),
            ));
        }
        if shared_gpu {
            // Decided on the gathered ids, so that every rank decides the same.
            let distinct = (0..ids.len()).all(|i| (0..i).all(|j| ids[i] != ids[j]));
            if ids.iter().any(Vec::is_empty) || !distinct {
                return Err(err(
                    "NCCL init",
                    "ranks share a GPU: NCCL needs a distinct NCCL_HOSTID in every rank's \
                     environment (ipcreduce launch sets them with IPCREDUCE_NCCL_SHARED_GPU=1)"
                        .into(),
                ));
            }
        }
        let id = if rank == 0 {
            nr::get_uniqueid().map_err(|e| err("ncclGetUniqueId", describe(e.0)))?
        } else {
            // SAFETY: plain bytes, overwritten below.
            unsafe { std::mem::zeroed() }
        };
        let raw: [u8; 128] = id.internal.map(|c| c as u8);
        let all = boot.all_gather(if rank == 0 { &raw } else { &[0] })?;
        let root: [u8; 128] = all[0]
            .as_slice()
            .try_into()
            .map_err(|_| err("NCCL id exchange", "rank 0 sent no NCCL id".into()))?;
        let id = ns::ncclUniqueId {
            internal: root.map(|b| b as std::ffi::c_char),
        };

        Self::open(boot, id, boot.world(), rank, shared_gpu, "ipcreduce")
    }

    /// Collective over the whole job: an NCCL communicator among `members` (ranks of the job,
    /// in the order NCCL numbers them), for every rank that is one; its unique id made by
    /// `members[0]` and sent through the job's bootstrap. Every rank of the job calls it (with
    /// its own group), so that the one exchange serves every group at once.
    pub fn init_among(boot: &mut Bootstrap, members: &[usize], name: &str) -> Result<Nccl> {
        let rank = boot.rank();
        let err = |op: &str, detail: String| Error::Cuda {
            rank,
            op: op.into(),
            detail,
        };
        let me = members
            .iter()
            .position(|&r| r == rank)
            .ok_or_else(|| err("NCCL init", format!("rank {rank} is not among {members:?}")))?;
        let mut mine = vec![present() as u8];
        if me == 0 && present() {
            let id = nr::get_uniqueid().map_err(|e| err("ncclGetUniqueId", describe(e.0)))?;
            mine.extend(id.internal.map(|c| c as u8));
        }
        let all = boot.all_gather(&mine)?;
        if let Some(&peer) = members.iter().find(|&&p| all[p].first() != Some(&1)) {
            let who = if peer == rank { "here" } else { "on that rank" };
            return Err(err(
                "NCCL init",
                format!("libnccl.so not found {who} (rank {peer}, of the NCCL group {members:?})"),
            ));
        }
        let root: [u8; 128] = all[members[0]][1..].try_into().map_err(|_| {
            err(
                "NCCL id exchange",
                format!("rank {} sent no NCCL id", members[0]),
            )
        })?;
        let id = ns::ncclUniqueId {
            internal: root.map(|b| b as std::ffi::c_char),
        };
        Self::open(boot, id, members.len(), me, false, name)
    }

    /// `ncclCommInitRankConfig` as rank `me` of `nranks` with `id`, then waits (bounded) for
    /// the communicator to be ready.
    fn open(
        boot: &Bootstrap,
        id: ns::ncclUniqueId,
        nranks: usize,
        me: usize,
        shared_gpu: bool,
        name: &str,
    ) -> Result<Nccl> {
        let rank = boot.rank();
        let err = |op: &str, detail: String| Error::Cuda {
            rank,
            op: op.into(),
            detail,
        };
        let name = CString::new(name).map_err(|_| err("NCCL init", "NUL in the name".into()))?;
        let socket = CString::new("Socket").expect("no NUL");
        let mut cfg = config(&name, shared_gpu.then_some(socket.as_c_str()));
        let mut comm = std::ptr::null_mut();
        // SAFETY: collective init; every member calls it with the same id; `cfg` and the
        // strings it points to outlive the call (NCCL copies them).
        let res = unsafe {
            ns::ncclCommInitRankConfig(&mut comm, nranks as i32, id, me as i32, &mut cfg)
        };
        if !matches!(
            res,
            ns::ncclResult_t::ncclSuccess | ns::ncclResult_t::ncclInProgress
        ) {
            if !comm.is_null() {
                // SAFETY: the half-made communicator, ended once.
                unsafe { ns::ncclCommAbort(comm) };
            }
            return Err(err("ncclCommInitRankConfig", describe(res)));
        }
        let mut nccl = Nccl {
            comm,
            rank,
            timeout: boot.timeout(),
            abort: boot.abort_state(),
            abort_on_drop: false,
        };
        nccl.settle("ncclCommInitRankConfig")?;
        Ok(nccl)
    }

    /// Waits (bounded by the timeout, and by our abort flag) until the communicator's last
    /// operation has left NCCL's "in progress" state.
    fn settle(&mut self, op: &str) -> Result<()> {
        const SPIN_BEFORE_SLEEP: Duration = Duration::from_millis(2);
        let started = Instant::now();
        let deadline = started + self.timeout;
        loop {
            let mut state = ns::ncclResult_t::ncclSuccess;
            // SAFETY: our communicator; writes one result.
            let res = unsafe { ns::ncclCommGetAsyncError(self.comm, &mut state) };
            if res != ns::ncclResult_t::ncclSuccess {
                state = res;
            }
            let why = match state {
                ns::ncclResult_t::ncclSuccess => return Ok(()),
                ns::ncclResult_t::ncclInProgress if self.abort.is_aborted() => {
                    format!("aborted: {}", self.abort.reason().unwrap_or_default())
                }
                ns::ncclResult_t::ncclInProgress if Instant::now() >= deadline => {
                    format!("still in progress after {:?}", self.timeout)
                }
                ns::ncclResult_t::ncclInProgress => {
                    // NCCL reports 'in progress' only for work it finishes in the background
                    // (finalize); spin (yielding) first, sleep once the wait is long.
                    if started.elapsed() < SPIN_BEFORE_SLEEP {
                        std::thread::yield_now();
                    } else {
                        std::thread::sleep(Duration::from_micros(50));
                    }
                    continue;
                }
                other => describe(other),
            };
            self.abort_on_drop = true;
            return Err(Error::Cuda {
                rank: self.rank,
                op: op.into(),
                detail: why,
            });
        }
    }

    /// Makes Drop end the communicator with ncclCommAbort.
    pub fn abort_on_drop(&mut self) {
        self.abort_on_drop = true;
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
        let what = format!("ncclAllReduce({count} x {dtype})");
        // SAFETY: the caller vouches for the pointers; the communicator is ours.
        let res = unsafe {
            ns::ncclAllReduce(
                send,
                recv,
                count,
                dt,
                o,
                self.comm,
                stream as ns::cudaStream_t,
            )
        };
        match res {
            ns::ncclResult_t::ncclSuccess => Ok(()),
            ns::ncclResult_t::ncclInProgress => self.settle(&what),
            other => {
                self.abort_on_drop = true;
                Err(Error::Cuda {
                    rank: self.rank,
                    op: what,
                    detail: describe(other),
                })
            }
        }
    }
}

impl Drop for Nccl {
    fn drop(&mut self) {
        if !self.abort_on_drop && !self.abort.is_aborted() {
            // A clean end: finalize (bounded by `settle`), then destroy.
            // SAFETY: our communicator.
            let res = unsafe { ns::ncclCommFinalize(self.comm) };
            let finalized = match res {
                ns::ncclResult_t::ncclSuccess => true,
                ns::ncclResult_t::ncclInProgress => self.settle("ncclCommFinalize").is_ok(),
                _ => false,
            };
            if finalized {
                // SAFETY: finalized, destroyed once; local after finalize.
                let res = unsafe { ns::ncclCommDestroy(self.comm) };
                if res != ns::ncclResult_t::ncclSuccess {
                    tracing::warn!(rank = self.rank, "ncclCommDestroy: {}", describe(res));
                }
                return;
            }
        }
        // SAFETY: ends our communicator once without waiting for peers.
        let res = unsafe { ns::ncclCommAbort(self.comm) };
        if res != ns::ncclResult_t::ncclSuccess {
            tracing::warn!(rank = self.rank, "ncclCommAbort: {}", describe(res));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_is_nccls_initializer_plus_our_choices() {
        let name = CString::new("ipcreduce").unwrap();
        let net = CString::new("Socket").unwrap();
        let c = config(&name, None);
        assert_eq!(c.magic, 0xcafe_beef);
        assert_eq!(c.size, std::mem::size_of::<ns::ncclConfig_t>());
        assert_eq!(c.blocking, 1, "blocking, as users run NCCL");
        assert_eq!(c.cgaClusterSize, UNDEF_INT);
        assert_eq!(c.maxP2pPeers, UNDEF_INT);
        assert!(c.netName.is_null());
        // SAFETY: points into `name`, alive.
        assert_eq!(unsafe { CStr::from_ptr(c.commName) }, name.as_c_str());
        let c = config(&name, Some(&net));
        // SAFETY: points into `net`, alive.
        assert_eq!(unsafe { CStr::from_ptr(c.netName) }, net.as_c_str());
    }
}
