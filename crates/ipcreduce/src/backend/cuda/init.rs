//! Start-up of a communicator (collective): the GPU, the limits every rank agrees on, the
//! workspaces and the fabric, the launcher's memory, optionally NCCL beside us; across nodes,
//! the node's communicator and NCCL between the nodes.

use super::calls::CallLedger;
use super::driver;
use super::kernels::{self, LL_MAX_BYTES, MAX_BLOCKS, MAX_RANKS};
use super::launcher::{data_offset, Agreed, Launcher, W_ABORT, W_ERR};
use super::memory::{DeviceAlloc, MappedHostWords};
use super::modules::Loaded;
use super::peers::device_uuid;
use super::registry::Registry;
use super::transport::SharedWorkspaces;
use super::{ce, hier, nccl, pointers, residency, streams, teardown, topology, usable, CudaComm};
use crate::bootstrap::Bootstrap;
use crate::config::{Config, Pdl};
use crate::error::{Error, Result};
use crate::plan::{Fabric, GridLimits};
use cudarc::driver::safe as cs;
use std::mem::ManuallyDrop;
use std::sync::{Arc, Weak};

/// Default bytes of one data slot (the workspace holds two). Larger messages are chunked.
const DEFAULT_SLOT_BYTES: usize = 16 << 20;
/// Most CTAs a kernel uses by default (a policy); fewer where they would not all be resident
/// beside the other ranks' (see residency.rs).
const DEFAULT_CTA_CAP: usize = 64;

impl CudaComm {
    pub fn new(boot: &mut Bootstrap, config: &Config) -> Result<CudaComm> {
        usable()?;
        let mut phases = crate::phases::Phases::start("cuda init");
        let rank = boot.rank();
        let world = boot.world();
        if world > MAX_RANKS {
            return Err(Error::invalid(
                rank,
                "init",
                format!("world size {world} exceeds the cuda backend's maximum of {MAX_RANKS}"),
            ));
        }
        // A bad value fails before any exchange with the peers, like a bad Config.
        let fused_forced = super::fused_path::forced_from_env()?;
        let cuda = |op: &str, e: cudarc::driver::DriverError| driver::from_cudarc(rank, op, e);
        let count = cs::CudaContext::device_count().map_err(|e| cuda("cuDeviceGetCount", e))?;
        let ordinal = config.pick_device(
            current_device(rank)?,
            boot.info().local_rank,
            count as usize,
        )?;
        let gpu = Loaded::get(ordinal, kernels::world_class(world), rank)?;
        phases.mark("context");
        let pdl = Pdl::resolve(config.pdl, gpu.pdl_capable);
        let ctx = gpu.ctx.clone();
        ctx.bind_to_thread()
            .map_err(|e| cuda("binding the context", e))?;
        let stream = ctx.new_stream().map_err(|e| cuda("stream creation", e))?;
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        phases.mark("stream");

        let device = ctx.cu_device();
        let uuids = boot.all_gather(&device_uuid(device, rank)?)?;
        // Ranks that share a GPU (MPS) share its SMs: every block of every rank must be resident
        // at once (blocks wait for their peers), so the grid shrinks as more ranks share.
        let sharing = uuids
            .iter()
            .map(|a| uuids.iter().filter(|b| *b == a).count())
            .max()
            .unwrap_or(1);
        // Config::blocks / IPCREDUCE_BLOCKS: one CTA count for every SM path (tuning); else
        // the count follows the message size (plan::cuda_path), up to the cap.
        let fixed = config.blocks;
        if fixed.is_some_and(|b| b == 0 || b > MAX_BLOCKS) {
            return Err(Error::Config(format!(
                "blocks {} (Config::blocks or IPCREDUCE_BLOCKS): 1 to {MAX_BLOCKS}",
                fixed.unwrap_or(0)
            )));
        }
        // What every rank's grid can count on being resident (the smallest room of any rank).
        let room = residency::agree(
            boot,
            residency::measure(&gpu.loaded_functions(), device, sharing, rank)?,
        )?;
        phases.mark("device exchange");
        let residency::Caps { cap, deep_cap } =
            residency::caps(&room, fixed, DEFAULT_CTA_CAP, MAX_BLOCKS)
                .map_err(|why| Error::invalid(rank, "init", why))?;
        let slot_bytes = config.workspace_bytes.map_or(DEFAULT_SLOT_BYTES, |b| b / 2);
        let slot_bytes = (slot_bytes.max(64 << 10) / 256) * 256;
        // Messages up to this size take the low-latency one-shot (0 disables it).
        // NVLink peer memory assumed here; on another fabric the default is set below.
        let ll_max = config.ll_max_bytes(world, Fabric::Peer);
        if ll_max > LL_MAX_BYTES {
            return Err(Error::Config(format!(
                "low-latency limit {ll_max} bytes (Config::ll_max_bytes or IPCREDUCE_LL_MAX): \
                 at most {LL_MAX_BYTES}"
            )));
        }
        // The copy-engine path is written for two ranks.
        let ce_min = match world {
            2 => config
                .ce_min_bytes
                .unwrap_or(crate::plan::CE_DEFAULT_MIN_BYTES),
            _ => 0,
        };
        let deep = match config.reg_loads.unwrap_or(crate::plan::REG_LOADS_DEFAULT) {
            8 => false,
            16 => true,
            n => {
                return Err(Error::Config(format!(
                "zero-copy loads in flight {n} (Config::reg_loads or IPCREDUCE_REG_LOADS): 8 or 16"
            )))
            }
        };
        // Validated by Config: 8 or 12.
        let ll12 = config.ll_data_bytes == Some(12);
        let mut limits = GridLimits {
            ll_max,
            cap,
            fixed,
            ce_min,
            // Set with the fabric, below.
            ce_staged_min: 0,
            deep,
            deep_cap,
            ll12,
            staged: crate::plan::StagedKnobs {
                chunk: config.staged_chunk_bytes,
                ctas: config.staged_ctas,
                round: config.staged_round.map(|r| r as u32),
            },
        };
        // Every rank must compute the same grid for every call and use the same slot size: the
        // protocol pairs block b with block b and alternates slots by chunk count.
        let mine = [
            cap as u64,
            fixed.unwrap_or(0) as u64,
            slot_bytes as u64,
            ll_max as u64,
            ce_min as u64,
            deep as u64,
            ll12 as u64,
            config.staged_chunk_bytes.map_or(0, |c| c as u64 + 1),
            config.staged_ctas.map_or(0, |c| c as u64 + 1),
            config.staged_round.map_or(0, |r| r as u64 + 1),
            config.ce_staged_min_bytes.map_or(0, |c| c as u64 + 1),
        ]
        .map(u64::to_le_bytes)
        .concat();
        let all = boot.all_gather(&mine)?;
        if let Some(peer) = all.iter().position(|v| v != &mine) {
            return Err(Error::Mismatch {
                rank,
                peer,
                op: "init".into(),
                seq: 0,
                detail: "IPCREDUCE_BLOCKS / IPCREDUCE_SLOT_BYTES / IPCREDUCE_LL_MAX / IPCREDUCE_CE_MIN / IPCREDUCE_CE_STAGED_MIN / IPCREDUCE_REG_LOADS / IPCREDUCE_LL_DATA / IPCREDUCE_STAGED_* (or the GPU sharing) differ between ranks"
                    .into(),
            });
        }

        // Also checks every pair (P2P query, mapping, cross-process read) for the transport.
        let bytes = data_offset(world) as usize + 2 * slot_bytes;
        let ws = SharedWorkspaces::open(boot, device, bytes, &uuids, config)?;
        phases.mark("workspaces");
        if ws.size < bytes {
            return Err(Error::Cuda {
                rank,
                op: "workspace creation".into(),
                detail: format!("got {} bytes, need {bytes}", ws.size),
            });
        }
        // The PCIe policy (or none) from the transport, IPCREDUCE_TOPOLOGY and the pairs.
        let fabric = topology::agree(
            boot,
            device,
            &uuids,
            ws.sharing().is_none(),
            config.topology,
        )?;
        // Every rank takes the same fabric, so every rank adjusts the same way.
        limits.ll_max = config.ll_max_bytes(world, fabric);
        config.check_ll_data(fabric)?;
        // The host-staged copy-engine path is written for two ranks.
        if fabric == Fabric::HostStaged && world == 2 {
            limits.ce_staged_min = config
                .ce_staged_min_bytes
                .unwrap_or(crate::plan::CE_STAGED_DEFAULT_MIN_BYTES);
        }
        if fabric == Fabric::PciePeer && fixed.is_none() {
            limits.cap = limits.cap.min(crate::plan::PCIE_CTA_CAP);
            limits.deep_cap = limits.deep_cap.min(limits.cap);
        }
        let state = DeviceAlloc::new(MAX_BLOCKS * 2 * 4 + 64, rank)?;
        let words = Arc::new(MappedHostWords::new(W_ERR + kernels::rec::WORDS, rank)?);
        ws.clear(rank, data_offset(world) as usize)?;
        // SAFETY: zeroing memory we own (private state) that no kernel uses yet.
        unsafe {
            driver::zero(state.ptr, state.bytes, rank, || {
                "clearing the protocol state".into()
            })?
        };
        driver::ctx_synchronize(rank, || "cuCtxSynchronize".into())?;
        phases.mark("fabric and state");
        let abort = boot.abort_state();
        let weak: Weak<MappedHostWords> = Arc::downgrade(&words);
        abort.on_abort(Box::new(move || {
            if let Some(w) = weak.upgrade() {
                w.set(W_ABORT, 1);
            }
        }));

        let devices: Vec<String> = {
            // The transport and policy, so results say how they were made.
            let via = match fabric {
                Fabric::PciePeer => ", PCIe policy",
                _ => ws.note(),
            };
            let names = boot.all_gather(format!("{name} (GPU {ordinal}{via})").as_bytes())?;
            names
                .iter()
                .map(|n| String::from_utf8_lossy(n).into_owned())
                .collect()
        };

        let own = stream.cu_stream() as streams::Key;
        let mut bases = [0u64; MAX_RANKS];
        for (r, b) in bases.iter_mut().enumerate().take(world) {
            *b = ws.base(r);
        }
        let agreed = Agreed {
            limits,
            fabric,
            peer_memory: ws.sharing().is_some(),
            slot_bytes,
            timeout: config.timeout(),
            pdl,
            // Not where ranks share a GPU (unless forced): see let_next_kernel_launch.
            let_next_launch: pdl.trigger(config.pdl_trigger, sharing),
            fused_forced,
        };
        let calls = CallLedger::new(rank, abort.clone(), boot.notices());
        // With tracing, the kernels stamp their phases (the traced variants, phase_ring.rs). A
        // ring that cannot be made costs the trace its stamps, not the job its communicator.
        let ring = if crate::flight::stamps::wanted() {
            super::phase_ring::PhaseRing::new(&gpu.ctx, gpu.target(), rank)
                .map_err(|e| tracing::warn!(rank, "phase stamps off: {e}"))
                .ok()
        } else {
            None
        };
        let mut launch = Launcher::new(
            (rank, world),
            gpu,
            bases,
            (words, state),
            (abort, calls),
            agreed,
        );
        launch.phases = ring;
        let mut comm = CudaComm {
            inter: None,
            rank,
            world,
            ordinal,
            device,
            registry: ManuallyDrop::new(Registry::default()),
            pointers: pointers::PointerCache::default(),
            ce: ce::Engine::new(ctx.clone()),
            next_region: 0,
            ctx,
            stream,
            streams: streams::Tracker::new(own),
            events: streams::CudaEvents::new(rank),
            captures: Default::default(),
            ws: ManuallyDrop::new(ws),
            launch,
            prepared: None,
            leak: teardown::Leak::Nothing,
            left: false,
            nccl: Err("not requested".into()),
            #[cfg(feature = "test-support")]
            bufs: Vec::new(),
            devices,
        };
        if comm.launch.limits.ce_staged_min > 0 {
            // Its chunks are at most a slot (plan::ce_staged_chunk_bytes).
            comm.ce.prepare_staged(rank, slot_bytes)?;
        }
        phases.mark("names");
        // Every rank's signal area is cleared before any kernel writes into it.
        boot.barrier()?;
        phases.mark("barrier");

        let shared_gpu = (0..world).any(|i| (0..i).any(|j| uuids[i] == uuids[j]));
        if config.with_nccl {
            comm.nccl = if shared_gpu && !config.nccl_shared_gpu() {
                // Keep the exchange inside Nccl::init out of it: no rank calls it.
                Err("NCCL refuses two ranks on one GPU (set IPCREDUCE_NCCL_SHARED_GPU=1 to run it over loopback sockets)".into())
            } else {
                nccl::Nccl::init(boot, shared_gpu).map_err(|e| e.to_string())
            };
            phases.mark("nccl");
        }
        phases.log(rank);
        tracing::debug!(
            rank,
            "programmatic dependent launch: {:?}, LL kernels let the next launch early: {}",
            comm.launch.pdl,
            comm.launch.let_next_launch
        );
        Ok(comm)
    }

    /// Collective over the job: the node's group, the communicator over it, then NCCL between
    /// the nodes (see hier.rs). `boot` is the job's bootstrap.
    pub fn new_across_nodes(boot: &mut Bootstrap, config: &Config) -> Result<CudaComm> {
        let mut group = boot.node_group()?;
        // NCCL beside ours (the baseline) spans the job, not the node: built below.
        let node_config = Config {
            with_nccl: false,
            ..config.clone()
        };
        let mut comm = CudaComm::new(&mut group, &node_config)?;
        let inter = hier::Inter::new(boot, group)?;
        if config.with_nccl {
            comm.nccl = nccl::Nccl::init(boot, config.nccl_shared_gpu()).map_err(|e| e.to_string());
        }
        comm.inter = Some(inter);
        Ok(comm)
    }
}

/// The device of the CUDA context current on this thread, if there is one: a caller that
/// made its own context current (PyTorch does) gets its communicator on that GPU.
fn current_device(rank: usize) -> Result<Option<usize>> {
    let Some(dev) = driver::current_context_device(rank)? else {
        return Ok(None);
    };
    let count = cs::CudaContext::device_count().unwrap_or(0);
    Ok((0..count)
        .find(|&ordinal| driver::device_of_ordinal(ordinal) == Some(dev))
        .map(|ordinal| ordinal as usize))
}
