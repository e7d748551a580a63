//! How a communicator is built: every knob in one struct, and the `IPCREDUCE_*` environment
//! variables parsed here and nowhere else.
//!
//! Precedence, for every knob: a value set in the [`Config`] by the program, else the
//! environment variable, else the built-in default. A variable that is set but cannot be
//! parsed is an error naming the variable, never ignored. This module imports no backend:
//! the backends and the communicator read it, it reads none of them.

use crate::error::{Error, Result};
pub use crate::plan::Topology;
use crate::types::{Algorithm, BackendChoice};
use std::time::Duration;

/// Default bound on every wait.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
/// Default size of the host backend's zero-copy heap in each rank's arena (virtual: pages are
/// only allocated when buffers touch them).
pub const DEFAULT_HOST_HEAP_BYTES: usize = 64 << 20;

/// How the cuda backend shares its workspaces between processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sharing {
    /// `cuMemCreate` + a POSIX fd passed over the bootstrap socket.
    Vmm,
    /// `cuIpcGetMemHandle` / `cuIpcOpenMemHandle` on `cuMemAlloc` memory.
    Ipc,
}

impl Sharing {
    pub fn name(self) -> &'static str {
        match self {
            Sharing::Vmm => "vmm",
            Sharing::Ipc => "ipc",
        }
    }
}

/// How the cuda backend's kernels reach the other ranks' workspaces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// Peer memory: workspaces on the GPUs, mapped across processes (NVLink or PCIe P2P).
    Peer,
    /// Every workspace in host memory, registered with every GPU: no peer access needed.
    Host,
}

impl Transport {
    pub fn name(self) -> &'static str {
        match self {
            Transport::Peer => "peer",
            Transport::Host => "host",
        }
    }
}

/// When the cuda backend launches its kernels with programmatic dependent launch (compute
/// capability 9.0 and up; `IPCREDUCE_PDL`): the kernel may then start while the kernel before
/// it on the stream finishes, and waits on the device for its results.
///
/// Measured on one H200 (two ranks under MPS, bf16): in CUDA graphs, up to 1 KiB, 0.15-0.2 us
/// slower after a kernel that does not let its successor launch early, and 1.3-1.5x faster
/// (about 2.0 against 2.8 us) after one that does (`griddepcontrol.launch_dependents`, as
/// PDL-aware GEMM and attention kernels do); eager calls about even up to 16 KiB and 1.1-1.3x
/// faster from 32 KiB to 1 MiB. Hence the default: eager calls only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pdl {
    /// Never (`0`, `off`).
    Off,
    /// Calls outside stream capture (`eager`, the default).
    Eager,
    /// Every call, in CUDA graphs too (`1`, `on`): for graphs whose kernels before the
    /// all-reduce let it launch early.
    Always,
}

impl Pdl {
    /// The mode a communicator runs: `Off` where the GPU lacks PDL (`capable` false), else the
    /// configured one, else `Eager`.
    pub fn resolve(configured: Option<Pdl>, capable: bool) -> Pdl {
        match configured {
            _ if !capable => Pdl::Off,
            Some(p) => p,
            None => Pdl::Eager,
        }
    }

    /// Whether a call is launched with PDL, `capturing` saying if its stream is being captured.
    pub fn for_call(self, capturing: bool) -> bool {
        match self {
            Pdl::Off => false,
            Pdl::Eager => !capturing,
            Pdl::Always => true,
        }
    }

    /// Whether the LL kernels let the next kernel launch at once (`Config::pdl_trigger`): as
    /// configured, else where no GPU is shared (`ranks_per_gpu` the most ranks on one GPU);
    /// never with PDL off.
    pub fn trigger(self, configured: Option<bool>, ranks_per_gpu: usize) -> bool {
        self != Pdl::Off && configured.unwrap_or(ranks_per_gpu == 1)
    }
}

/// Everything that shapes a communicator. `None` means "not set here": the environment
/// variable named on the field decides, else the default. Every rank of a job must end up
/// with the same values for the knobs marked *(same on every rank)*; init checks it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Config {
    /// Data plane: cuda, host, or auto (cuda when every rank can use a GPU).
    pub backend: BackendChoice,
    /// Bound on every wait, bootstrap and collectives. `IPCREDUCE_TIMEOUT_MS`; 30 s.
    pub timeout: Option<Duration>,
    /// Algorithm for calls that ask for `Auto`. `IPCREDUCE_ALGO` (oneshot, twoshot, nccl).
    pub algo: Option<Algorithm>,
    /// Bytes of shared data area per rank: two slots; larger messages are chunked
    /// *(same on every rank)*. `IPCREDUCE_SLOT_BYTES` (one slot); cuda 2 x 16 MiB, host
    /// 2 x 4 MiB.
    pub workspace_bytes: Option<usize>,
    /// cuda: blocks of every kernel, fixed per communicator *(same on every rank)*.
    /// `IPCREDUCE_BLOCKS`; 32, fewer when ranks share a GPU.
    pub blocks: Option<usize>,
    /// cuda: largest message for the low-latency one-shot, 0 = off *(same on every rank)*.
    /// `IPCREDUCE_LL_MAX`; by world size and fabric ([`crate::plan::ll_default_max_bytes`]:
    /// 1 MiB at two ranks over NVLink), at most 1 MiB.
    pub ll_max_bytes: Option<usize>,
    /// cuda: data bytes per 16-byte line of the low-latency one-shot, 8 (`oneshot-ll`) or 12
    /// (`oneshot-ll12`) *(same on every rank)*. `IPCREDUCE_LL_DATA`; 8.
    pub ll_data_bytes: Option<usize>,
    /// cuda: 16-byte packs in flight per thread in the zero-copy kernels, 8 or 16 *(same on
    /// every rank)*. `IPCREDUCE_REG_LOADS`; 16.
    pub reg_loads: Option<usize>,
    /// cuda: largest registered (zero-copy) message `Auto` runs one-shot; two-shot beyond
    /// *(same on every rank)*. `IPCREDUCE_REG_ONESHOT_MAX`; by world size
    /// ([`crate::plan::reg_oneshot_max_bytes`]: 4 MiB at two ranks).
    pub reg_oneshot_max_bytes: Option<usize>,
    /// cuda, two ranks, registered buffers, out of place: messages from this size on take the
    /// copy-engine path, 0 = never *(same on every rank)*. `IPCREDUCE_CE_MIN`; 0 (until measured).
    pub ce_min_bytes: Option<usize>,
    /// cuda, two ranks, host-staged transport: messages from this size on go through host
    /// memory by the copy engines (each direction of the PCIe link carried by DMA, not by
    /// kernel loads and stores), 0 = never *(same on every rank)*. `IPCREDUCE_CE_STAGED_MIN`;
    /// 0 ([`crate::plan::CE_STAGED_DEFAULT_MIN_BYTES`] says why).
    pub ce_staged_min_bytes: Option<usize>,
    /// cuda, staged kernels (one-shot and two-shot without registered buffers): bytes per
    /// chunk *(same on every rank)*, rounded down to 256 bytes, at most a slot.
    /// `IPCREDUCE_STAGED_CHUNK`; by fabric and size ([`crate::plan::staged_chunk_bytes`]).
    pub staged_chunk_bytes: Option<usize>,
    /// cuda, staged kernels: CTAs, in place of the size rule and `IPCREDUCE_BLOCKS`, at most
    /// the agreed cap *(same on every rank)*. `IPCREDUCE_STAGED_CTAS`.
    pub staged_ctas: Option<usize>,
    /// cuda, staged kernels: 16-byte packs per thread per round when a copy into the
    /// workspace runs beside a read from it, 0 = one after the other, at most 255 *(same on
    /// every rank)*. `IPCREDUCE_STAGED_ROUND`; by fabric ([`crate::plan::staged_round`]).
    pub staged_round: Option<usize>,
    /// cuda: when kernels are launched with programmatic dependent launch ([`Pdl`]).
    /// `IPCREDUCE_PDL` (0/off, eager, 1/on, auto); eager calls only, where the GPU has it.
    pub pdl: Option<Pdl>,
    /// cuda: the low-latency kernels let the next kernel on their stream launch at once
    /// (`griddepcontrol.launch_dependents`), so a successor launched with programmatic
    /// dependent launch (the next call, see [`Pdl`], or a PDL-aware kernel of the caller's)
    /// starts while they run; it waits on the device for their results. `IPCREDUCE_PDL_TRIGGER`
    /// (1/0); on where the GPU has PDL, `IPCREDUCE_PDL` is not off and no two ranks share a GPU
    /// (there a successor resident early could keep a peer's kernel off the GPU: forcing it
    /// on is for tests with small grids).
    pub pdl_trigger: Option<bool>,
    /// cuda: how workspaces are shared. `IPCREDUCE_SHARE` (vmm, ipc, auto); auto tries VMM,
    /// then IPC.
    pub sharing: Option<Sharing>,
    /// cuda: peer memory or staged through host memory *(same on every rank)*.
    /// `IPCREDUCE_TRANSPORT` (peer, host, auto); auto takes peer memory when every pair passes
    /// its checks, else host staging.
    pub transport: Option<Transport>,
    /// cuda, tests of `auto`'s fallback: rank R reports that its P2P query for rank P failed.
    /// `IPCREDUCE_DENY_PEER=R:P`.
    pub deny_peer: Option<(usize, usize)>,
    /// cuda, peer transport: the links between GPUs *(same on every rank)*.
    /// `IPCREDUCE_TOPOLOGY` (pcie, nvlink, auto); auto classifies every pair of GPUs (PCIe
    /// when P2P works without native atomics) and takes the PCIe policy if any pair is PCIe.
    pub topology: Option<Topology>,
    /// host: bytes of the zero-copy heap in each arena *(same on every rank)*.
    /// `IPCREDUCE_HOST_HEAP_MB`; 64 MiB.
    pub host_heap_bytes: Option<usize>,
    /// cuda: the GPU ordinal. `IPCREDUCE_DEVICE`; else the device of the CUDA context current
    /// on the calling thread, else `local_rank % device count`.
    pub device: Option<usize>,
    /// cuda: build an NCCL communicator beside ours, for `Algorithm::Nccl`.
    pub with_nccl: bool,
    /// cuda: let NCCL run although ranks share a GPU (NCCL then needs each rank to look like
    /// its own host: `ipcreduce launch` sets `NCCL_HOSTID` per rank).
    /// `IPCREDUCE_NCCL_SHARED_GPU` (1/0); off.
    pub nccl_shared_gpu: Option<bool>,
}

/// The former name of [`Config`].
pub type Options = Config;

impl Config {
    /// Fills every knob not set here from the process environment, strictly.
    pub fn resolve(&self) -> Result<Config> {
        self.resolve_with(|k| std::env::var(k).ok())
    }

    /// [`Config::resolve`] over any variable source (tests pass a map). Every variable that
    /// is set is parsed, even for a knob the program set, so a typo never goes unnoticed.
    pub fn resolve_with(&self, env: impl Fn(&str) -> Option<String>) -> Result<Config> {
        let from_env = Self::from_vars(env)?;
        let c = Config {
            backend: self.backend,
            timeout: self.timeout.or(from_env.timeout),
            algo: self.algo.or(from_env.algo),
            workspace_bytes: self.workspace_bytes.or(from_env.workspace_bytes),
            blocks: self.blocks.or(from_env.blocks),
            ll_max_bytes: self.ll_max_bytes.or(from_env.ll_max_bytes),
            ll_data_bytes: self.ll_data_bytes.or(from_env.ll_data_bytes),
            reg_loads: self.reg_loads.or(from_env.reg_loads),
            reg_oneshot_max_bytes: self
                .reg_oneshot_max_bytes
                .or(from_env.reg_oneshot_max_bytes),
            ce_min_bytes: self.ce_min_bytes.or(from_env.ce_min_bytes),
            ce_staged_min_bytes: self.ce_staged_min_bytes.or(from_env.ce_staged_min_bytes),
            staged_chunk_bytes: self.staged_chunk_bytes.or(from_env.staged_chunk_bytes),
            staged_ctas: self.staged_ctas.or(from_env.staged_ctas),
            staged_round: self.staged_round.or(from_env.staged_round),
            pdl: self.pdl.or(from_env.pdl),
            pdl_trigger: self.pdl_trigger.or(from_env.pdl_trigger),
            sharing: self.sharing.or(from_env.sharing),
            transport: self.transport.or(from_env.transport),
            deny_peer: self.deny_peer.or(from_env.deny_peer),
            topology: self.topology.or(from_env.topology),
            host_heap_bytes: self.host_heap_bytes.or(from_env.host_heap_bytes),
            device: self.device.or(from_env.device),
            with_nccl: self.with_nccl,
            nccl_shared_gpu: self.nccl_shared_gpu.or(from_env.nccl_shared_gpu),
        };
        c.validate()?;
        Ok(c)
    }

    /// The knobs the environment sets (the others `None`).
    fn from_vars(env: impl Fn(&str) -> Option<String>) -> Result<Config> {
        // Set and non-empty: an empty variable counts as unset, as in a shell's `X= cmd`.
        let var = |k: &str| env(k).filter(|v| !v.trim().is_empty());
        let int =
            |k: &str| -> Result<Option<usize>> { var(k).map(|v| parse_int(k, &v)).transpose() };
        let times = |k: &str, unit: usize| -> Result<Option<usize>> {
            int(k)?
                .map(|n| {
                    n.checked_mul(unit)
                        .ok_or_else(|| Error::Config(format!("{k}={n}: too large")))
                })
                .transpose()
        };
        let algo = var("IPCREDUCE_ALGO")
            .map(|v| {
                v.trim()
                    .parse()
                    .map_err(|e| Error::Config(format!("IPCREDUCE_ALGO={v}: {e}")))
            })
            .transpose()?;
        // Enumerated variables: one of the words, "auto" (the default's word) meaning unset.
        use Topology::{Nvlink, Pcie};
        use Transport::{Host, Peer};
        let sharing = choice(
            &var,
            "IPCREDUCE_SHARE",
            &[("vmm", Sharing::Vmm), ("ipc", Sharing::Ipc)],
        )?;
        let transport = choice(
            &var,
            "IPCREDUCE_TRANSPORT",
            &[("peer", Peer), ("host", Host)],
        )?;
        let topology = choice(
            &var,
            "IPCREDUCE_TOPOLOGY",
            &[("pcie", Pcie), ("nvlink", Nvlink)],
        )?;
        let deny_peer = var("IPCREDUCE_DENY_PEER")
            .map(|v| {
                let bad = || Error::Config(format!("IPCREDUCE_DENY_PEER={v}: expected RANK:PEER"));
                let (r, p) = v.trim().split_once(':').ok_or_else(bad)?;
                match (r.parse::<usize>(), p.parse::<usize>()) {
                    (Ok(r), Ok(p)) if r != p => Ok((r, p)),
                    _ => Err(bad()),
                }
            })
            .transpose()?;
        let pdl = choice(
            &var,
            "IPCREDUCE_PDL",
            &[
                ("0", Pdl::Off),
                ("off", Pdl::Off),
                ("eager", Pdl::Eager),
                ("1", Pdl::Always),
                ("on", Pdl::Always),
            ],
        )?;
        let pdl_trigger = var("IPCREDUCE_PDL_TRIGGER")
            .map(|v| parse_bool("IPCREDUCE_PDL_TRIGGER", &v))
            .transpose()?;
        let nccl_shared_gpu = var("IPCREDUCE_NCCL_SHARED_GPU")
            .map(|v| parse_bool("IPCREDUCE_NCCL_SHARED_GPU", &v))
            .transpose()?;
        Ok(Config {
            backend: BackendChoice::Auto,
            timeout: int("IPCREDUCE_TIMEOUT_MS")?.map(|ms| Duration::from_millis(ms as u64)),
            algo,
            workspace_bytes: times("IPCREDUCE_SLOT_BYTES", 2)?,
            blocks: int("IPCREDUCE_BLOCKS")?,
            ll_max_bytes: int("IPCREDUCE_LL_MAX")?,
            ll_data_bytes: int("IPCREDUCE_LL_DATA")?,
            reg_loads: int("IPCREDUCE_REG_LOADS")?,
            reg_oneshot_max_bytes: int("IPCREDUCE_REG_ONESHOT_MAX")?,
            ce_min_bytes: int("IPCREDUCE_CE_MIN")?,
            ce_staged_min_bytes: int("IPCREDUCE_CE_STAGED_MIN")?,
            staged_chunk_bytes: int("IPCREDUCE_STAGED_CHUNK")?,
            staged_ctas: int("IPCREDUCE_STAGED_CTAS")?,
            staged_round: int("IPCREDUCE_STAGED_ROUND")?,
            pdl,
            pdl_trigger,
            sharing,
            transport,
            deny_peer,
            topology,
            host_heap_bytes: times("IPCREDUCE_HOST_HEAP_MB", 1 << 20)?,
            device: int("IPCREDUCE_DEVICE")?,
            with_nccl: false,
            nccl_shared_gpu,
        })
    }

    /// Values no backend can use, whether they came from the program or the environment.
    fn validate(&self) -> Result<()> {
        let bad = |what: &str, why: &str| Err(Error::Config(format!("{what}: {why}")));
        if self.timeout == Some(Duration::ZERO) {
            return bad("timeout (IPCREDUCE_TIMEOUT_MS)", "must be above 0");
        }
        if self.blocks == Some(0) {
            return bad("blocks (IPCREDUCE_BLOCKS)", "must be at least 1");
        }
        if self.workspace_bytes == Some(0) {
            return bad("workspace_bytes (IPCREDUCE_SLOT_BYTES)", "must be above 0");
        }
        if self.staged_chunk_bytes.is_some_and(|n| n < 256) {
            return bad(
                "staged_chunk_bytes (IPCREDUCE_STAGED_CHUNK)",
                "must be at least 256",
            );
        }
        if self.staged_ctas.is_some_and(|n| n == 0) {
            return bad("staged_ctas (IPCREDUCE_STAGED_CTAS)", "must be at least 1");
        }
        if self.staged_round.is_some_and(|n| n > 255) {
            return bad("staged_round (IPCREDUCE_STAGED_ROUND)", "must be 0 to 255");
        }
        if self.ll_data_bytes.is_some_and(|n| n != 8 && n != 12) {
            return bad("ll_data_bytes (IPCREDUCE_LL_DATA)", "must be 8 or 12");
        }
        if self.reg_loads.is_some_and(|n| n != 8 && n != 16) {
            return bad("reg_loads (IPCREDUCE_REG_LOADS)", "must be 8 or 16");
        }
        Ok(())
    }

    /// cuda: refuses LL12 lines (`IPCREDUCE_LL_DATA=12`) on a fabric that does not make a
    /// 16-byte store arrive whole. LL12 validates a line by its last 4 bytes only, so it relies
    /// on 16-byte single-copy atomicity, which NVLink peer memory gives in practice but PTX does
    /// not promise, and PCIe (peer or to host memory) may split into smaller writes: a reader
    /// could take the flag of this call with data of an earlier one.
    pub fn check_ll_data(&self, fabric: crate::plan::Fabric) -> Result<()> {
        use crate::plan::Fabric;
        match (self.ll_data_bytes, fabric) {
            (Some(12), Fabric::PciePeer | Fabric::HostStaged) => Err(Error::Config(format!(
                "ll_data_bytes 12 (IPCREDUCE_LL_DATA=12) needs NVLink peer memory, and this \
                 communicator's fabric is {}: LL12 lines rely on 16-byte stores arriving whole; \
                 leave IPCREDUCE_LL_DATA unset (8) here",
                fabric.describe()
            ))),
            _ => Ok(()),
        }
    }

    /// The bound on every wait.
    pub fn timeout(&self) -> Duration {
        self.timeout.unwrap_or(DEFAULT_TIMEOUT)
    }

    /// cuda: largest message for the low-latency one-shot at `world` ranks on `fabric`.
    pub fn ll_max_bytes(&self, world: usize, fabric: crate::plan::Fabric) -> usize {
        self.ll_max_bytes
            .unwrap_or_else(|| crate::plan::ll_default_max_bytes(world, fabric))
    }

    /// host: zero-copy heap bytes per arena.
    pub fn host_heap_bytes(&self) -> usize {
        self.host_heap_bytes.unwrap_or(DEFAULT_HOST_HEAP_BYTES)
    }

    /// Whether NCCL may run with ranks sharing a GPU.
    pub fn nccl_shared_gpu(&self) -> bool {
        self.nccl_shared_gpu.unwrap_or(false)
    }

    /// cuda: the GPU to use out of `count`: the configured one, else the device of the
    /// calling thread's current CUDA context (`current`), else `local_rank % count`.
    pub fn pick_device(
        &self,
        current: Option<usize>,
        local_rank: usize,
        count: usize,
    ) -> Result<usize> {
        if count == 0 {
            return Err(Error::CudaUnavailable("no CUDA device visible".into()));
        }
        match self.device.or(current) {
            Some(d) if d >= count => Err(Error::Config(format!(
                "device {d} (Config::device, IPCREDUCE_DEVICE or the current CUDA context) \
                 does not exist: {count} visible"
            ))),
            Some(d) => Ok(d),
            None => Ok(local_rank % count),
        }
    }
}

fn parse_int<T: std::str::FromStr>(name: &str, v: &str) -> Result<T> {
    v.trim()
        .parse()
        .map_err(|_| Error::Config(format!("{name}={v}: expected a non-negative integer")))
}

/// Variable `name` (from `var`): one of `table`'s words, in any case; "auto" and unset are
/// None; anything else is an error listing the words.
fn choice<T: Copy>(
    var: &dyn Fn(&str) -> Option<String>,
    name: &str,
    table: &[(&str, T)],
) -> Result<Option<T>> {
    let Some(v) = var(name) else { return Ok(None) };
    let word = v.trim().to_ascii_lowercase();
    if word == "auto" {
        return Ok(None);
    }
    if let Some((_, value)) = table.iter().find(|(w, _)| *w == word) {
        return Ok(Some(*value));
    }
    let words: Vec<&str> = table.iter().map(|(w, _)| *w).collect();
    Err(Error::Config(format!(
        "{name}={v}: expected {} or auto",
        words.join(", ")
    )))
}

fn parse_bool(name: &str, v: &str) -> Result<bool> {
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(Error::Config(format!("{name}={v}: expected 1 or 0"))),
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn ll12_lines_only_on_nvlink_peer_memory() {
        use crate::plan::Fabric;
        let ll12 = Config {
            ll_data_bytes: Some(12),
            ..Config::default()
        };
        ll12.check_ll_data(Fabric::Peer).unwrap();
        for fabric in [Fabric::PciePeer, Fabric::HostStaged] {
            let err = ll12.check_ll_data(fabric).unwrap_err();
            assert!(matches!(err, Error::Config(_)), "{err:?}");
            let text = err.to_string();
            assert!(
                text.contains("IPCREDUCE_LL_DATA") && text.contains(&fabric.describe()),
                "{text}"
            );
        }
        for bytes in [None, Some(8)] {
            let c = Config {
                ll_data_bytes: bytes,
                ..Config::default()
            };
            for fabric in [Fabric::Peer, Fabric::PciePeer, Fabric::HostStaged] {
                c.check_ll_data(fabric).unwrap();
            }
        }
    }
    use super::*;
    use std::collections::HashMap;

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        let map: HashMap<&str, &str> = pairs.iter().copied().collect();
        move |k| map.get(k).map(|v| v.to_string())
    }

    fn config_error(pairs: &[(&str, &str)]) -> String {
        match Config::default().resolve_with(env(pairs)) {
            Err(Error::Config(msg)) => msg,
            other => panic!("{pairs:?}: expected a configuration error, got {other:?}"),
        }
    }

    use crate::plan::Fabric;

    #[test]
    fn every_variable_is_read() {
        let c = Config::default()
            .resolve_with(env(&[
                ("IPCREDUCE_TIMEOUT_MS", "1500"),
                ("IPCREDUCE_ALGO", "two-shot"),
                ("IPCREDUCE_SLOT_BYTES", "1048576"),
                ("IPCREDUCE_BLOCKS", "16"),
                ("IPCREDUCE_LL_MAX", "0"),
                ("IPCREDUCE_SHARE", "ipc"),
                ("IPCREDUCE_HOST_HEAP_MB", "8"),
                ("IPCREDUCE_DEVICE", "3"),
                ("IPCREDUCE_NCCL_SHARED_GPU", "1"),
                ("IPCREDUCE_TRANSPORT", "host"),
                ("IPCREDUCE_DENY_PEER", "1:0"),
                ("IPCREDUCE_REG_LOADS", "8"),
                ("IPCREDUCE_REG_ONESHOT_MAX", "65536"),
                ("IPCREDUCE_LL_DATA", "12"),
                ("IPCREDUCE_TOPOLOGY", "PCIe"),
                ("IPCREDUCE_PDL", "0"),
                ("IPCREDUCE_PDL_TRIGGER", "1"),
                ("IPCREDUCE_STAGED_CHUNK", "1048576"),
                ("IPCREDUCE_STAGED_CTAS", "24"),
                ("IPCREDUCE_STAGED_ROUND", "0"),
            ]))
            .unwrap();
        assert_eq!(c.timeout(), Duration::from_millis(1500));
        assert_eq!(c.algo, Some(Algorithm::TwoShot));
        assert_eq!(c.workspace_bytes, Some(2 << 20));
        assert_eq!(c.blocks, Some(16));
        assert_eq!(c.ll_max_bytes(2, Fabric::Peer), 0);
        assert_eq!(c.reg_loads, Some(8));
        assert_eq!(c.ll_data_bytes, Some(12));
        assert_eq!(c.reg_oneshot_max_bytes, Some(65536));
        assert_eq!(c.sharing, Some(Sharing::Ipc));
        assert_eq!(c.host_heap_bytes(), 8 << 20);
        assert_eq!(c.device, Some(3));
        assert!(c.nccl_shared_gpu());
        assert_eq!(c.transport, Some(Transport::Host));
        assert_eq!(c.deny_peer, Some((1, 0)));
        assert_eq!(c.topology, Some(Topology::Pcie));
        assert_eq!(c.pdl, Some(Pdl::Off));
        assert_eq!(c.pdl_trigger, Some(true));
        assert_eq!(c.staged_chunk_bytes, Some(1 << 20));
        assert_eq!(c.staged_ctas, Some(24));
        assert_eq!(c.staged_round, Some(0));
        for (v, want) in [
            ("on", Pdl::Always),
            ("1", Pdl::Always),
            ("eager", Pdl::Eager),
        ] {
            let c = Config::default()
                .resolve_with(env(&[("IPCREDUCE_PDL", v)]))
                .unwrap();
            assert_eq!(c.pdl, Some(want), "{v}");
        }
    }

    #[test]
    fn pdl_modes_launches_and_trigger() {
        // No PDL on the GPU: off, whatever was asked.
        assert_eq!(Pdl::resolve(Some(Pdl::Always), false), Pdl::Off);
        assert_eq!(Pdl::resolve(None, true), Pdl::Eager);
        assert_eq!(Pdl::resolve(Some(Pdl::Off), true), Pdl::Off);
        // Eager: outside capture only; Always: captured calls too.
        assert!(Pdl::Eager.for_call(false) && !Pdl::Eager.for_call(true));
        assert!(Pdl::Always.for_call(false) && Pdl::Always.for_call(true));
        assert!(!Pdl::Off.for_call(false) && !Pdl::Off.for_call(true));
        // The trigger: on by default where no GPU is shared; forced either way; never with
        // PDL off.
        assert!(Pdl::Eager.trigger(None, 1));
        assert!(!Pdl::Eager.trigger(None, 2));
        assert!(Pdl::Always.trigger(Some(true), 4));
        assert!(!Pdl::Always.trigger(Some(false), 1));
        assert!(!Pdl::Off.trigger(Some(true), 1));
    }

    #[test]
    fn defaults_without_variables() {
        let c = Config::default().resolve_with(env(&[])).unwrap();
        assert_eq!(c, Config::default());
        assert_eq!(c.timeout(), DEFAULT_TIMEOUT);
        assert_eq!(c.ll_max_bytes(2, Fabric::Peer), 1 << 20);
        assert_eq!(c.ll_max_bytes(8, Fabric::Peer), 64 << 10);
        assert_eq!(c.ll_max_bytes(2, Fabric::HostStaged), 16 << 10);
        assert_eq!(c.ll_max_bytes(2, Fabric::PciePeer), 64 << 10);
        assert_eq!(c.host_heap_bytes(), DEFAULT_HOST_HEAP_BYTES);
        assert!(!c.nccl_shared_gpu());
        // Empty counts as unset; "auto" sharing is no choice.
        let c = Config::default()
            .resolve_with(env(&[
                ("IPCREDUCE_TIMEOUT_MS", ""),
                ("IPCREDUCE_SHARE", "auto"),
                ("IPCREDUCE_TRANSPORT", "auto"),
                ("IPCREDUCE_TOPOLOGY", "auto"),
                ("IPCREDUCE_PDL", "auto"),
            ]))
            .unwrap();
        assert_eq!(c, Config::default());
    }

    #[test]
    fn bad_values_are_errors_naming_the_variable() {
        for (k, v) in [
            ("IPCREDUCE_TIMEOUT_MS", "30s"),
            ("IPCREDUCE_TIMEOUT_MS", "-1"),
            ("IPCREDUCE_TIMEOUT_MS", "0"),
            ("IPCREDUCE_ALGO", "ring"),
            ("IPCREDUCE_SLOT_BYTES", "16M"),
            ("IPCREDUCE_SLOT_BYTES", "0"),
            ("IPCREDUCE_BLOCKS", "0"),
            ("IPCREDUCE_BLOCKS", "many"),
            ("IPCREDUCE_LL_MAX", "1.5"),
            ("IPCREDUCE_REG_LOADS", "12"),
            ("IPCREDUCE_LL_DATA", "16"),
            ("IPCREDUCE_REG_ONESHOT_MAX", "4M"),
            ("IPCREDUCE_SHARE", "nvlink"),
            ("IPCREDUCE_HOST_HEAP_MB", "99999999999999999999"),
            ("IPCREDUCE_DEVICE", "gpu0"),
            ("IPCREDUCE_NCCL_SHARED_GPU", "maybe"),
            ("IPCREDUCE_TRANSPORT", "nvlink"),
            ("IPCREDUCE_TRANSPORT", "shm"),
            ("IPCREDUCE_DENY_PEER", "1"),
            ("IPCREDUCE_DENY_PEER", "1:1"),
            ("IPCREDUCE_DENY_PEER", "a:0"),
            ("IPCREDUCE_DENY_PEER", "1:0:2"),
            ("IPCREDUCE_TOPOLOGY", "pci"),
            ("IPCREDUCE_TOPOLOGY", "host"),
            ("IPCREDUCE_TOPOLOGY", "1"),
            ("IPCREDUCE_PDL", "graph"),
            ("IPCREDUCE_PDL", "yes"),
            ("IPCREDUCE_PDL_TRIGGER", "eager"),
            ("IPCREDUCE_STAGED_CHUNK", "255"),
            ("IPCREDUCE_STAGED_CHUNK", "4M"),
            ("IPCREDUCE_STAGED_CTAS", "0"),
            ("IPCREDUCE_STAGED_ROUND", "256"),
        ] {
            let msg = config_error(&[(k, v)]);
            assert!(msg.contains(k), "{k}={v}: {msg}");
        }
        // Enumerated variables list their words.
        assert_eq!(
            config_error(&[("IPCREDUCE_TOPOLOGY", "pci")]),
            "IPCREDUCE_TOPOLOGY=pci: expected pcie, nvlink or auto"
        );
        assert!(config_error(&[("IPCREDUCE_SHARE", "x")]).ends_with("expected vmm, ipc or auto"));
    }

    #[test]
    fn the_program_beats_the_environment_which_beats_the_default() {
        let vars = [
            ("IPCREDUCE_TIMEOUT_MS", "1000"),
            ("IPCREDUCE_BLOCKS", "8"),
            ("IPCREDUCE_SHARE", "ipc"),
        ];
        let set = Config {
            timeout: Some(Duration::from_millis(250)),
            blocks: Some(4),
            ..Config::default()
        };
        let c = set.resolve_with(env(&vars)).unwrap();
        assert_eq!(c.timeout(), Duration::from_millis(250));
        assert_eq!(c.blocks, Some(4));
        // Not set by the program: the environment decides.
        assert_eq!(c.sharing, Some(Sharing::Ipc));
        // A bad variable is an error even where the program set the knob.
        assert!(matches!(
            set.resolve_with(env(&[("IPCREDUCE_TIMEOUT_MS", "soon")])),
            Err(Error::Config(_))
        ));
        // Values set by the program are checked too.
        let zero = Config {
            blocks: Some(0),
            ..Config::default()
        };
        assert!(matches!(zero.resolve_with(env(&[])), Err(Error::Config(_))));
    }

    #[test]
    fn the_device_is_the_chosen_one_then_the_current_one_then_local_rank() {
        let none = Config::default();
        assert_eq!(none.pick_device(None, 5, 4).unwrap(), 1);
        assert_eq!(none.pick_device(Some(2), 5, 4).unwrap(), 2);
        let chosen = Config {
            device: Some(3),
            ..Config::default()
        };
        assert_eq!(chosen.pick_device(Some(2), 5, 4).unwrap(), 3);
        match chosen.pick_device(None, 0, 2) {
            Err(Error::Config(m)) => {
                assert!(m.contains("device 3") && m.contains("2 visible"), "{m}")
            }
            other => panic!("device 3 of 2: {other:?}"),
        }
        match none.pick_device(None, 0, 0) {
            Err(Error::CudaUnavailable(m)) => assert!(m.contains("no CUDA device"), "{m}"),
            other => panic!("no device: {other:?}"),
        }
    }
}
