//! Every entry point of NCCL 2.28 that this library does not change: handed to the real NCCL.

use crate::types::*;
use std::ffi::{c_int, c_void};

forward! {
    fn ncclMemAlloc / pncclMemAlloc(ptr: *mut *mut c_void, size: usize) -> NcclResult = SYSTEM_ERROR;
    fn ncclMemFree / pncclMemFree(ptr: *mut c_void) -> NcclResult = SYSTEM_ERROR;
    fn ncclGetVersion / pncclGetVersion(version: *mut c_int) -> NcclResult = SYSTEM_ERROR;
    fn ncclGetUniqueId / pncclGetUniqueId(id: *mut UniqueId) -> NcclResult = SYSTEM_ERROR;
    fn ncclCommInitAll / pncclCommInitAll(comm: *mut Comm, ndev: c_int, devlist: *const c_int) -> NcclResult = SYSTEM_ERROR;
    fn ncclCommCount / pncclCommCount(comm: Comm, count: *mut c_int) -> NcclResult = SYSTEM_ERROR;
    fn ncclCommCuDevice / pncclCommCuDevice(comm: Comm, device: *mut c_int) -> NcclResult = SYSTEM_ERROR;
    fn ncclCommUserRank / pncclCommUserRank(comm: Comm, rank: *mut c_int) -> NcclResult = SYSTEM_ERROR;
    fn ncclCommRegister / pncclCommRegister(comm: Comm, buff: *mut c_void, size: usize, handle: *mut *mut c_void) -> NcclResult = SYSTEM_ERROR;
    fn ncclCommDeregister / pncclCommDeregister(comm: Comm, handle: *mut c_void) -> NcclResult = SYSTEM_ERROR;
    fn ncclRedOpCreatePreMulSum / pncclRedOpCreatePreMulSum(op: *mut RedOp, scalar: *mut c_void, datatype: DataType, residence: Residence, comm: Comm) -> NcclResult = SYSTEM_ERROR;
    fn ncclRedOpDestroy / pncclRedOpDestroy(op: RedOp, comm: Comm) -> NcclResult = SYSTEM_ERROR;
    fn ncclReduce / pncclReduce(send: *const c_void, recv: *mut c_void, count: usize, datatype: DataType, op: RedOp, root: c_int, comm: Comm, stream: Stream) -> NcclResult = SYSTEM_ERROR;
    fn ncclBcast / pncclBcast(buff: *mut c_void, count: usize, datatype: DataType, root: c_int, comm: Comm, stream: Stream) -> NcclResult = SYSTEM_ERROR;
    fn ncclBroadcast / pncclBroadcast(send: *const c_void, recv: *mut c_void, count: usize, datatype: DataType, root: c_int, comm: Comm, stream: Stream) -> NcclResult = SYSTEM_ERROR;
    fn ncclAlltoAll / pncclAlltoAll(send: *const c_void, recv: *mut c_void, count: usize, datatype: DataType, comm: Comm, stream: Stream) -> NcclResult = SYSTEM_ERROR;
    fn ncclGather / pncclGather(send: *const c_void, recv: *mut c_void, count: usize, datatype: DataType, root: c_int, comm: Comm, stream: Stream) -> NcclResult = SYSTEM_ERROR;
    fn ncclScatter / pncclScatter(send: *const c_void, recv: *mut c_void, count: usize, datatype: DataType, root: c_int, comm: Comm, stream: Stream) -> NcclResult = SYSTEM_ERROR;
    fn ncclSend / pncclSend(send: *const c_void, count: usize, datatype: DataType, peer: c_int, comm: Comm, stream: Stream) -> NcclResult = SYSTEM_ERROR;
    fn ncclRecv / pncclRecv(recv: *mut c_void, count: usize, datatype: DataType, peer: c_int, comm: Comm, stream: Stream) -> NcclResult = SYSTEM_ERROR;
    // The device API's host side (nccl_device/*.h): requirement structs by pointer, teams by value.
    fn ncclDevCommCreate / pncclDevCommCreate(comm: Comm, reqs: *const c_void, out: *mut c_void) -> NcclResult = SYSTEM_ERROR;
    fn ncclDevCommDestroy / pncclDevCommDestroy(comm: Comm, dev: *const c_void) -> NcclResult = SYSTEM_ERROR;
    fn ncclGinBarrierCreateRequirement / pncclGinBarrierCreateRequirement(comm: Comm, team: Team, n: c_int, handle: *mut c_void, req: *mut c_void) -> NcclResult = SYSTEM_ERROR;
    fn ncclLsaBarrierCreateRequirement / pncclLsaBarrierCreateRequirement(team: Team, n: c_int, handle: *mut c_void, req: *mut c_void) -> NcclResult = SYSTEM_ERROR;
    fn ncclLLA2ACalcSlots / pncclLLA2ACalcSlots(max_elts: c_int, max_elt_size: c_int) -> c_int = -1;
    fn ncclLLA2ACreateRequirement / pncclLLA2ACreateRequirement(blocks: c_int, slots: c_int, handle: *mut c_void, req: *mut c_void) -> NcclResult = SYSTEM_ERROR;
    fn ncclTeamWorld / pncclTeamWorld(comm: Comm) -> Team = Team::default();
    fn ncclTeamLsa / pncclTeamLsa(comm: Comm) -> Team = Team::default();
    fn ncclTeamRail / pncclTeamRail(comm: Comm) -> Team = Team::default();
    fn ncclTeamRankToWorld / pncclTeamRankToWorld(comm: Comm, team: Team, rank: c_int) -> c_int = -1;
    fn ncclTeamRankToLsa / pncclTeamRankToLsa(comm: Comm, team: Team, rank: c_int) -> c_int = -1;
}

// The two entry points that return nothing: `real_fn!`'s "return nothing" reads `()` there.

#[no_mangle]
#[allow(clippy::unused_unit)]
pub unsafe extern "C" fn ncclResetDebugInit() {
    crate::log::forwarded("ncclResetDebugInit");
    let f = real_fn!(ncclResetDebugInit() -> (), ());
    // SAFETY: no arguments.
    unsafe { f() }
}

#[no_mangle]
pub unsafe extern "C" fn pncclResetDebugInit() {
    // SAFETY: as the function it aliases.
    unsafe { ncclResetDebugInit() }
}

/// Exported by NCCL without a `pnccl` twin.
#[no_mangle]
#[allow(clippy::unused_unit)]
pub unsafe extern "C" fn ncclResetDebugInitInternal() {
    crate::log::forwarded("ncclResetDebugInitInternal");
    let f = real_fn!(ncclResetDebugInitInternal() -> (), ());
    // SAFETY: no arguments.
    unsafe { f() }
}
