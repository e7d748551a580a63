//! Sharing device memory between processes: VMM allocations exported as POSIX fds and mapped
//! by the peers, and the legacy IPC handles (see workspace.rs for how they are used). The
//! functions that release return the driver's result: their callers run in Drop and log.

use super::ck;
use crate::error::Result;
use cudarc::driver::sys;
use std::ffi::c_int;

/// The recommended granularity of allocations with `prop` (at least 1).
pub fn granularity(prop: &sys::CUmemAllocationProp, rank: usize) -> Result<usize> {
    let mut g = 0usize;
    // SAFETY: writes one usize.
    ck(
        unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut g,
                prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
            )
        },
        rank,
        || "cuMemGetAllocationGranularity".into(),
    )?;
    Ok(g.max(1))
}

/// One physical allocation of `size` bytes with `prop`; the caller owns the handle.
pub fn mem_create(
    size: usize,
    prop: &sys::CUmemAllocationProp,
    rank: usize,
) -> Result<sys::CUmemGenericAllocationHandle> {
    let mut handle = 0;
    // SAFETY: creates one physical allocation, owned by the caller.
    ck(
        unsafe { sys::cuMemCreate(&mut handle, size, prop, 0) },
        rank,
        || format!("cuMemCreate({size} bytes, POSIX fd handle)"),
    )?;
    Ok(handle)
}

/// Exports `handle` as a new POSIX fd, which the caller then owns.
pub fn export_posix_fd(handle: sys::CUmemGenericAllocationHandle, rank: usize) -> Result<c_int> {
    let mut fd: c_int = -1;
    // SAFETY: exports the handle as a new fd (written into `fd`).
    let exported = unsafe {
        sys::cuMemExportToShareableHandle(
            (&mut fd as *mut c_int).cast(),
            handle,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    };
    ck(exported, rank, || "cuMemExportToShareableHandle".into())?;
    Ok(fd)
}

/// Imports the allocation behind the POSIX fd `fd` (the driver dups it); the caller owns the
/// handle.
pub fn import_posix_fd(
    fd: c_int,
    rank: usize,
    what: impl FnOnce() -> String,
) -> Result<sys::CUmemGenericAllocationHandle> {
    let mut handle = 0;
    // SAFETY: imports the allocation from a live fd of the caller's.
    let res = unsafe {
        sys::cuMemImportFromShareableHandle(
            &mut handle,
            fd as usize as *mut std::ffi::c_void,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        )
    };
    ck(res, rank, what)?;
    Ok(handle)
}

/// Reserves `size` bytes of address space.
pub fn address_reserve(
    size: usize,
    rank: usize,
    what: impl FnOnce() -> String,
) -> Result<sys::CUdeviceptr> {
    let mut ptr = 0;
    // SAFETY: writes one address; the range is the caller's to free.
    ck(
        unsafe { sys::cuMemAddressReserve(&mut ptr, size, 0, 0, 0) },
        rank,
        what,
    )?;
    Ok(ptr)
}

/// Gives back an address range of [`address_reserve`].
///
/// # Safety
/// The range is ours, reserved once, and nothing is mapped in it any more.
pub unsafe fn address_free(ptr: sys::CUdeviceptr, size: usize) -> sys::CUresult {
    // SAFETY: as the caller vouched.
    unsafe { sys::cuMemAddressFree(ptr, size) }
}

/// Maps `handle` at `ptr`.
///
/// # Safety
/// `[ptr, ptr + size)` is a reserved range of ours with nothing mapped in it.
pub unsafe fn mem_map(
    ptr: sys::CUdeviceptr,
    size: usize,
    handle: sys::CUmemGenericAllocationHandle,
    rank: usize,
    what: impl FnOnce() -> String,
) -> Result<()> {
    // SAFETY: as the caller vouched.
    ck(
        unsafe { sys::cuMemMap(ptr, size, 0, handle, 0) },
        rank,
        what,
    )
}

/// Unmaps what [`mem_map`] mapped.
///
/// # Safety
/// The range is mapped by us and no work uses it any more.
pub unsafe fn unmap(ptr: sys::CUdeviceptr, size: usize) -> sys::CUresult {
    // SAFETY: as the caller vouched.
    unsafe { sys::cuMemUnmap(ptr, size) }
}

/// Gives `device` read/write access to the mapped range.
///
/// # Safety
/// `[ptr, ptr + size)` is mapped by us.
pub unsafe fn set_access(
    ptr: sys::CUdeviceptr,
    size: usize,
    device: sys::CUdevice,
    rank: usize,
    what: impl FnOnce() -> String,
) -> Result<()> {
    // SAFETY: a plain C struct; all-zero, then the fields that matter set.
    let mut access: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
    access.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = device;
    access.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    // SAFETY: as the caller vouched; `access` outlives the call.
    ck(
        unsafe { sys::cuMemSetAccess(ptr, size, &access, 1) },
        rank,
        what,
    )
}

/// Device memory of `bytes` for sharing through IPC handles.
pub fn ipc_alloc(
    bytes: usize,
    rank: usize,
    what: impl FnOnce() -> String,
) -> Result<sys::CUdeviceptr> {
    let mut ptr = 0;
    // SAFETY: plain allocation, owned by the caller.
    ck(unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes) }, rank, what)?;
    Ok(ptr)
}

/// Frees what [`ipc_alloc`] gave.
///
/// # Safety
/// `ptr` came from [`ipc_alloc`], is freed once, and no work uses it any more.
pub unsafe fn ipc_free(ptr: sys::CUdeviceptr) -> sys::CUresult {
    // SAFETY: as the caller vouched.
    unsafe { sys::cuMemFree_v2(ptr) }
}

/// The IPC handle of our allocation at `ptr`.
pub fn ipc_handle(ptr: sys::CUdeviceptr, rank: usize) -> Result<sys::CUipcMemHandle> {
    // SAFETY: a plain C struct filled by the driver.
    let mut handle: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
    // SAFETY: writes one handle; `ptr` is only looked up.
    ck(
        unsafe { sys::cuIpcGetMemHandle(&mut handle, ptr) },
        rank,
        || "cuIpcGetMemHandle".into(),
    )?;
    Ok(handle)
}

/// Opens a peer's allocation from its IPC handle; close it with [`ipc_close`].
pub fn ipc_open(
    handle: sys::CUipcMemHandle,
    rank: usize,
    what: impl FnOnce() -> String,
) -> Result<sys::CUdeviceptr> {
    let mut ptr = 0;
    // SAFETY: opens the peer's allocation, writes one address.
    let res = unsafe {
        sys::cuIpcOpenMemHandle_v2(
            &mut ptr,
            handle,
            sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
        )
    };
    ck(res, rank, what)?;
    Ok(ptr)
}

/// Closes what [`ipc_open`] opened.
///
/// # Safety
/// `ptr` came from [`ipc_open`], is closed once, and no work uses it any more.
pub unsafe fn ipc_close(ptr: sys::CUdeviceptr) -> sys::CUresult {
    // SAFETY: as the caller vouched.
    unsafe { sys::cuIpcCloseMemHandle(ptr) }
}
