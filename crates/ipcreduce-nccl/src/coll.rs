//! The collectives ipcreduce runs, and the group calls that decide when it may.
//!
//! A call is ours when its communicator is accelerated, it is not inside a group (a group is
//! forwarded whole: NCCL gives its calls the semantics of one fused operation), the element
//! type and operator are ipcreduce's, the stream is a real one (NCCL's null stream is the
//! legacy default stream) and the arguments pass the checks NCCL would make. Each rule
//! depends on the call alone, so every rank takes the same path for the same call. A refused
//! argument is forwarded, so that the caller gets NCCL's own error for it.

use crate::comm::{lookup, Accel};
use crate::log::{self, Coll};
use crate::types::*;
use std::cell::Cell;
use std::ffi::c_void;
use std::sync::Arc;

thread_local! {
    /// `ncclGroupStart` depth of this thread (NCCL's groups are per thread too).
    static GROUP_DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// Whether this thread is between `ncclGroupStart` and its `ncclGroupEnd`.
pub fn in_group() -> bool {
    GROUP_DEPTH.with(Cell::get) > 0
}

/// The call's own description, for the log line.
struct Call {
    coll: Coll,
    count: usize,
    dtype: DataType,
    op: RedOp,
}

impl std::fmt::Display for Call {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "count={} dtype={}", self.count, self.dtype)?;
        if !matches!(self.coll, Coll::AllGather) {
            write!(f, " op={}", self.op)?;
        }
        Ok(())
    }
}

/// The accelerated communicator and ipcreduce's types for `call`, or why it is forwarded.
fn ours(
    call: &Call,
    comm: Comm,
    stream: Stream,
    spans: impl FnOnce(usize, usize) -> Option<(usize, usize)>,
    send: *const c_void,
    recv: *mut c_void,
) -> Result<(Arc<Accel>, ipcreduce::DType, ipcreduce::ReduceOp), &'static str> {
    if !matches!(log::mode(), Ok(log::Mode::On | log::Mode::Log)) {
        return Err("IPCREDUCE_NCCL=off");
    }
    if GROUP_DEPTH.with(Cell::get) > 0 {
        return Err("inside a group");
    }
    let a = lookup(comm).ok_or("communicator not accelerated")?;
    let dt = to_dtype(call.dtype).ok_or("element type")?;
    let op = if matches!(call.coll, Coll::AllGather) {
        ipcreduce::ReduceOp::Sum
    } else {
        to_op(call.op).ok_or("operator")?
    };
    if call.count == 0 {
        return Err("count 0");
    }
    if stream.is_null() {
        return Err("legacy default stream");
    }
    let (send_bytes, recv_bytes) = call
        .count
        .checked_mul(dt.size())
        .and_then(|b| spans(b, a.world))
        .filter(|(s, r)| *s.max(r) <= isize::MAX as usize)
        .ok_or("count overflows")?;
    let (s, r) = (send as usize, recv as usize);
    if s == 0 || r == 0 || s % dt.size() != 0 || r % dt.size() != 0 {
        return Err("buffer null or misaligned");
    }
    // In place is the one overlap allowed: the same start for all-reduce, NCCL's offsets for
    // the other two (checked by the caller's `in_place`).
    if s != r && s < r + recv_bytes && r < s + send_bytes && !in_place(call, s, r, &a, dt) {
        return Err("buffers overlap");
    }
    Ok((a, dt, op))
}

/// NCCL's in-place forms: reduce-scatter `recv == send + rank * count`, all-gather
/// `send == recv + rank * count` (elements).
fn in_place(call: &Call, s: usize, r: usize, a: &Accel, dt: ipcreduce::DType) -> bool {
    let off = a.rank * call.count * dt.size();
    match call.coll {
        Coll::AllReduce => s == r,
        Coll::ReduceScatter => r == s + off,
        Coll::AllGather => s == r + off,
    }
}

/// Logs and counts a forwarded call, returning `fwd()`'s result.
fn forwarded(call: &Call, comm: Comm, why: &str, fwd: impl FnOnce() -> NcclResult) -> NcclResult {
    let rank = lookup(comm).map(|a| a.rank);
    log::collective(call.coll, rank, false, format_args!("{call} ({why})"));
    fwd()
}

entry! {
    fn ncclAllReduce / pncclAllReduce(send: *const c_void, recv: *mut c_void, count: usize, datatype: DataType, op: RedOp, comm: Comm, stream: Stream) -> NcclResult {
        let fwd = real_fn!(ncclAllReduce(*const c_void, *mut c_void, usize, DataType, RedOp, Comm, Stream) -> NcclResult, SYSTEM_ERROR);
        let call = Call { coll: Coll::AllReduce, count, dtype: datatype, op };
        match ours(&call, comm, stream, |b, _| Some((b, b)), send, recv) {
            Ok((a, dt, rop)) => {
                log::collective(call.coll, Some(a.rank), true, format_args!("{call}"));
                let mut c = a.comm.lock().unwrap_or_else(|p| p.into_inner());
                // SAFETY: the checks above; the caller vouches for the memory, as with NCCL.
                let r = unsafe { c.all_reduce_raw(send, recv, count, dt, rop, ipcreduce::Algorithm::Auto, stream) };
                r.map_or_else(|e| a.fail(&e), |()| SUCCESS)
            }
            // SAFETY: the caller's arguments, unchanged.
            Err(why) => forwarded(&call, comm, why, || unsafe { fwd(send, recv, count, datatype, op, comm, stream) }),
        }
    }

    fn ncclReduceScatter / pncclReduceScatter(send: *const c_void, recv: *mut c_void, recvcount: usize, datatype: DataType, op: RedOp, comm: Comm, stream: Stream) -> NcclResult {
        let fwd = real_fn!(ncclReduceScatter(*const c_void, *mut c_void, usize, DataType, RedOp, Comm, Stream) -> NcclResult, SYSTEM_ERROR);
        let call = Call { coll: Coll::ReduceScatter, count: recvcount, dtype: datatype, op };
        match ours(&call, comm, stream, |b, w| Some((b.checked_mul(w)?, b)), send, recv) {
            Ok((a, dt, rop)) => {
                log::collective(call.coll, Some(a.rank), true, format_args!("{call}"));
                let mut c = a.comm.lock().unwrap_or_else(|p| p.into_inner());
                // SAFETY: as above.
                let r = unsafe { c.reduce_scatter_raw(send, recv, recvcount, dt, rop, stream) };
                r.map_or_else(|e| a.fail(&e), |()| SUCCESS)
            }
            // SAFETY: the caller's arguments, unchanged.
            Err(why) => forwarded(&call, comm, why, || unsafe { fwd(send, recv, recvcount, datatype, op, comm, stream) }),
        }
    }

    fn ncclAllGather / pncclAllGather(send: *const c_void, recv: *mut c_void, sendcount: usize, datatype: DataType, comm: Comm, stream: Stream) -> NcclResult {
        let fwd = real_fn!(ncclAllGather(*const c_void, *mut c_void, usize, DataType, Comm, Stream) -> NcclResult, SYSTEM_ERROR);
        let call = Call { coll: Coll::AllGather, count: sendcount, dtype: datatype, op: op::SUM };
        match ours(&call, comm, stream, |b, w| Some((b, b.checked_mul(w)?)), send, recv) {
            Ok((a, dt, _)) => {
                log::collective(call.coll, Some(a.rank), true, format_args!("{call}"));
                let mut c = a.comm.lock().unwrap_or_else(|p| p.into_inner());
                // SAFETY: as above.
                let r = unsafe { c.all_gather_raw(send, recv, sendcount, dt, stream) };
                r.map_or_else(|e| a.fail(&e), |()| SUCCESS)
            }
            // SAFETY: the caller's arguments, unchanged.
            Err(why) => forwarded(&call, comm, why, || unsafe { fwd(send, recv, sendcount, datatype, comm, stream) }),
        }
    }

    fn ncclGroupStart / pncclGroupStart() -> NcclResult {
        log::forwarded("ncclGroupStart");
        let f = real_fn!(ncclGroupStart() -> NcclResult, SYSTEM_ERROR);
        // SAFETY: no arguments.
        let r = unsafe { f() };
        if r == SUCCESS {
            GROUP_DEPTH.with(|d| d.set(d.get() + 1));
        }
        r
    }

    fn ncclGroupEnd / pncclGroupEnd() -> NcclResult {
        log::forwarded("ncclGroupEnd");
        let f = real_fn!(ncclGroupEnd() -> NcclResult, SYSTEM_ERROR);
        // SAFETY: no arguments.
        let r = unsafe { f() };
        // NCCL leaves the group whatever the result.
        let depth = GROUP_DEPTH.with(|d| {
            d.set(d.get().saturating_sub(1));
            d.get()
        });
        if depth == 0 {
            return crate::comm::group_ended(r);
        }
        r
    }
}
