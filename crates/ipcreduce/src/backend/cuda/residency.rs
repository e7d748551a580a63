//! How many CTAs a kernel of one rank may use so that every CTA of every rank is resident at
//! once.
//!
//! The kernels' blocks wait for their peers' blocks (block b of every rank meets at the same
//! flags), so a grid that does not fit beside the grids of the other ranks on the same GPU
//! never finishes: the blocks that run wait for blocks that cannot start. Until the timeout,
//! that is a hang. The room is measured on the device, not assumed:
//! - the SMs of the device (`CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT`; a MIG slice reports its
//!   own);
//! - the SMs this context may use: the execution affinity the driver reports
//!   (`cuCtxGetExecAffinity`, `CU_EXEC_AFFINITY_TYPE_SM_COUNT`) where it is smaller. An MPS
//!   active-thread share (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`, the client's or the daemon's) is
//!   already in the device's SM count as the client sees it (on an H200, driver 580, a 10 %
//!   client reads 12 of 132 SMs), so it is not applied again;
//! - the ranks sharing the GPU: each counts on `usable SMs / sharing` whole SMs (whether MPS
//!   places two clients' blocks on one SM or not, and a limited client's blocks on the same
//!   SMs as another's, this fits);
//! - the blocks per SM every kernel is guaranteed, loaded yet or not (see [`promised`]): two
//!   for the 512-thread kernels, one for the deep zero-copy ones, no more than the SM's thread
//!   limit holds, and no more than the occupancy calculator
//!   (`cuOccupancyMaxActiveBlocksPerMultiprocessor`) gives any kernel loaded so far.
//!
//! Kernels are loaded as calls first need them (modules.rs), after the caps are set, so the
//! caps cannot come from measuring every kernel. They come from the launch bounds instead:
//! every entry point is `__launch_bounds__(512, 2)`, the deep ones `(512, 1)` (prims.cuh's
//! ENTRY, scatter_gather.cu's SG_ENTRY; a test reads them), which makes ptxas fit their
//! registers to that many blocks per SM; they use no shared memory, so registers and threads
//! are all that limit their occupancy. And the promise is checked, not trusted: every kernel
//! loaded later must reach its promised blocks per SM on this device ([`check_fits`]) or its
//! load fails with an error naming it, never a grid that cannot all be resident. Every rank
//! computes the same promise from the same device attributes, and the smallest room is agreed.
//!
//! Every rank measures its own and all take the smallest (the protocol pairs block b with block
//! b, so all ranks must launch the same grid). The arithmetic is plain functions, tested here.

use super::driver::ck;
use crate::bootstrap::Bootstrap;
use crate::error::{Error, Result};
use cudarc::driver::sys;

/// What one rank measured: resident 512-thread CTAs and deep (one block per SM) CTAs it may
/// launch, and how (for messages).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Room {
    /// CTAs of the two-blocks-per-SM kernels that fit for this rank.
    pub wide: usize,
    /// CTAs of the deep zero-copy kernels that fit for this rank.
    pub deep: usize,
    /// SMs of the device, SMs this rank may hold, ranks sharing the GPU.
    pub device_sms: usize,
    pub rank_sms: usize,
    pub sharing: usize,
}

/// The caps of one communicator (agreed by every rank).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Caps {
    pub cap: usize,
    pub deep_cap: usize,
}

/// SMs one process may use on a device of `device_sms` (the count the client is shown, MPS
/// share included): fewer where the driver reports a smaller execution affinity.
pub(super) fn usable_sms(device_sms: usize, affinity: Option<usize>) -> usize {
    match affinity.filter(|&a| a > 0) {
        Some(a) => device_sms.min(a),
        None => device_sms,
    }
}

/// SMs one of `sharing` ranks on the GPU may count on: an even split of what each may use.
/// A limited client (an MPS share, an affinity) is held to `usable` SMs, but not to SMs of its
/// own: MPS may run every client's blocks on the same `usable` SMs, so the ranks' grids must fit
/// there together. Without a limit that is the even split of the device.
pub(super) fn rank_sms(usable: usize, device_sms: usize, sharing: usize) -> usize {
    usable.min(device_sms) / sharing.max(1)
}

/// The caps from the smallest room of any rank. `fixed` (`IPCREDUCE_BLOCKS`) must fit; without
/// it, the policy cap `default_cap` applies as well. An error (the same on every rank, since
/// every rank computes it from the same numbers) when nothing fits.
pub(super) fn caps(
    room: &Room,
    fixed: Option<usize>,
    default_cap: usize,
    max_blocks: usize,
) -> std::result::Result<Caps, String> {
    let why = || {
        format!(
            "{} SMs of {} for each of the {} ranks sharing this GPU",
            room.rank_sms, room.device_sms, room.sharing
        )
    };
    if room.wide == 0 || room.deep == 0 {
        return Err(format!(
            "no kernel grid fits: {} (every CTA of every rank must be resident at once); \
             fewer ranks on the GPU or a larger MPS share needed",
            why()
        ));
    }
    let wide = room.wide.min(max_blocks);
    let cap = match fixed {
        Some(f) if f > wide => {
            return Err(format!(
                "blocks {f} (Config::blocks or IPCREDUCE_BLOCKS): at most {wide} CTAs per rank \
                 can be resident at once here ({})",
                why()
            ))
        }
        Some(_) => wide,
        None => wide.min(default_cap),
    };
    Ok(Caps {
        cap,
        deep_cap: cap.min(room.deep),
    })
}

/// The smallest of every rank's room (all-gathered): what all ranks can launch.
pub(super) fn smallest(all: &[Room]) -> Option<Room> {
    all.iter()
        .copied()
        .min_by_key(|r| r.rank_sms)
        .map(|first| Room {
            wide: all.iter().map(|r| r.wide).min().unwrap_or(0),
            deep: all.iter().map(|r| r.deep).min().unwrap_or(0),
            ..first
        })
}

impl Room {
    fn to_bytes(self) -> Vec<u8> {
        [
            self.wide,
            self.deep,
            self.device_sms,
            self.rank_sms,
            self.sharing,
        ]
        .map(|v| (v as u64).to_le_bytes())
        .concat()
    }

    fn from_bytes(b: &[u8]) -> Option<Room> {
        let w = |i: usize| -> Option<usize> {
            Some(u64::from_le_bytes(b.get(i * 8..i * 8 + 8)?.try_into().ok()?) as usize)
        };
        Some(Room {
            wide: w(0)?,
            deep: w(1)?,
            device_sms: w(2)?,
            rank_sms: w(3)?,
            sharing: w(4)?,
        })
    }
}

/// Measures this rank's room on `device` (its context current), with `sharing` ranks on the
/// GPU, for the kernels of the process loaded so far, `loaded` (modules.rs).
pub(super) fn measure(
    loaded: &[(crate::plan::CudaPath, sys::CUfunction)],
    device: sys::CUdevice,
    sharing: usize,
    rank: usize,
) -> Result<Room> {
    let mut sms = 0;
    // SAFETY: writes one int for a valid device.
    ck(
        unsafe {
            sys::cuDeviceGetAttribute(
                &mut sms,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                device,
            )
        },
        rank,
        || "cuDeviceGetAttribute(MULTIPROCESSOR_COUNT)".into(),
    )?;
    let device_sms = sms.max(0) as usize;
    let usable = usable_sms(device_sms, context_sm_affinity());
    let rank_sms = rank_sms(usable, device_sms, sharing);
    let mut threads_per_sm = 0;
    // SAFETY: writes one int for a valid device.
    ck(
        unsafe {
            sys::cuDeviceGetAttribute(
                &mut threads_per_sm,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR,
                device,
            )
        },
        rank,
        || "cuDeviceGetAttribute(MAX_THREADS_PER_MULTIPROCESSOR)".into(),
    )?;
    let fit = threads_per_sm.max(0) as usize / super::THREADS as usize;
    let mut wide_per_sm = promised(false).min(fit);
    let mut deep_per_sm = promised(true).min(fit);
    // Kernels this process loaded already (another communicator's) may fit fewer.
    let sm_funcs = loaded.iter().map(|&(p, f)| (p.one_block_per_sm(), f));
    for (deep, f) in sm_funcs {
        let n = blocks_per_sm(f, super::THREADS, rank)?;
        let slot = if deep {
            &mut deep_per_sm
        } else {
            &mut wide_per_sm
        };
        *slot = (*slot).min(n);
    }
    let room = Room {
        wide: rank_sms * wide_per_sm,
        deep: rank_sms * deep_per_sm,
        device_sms,
        rank_sms,
        sharing,
    };
    tracing::debug!(
        rank,
        ?room,
        usable,
        wide_per_sm,
        deep_per_sm,
        "kernel residency"
    );
    Ok(room)
}

/// What every rank can launch: each rank's [`measure`], all-gathered, the smallest taken.
pub(super) fn agree(boot: &mut Bootstrap, mine: Room) -> Result<Room> {
    let rank = boot.rank();
    let all = boot.all_gather(&mine.to_bytes())?;
    let rooms: Vec<Room> = all
        .iter()
        .enumerate()
        .map(|(peer, b)| {
            Room::from_bytes(b).ok_or_else(|| {
                Error::invalid(
                    rank,
                    "init",
                    format!("rank {peer} sent a malformed residency record"),
                )
            })
        })
        .collect::<Result<_>>()?;
    Ok(smallest(&rooms).unwrap_or(mine))
}

/// The blocks per SM a kernel's launch bounds promise: `__launch_bounds__(512, 1)` for the
/// deep zero-copy kernels, `(512, 2)` for every other (prims.cuh, scatter_gather.cu).
pub(super) fn promised(one_block_per_sm: bool) -> usize {
    if one_block_per_sm {
        1
    } else {
        2
    }
}

/// Fails when `f` (path `path`'s kernel `name`, just loaded) fits fewer blocks per SM than its
/// launch bounds promised, which the caps agreed at init count on.
pub(super) fn check_fits(
    path: crate::plan::CudaPath,
    f: sys::CUfunction,
    name: &str,
    rank: usize,
) -> Result<()> {
    let want = promised(path.one_block_per_sm());
    let got = blocks_per_sm(f, super::THREADS, rank)?;
    if got >= want {
        return Ok(());
    }
    Err(Error::invalid(
        rank,
        "kernel load",
        format!(
            "{name} fits {got} blocks of {} threads per SM, its launch bounds promise {want}: \
             the CTA caps set at init would not all be resident",
            super::THREADS
        ),
    ))
}

/// Resident blocks of `threads` threads per SM for `f`, as the occupancy calculator says.
fn blocks_per_sm(f: sys::CUfunction, threads: u32, rank: usize) -> Result<usize> {
    let mut n = 0;
    // SAFETY: writes one int for a loaded function.
    ck(
        unsafe { sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut n, f, threads as i32, 0) },
        rank,
        || "cuOccupancyMaxActiveBlocksPerMultiprocessor".into(),
    )?;
    Ok(n.max(0) as usize)
}

/// The SM count of the current context's execution affinity, where the driver reports one.
fn context_sm_affinity() -> Option<usize> {
    // SAFETY: plain data; the driver fills it in.
    let mut p: sys::CUexecAffinityParam = unsafe { std::mem::zeroed() };
    // SAFETY: writes one struct for the current context.
    let res = unsafe {
        sys::cuCtxGetExecAffinity(
            &mut p,
            sys::CUexecAffinityType::CU_EXEC_AFFINITY_TYPE_SM_COUNT,
        )
    };
    if res != sys::CUresult::CUDA_SUCCESS {
        return None;
    }
    // SAFETY: the SM-count member is the one this type fills.
    let n = unsafe { p.param.smCount.val };
    (n > 0).then_some(n as usize)
}

#[cfg(test)]
#[path = "residency_tests.rs"]
mod tests;
