//! The collectives ipcreduce runs.
//!
//! A call is ours when its communicator is accelerated, the element type and operator are
//! ipcreduce's, the stream is a real one (NCCL's null stream is the legacy default stream) and
//! the arguments pass the checks NCCL would make; inside a group, only when it is the group's
//! one call (see [`crate::group`]). Each rule depends on the call alone, so every rank takes
//! the same path for the same call. A refused argument is forwarded, so that the caller gets
//! NCCL's own error for it.

use crate::comm::{lookup, Accel};
use crate::group;
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
        Ok(())
    }
}

/// The accelerated communicator and ipcreduce's types for `call`, or why it is forwarded.
pub fn ours(
    call: &Args,
) -> Result<(Arc<Accel>, ipcreduce::DType, ipcreduce::ReduceOp), &'static str> {
    if !matches!(log::mode(), Ok(log::Mode::On | log::Mode::Log)) {
        return Err("IPCREDUCE_NCCL=off");
    }
    let a = lookup(call.comm).ok_or("communicator not accelerated")?;
    let dt = to_dtype(call.dtype).ok_or("element type")?;
    let op = if matches!(call.coll, Coll::AllGather) {
        ipcreduce::ReduceOp::Sum
    } else {
        to_op(call.op).ok_or("operator")?
    };
    if call.count == 0 {
        return Err("count 0");
    }
    if call.stream.is_null() {
        return Err("legacy default stream");
    }
    let w = a.world;
    let (send_bytes, recv_bytes) = call
        .count
        .checked_mul(dt.size())
        .and_then(|b| match call.coll {
            Coll::AllReduce => Some((b, b)),
            Coll::ReduceScatter => Some((b.checked_mul(w)?, b)),
            Coll::AllGather => Some((b, b.checked_mul(w)?)),
        })
        .filter(|(s, r)| *s.max(r) <= isize::MAX as usize)
        .ok_or("count overflows")?;
    let (s, r) = (call.send as usize, call.recv as usize);
    if s == 0 || r == 0 || s % dt.size() != 0 || r % dt.size() != 0 {
        return Err("buffer null or misaligned");
    }
    // In place is the one overlap allowed: the same start for all-reduce, NCCL's offsets for
    // the other two.
    if s != r && s < r + recv_bytes && r < s + send_bytes && !in_place(call, s, r, &a, dt) {
        return Err("buffers overlap");
    }
    Ok((a, dt, op))
}

/// NCCL's in-place forms: reduce-scatter `recv == send + rank * count`, all-gather
/// `send == recv + rank * count` (elements).
fn in_place(call: &Args, s: usize, r: usize, a: &Accel, dt: ipcreduce::DType) -> bool {
    let off = a.rank * call.count * dt.size();
    match call.coll {
        Coll::AllReduce => s == r,
        Coll::ReduceScatter => r == s + off,
        Coll::AllGather => s == r + off,
    }
}

/// Runs `call` on ipcreduce if it may, else hands it to NCCL.
pub fn run(call: &Args) -> NcclResult {
    match ours(call) {
        Ok((a, dt, op)) => {
            log::collective(call.coll, Some(a.rank), true, format_args!("{call}"));
            // A panic must not cross into C (it would abort the caller's process): it becomes
            // an internal error, on a communicator then aborted.
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let mut c = a.comm.lock().unwrap_or_else(|p| p.into_inner());
                // SAFETY: the checks of `ours`; the caller vouches for the memory, as with NCCL.
                unsafe {
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
                }
            }));
            match r {
                Ok(r) => r.map_or_else(|e| a.fail(&e), |()| SUCCESS),
                Err(_) => {
                    let why = format!("rank {}: ipcreduce panicked in {call}", a.rank);
                    a.abort.abort(why.clone());
                    a.error.set(&format!("ipcreduce-nccl: {why}"));
                    INTERNAL_ERROR
                }
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
    type Reduce = unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        DataType,
        RedOp,
        Comm,
        Stream,
    ) -> NcclResult;
    let reduce = |f: Reduce| {
        // SAFETY: the caller's arguments, unchanged.
        unsafe { f(c.send, c.recv, c.count, c.dtype, c.op, c.comm, c.stream) }
    };
    match call.coll {
        Coll::AllReduce => reduce(real_fn!(
            ncclAllReduce(
                *const c_void,
                *mut c_void,
                usize,
                DataType,
                RedOp,
                Comm,
                Stream,
            ) -> NcclResult,
            SYSTEM_ERROR
        )),
        Coll::ReduceScatter => reduce(real_fn!(
            ncclReduceScatter(
                *const c_void,
                *mut c_void,
                usize,
                DataType,
                RedOp,
                Comm,
                Stream,
            ) -> NcclResult,
            SYSTEM_ERROR
        )),
        Coll::AllGather => {
            let f = real_fn!(
                ncclAllGather(
                    *const c_void,
                    *mut c_void,
                    usize,
                    DataType,
                    Comm,
                    Stream,
                ) -> NcclResult,
                SYSTEM_ERROR
            );
            // SAFETY: the caller's arguments, unchanged.
            unsafe { f(c.send, c.recv, c.count, c.dtype, c.comm, c.stream) }
        }
    }
}

/// A call from the API: inside a group the group decides, else it runs now.
fn call(args: Args) -> NcclResult {
    if group::in_group() {
        return group::collective(args);
    }
    run(&args)
}

entry! {
    fn ncclAllReduce / pncclAllReduce(send: *const c_void, recv: *mut c_void, count: usize, datatype: DataType, op: RedOp, comm: Comm, stream: Stream) -> NcclResult {
        call(Args { coll: Coll::AllReduce, send, recv, count, dtype: datatype, op, comm, stream })
    }

    fn ncclReduceScatter / pncclReduceScatter(send: *const c_void, recv: *mut c_void, recvcount: usize, datatype: DataType, op: RedOp, comm: Comm, stream: Stream) -> NcclResult {
        call(Args { coll: Coll::ReduceScatter, send, recv, count: recvcount, dtype: datatype, op, comm, stream })
    }

    fn ncclAllGather / pncclAllGather(send: *const c_void, recv: *mut c_void, sendcount: usize, datatype: DataType, comm: Comm, stream: Stream) -> NcclResult {
        call(Args { coll: Coll::AllGather, send, recv, count: sendcount, dtype: datatype, op: op::SUM, comm, stream })
    }
}
