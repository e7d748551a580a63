//! The collectives ipcreduce runs.
//!
//! A call is ours when its communicator is accelerated, the element type and operator are
//! ipcreduce's and the arguments pass the checks NCCL would make; inside a group, only when it
//! is the group's one call (see [`crate::group`]). Any stream will do, the legacy default
//! stream (handle 0 or `cudaStreamLegacy`) and the per-thread one (`cudaStreamPerThread`)
//! included: the kernel is launched on that same handle, so it keeps the stream's CUDA
//! semantics (the legacy stream waits for, and is waited for by, every blocking stream of the
//! context), as NCCL's own kernel would. Each rule depends on the call alone, so every rank takes
//! the same path for the same call. A refused argument is forwarded, so that the caller gets
//! NCCL's own error for it.

use crate::comm::{lookup, Accel};
use crate::log::{self, Coll};
use crate::types::*;
use std::ffi::c_void;
use std::sync::Arc;

/// One collective call, as the caller made it.
#[derive(Clone, Copy)]
pub struct Args {
    pub coll: Coll,
    pub send: *const c_void,
    pub recv: *mut c_void,
    /// all-reduce: count; reduce-scatter: recvcount; all-gather: sendcount.
    pub count: usize,
    pub dtype: DataType,
    /// Unused by all-gather.
    pub op: RedOp,
    pub comm: Comm,
    pub stream: Stream,
}

impl std::fmt::Display for Args {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "count={} dtype={}", self.count, self.dtype)?;
        if !matches!(self.coll, Coll::AllGather) {
            write!(f, " op={}", self.op)?;
        }
        // 0x0 and 0x1 are the legacy default stream, 0x2 the per-thread one.
        write!(f, " stream={:#x}", self.stream as usize)
    }
}

/// What ipcreduce runs for one call: its types, and whether the sum is then divided by the
/// world size (`ncclAvg`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Plan {
    pub dtype: ipcreduce::DType,
    pub op: ipcreduce::ReduceOp,
    pub avg: bool,
}

/// The accelerated communicator and ipcreduce's plan for `call`, or why it is forwarded.
pub fn ours(call: &Args) -> Result<(Arc<Accel>, Plan), &'static str> {
    if !log::accelerating() {
        return Err("IPCREDUCE_NCCL=off");
    }
    let a = lookup(call.comm).ok_or("communicator not accelerated")?;
    let plan = check(call, a.rank, a.world)?;
    Ok((a, plan))
}

/// The checks of one call by rank `rank` of `world` (all but the communicator's): its plan
/// on ipcreduce, or why it stays NCCL's.
fn check(call: &Args, rank: usize, world: usize) -> Result<Plan, &'static str> {
    let dt = to_dtype(call.dtype).ok_or("element type")?;
    let (op, avg) = match call.coll {
        Coll::AllGather => (ipcreduce::ReduceOp::Sum, false),
        _ if call.op == op::AVG => (ipcreduce::ReduceOp::Sum, true),
        _ => (to_op(call.op).ok_or("operator")?, false),
    };
    if call.count == 0 {
        return Err("count 0");
    }
    let (send_bytes, recv_bytes) = call
        .count
        .checked_mul(dt.size())
        .and_then(|b| match call.coll {
            Coll::AllReduce => Some((b, b)),
            Coll::ReduceScatter => Some((b.checked_mul(world)?, b)),
            Coll::AllGather => Some((b, b.checked_mul(world)?)),
        })
        .filter(|(s, r)| *s.max(r) <= isize::MAX as usize)
        .ok_or("count overflows")?;
    let (s, r) = (call.send as usize, call.recv as usize);
    if s == 0 || r == 0 || s % dt.size() != 0 || r % dt.size() != 0 {
        return Err("buffer null or misaligned");
    }
    // In place is the one overlap allowed: the same start for all-reduce, NCCL's offsets for
    // the other two: reduce-scatter `recv == send + rank * count`, all-gather
    // `send == recv + rank * count` (elements).
    let off = rank * call.count * dt.size();
    let in_place = match call.coll {
        Coll::AllReduce => s == r,
        Coll::ReduceScatter => r == s + off,
        Coll::AllGather => s == r + off,
    };
    // (Equal starts overlap too: in place for all-reduce, for the other two only at rank 0.)
    if s < r + recv_bytes && r < s + send_bytes && !in_place {
        return Err("buffers overlap");
    }
    Ok(Plan { dtype: dt, op, avg })
}

/// Runs `call` on ipcreduce if it may, else hands it to NCCL.
pub fn run(call: &Args) -> NcclResult {
    let mut clock = crate::profile::Clock::start();
    match ours(call) {
        Ok((a, plan)) => {
            let (dt, op) = (plan.dtype, plan.op);
            // A panic must not cross into C (it would abort the caller's process): it becomes
            // an internal error, on a communicator then aborted.
            clock.lap(0);
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let mut c = a.comm.lock().unwrap_or_else(|p| p.into_inner());
                clock.lap(1);
                // SAFETY: the checks of `ours`; the caller vouches for the memory, as with NCCL.
                let r = unsafe {
                    match call.coll {
                        Coll::AllReduce => c.all_reduce_raw(
                            call.send,
                            call.recv,
                            call.count,
                            dt,
                            op,
                            ipcreduce::Algorithm::Auto,
                            call.stream,
                        ),
                        Coll::ReduceScatter => c.reduce_scatter_raw(
                            call.send,
                            call.recv,
                            call.count,
                            dt,
                            op,
                            call.stream,
                        ),
                        Coll::AllGather => {
                            c.all_gather_raw(call.send, call.recv, call.count, dt, call.stream)
                        }
                    }
                };
                // ncclAvg: the sum's result divided in place, behind it on the same stream.
                let r = match r {
                    Ok(()) if plan.avg => {
                        // SAFETY: recv holds count elements of dt (checked); the sum's call
                        // left the communicator's context current.
                        unsafe { a.divide(call.recv, call.count, dt, call.stream) }
                    }
                    r => r,
                };
                clock.lap(2);
                // In log mode the all-reduce's line names the path it took.
                let path = match (log::logging(), call.coll) {
                    (true, Coll::AllReduce) => c
                        .last_path()
                        .map(|p| format!(" [{}, {} CTAs]", p.name, p.ctas))
                        .unwrap_or_default(),
                    _ => String::new(),
                };
                log::collective(call.coll, Some(a.rank), true, format_args!("{call}{path}"));
                clock.lap(3);
                r
            }));
            match r {
                Ok(r) => r.map_or_else(|e| a.fail(&e), |()| SUCCESS),
                Err(_) => a.panicked(call),
            }
        }
        Err(why) => forward(call, why),
    }
}

/// Hands `call` to the real NCCL (logged with `why`).
pub fn forward(call: &Args, why: &str) -> NcclResult {
    let rank = lookup(call.comm).map(|a| a.rank);
    log::collective(call.coll, rank, false, format_args!("{call} ({why})"));
    let c = call;
    match call.coll {
        Coll::AllReduce => {
            let f = real_fn!(ncclAllReduce as Reduce, SYSTEM_ERROR);
            // SAFETY: the caller's arguments, unchanged.
            unsafe { f(c.send, c.recv, c.count, c.dtype, c.op, c.comm, c.stream) }
        }
        Coll::ReduceScatter => {
            let f = real_fn!(ncclReduceScatter as Reduce, SYSTEM_ERROR);
            // SAFETY: the caller's arguments, unchanged.
            unsafe { f(c.send, c.recv, c.count, c.dtype, c.op, c.comm, c.stream) }
        }
        Coll::AllGather => {
            let f = real_fn!(ncclAllGather as Gather, SYSTEM_ERROR);
            // SAFETY: the caller's arguments, unchanged.
            unsafe { f(c.send, c.recv, c.count, c.dtype, c.comm, c.stream) }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(coll: Coll, send: usize, recv: usize, count: usize, dtype: DataType) -> Args {
        Args {
            coll,
            send: send as *const c_void,
            recv: recv as *mut c_void,
            count,
            dtype,
            op: op::SUM,
            comm: std::ptr::null_mut(),
            stream: 0x10 as Stream,
        }
    }

    const BASE: usize = 0x7f00_0000_0000;

    #[test]
    fn ipcreduce_takes_its_types_and_ops_only() {
        let mut a = args(Coll::AllReduce, BASE, BASE + 4096, 256, dtype::FLOAT32);
        assert!(check(&a, 0, 2).is_ok());
        for d in [0, 2, 4, 8, 10] {
            a.dtype = d; // int8, int32, int64, float64, fp8
            assert_eq!(check(&a, 0, 2).unwrap_err(), "element type");
        }
        a.dtype = dtype::BFLOAT16;
        for o in [1, 5] {
            a.op = o; // prod, a premul-sum handle
            assert_eq!(check(&a, 0, 2).unwrap_err(), "operator");
        }
        // Avg: the sum, divided afterwards; reduce-scatter too.
        a.op = op::AVG;
        let avg = Plan {
            dtype: ipcreduce::DType::Bf16,
            op: ipcreduce::ReduceOp::Sum,
            avg: true,
        };
        assert_eq!(check(&a, 0, 2), Ok(avg));
        let mut rs = args(Coll::ReduceScatter, BASE, BASE + 4096, 256, dtype::FLOAT16);
        rs.op = op::AVG;
        assert!(check(&rs, 1, 2).unwrap().avg);
        a.op = op::MAX;
        assert!(!check(&a, 0, 2).unwrap().avg);
        // All-gather has no operator: whatever the field holds.
        let mut g = args(Coll::AllGather, BASE, BASE + 4096, 256, dtype::FLOAT16);
        g.op = op::AVG;
        let p = check(&g, 1, 2).unwrap();
        assert_eq!((p.op, p.avg), (ipcreduce::ReduceOp::Sum, false));
    }

    #[test]
    fn default_streams_are_taken() {
        // NCCL's null stream (the legacy default stream), cudaStreamLegacy and
        // cudaStreamPerThread (cuda_runtime_api.h: 0x1, 0x2) are streams like any other.
        for s in [0usize, 0x1, 0x2] {
            let mut a = args(Coll::AllReduce, BASE, BASE + 4096, 256, dtype::FLOAT32);
            a.stream = s as Stream;
            assert!(check(&a, 0, 2).is_ok(), "stream {s:#x}");
            let mut g = args(Coll::AllGather, BASE, BASE + 8192, 256, dtype::FLOAT32);
            g.stream = s as Stream;
            assert!(check(&g, 1, 2).is_ok(), "stream {s:#x}");
        }
    }

    #[test]
    fn calls_nccl_answers_itself_are_forwarded() {
        let ok = args(Coll::AllReduce, BASE, BASE + 4096, 256, dtype::FLOAT32);
        let mut a = ok;
        a.count = 0;
        assert_eq!(check(&a, 0, 2).unwrap_err(), "count 0");
        let mut a = ok;
        a.send = std::ptr::null();
        assert_eq!(check(&a, 0, 2).unwrap_err(), "buffer null or misaligned");
        let mut a = ok;
        a.recv = (BASE + 4098) as *mut c_void;
        assert_eq!(check(&a, 0, 2).unwrap_err(), "buffer null or misaligned");
        // Overflow of count * size, and of world * bytes for the gathered side.
        let mut a = ok;
        a.count = usize::MAX / 2;
        assert_eq!(check(&a, 0, 2).unwrap_err(), "count overflows");
        let g = args(
            Coll::AllGather,
            BASE,
            BASE + 4096,
            isize::MAX as usize / 4,
            dtype::FLOAT16,
        );
        assert_eq!(check(&g, 0, 4).unwrap_err(), "count overflows");
    }

    #[test]
    fn overlap_only_in_nccls_in_place_forms() {
        let n = 1024; // f32 elements: 4 KiB per rank's part
                      // All-reduce: equal pointers in place, a partial overlap refused.
        let a = args(Coll::AllReduce, BASE, BASE, n, dtype::FLOAT32);
        assert!(check(&a, 0, 2).is_ok());
        let a = args(Coll::AllReduce, BASE, BASE + 64, n, dtype::FLOAT32);
        assert_eq!(check(&a, 0, 2).unwrap_err(), "buffers overlap");
        // Reduce-scatter, world 4: recv at send + rank * count is in place, elsewhere inside
        // send is not; disjoint is fine.
        for rank in 0..4 {
            let rs = args(
                Coll::ReduceScatter,
                BASE,
                BASE + rank * n * 4,
                n,
                dtype::FLOAT32,
            );
            assert!(check(&rs, rank, 4).is_ok(), "rank {rank} in place");
            let wrong = (rank + 1) % 4;
            let rs = args(
                Coll::ReduceScatter,
                BASE,
                BASE + wrong * n * 4,
                n,
                dtype::FLOAT32,
            );
            assert_eq!(
                check(&rs, rank, 4).unwrap_err(),
                "buffers overlap",
                "rank {rank}"
            );
        }
        let rs = args(
            Coll::ReduceScatter,
            BASE,
            BASE + 4 * n * 4,
            n,
            dtype::FLOAT32,
        );
        assert!(check(&rs, 2, 4).is_ok());
        // All-gather: send at recv + rank * count in place.
        for rank in 0..4 {
            let ag = args(
                Coll::AllGather,
                BASE + rank * n * 2,
                BASE,
                n,
                dtype::BFLOAT16,
            );
            assert!(check(&ag, rank, 4).is_ok(), "rank {rank} in place");
            let ag = args(
                Coll::AllGather,
                BASE + rank * n * 2 + 2,
                BASE,
                n,
                dtype::BFLOAT16,
            );
            assert_eq!(
                check(&ag, rank, 4).unwrap_err(),
                "buffers overlap",
                "rank {rank}"
            );
        }
    }
}
