//! Pure decisions, kept apart from any backend so they can be unit-tested without a GPU:
//! which algorithm `Auto` picks, and how a message is cut into chunks and shards.
//!
//! All thresholds live here. They are first guesses until tuned on real hardware; the
//! benchmark's JSON is the evidence for changing them.

pub use crate::shards::Span;
use crate::types::{Algorithm, BackendKind};

/// What the cuda backend assumes about the links between GPUs, when forced
/// (`IPCREDUCE_TOPOLOGY`); unset, it is classified from the P2P attributes of every pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Topology {
    /// PCIe between GPUs: peer-memory pushes in passes and fewer CTAs (the PCIe policy).
    Pcie,
    /// NVLink (or one GPU): no PCIe policy, whatever the classification says.
    Nvlink,
}

impl Topology {
    pub fn name(self) -> &'static str {
        match self {
            Topology::Pcie => "pcie",
            Topology::Nvlink => "nvlink",
        }
    }
}

/// What the cuda backend's data crosses, agreed by every rank at init ([`fabric`]). It shapes
/// `Auto`'s algorithm, the staged chunk size, the CTA cap and the kernels' push order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Fabric {
    /// Peer memory over NVLink, ranks sharing one GPU, or the host backend.
    #[default]
    Peer,
    /// Peer memory over PCIe P2P: the PCIe policy (pushes in passes, at most
    /// [`PCIE_CTA_CAP`] CTAs), where all-to-all pushes would collapse at the root complex.
    PciePeer,
    /// Every workspace in host memory (the host-staged transport): all traffic crosses each
    /// GPU's PCIe link to host memory and back.
    HostStaged,
}

impl Fabric {
    /// The path `auto` takes between two GPUs, in words (`ipcreduce topo`, device descriptions).
    pub fn describe(self) -> String {
        match self {
            Fabric::Peer => "peer memory".into(),
            Fabric::PciePeer => {
                format!("peer memory, PCIe policy (pushes in passes, at most {PCIE_CTA_CAP} CTAs)")
            }
            Fabric::HostStaged => "host-staged (through host memory)".into(),
        }
    }

    /// The kernels' `Args::mode` bits (kernels/prims.cuh, MODE_*).
    pub fn kernel_mode(self) -> u32 {
        match self {
            Fabric::PciePeer => MODE_PUSH_PASSES,
            _ => 0,
        }
    }
}

/// kernels/prims.cuh's MODE_PUSH_PASSES: in pass p rank r pushes only to rank (r+1+p) mod W.
pub const MODE_PUSH_PASSES: u32 = 1;

/// kernels/prims.cuh's MODE_LET_NEXT_LAUNCH: the LL kernels let the next kernel on their
/// stream launch at once (programmatic dependent launch).
pub const MODE_LET_NEXT_LAUNCH: u32 = 2;

/// kernels/prims.cuh's MODE_ROUND_SHIFT: bits 8-15 of the staged kernels' mode are the packs
/// per thread per round of their interleaved copy and read ([`staged_round`]).
pub const MODE_ROUND_SHIFT: u32 = 8;

/// The staged kernels' knobs, agreed by every rank at init (`None`: by the size rules).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StagedKnobs {
    /// `IPCREDUCE_STAGED_CHUNK`: bytes per chunk.
    pub chunk: Option<usize>,
    /// `IPCREDUCE_STAGED_CTAS`: CTAs of every staged call.
    pub ctas: Option<usize>,
    /// `IPCREDUCE_STAGED_ROUND`: packs per thread per round, 0 = no interleave.
    pub round: Option<u32>,
}

/// Packs per thread per round of the staged kernels' interleave (staged.cu): on the
/// host-staged transport a thread alternates between its copy into host memory (chunk k+1's
/// copy-in: writes up the GPU's PCIe link) and its reads from it (chunk k's reduce, two-shot's
/// gather: reads, whose data comes down the link) every `round` packs, so both directions carry
/// traffic at once. 4 (the copy's unroll: one unrolled step of each per round): measured (one
/// H200, two ranks under MPS, 2026-12-02, scripts/device/staged-sweep.sh) never more than 3%
/// slower than 0 and up to 20% faster (one-shot 64 MiB, 4 MiB chunks, 16 CTAs: 15.8 -> 19.1
/// GB/s busbw). On peer memory the copy-in is local HBM traffic with nothing to balance: 0,
/// the order measured there.
pub fn staged_round(fabric: Fabric, forced: Option<u32>) -> u32 {
    match (forced, fabric) {
        (Some(r), _) => r.min(255),
        (None, Fabric::HostStaged) => 4,
        (None, _) => 0,
    }
}

/// Most CTAs per kernel under the PCIe policy. PCIe Gen4/Gen5 x16 carries 25-55 GB/s per
/// direction: 16 CTAs of 512 threads with 4 16-byte loads in flight each (512 KiB) cover its
/// bandwidth-delay product at several microseconds of latency; more CTAs only add requests
/// that queue at the switch or root complex.
pub const PCIE_CTA_CAP: usize = 16;

/// The fabric every rank takes: host staging when the transport is host memory; else the
/// forced topology (`IPCREDUCE_TOPOLOGY`), else PCIe when any rank saw a pair of distinct GPUs
/// linked by PCIe (`any_pcie_pair`, see backend/cuda/topology.rs). The policy only concerns
/// pushes into peer GPUs, which the host-staged transport never makes.
pub fn fabric(host_staged: bool, forced: Option<Topology>, any_pcie_pair: bool) -> Fabric {
    match (host_staged, forced) {
        (true, _) => Fabric::HostStaged,
        (false, Some(Topology::Pcie)) => Fabric::PciePeer,
        (false, Some(Topology::Nvlink)) => Fabric::Peer,
        (false, None) if any_pcie_pair => Fabric::PciePeer,
        (false, None) => Fabric::Peer,
    }
}

/// Size limits under which `Auto` picks one-shot, per backend and world size.
/// One-shot moves (world-1) x bytes per rank but needs one barrier; two-shot moves
/// 2 (world-1)/world x bytes and needs two, so one-shot wins while latency dominates.
/// At two ranks both put the same bytes on each direction of the link (one-shot reads the
/// peer's whole input; two-shot reads half and writes half back), so one-shot, with fewer
/// barriers and no gather, wins at every size: measured on two H200s over NVLink
/// (2026-11-30, staged buffers: 18.7 against 26.4 us at 2 MB, 321 against 233 GB/s at 512 MB).
///
/// Host-staged (every workspace in host memory; B ~ 50-55 GB/s per direction of a Gen5 x16
/// link, and writes to and reads from host memory use opposite directions, so a pipelined
/// kernel takes max(written, read) / B). Per rank and message of N bytes:
/// - one-shot writes N (its input, for the peers) and reads (W-1) N (every peer's input);
/// - two-shot writes (W-1)/W N (the peers' shards) + (W-1)/W N (its reduced shard into each
///   peer's slot) and reads (W-1)/W N (its shard from the peers) + (W-1)/W N (the gather),
///   i.e. 2(W-1)/W N each way (pulling the gather instead of pushing it would write less,
///   N in all, but read the same: no better bound).
///
/// | W | one-shot bound | two-shot bound |
/// |---|---|---|
/// | 2 | N / B | N / B |
/// | 4 | 3 N / B | 1.5 N / B |
/// | 8 | 7 N / B | 1.75 N / B |
///
/// At two ranks the bounds are equal, and one-shot (one barrier per chunk instead of two) wins
/// up to 512 KiB, two-shot above: measured with two ranks under MPS, bf16, the same run, 5
/// rounds (one H100, 2026-12-07, bench/results/2026-12-07-h100-host-staged-auto): one-shot
/// 1.02-1.04x faster at 512 KiB, two-shot 1.05-1.06x faster at 2, 32 and 128 MiB and 1.02x at
/// 8 MiB; one H200 (2026-12-04): two-shot 1.06-1.07x at 1 MiB, within 2% from 4 MiB. Above
/// two, two-shot from where its extra barrier (a flag round trip through host memory, ~2-3 us)
/// costs less than the bytes saved: 1.5 N / B > 3 us at about 100 KB for W = 4, 5.25 N / B >
/// 3 us at about 30 KB for W = 8. Ranks sharing one GPU (MPS) share one link: the ratios hold.
pub fn oneshot_max_bytes(backend: BackendKind, fabric: Fabric, world: usize) -> usize {
    match (backend, fabric) {
        (BackendKind::Cuda, Fabric::HostStaged) => match world {
            0..=2 => 512 << 10,
            3..=4 => 64 << 10,
            _ => 32 << 10,
        },
        (BackendKind::Cuda, _) => match world {
            0..=2 => usize::MAX,
            3..=4 => 256 << 10,
            _ => 128 << 10,
        },
        (BackendKind::Host, _) => match world {
            0..=2 => HOST_ONESHOT_MAX[0],
            3..=4 => HOST_ONESHOT_MAX[1],
            _ => HOST_ONESHOT_MAX[2],
        },
    }
}

/// The host backend's default crossover, largest one-shot message at 2, 3-4 and 5+ ranks
/// (`ipcreduce tune --backend host` measures this machine's and `auto` then follows it).
///
/// Measured with `ipcreduce tune --backend host -b 4K -e 1M -f 2 -d f32` (2 MiB at two ranks;
/// back-to-back calls, median of 7 rounds of 10 ms, slowest rank) on the 2-core development
/// machine, quiet, 2026-12-04, three runs per world (raw: bench/results/2026-12-04-host-crossover/;
/// one-shot/two-shot time, median of the runs [range of the runs]):
/// - 2 ranks: 0.79-0.97 up to 128 KiB [0.79-0.99], 1.01 at 256 KiB [0.96-1.03], 1.10-1.13 at
///   512 KiB-1 MiB [1.09-1.15], 0.98 at 2 MiB: one-shot up to 256 KiB.
/// - 4 ranks: 0.73-0.90 up to 16 KiB [0.71-0.91], 1.07 at 32 KiB [1.06-1.08], 1.25-1.59 at
///   64-512 KiB: one-shot up to 16 KiB (every rank reduces every peer's whole buffer, and four
///   ranks share two cores).
/// - 8 ranks: 0.71-0.91 up to 16 KiB [0.70-0.99], 1.37 at 32 KiB [1.28-1.37], 1.26-1.91 at
///   64 KiB-1 MiB: one-shot up to 16 KiB.
///
/// (The earlier table, 512 KiB / 64 KiB / 128 KiB from single runs of 2026-12-02 taken while
/// the machine's load rose, had auto up to 1.9x slower than two-shot at 128 KiB and 8 ranks.)
pub const HOST_ONESHOT_MAX: [usize; 3] = [256 << 10, 16 << 10, 16 << 10];

/// Bytes per chunk of a staged call (one-shot and two-shot without registered buffers): at
/// most the slot size and, like it, a multiple of 256 bytes. Peer memory: the whole slot
/// (copy-in is local HBM traffic, nothing to overlap; as measured on NVLink). Host-staged: the
/// kernels overlap the copy-in of chunk k+1 (PCIe writes) with the reads of chunk k (PCIe
/// reads), so more chunks overlap more, but each costs every CTA a flag round trip through
/// host memory: about 16 chunks per message, between 1 and 4 MiB. Measured (one H200, two
/// ranks under MPS, bf16, 2026-12-02, scripts/device/staged-sweep.sh; busbw of the best CTA
/// count and interleave): 4 MiB 15.5 GB/s with 1 MiB chunks against 12.3 with one 4 MiB chunk;
/// 16 MiB 17.9 (1 MiB) against 17.0 (4 MiB); 64 MiB 19.1 (4 MiB) against 18.7 (1 MiB).
/// `forced` (`IPCREDUCE_STAGED_CHUNK`) takes the place of the rule, rounded down to 256 bytes
/// and at most the slot.
pub fn staged_chunk_bytes(
    fabric: Fabric,
    bytes: usize,
    slot_bytes: usize,
    forced: Option<usize>,
) -> usize {
    if let Some(c) = forced {
        return (c / 256 * 256).clamp(256, slot_bytes);
    }
    match fabric {
        Fabric::HostStaged => (bytes / 16)
            .next_multiple_of(64 << 10)
            .clamp(1 << 20, 4 << 20)
            .min(slot_bytes),
        _ => slot_bytes,
    }
}

/// Default largest message for the cuda backend's low-latency one-shot (data and flags pushed
/// together, no barrier, no staging copy, registered or not): beyond it the doubled traffic
/// costs more than the barriers it saves. Every rank pushes (world-1) x 2 x bytes, so the limit
/// falls with the world. DEFAULTS from the design: at two ranks 1 MiB of LL lines is 2 MiB per
/// direction, ~6 us at 370 GB/s, where the zero-copy one-shot's two system barriers and NCCL
/// took 10-14 us (two H200s, 2026-11-30); to be confirmed by scripts/device/bw-variants.sh.
/// Over PCIe peer memory (the PCIe policy) every LL byte crosses the link twice as a line: the
/// previous 64 KiB until that fabric is measured. Staged through host memory, 16 KiB at two
/// ranks: measured (one H200, two ranks under MPS, bf16, 2026-12-02), LL takes 11.5 us at
/// 8 KiB and 33 us at 32 KiB, where the staged kernels take 19-22 us from 8 B to 128 KiB
/// (one-shot 19.4 us at 128 KiB): the crossover lies near 16 KiB. Each rank pushes its lines to
/// every peer, so the limit falls with the world: 4 KiB at three and four ranks, 2 KiB above,
/// from these measurements at four and eight. Measured with the old 16 KiB at every world (one H100,
/// ranks under MPS, 2026-12-07, bench/results/2026-12-07-h100-host-staged-auto): at four ranks
/// LL took 15-19 us at 2 KiB but 46-52 us at 8 KiB, where two-shot took 40-48 us and the staged
/// one-shot 26-32 us at 32 KiB; at eight ranks 49-59 us at 2 KiB and 219-224 us at 8 KiB,
/// two-shot 63-77 us.
/// `IPCREDUCE_LL_MAX` overrides for every world and fabric (0 disables).
pub fn ll_default_max_bytes(world: usize, fabric: Fabric) -> usize {
    match (fabric, world) {
        (Fabric::Peer, 0..=2) => 1 << 20,
        (Fabric::Peer, 3..=4) => 256 << 10,
        (Fabric::Peer, _) => 64 << 10,
        (Fabric::PciePeer, _) => 64 << 10,
        (Fabric::HostStaged, 0..=2) => 16 << 10,
        (Fabric::HostStaged, 3..=4) => 4 << 10,
        (Fabric::HostStaged, _) => 2 << 10,
    }
}

/// Largest registered (zero-copy) message `Auto` sends through one-shot; larger ones take the
/// zero-copy two-shot. At two ranks both move the same bytes over each direction of the link,
/// but two-shot pulls only half of them by loads (round trips) and pushes the other half by
/// stores (posted): a stand-alone zero-copy two-shot reached 301 GB/s at 16 MB and 323-343 at
/// 256 MB-1 GiB where the one-shot ran at ~270 (two H200s, 2026-11-30). DEFAULTS between those
/// measurements; `IPCREDUCE_REG_ONESHOT_MAX` overrides for every world.
pub fn reg_oneshot_max_bytes(world: usize) -> usize {
    match world {
        0..=2 => 4 << 20,
        3..=4 => 256 << 10,
        _ => 128 << 10,
    }
}

/// Packs in flight per thread in the zero-copy kernels: 8 (the kernels compiled for two blocks
/// per SM) or 16 (their deep variants, one block per SM; 12 at three or four ranks, see
/// zerocopy.cu). `IPCREDUCE_REG_LOADS` overrides.
pub const REG_LOADS_DEFAULT: usize = 16;

/// Default smallest message for the cuda copy-engine path (two ranks, registered, out of
/// place): DEFAULT, off until the NVLink runs measure it against the zero-copy SM kernels (the
/// plain CE pipeline the design starts from reached 308 GB/s at 32 MB and 342 at 512 MB).
/// `IPCREDUCE_CE_MIN` overrides.
pub const CE_DEFAULT_MIN_BYTES: usize = 0;

/// Default smallest message for the host-staged copy-engine path (two ranks, host-staged
/// transport): off. Why the path exists: on one H200's PCIe Gen5 x16 link (2026-12-04,
/// scripts/device/pcie-link.sh) each direction carries 55 GB/s alone and 49 while the other
/// direction is busy when the copy engines move the bytes, but 37.6 when kernels' stores and
/// loads of mapped host memory do (16-132 CTAs alike); every all-reduce on this transport
/// moves its bytes both ways at once, so the staged kernels stop near 19 GB/s busbw, below the
/// copy engines' bound of 24.5. Why off: with the copies on the two barrier lanes (a barrier
/// between a lane's copies) it lost to the staged kernels up to 64 MiB and tied from 256 MiB
/// (two ranks under MPS, bf16, eager: 16 MiB 13.3 against 17.9 GB/s, 64 MiB 18.1 against
/// 19.1, 256 MiB 19.9 against 19.6; bench/results/2026-12-04-h200-mps-ce-staged/): each chunk
/// cost about 27 us of barriers in which its lane's direction idled. With copy streams of their
/// own (ce::launch_staged) it still loses up to 64 MiB and wins by 3 % at 256 MiB (one H100,
/// eager: 16 MiB 14.9 against 17.7, 64 MiB 17.5 against 19.1, 256 MiB 19.9 against 19.4;
/// bench/results/2026-12-07-h100-ce-staged-streams/). Two ranks' processes on one H100 move
/// 47.9 GB/s each way together by copy engines (a bound of 24.0 GB/s busbw) but 38.9 by
/// kernels (19.4, where the staged kernels already are), and the path reached 21.2 GB/s at
/// 256 MiB, one direction of the link idle at both ends of a call, which [`ce_staged_pieces`]
/// shortens (bench/results/2026-12-07-h100-69beacd-link-pair/). `IPCREDUCE_CE_STAGED_MIN`
/// turns it on from that size.
pub const CE_STAGED_DEFAULT_MIN_BYTES: usize = 0;

/// Bytes per chunk of the host-staged copy-engine path: each chunk's copy into host memory
/// runs beside an earlier chunk's copy out of it, and the first and last run alone, so
/// about 16 chunks per message, from 1 MiB (each chunk costs two barriers through host
/// memory) to the slot (the path cuts it further to a position of its staging area,
/// `ce::launch_staged`). `forced` (`IPCREDUCE_STAGED_CHUNK`) takes the place of the rule as
/// for the staged kernels.
pub fn ce_staged_chunk_bytes(bytes: usize, slot_bytes: usize, forced: Option<usize>) -> usize {
    if let Some(c) = forced {
        return (c / 256 * 256).clamp(256, slot_bytes);
    }
    (bytes / 16)
        .next_multiple_of(64 << 10)
        .max(1 << 20)
        .min(slot_bytes)
}

/// Smallest chunk of the host-staged copy-engine path's ramps ([`ce_staged_pieces`]): below
/// it a chunk's two barriers through host memory cost more than its copy saves.
pub const CE_STAGED_RAMP_MIN_BYTES: usize = 512 << 10;

/// The chunks of a host-staged copy-engine call of `count` elements of `elem` bytes, in
/// chunks of at most `chunk` elements: the first ones grow (an eighth, a quarter, a half of
/// `chunk`, those of at least [`CE_STAGED_RAMP_MIN_BYTES`]), the middle ones are as even as
/// the alignment allows, and the last ones shrink as the first grew. Why: the first chunk's
/// copy into host memory has nothing beside it in the other direction of the link, and the
/// last chunk's copy out of host memory neither, so each end leaves one direction idle for a
/// chunk's copy. At 256 MiB in 8 MiB chunks the first chunk was in both ranks' slots only
/// after 0.88 ms and the last copy out ended 0.58 ms after the last copy in, of a 12.2 ms
/// call (two ranks on one H100, traced, 2026-12-07). Messages too small for both ramps and
/// two full chunks keep even chunks of `chunk`. Every chunk starts at a multiple of 4096
/// bytes (the reduce's 16-byte packs stay aligned); only the last may end elsewhere.
pub fn ce_staged_pieces(count: usize, elem: usize, chunk: usize) -> Vec<Span> {
    let align = (4096 / elem.max(1)).max(1);
    let chunk = chunk.max(1);
    let ramp: Vec<usize> = [3u32, 2, 1]
        .iter()
        .map(|&s| (chunk >> s) / align * align)
        .filter(|&c| c * elem >= CE_STAGED_RAMP_MIN_BYTES)
        .collect();
    let ramp_total: usize = ramp.iter().sum();
    if ramp.is_empty() || count < 2 * ramp_total + 2 * chunk {
        // Even chunks; an empty call still has its one (empty) chunk.
        let even: Vec<Span> = chunks(count, chunk).collect();
        return if even.is_empty() {
            vec![Span { start: 0, end: 0 }]
        } else {
            even
        };
    }
    let rest = count - 2 * ramp_total;
    // The middle stays a multiple of `align`, so every ramp chunk after it starts aligned; the
    // few elements over go to the last chunk.
    let middle = rest / align * align;
    let n = middle.div_ceil(chunk);
    let each = middle
        .div_ceil(n)
        .next_multiple_of(align)
        .min(chunk / align * align);
    let mut lens = ramp.clone();
    let mut left = middle;
    while left > 0 {
        let take = each.min(left);
        lens.push(take);
        left -= take;
    }
    lens.extend(ramp.iter().rev());
    *lens.last_mut().expect("the ramp is not empty") += rest - middle;
    let mut start = 0;
    lens.into_iter()
        .map(|len| {
            let s = Span {
                start,
                end: start + len,
            };
            start += len;
            s
        })
        .collect()
}

/// The algorithm a call runs: an explicit choice wins over `IPCREDUCE_ALGO` (`env`), which
/// wins over `Auto`'s size rule.
pub fn choose(
    requested: Algorithm,
    env: Option<Algorithm>,
    backend: BackendKind,
    fabric: Fabric,
    world: usize,
    bytes: usize,
) -> Algorithm {
    let algo = match (requested, env) {
        (Algorithm::Auto, Some(e)) => e,
        (r, _) => r,
    };
    match algo {
        Algorithm::Auto if world == 1 => Algorithm::OneShot,
        Algorithm::Auto if bytes <= oneshot_max_bytes(backend, fabric, world) => Algorithm::OneShot,
        Algorithm::Auto => Algorithm::TwoShot,
        other => other,
    }
}

/// [`choose`] for a call on registered (zero-copy) buffers of the cuda backend: `Auto` takes
/// one-shot up to `oneshot_max` bytes (`None`: [`reg_oneshot_max_bytes`]), two-shot beyond.
pub fn choose_zero_copy(
    requested: Algorithm,
    env: Option<Algorithm>,
    world: usize,
    bytes: usize,
    oneshot_max: Option<usize>,
) -> Algorithm {
    let algo = match (requested, env) {
        (Algorithm::Auto, Some(e)) => e,
        (r, _) => r,
    };
    match algo {
        Algorithm::Auto if world == 1 => Algorithm::OneShot,
        Algorithm::Auto if bytes <= oneshot_max.unwrap_or(reg_oneshot_max_bytes(world)) => {
            Algorithm::OneShot
        }
        Algorithm::Auto => Algorithm::TwoShot,
        other => other,
    }
}

/// What a call ran, as [`crate::Communicator::last_path`] reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct PathInfo {
    /// "oneshot-ll", "oneshot-staged", "twoshot-staged", "oneshot-reg", "twoshot-reg", "nccl".
    pub name: &'static str,
    /// CTAs of the kernel (0 for NCCL: its own choice).
    pub ctas: u32,
    /// Whether the call read and wrote registered buffers directly (zero-copy).
    pub registered: bool,
}

/// The cuda backend's data paths: one table of them in backend/cuda/paths.rs.
pub use crate::backend::cuda::paths::CudaPath;

/// The cuda backend's grid limits, agreed by every rank at init.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GridLimits {
    /// Largest message for the low-latency one-shot (0 = off).
    pub ll_max: usize,
    /// Most CTAs a kernel may use (every CTA of every rank sharing a GPU must be resident).
    pub cap: usize,
    /// `IPCREDUCE_BLOCKS`: one CTA count for every SM path, overriding the size rule.
    pub fixed: Option<usize>,
    /// Smallest message for the copy-engine path (registered, out of place); 0 = never. Zero
    /// unless the world has two ranks.
    pub ce_min: usize,
    /// Smallest message for the host-staged copy-engine path (unregistered or not); 0 = never.
    /// Zero unless the world has two ranks on the host-staged transport.
    pub ce_staged_min: usize,
    /// Zero-copy calls run the deep kernels (16 packs in flight; `IPCREDUCE_REG_LOADS=16`).
    pub deep: bool,
    /// Most CTAs of a kernel compiled for one block per SM (the deep ones): `cap` on a GPU of
    /// its own, half the SM slots of `cap` when ranks share a GPU.
    pub deep_cap: usize,
    /// LL calls carry 12 data bytes per line (`IPCREDUCE_LL_DATA=12`) instead of 8.
    pub ll12: bool,
    /// The staged kernels' chunk, CTAs and interleave, where set.
    pub staged: StagedKnobs,
}

/// Default CTA counts by message size. DEFAULTS, first guesses from the kernels' design (8
/// 16-byte loads in flight per thread, 512 threads, ~65 GB/s per CTA on NVLink for zero-copy;
/// the staged path also copies through HBM): to be replaced by the measured table.
pub fn default_ctas(path: CudaPath, bytes: usize) -> usize {
    const K: usize = 1 << 10;
    const M: usize = 1 << 20;
    match path {
        // One thread per 16-byte pair of LL lines. Up to 512 pairs (8 KiB) one CTA: a second
        // one made an 8 KiB call ~0.7 us slower (graph, two ranks under MPS on one H100,
        // 2026-12-05: 4.3-4.4 us against 3.7 with one), mostly the fences finish_call had
        // then (removed since: worth measuring two CTAs at 4-8 KiB again). Then CTAs of 256
        // pairs up to 64 KiB: 10 % faster at 16 KiB than 512 (4.33 against 4.81 us), 5-6 % at
        // 32-64 KiB; 128 pairs was within 2 % of 256 there and 30 % slower at 4 KiB. Above 64
        // KiB (not measured that way) 512 pairs a CTA, never fewer CTAs than at 64 KiB.
        CudaPath::OneShotLl => match bytes.div_ceil(16) {
            0..=512 => 1,
            pairs @ 513..=4096 => pairs.div_ceil(256),
            pairs => pairs.div_ceil(512).max(16),
        },
        // One thread per 12-byte line.
        CudaPath::OneShotLl12 => bytes.div_ceil(12).div_ceil(512),
        // The copy-engine path's local reduce kernel.
        CudaPath::Ce | CudaPath::CeStaged => 16,
        // Measured with a zero-copy two-shot of the same structure on two H200s (2026-11-30):
        // 16 CTAs are within 3% of the best at 1 MB, 24-32 within 6% from 4 MB on; 16 CTAs
        // at 64 MB lose 13%.
        CudaPath::OneShotReg | CudaPath::TwoShotReg => match bytes {
            0..=262_144 => 8,
            _ if bytes <= M => 16,
            _ => 32,
        },
        // The probe of the deep two-shot (2026-11-30, 256 MB): 8 CTAs 287 GB/s, 16 323, 32
        // 332, 64 335; at 1 GiB 16 CTAs 328, 64 339. More CTAs only where the bytes are.
        CudaPath::OneShotRegDeep | CudaPath::TwoShotRegDeep => match bytes {
            0..=262_144 => 8,
            _ if bytes <= M => 16,
            _ if bytes <= 32 * M => 32,
            _ => 64,
        },
        CudaPath::OneShotStaged | CudaPath::TwoShotStaged => match bytes {
            _ if bytes <= 256 * K => 8,
            _ if bytes <= 2 * M => 16,
            _ if bytes <= 16 * M => 32,
            _ => 64,
        },
        // Reduce-scatter and all-gather, by the bytes of the whole: in the spirit of the
        // all-reduce's rules, to be measured.
        CudaPath::ReduceScatterReg | CudaPath::AllGatherReg => match bytes {
            _ if bytes <= 256 * K => 8,
            _ if bytes <= M => 16,
            _ => 32,
        },
        CudaPath::ReduceScatterStaged | CudaPath::AllGatherStaged => match bytes {
            _ if bytes <= 256 * K => 8,
            _ if bytes <= 2 * M => 16,
            _ if bytes <= 16 * M => 32,
            _ => 64,
        },
        // One line of no data.
        CudaPath::Empty => 1,
        // The fused kernels deal rows to blocks: their grid follows the rows
        // (backend/cuda/fused.rs), not the bytes.
        CudaPath::FusedOneShot
        | CudaPath::FusedTwoShot
        | CudaPath::FusedLl
        | CudaPath::FusedReference => 1,
    }
}

/// CTAs of a staged call through host memory (the tuning table's place there: tables are
/// measured on peer memory). Measured (one H200, two ranks under MPS, bf16, 2026-12-02,
/// scripts/device/staged-sweep.sh, 16 against 64 CTAs): up to 4 MiB 16 CTAs are as fast or
/// faster (256 KiB 9.0 against 8.3-8.5 GB/s one-shot, 8.0 against 6.7-7.3 two-shot; 4 MiB
/// two-shot 15.2 against 14.6); from 16 MiB 64 CTAs keep more reads from host memory in
/// flight (16 MiB one-shot, 1 MiB chunks: 17.9 against 17.3) and tie at 64 MiB (19.1).
pub fn host_staged_ctas(bytes: usize) -> usize {
    match bytes {
        _ if bytes <= 4 << 20 => 16,
        _ => 64,
    }
}

/// The path and CTA count of one cuda call. `algo` is resolved (one-shot or two-shot);
/// `registered`: send and recv both lie in registered buffers; `tuned`: the tuning table's CTA
/// count for this call (its row's algorithm is `algo`), which the size rule gives way to and
/// `IPCREDUCE_BLOCKS` overrides. Every rank computes the same answer from the same arguments,
/// which the kernels' barrier protocol relies on.
pub fn cuda_path(
    algo: Algorithm,
    bytes: usize,
    registered: bool,
    in_place: bool,
    lim: &GridLimits,
    tuned: Option<usize>,
) -> (CudaPath, u32) {
    let path = match (algo, registered) {
        (Algorithm::OneShot, _) if bytes <= lim.ll_max && lim.ll12 => CudaPath::OneShotLl12,
        (Algorithm::OneShot, _) if bytes <= lim.ll_max => CudaPath::OneShotLl,
        (_, true) if lim.ce_min > 0 && bytes >= lim.ce_min && !in_place => CudaPath::Ce,
        _ if lim.ce_staged_min > 0 && bytes >= lim.ce_staged_min => CudaPath::CeStaged,
        // One-shot in place would let a peer read an element this rank already overwrote.
        (Algorithm::OneShot, true) if !in_place && lim.deep => CudaPath::OneShotRegDeep,
        (Algorithm::OneShot, true) if !in_place => CudaPath::OneShotReg,
        (_, true) if lim.deep => CudaPath::TwoShotRegDeep,
        (_, true) => CudaPath::TwoShotReg,
        (Algorithm::OneShot, false) => CudaPath::OneShotStaged,
        (_, false) => CudaPath::TwoShotStaged,
    };
    // IPCREDUCE_STAGED_CTAS, for the staged paths, before everything else.
    let forced = match path {
        CudaPath::OneShotStaged | CudaPath::TwoShotStaged => lim.staged.ctas.or(lim.fixed),
        _ => lim.fixed,
    };
    let ctas = match (path, forced.or(tuned)) {
        (CudaPath::OneShotLl | CudaPath::OneShotLl12, Some(f)) => default_ctas(path, bytes).min(f),
        (_, Some(f)) => f,
        _ => default_ctas(path, bytes),
    };
    let cap = if path.one_block_per_sm() {
        lim.deep_cap
    } else {
        lim.cap
    };
    (path, ctas.clamp(1, cap.max(1)) as u32)
}

/// Threads per block of a call: `full` (the kernels' 512), except an LL call, whose blocks
/// share its 16-byte pairs of lines evenly, a thread each, rounded up to whole warps (at most
/// `full`: past that the kernel's loops stride over the grid), and a one-block LL12 call (one
/// thread per 12-byte line): fewer warps to start and to pass the block's final barrier on the
/// smallest messages' critical path, and the pairs spread over every block of a larger call.
/// LL pairs no block or thread with a peer's (lines are indexed by the message), so ranks need
/// not agree.
pub fn block_threads(path: CudaPath, bytes: usize, grid: u32, full: u32) -> u32 {
    let per_thread = match path {
        CudaPath::OneShotLl | CudaPath::Empty => 16,
        CudaPath::OneShotLl12 if grid == 1 => 12,
        _ => return full,
    };
    let items = bytes.div_ceil(per_thread).max(1) as u32;
    items
        .div_ceil(grid.max(1))
        .div_ceil(32)
        .saturating_mul(32)
        .min(full)
}

/// Cuts `count` elements into chunks of at most `chunk_elems` elements.
pub fn chunks(count: usize, chunk_elems: usize) -> impl Iterator<Item = Span> {
    assert!(chunk_elems > 0, "chunk size must be positive");
    (0..count.div_ceil(chunk_elems)).map(move |i| Span {
        start: i * chunk_elems,
        end: ((i + 1) * chunk_elems).min(count),
    })
}

/// Splits `len` elements into `parts` contiguous shards whose starts are multiples of
/// `align` elements (so vector accesses stay aligned); the last shards may be shorter or empty.
/// The rule is [`crate::shards::Shards::aligned`]'s.
pub fn shard(len: usize, parts: usize, index: usize, align: usize) -> Span {
    assert!(parts > 0 && index < parts && align > 0);
    crate::shards::Shards::aligned(len, parts, align).span(index)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn explicit_choice_beats_env_beats_auto() {
        let b = BackendKind::Cuda;
        let f = Fabric::Peer;
        assert_eq!(
            choose(Algorithm::TwoShot, Some(Algorithm::OneShot), b, f, 2, 8),
            Algorithm::TwoShot
        );
        assert_eq!(
            choose(Algorithm::Auto, Some(Algorithm::TwoShot), b, f, 2, 8),
            Algorithm::TwoShot
        );
        assert_eq!(
            choose(Algorithm::Auto, None, b, f, 2, 8),
            Algorithm::OneShot
        );
        // Two ranks: one-shot at every size; more ranks: two-shot for large messages.
        assert_eq!(
            choose(Algorithm::Auto, None, b, f, 2, 1 << 30),
            Algorithm::OneShot
        );
        assert_eq!(
            choose(Algorithm::Auto, None, b, f, 4, 1 << 30),
            Algorithm::TwoShot
        );
        assert_eq!(
            choose(Algorithm::Auto, None, b, f, 1, 1 << 30),
            Algorithm::OneShot
        );
    }

    #[test]
    fn host_auto_takes_one_shot_below_the_crossover_and_two_shot_above() {
        let (b, f) = (BackendKind::Host, Fabric::Peer);
        let auto = |w, bytes| choose(Algorithm::Auto, None, b, f, w, bytes);
        // (world, largest one-shot message): the documented defaults.
        for (w, max) in [(2, 256 << 10), (3, 16 << 10), (4, 16 << 10), (8, 16 << 10)] {
            assert_eq!(auto(w, 8), Algorithm::OneShot, "world {w}");
            assert_eq!(auto(w, max), Algorithm::OneShot, "world {w}");
            assert_eq!(auto(w, max + 4), Algorithm::TwoShot, "world {w}");
            assert_eq!(auto(w, 16 << 20), Algorithm::TwoShot, "world {w}");
        }
        assert_eq!(auto(1, 1 << 30), Algorithm::OneShot);
    }

    #[test]
    fn host_staged_auto_follows_the_pcie_byte_counts() {
        let (b, h) = (BackendKind::Cuda, Fabric::HostStaged);
        let auto = |world, bytes| choose(Algorithm::Auto, None, b, h, world, bytes);
        // Two ranks: one-shot and two-shot move the same bytes each way; one-shot's single
        // barrier wins up to the measured 512 KiB, two-shot above.
        assert_eq!(auto(2, 512 << 10), Algorithm::OneShot);
        assert_eq!(auto(2, (512 << 10) + 2), Algorithm::TwoShot);
        assert_eq!(auto(2, 1 << 30), Algorithm::TwoShot);
        // Four and eight: two-shot reads 1.5 N and 1.75 N where one-shot reads 3 N and 7 N.
        assert_eq!(auto(4, 32 << 10), Algorithm::OneShot);
        assert_eq!(auto(4, 128 << 10), Algorithm::TwoShot);
        assert_eq!(auto(8, 16 << 10), Algorithm::OneShot);
        assert_eq!(auto(8, 64 << 10), Algorithm::TwoShot);
        // Host staging switches earlier than peer memory at every world size above two.
        for w in [3, 4, 5, 8] {
            assert!(oneshot_max_bytes(b, h, w) < oneshot_max_bytes(b, Fabric::Peer, w));
        }
        // The PCIe policy changes pushes and CTAs, not the algorithm.
        for w in [2, 4, 8] {
            assert_eq!(
                oneshot_max_bytes(b, Fabric::PciePeer, w),
                oneshot_max_bytes(b, Fabric::Peer, w)
            );
        }
        // An explicit choice still wins.
        assert_eq!(
            choose(Algorithm::TwoShot, None, b, h, 2, 8),
            Algorithm::TwoShot
        );
    }

    #[test]
    fn host_staged_chunks_pipeline_and_peer_chunks_fill_the_slot() {
        const M: usize = 1 << 20;
        let slot = 16 * M;
        let host = |bytes| staged_chunk_bytes(Fabric::HostStaged, bytes, slot, None);
        // About sixteen chunks per message, between 1 MiB and 4 MiB: the measured best at 4,
        // 16 and 64 MiB.
        assert_eq!(host(4 * M), M);
        assert_eq!(host(16 * M), M);
        assert_eq!(host(64 * M), 4 * M);
        assert_eq!(host(32 * M), 2 * M);
        assert_eq!(host(1 << 30), 4 * M);
        assert_eq!(host(64 << 10), M);
        assert_eq!(host(3 * M + 5), M);
        assert_eq!(host(24 * M), 1536 << 10);
        // Never above the slot, always a multiple of 256 bytes.
        assert_eq!(staged_chunk_bytes(Fabric::HostStaged, 1 << 30, M, None), M);
        for bytes in [1, 1000, 5 * M + 3, 77 * M] {
            for slot in [64 << 10, 300 * 256, M, slot] {
                let c = staged_chunk_bytes(Fabric::HostStaged, bytes, slot, None);
                assert!(
                    c <= slot && c.is_multiple_of(256) && c > 0,
                    "{bytes} {slot} {c}"
                );
            }
        }
        for f in [Fabric::Peer, Fabric::PciePeer] {
            assert_eq!(staged_chunk_bytes(f, 8 * M, slot, None), slot);
        }
    }

    #[test]
    fn staged_knobs_take_the_place_of_the_rules_for_the_staged_paths_only() {
        const M: usize = 1 << 20;
        // A forced chunk: rounded down to 256 bytes, at least 256, at most the slot, on any
        // fabric and size.
        for f in [Fabric::Peer, Fabric::PciePeer, Fabric::HostStaged] {
            assert_eq!(staged_chunk_bytes(f, 8 * M, 16 * M, Some(65_600)), 65_536);
            assert_eq!(staged_chunk_bytes(f, 8 * M, 16 * M, Some(300)), 256);
            assert_eq!(staged_chunk_bytes(f, 1, M, Some(64 * M)), M);
        }
        // CTAs: the staged knob beats IPCREDUCE_BLOCKS and the tuned count on the staged paths,
        // within the cap; the other paths ignore it.
        let lim = GridLimits {
            ll_max: 64 << 10,
            cap: 48,
            fixed: Some(8),
            staged: StagedKnobs {
                ctas: Some(24),
                ..StagedKnobs::default()
            },
            ..limits()
        };
        let (one, two) = (Algorithm::OneShot, Algorithm::TwoShot);
        assert_eq!(
            cuda_path(one, 8 * M, false, false, &lim, Some(4)),
            (CudaPath::OneShotStaged, 24)
        );
        assert_eq!(
            cuda_path(two, 512 << 10, false, true, &lim, None),
            (CudaPath::TwoShotStaged, 24)
        );
        assert_eq!(cuda_path(two, 8 * M, true, false, &lim, None).1, 8);
        let over = GridLimits {
            staged: StagedKnobs {
                ctas: Some(100),
                ..StagedKnobs::default()
            },
            ..lim
        };
        assert_eq!(cuda_path(one, 8 * M, false, false, &over, None).1, 48);
        // The interleave: on by default only staged through host memory; forced anywhere.
        assert_eq!(staged_round(Fabric::HostStaged, None), 4);
        assert_eq!(staged_round(Fabric::Peer, None), 0);
        assert_eq!(staged_round(Fabric::PciePeer, None), 0);
        assert_eq!(staged_round(Fabric::HostStaged, Some(0)), 0);
        assert_eq!(staged_round(Fabric::Peer, Some(2)), 2);
        assert_eq!(staged_round(Fabric::Peer, Some(1000)), 255);
        // Host-staged CTAs: 16 up to 4 MiB, 64 beyond (measured).
        assert_eq!(host_staged_ctas(256 << 10), 16);
        assert_eq!(host_staged_ctas(4 * M), 16);
        assert_eq!(host_staged_ctas(4 * M + 1), 64);
        assert_eq!(host_staged_ctas(256 * M), 64);
    }

    #[test]
    fn the_fabric_follows_transport_then_forced_topology_then_pairs() {
        use Topology::{Nvlink, Pcie};
        assert_eq!(fabric(true, Some(Pcie), true), Fabric::HostStaged);
        assert_eq!(fabric(true, None, false), Fabric::HostStaged);
        assert_eq!(fabric(false, Some(Pcie), false), Fabric::PciePeer);
        assert_eq!(fabric(false, Some(Nvlink), true), Fabric::Peer);
        assert_eq!(fabric(false, None, true), Fabric::PciePeer);
        assert_eq!(fabric(false, None, false), Fabric::Peer);
        assert_eq!(Fabric::PciePeer.kernel_mode(), MODE_PUSH_PASSES);
        assert_eq!(Fabric::HostStaged.kernel_mode(), 0);
        assert_eq!(Fabric::Peer.kernel_mode(), 0);
        assert!(Fabric::PciePeer.describe().contains("passes"));
        assert!(Fabric::HostStaged.describe().starts_with("host-staged"));
    }

    #[test]
    fn cuda_paths_follow_size_registration_and_overrides() {
        let lim = GridLimits {
            ll_max: 64 << 10,
            cap: 64,
            fixed: None,
            ce_min: 0,
            ce_staged_min: 0,
            deep: false,
            deep_cap: 64,
            ll12: false,
            staged: StagedKnobs::default(),
        };
        let one = Algorithm::OneShot;
        let two = Algorithm::TwoShot;
        assert_eq!(
            cuda_path(one, 4096, false, false, &lim, None).0,
            CudaPath::OneShotLl
        );
        assert_eq!(
            cuda_path(one, 4096, true, false, &lim, None).0,
            CudaPath::OneShotLl
        );
        assert_eq!(
            cuda_path(one, 1 << 20, false, false, &lim, None).0,
            CudaPath::OneShotStaged
        );
        assert_eq!(
            cuda_path(one, 1 << 20, true, false, &lim, None).0,
            CudaPath::OneShotReg
        );
        assert_eq!(
            cuda_path(one, 1 << 20, true, true, &lim, None).0,
            CudaPath::TwoShotReg
        );
        assert_eq!(
            cuda_path(two, 4096, false, true, &lim, None).0,
            CudaPath::TwoShotStaged
        );
        assert_eq!(
            cuda_path(two, 1 << 30, true, false, &lim, None),
            (CudaPath::TwoShotReg, 32)
        );
        // More CTAs for bigger staged messages, never above the cap.
        let small = cuda_path(two, 64 << 10, false, false, &lim, None).1;
        let big = cuda_path(two, 1 << 30, false, false, &lim, None).1;
        assert!(small < big && big <= 64, "{small} {big}");
        let capped = GridLimits { cap: 12, ..lim };
        assert_eq!(cuda_path(two, 1 << 30, false, false, &capped, None).1, 12);
        let fixed = GridLimits {
            fixed: Some(40),
            ..lim
        };
        assert_eq!(cuda_path(two, 1 << 30, true, false, &fixed, None).1, 40);
        assert_eq!(cuda_path(two, 100, false, false, &fixed, None).1, 40);
        // LL: one thread per 16 bytes, the override only caps it.
        assert_eq!(cuda_path(one, 8, false, false, &fixed, None).1, 1);
        assert_eq!(cuda_path(one, 64 << 10, false, false, &fixed, None).1, 16);
        let fixed8 = GridLimits {
            fixed: Some(8),
            ..lim
        };
        assert_eq!(cuda_path(one, 64 << 10, false, false, &fixed8, None).1, 8);
        let codes: std::collections::HashSet<_> = [
            CudaPath::OneShotStaged,
            CudaPath::TwoShotStaged,
            CudaPath::OneShotReg,
            CudaPath::TwoShotReg,
        ]
        .iter()
        .map(|p| p.code())
        .collect();
        assert_eq!(
            codes.len(),
            4,
            "staged and zero-copy paths must stamp differently"
        );
        // The copy-engine path: registered, out of place, from its threshold on.
        let ce = GridLimits {
            ce_min: 32 << 20,
            ce_staged_min: 0,
            ..lim
        };
        assert_eq!(
            cuda_path(two, 64 << 20, true, false, &ce, None).0,
            CudaPath::Ce
        );
        assert_eq!(
            cuda_path(one, 64 << 20, true, false, &ce, None).0,
            CudaPath::Ce
        );
        assert_eq!(
            cuda_path(two, 64 << 20, true, true, &ce, None).0,
            CudaPath::TwoShotReg
        );
        assert_eq!(
            cuda_path(two, 64 << 20, false, false, &ce, None).0,
            CudaPath::TwoShotStaged
        );
        assert_eq!(
            cuda_path(two, 16 << 20, true, false, &ce, None).0,
            CudaPath::TwoShotReg
        );
        // The host-staged copy-engine path: any algorithm, in place or not, from its threshold.
        let ce_staged = GridLimits {
            ce_staged_min: 4 << 20,
            ..lim
        };
        for algo in [one, two] {
            for in_place in [false, true] {
                let at = |bytes| cuda_path(algo, bytes, false, in_place, &ce_staged, None).0;
                assert_eq!(at(4 << 20), CudaPath::CeStaged);
                assert_eq!(at(1 << 30), CudaPath::CeStaged);
                assert_ne!(at((4 << 20) - 1), CudaPath::CeStaged);
            }
        }
    }

    #[test]
    fn ce_staged_pieces_ramp_up_and_down_and_cover_the_call_aligned() {
        const M: usize = 1 << 20;
        // 256 MiB of bf16 in 8 MiB chunks: 1, 2, 4 MiB, then 242 MiB in 31 even chunks (up to
        // the alignment), then 4, 2, 1 MiB.
        let lens: Vec<usize> = ce_staged_pieces(128 * M, 2, 4 * M)
            .iter()
            .map(|s| s.len() * 2)
            .collect();
        assert_eq!(&lens[..3], &[M, 2 * M, 4 * M]);
        assert_eq!(&lens[lens.len() - 3..], &[4 * M, 2 * M, M]);
        let middle = &lens[3..lens.len() - 3];
        assert_eq!(middle.len(), 31, "{lens:?}");
        assert!(middle.iter().all(|&l| l > 7 * M && l <= 8 * M), "{lens:?}");
        assert_eq!(lens.iter().sum::<usize>(), 256 * M);
        // A chunk of 1 MiB ramps with its half only (a quarter is under the ramp's minimum).
        let lens: Vec<usize> = ce_staged_pieces(8 * M, 2, M / 2)
            .iter()
            .map(|s| s.len() * 2)
            .collect();
        assert_eq!((lens[0], lens[lens.len() - 1]), (M / 2, M / 2), "{lens:?}");
        // Too small for both ramps and two chunks: even chunks, as without the ramp.
        // (5 MiB of f32 in 2 MiB chunks; the ramps of 0.5 and 1 MiB and two chunks need 7.)
        let even = ce_staged_pieces(5 * M / 4, 4, M / 2);
        assert_eq!(even.len(), 3);
        assert_eq!((even[0].len(), even[2].len()), (M / 2, M / 4));
        assert_eq!(
            ce_staged_pieces(0, 2, 1024),
            vec![Span { start: 0, end: 0 }]
        );
        for elem in [1usize, 2, 4, 8] {
            for chunk_bytes in [256usize, 4096, M, M + 256, 3 * M, 8 * M] {
                for count in [1usize, 1000, M + 1, 5 * M + 3, 37 * M + 11, 300 * M / elem] {
                    let chunk = chunk_bytes / elem;
                    let pieces = ce_staged_pieces(count, elem, chunk);
                    let why = format!("{count} x {elem} B in {chunk_bytes} B chunks");
                    assert_eq!(pieces[0].start, 0, "{why}");
                    assert_eq!(pieces.last().unwrap().end, count, "{why}");
                    for w in pieces.windows(2) {
                        assert_eq!(w[0].end, w[1].start, "{why}");
                    }
                    for p in &pieces {
                        assert!(!p.is_empty() && p.len() <= chunk, "{why}: {p:?}");
                        // Aligned starts wherever the chunks themselves are.
                        if chunk_bytes % 4096 == 0 {
                            assert_eq!(p.start * elem % 4096, 0, "{why}: {p:?}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn ce_staged_chunks_are_a_sixteenth_within_a_mebibyte_and_the_slot() {
        const M: usize = 1 << 20;
        let slot = 16 * M;
        assert_eq!(ce_staged_chunk_bytes(4 * M, slot, None), M);
        assert_eq!(ce_staged_chunk_bytes(64 * M, slot, None), 4 * M);
        assert_eq!(ce_staged_chunk_bytes(1 << 30, slot, None), slot);
        assert_eq!(ce_staged_chunk_bytes(1 << 30, M / 2, None), M / 2);
        assert_eq!(ce_staged_chunk_bytes(64 * M, slot, Some(M + 100)), M);
        for bytes in [1usize, 4095, 5 * M + 3, 300 * M] {
            let c = ce_staged_chunk_bytes(bytes, slot, None);
            assert_eq!(
                c % 4096,
                0,
                "{bytes}: chunk {c} keeps 16-byte packs aligned"
            );
        }
    }

    fn limits() -> GridLimits {
        GridLimits {
            ll_max: ll_default_max_bytes(2, Fabric::Peer),
            cap: 64,
            fixed: None,
            ce_min: 0,
            ce_staged_min: 0,
            deep: true,
            deep_cap: 64,
            ll12: false,
            staged: StagedKnobs::default(),
        }
    }

    #[test]
    fn ll_limit_falls_with_the_world_and_fits_the_kernels_area() {
        assert_eq!(ll_default_max_bytes(2, Fabric::Peer), 1 << 20);
        assert!(ll_default_max_bytes(4, Fabric::Peer) < ll_default_max_bytes(2, Fabric::Peer));
        assert!(ll_default_max_bytes(8, Fabric::Peer) < ll_default_max_bytes(4, Fabric::Peer));
        for w in 1..=8 {
            for fabric in [Fabric::Peer, Fabric::PciePeer, Fabric::HostStaged] {
                let max = ll_default_max_bytes(w, fabric);
                assert!(max <= crate::backend::cuda::kernels::LL_MAX_BYTES);
                // PCIe peer memory keeps 64 KiB; through host memory LL stops at the
                // measured crossover with the staged kernels, which falls with the peers
                // every rank pushes its lines to.
                let want = match (fabric, w) {
                    (Fabric::Peer, _) => max,
                    (Fabric::PciePeer, _) => 64 << 10,
                    (Fabric::HostStaged, 0..=2) => 16 << 10,
                    (Fabric::HostStaged, 3..=4) => 4 << 10,
                    (Fabric::HostStaged, _) => 2 << 10,
                };
                assert_eq!(max, want, "{fabric:?} at world {w}");
            }
        }
        // Registered or not, in place or not: one-shot up to the limit runs LL.
        let lim = limits();
        let one = Algorithm::OneShot;
        for (reg, inplace) in [(false, false), (true, false), (true, true), (false, true)] {
            assert_eq!(
                cuda_path(one, 1 << 20, reg, inplace, &lim, None).0,
                CudaPath::OneShotLl
            );
            assert_ne!(
                cuda_path(one, (1 << 20) + 2, reg, inplace, &lim, None).0,
                CudaPath::OneShotLl
            );
        }
        // LL CTAs: one thread per 16 bytes, so they grow with the size up to the cap.
        let ctas = |b| cuda_path(one, b, false, false, &lim, None).1;
        assert_eq!(ctas(8), 1);
        assert_eq!(ctas(8 << 10), 1);
        assert_eq!(ctas(64 << 10), 16);
        assert_eq!(ctas(128 << 10), 16);
        assert_eq!(ctas(256 << 10), 32);
        assert_eq!(ctas(1 << 20), 64);
        let shared = GridLimits { cap: 24, ..lim };
        assert_eq!(cuda_path(one, 1 << 20, false, false, &shared, None).1, 24);
    }

    #[test]
    fn zero_copy_auto_switches_to_two_shot_above_its_limit() {
        let auto = Algorithm::Auto;
        let (one, two) = (Algorithm::OneShot, Algorithm::TwoShot);
        // Two ranks: plain buffers stay one-shot at every size, registered ones go two-shot
        // beyond reg_oneshot_max_bytes.
        let max = reg_oneshot_max_bytes(2);
        assert_eq!(choose_zero_copy(auto, None, 2, max, None), one);
        assert_eq!(choose_zero_copy(auto, None, 2, max + 1, None), two);
        assert_eq!(
            choose(auto, None, BackendKind::Cuda, Fabric::Peer, 2, 1 << 30),
            one
        );
        // The override moves the limit; explicit choices and IPCREDUCE_ALGO win over it.
        assert_eq!(
            choose_zero_copy(auto, None, 2, 1 << 20, Some(64 << 10)),
            two
        );
        assert_eq!(
            choose_zero_copy(auto, None, 2, 1 << 30, Some(usize::MAX)),
            one
        );
        assert_eq!(choose_zero_copy(one, None, 2, 1 << 30, None), one);
        assert_eq!(choose_zero_copy(auto, Some(one), 2, 1 << 30, None), one);
        assert_eq!(choose_zero_copy(two, Some(one), 2, 8, None), two);
        assert_eq!(choose_zero_copy(auto, None, 1, 1 << 30, None), one);
        // The documented limits (README, IPCREDUCE_REG_ONESHOT_MAX): 4 MiB at two ranks,
        // 256 KiB at three or four, 128 KiB above; two-shot from there on.
        let documented = [(2, 4 << 20), (3, 256 << 10), (4, 256 << 10), (8, 128 << 10)];
        for (world, limit) in documented {
            assert_eq!(reg_oneshot_max_bytes(world), limit, "world {world}");
            assert_eq!(choose_zero_copy(auto, None, world, limit, None), one);
            assert_eq!(choose_zero_copy(auto, None, world, limit + 1, None), two);
        }
        assert_eq!(choose_zero_copy(auto, None, 8, 1 << 20, None), two);
    }

    #[test]
    fn zero_copy_kernels_follow_the_depth_knob() {
        let lim = limits();
        let (one, two) = (Algorithm::OneShot, Algorithm::TwoShot);
        let big = 64 << 20;
        assert_eq!(
            cuda_path(one, big, true, false, &lim, None).0,
            CudaPath::OneShotRegDeep
        );
        assert_eq!(
            cuda_path(two, big, true, false, &lim, None).0,
            CudaPath::TwoShotRegDeep
        );
        // In place: two-shot (one-shot would let a peer read an element already overwritten).
        assert_eq!(
            cuda_path(one, big, true, true, &lim, None).0,
            CudaPath::TwoShotRegDeep
        );
        // Plain buffers never take a zero-copy kernel.
        assert_eq!(
            cuda_path(two, big, false, false, &lim, None).0,
            CudaPath::TwoShotStaged
        );
        let shallow = GridLimits { deep: false, ..lim };
        assert_eq!(
            cuda_path(one, big, true, false, &shallow, None).0,
            CudaPath::OneShotReg
        );
        assert_eq!(
            cuda_path(two, big, true, false, &shallow, None).0,
            CudaPath::TwoShotReg
        );
        for p in CudaPath::ALL {
            assert_eq!(
                p.one_block_per_sm(),
                matches!(p, CudaPath::OneShotRegDeep | CudaPath::TwoShotRegDeep),
                "{p:?}"
            );
            assert!(!p.one_block_per_sm() || p.registered(), "{p:?}");
        }
        // Deep kernels: CTAs grow with the size, and ranks sharing a GPU cap them lower.
        let ctas = |b, l: &GridLimits| cuda_path(two, b, true, false, l, None).1;
        assert_eq!(ctas(2 << 20, &lim), 32);
        assert_eq!(ctas(1 << 30, &lim), 64);
        assert!(ctas(4 << 20, &lim) <= ctas(1 << 30, &lim));
        let shared = GridLimits {
            cap: 96,
            deep_cap: 48,
            ..lim
        };
        assert_eq!(ctas(1 << 30, &shared), 48);
        // The staged kernels keep the two-per-SM cap.
        assert_eq!(cuda_path(two, 1 << 30, false, false, &shared, None).1, 64);
    }

    #[test]
    fn tuned_ctas_apply_unless_blocks_is_set() {
        let lim = limits();
        let two = Algorithm::TwoShot;
        assert_eq!(cuda_path(two, 1 << 30, true, false, &lim, Some(24)).1, 24);
        assert_eq!(cuda_path(two, 1 << 30, false, false, &lim, Some(24)).1, 24);
        // Never above the cap; IPCREDUCE_BLOCKS wins.
        assert_eq!(cuda_path(two, 1 << 30, true, false, &lim, Some(500)).1, 64);
        let fixed = GridLimits {
            fixed: Some(40),
            ..lim
        };
        assert_eq!(cuda_path(two, 1 << 30, true, false, &fixed, Some(24)).1, 40);
        // LL: a tuned count only caps its size rule, as IPCREDUCE_BLOCKS does.
        let one = Algorithm::OneShot;
        assert_eq!(cuda_path(one, 1 << 20, false, false, &lim, Some(16)).1, 16);
        assert_eq!(cuda_path(one, 4096, false, false, &lim, Some(16)).1, 1);
    }

    #[test]
    fn ll_ctas_one_up_to_8_kib_then_256_pairs_each_to_64_kib() {
        let ll = CudaPath::OneShotLl;
        for (bytes, ctas) in [
            (0, 1),
            (8, 1),
            (4 << 10, 1),
            (8 << 10, 1),
            ((8 << 10) + 16, 3), // 513 pairs
            (16 << 10, 4),
            (64 << 10, 16),
            ((64 << 10) + 16, 16), // 4097 pairs: 512 a CTA from here, at least 16 CTAs
            (128 << 10, 16),
            (256 << 10, 32),
            (1 << 20, 128),
        ] {
            assert_eq!(default_ctas(ll, bytes), ctas, "{bytes} bytes");
        }
        // Every pair has a thread of the rule's grid, and no block has a warp without pairs.
        for bytes in (1..=(1usize << 20)).step_by(208) {
            let grid = default_ctas(ll, bytes) as u32;
            let t = block_threads(ll, bytes, grid, 512) as usize;
            let pairs = bytes.div_ceil(16);
            assert!(t * grid as usize >= pairs, "{bytes}: {grid} x {t}");
            assert!((t - 32) * grid as usize <= pairs, "{bytes}: {grid} x {t}");
        }
    }

    #[test]
    fn small_ll_calls_launch_only_the_warps_they_need() {
        let ll = CudaPath::OneShotLl;
        assert_eq!(block_threads(ll, 8, 1, 512), 32);
        assert_eq!(block_threads(ll, 512, 1, 512), 32);
        assert_eq!(block_threads(ll, 528, 1, 512), 64);
        assert_eq!(block_threads(ll, 8 << 10, 1, 512), 512);
        // Every pair still has a thread: one block covers bytes/16 pairs.
        for bytes in [1usize, 15, 16, 17, 1000, 4095, 8192] {
            let t = block_threads(ll, bytes, 1, 512) as usize;
            assert!(t * 16 >= bytes && t.is_multiple_of(32), "{bytes}: {t}");
        }
        // Several blocks share the pairs: 16 KiB is 1024 pairs, 4 blocks of 256; 9 KiB is 576
        // pairs, 3 blocks of 192; a grid held below the rule (a cap) gets full blocks, whose
        // loops stride over the grid.
        assert_eq!(block_threads(ll, 16 << 10, 4, 512), 256);
        assert_eq!(block_threads(ll, 9 << 10, 3, 512), 192);
        assert_eq!(block_threads(ll, 64 << 10, 16, 512), 256);
        assert_eq!(block_threads(ll, 64 << 10, 8, 512), 512);
        assert_eq!(block_threads(ll, 64 << 10, 2, 512), 512);
        // Any other path: the full block the kernels are built for.
        assert_eq!(block_threads(CudaPath::TwoShotRegDeep, 8, 1, 512), 512);
        assert_eq!(block_threads(CudaPath::OneShotStaged, 8, 1, 512), 512);
    }

    #[test]
    fn ll12_replaces_ll_when_chosen() {
        let lim = GridLimits {
            ll12: true,
            ..limits()
        };
        let one = Algorithm::OneShot;
        for (reg, inplace) in [(false, false), (true, false), (true, true)] {
            assert_eq!(
                cuda_path(one, 1 << 20, reg, inplace, &lim, None).0,
                CudaPath::OneShotLl12
            );
        }
        assert_eq!(
            cuda_path(one, (1 << 20) + 2, true, false, &lim, None).0,
            CudaPath::OneShotRegDeep
        );
        // One thread per 12-byte line: 1 MiB needs 171 CTAs of 512, capped; 6 KiB one block.
        assert_eq!(cuda_path(one, 1 << 20, false, false, &lim, None).1, 64);
        assert_eq!(cuda_path(one, 6 << 10, false, false, &lim, None).1, 1);
        assert_eq!(block_threads(CudaPath::OneShotLl12, 12 * 33, 1, 512), 64);
        assert_eq!(block_threads(CudaPath::OneShotLl12, 12 * 32, 1, 512), 32);
        // LL12's lines fit in the LL area (sized for 8 data bytes per line).
        let lines = crate::backend::cuda::kernels::LL_MAX_BYTES.div_ceil(12);
        assert!(lines <= crate::backend::cuda::kernels::LL_MAX_BYTES / 8);
    }

    #[test]
    fn every_path_has_its_own_code_and_name() {
        let codes: std::collections::HashSet<_> = CudaPath::ALL.iter().map(|p| p.code()).collect();
        assert_eq!(codes.len(), CudaPath::ALL.len());
        let names: std::collections::HashSet<_> = CudaPath::ALL.iter().map(|p| p.name()).collect();
        assert_eq!(names.len(), CudaPath::ALL.len());
    }

    proptest! {
        #[test]
        fn chunks_cover_exactly(count in 0usize..100_000, chunk in 1usize..5000) {
            let mut next = 0;
            for c in chunks(count, chunk) {
                prop_assert_eq!(c.start, next);
                prop_assert!(c.len() <= chunk && !c.is_empty());
                next = c.end;
            }
            prop_assert_eq!(next, count);
        }

        #[test]
        fn shards_partition_and_align(len in 0usize..100_000, parts in 1usize..9, align in 1usize..17) {
            let mut next = 0;
            for i in 0..parts {
                let s = shard(len, parts, i, align);
                prop_assert_eq!(s.start, next);
                prop_assert!(s.start.is_multiple_of(align) || s.start == len);
                next = s.end;
            }
            prop_assert_eq!(next, len);
        }
    }

    proptest! {
        #[test]
        fn aligned_shards_partition_and_agree_with_plan(
            total in 0usize..200_000, parts in 1usize..9, align in 1usize..17
        ) {
            let s = crate::shards::Shards::aligned(total, parts, align);
            let mut next = 0;
            for i in 0..parts {
                let span = s.span(i);
                prop_assert_eq!(span.start, next);
                prop_assert!(span.start.is_multiple_of(align) || span.start == total);
                prop_assert_eq!(span, shard(total, parts, i, align));
                next = span.end;
            }
            prop_assert_eq!(next, total);
        }
    }
}
