//! The collectives' entry points (`ncclAllReduce`, `ncclReduceScatter`, `ncclAllGather`):
//! inside a group the group decides ([`crate::group`]), else the call runs now ([`crate::coll`]).

use crate::coll::{run, Args};
use crate::group;
use crate::log::Coll;
use crate::types::*;
use std::ffi::c_void;

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
