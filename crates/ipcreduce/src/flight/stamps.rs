//! Phase stamps (cuda, with `IPCREDUCE_TRACE`): the host's half of the in-kernel stamps of
//! "Phase stamps" in kernels/prims.cuh. Thread 0 of every block of a traced kernel writes a
//! %globaltimer stamp at each phase boundary (start, each peer first seen, reduce done, gather
//! done, end) into a ring in device memory, one 64-bit word per (call, block, phase). This
//! module decodes the ring (the cuda backend owns the memory, copies it into host memory when
//! the trace is written, and owns the clock: backend/cuda/phase_ring.rs) into per-call,
//! per-block times on the host's wall clock, for the trace files the flight recorder writes.
//!
//! Nothing here calls CUDA: [`Source::read`] hands over the words.

/// Calls the ring holds (`PH_CALLS`): the slot of call `kseq` is `kseq % CALLS`.
pub const CALLS: usize = 1024;
/// Blocks per call (`MAX_BLOCKS`).
pub const BLOCKS: usize = 128;
/// Peers a block can wait for (`MAX_RANKS`).
pub const PEERS: usize = 8;
/// Stamp slots per block (`PH_SLOTS`): the four phases, then one per peer.
pub const SLOTS: usize = 4 + PEERS;
/// Words of the ring.
pub const WORDS: usize = CALLS * BLOCKS * SLOTS;
// Slots of one block (PH_* in prims.cuh).
pub const START: usize = 0;
pub const REDUCE: usize = 1;
pub const GATHER: usize = 2;
pub const END: usize = 3;
pub const PEER: usize = 4;
const TIME_BITS: u32 = 48;
const TIME_MASK: u64 = (1 << TIME_BITS) - 1;

/// The ring's word index of (call slot, block, phase slot).
pub fn index(kseq: u64, block: usize, slot: usize) -> usize {
    ((kseq as usize % CALLS) * BLOCKS + block) * SLOTS + slot
}

/// The word a traced kernel writes for call `kseq` at globaltimer `gt` (tests; the kernels'
/// own is `phase_stamp` in prims.cuh).
pub fn word(kseq: u64, gt: u64) -> u64 {
    (kseq << TIME_BITS) | (gt & TIME_MASK)
}

/// One block's stamps of one call, host wall-clock ns (None: not reached, or not stamped by
/// this kernel).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockStamps {
    pub block: usize,
    pub start: Option<u64>,
    /// (peer, when the block first saw it), in peer order.
    pub peers: Vec<(usize, u64)>,
    pub reduce: Option<u64>,
    pub gather: Option<u64>,
    pub end: Option<u64>,
}

/// One kernel call's stamps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallStamps {
    /// The flight recorder's number of the call that launched it.
    pub seq: u64,
    /// The backend's number of the kernel call (the kernels' `a.seq`).
    pub kseq: u64,
    pub blocks: Vec<BlockStamps>,
}

impl CallStamps {
    /// When the call's kernel ran: its first block's start to its last block's end (host
    /// wall-clock ns), once every block that started has ended (a kernel still running, or
    /// one stopped inside, has none).
    pub fn span(&self) -> Option<(u64, u64)> {
        let started: Vec<&BlockStamps> = self.blocks.iter().filter(|b| b.start.is_some()).collect();
        let start = started.iter().filter_map(|b| b.start).min()?;
        let mut end = start;
        for b in &started {
            end = end.max(b.end?);
        }
        Some((start, end))
    }

    /// The `phases` field of the call's line in a trace file (docs/tracing.md).
    pub fn to_json(&self, tick_ns: u64) -> serde_json::Value {
        let blocks: Vec<serde_json::Value> = self
            .blocks
            .iter()
            .map(|b| {
                serde_json::json!({
                    "block": b.block,
                    "start_ns": b.start,
                    "peers": b.peers.iter().map(|&(p, t)| serde_json::json!([p, t])).collect::<Vec<_>>(),
                    "reduce_ns": b.reduce,
                    "gather_ns": b.gather,
                    "end_ns": b.end,
                })
            })
            .collect();
        serde_json::json!({ "kseq": self.kseq, "tick_ns": tick_ns, "blocks": blocks })
    }
}

/// The GPU's globaltimer against the host's wall clock: its tick and two anchors, each a
/// (globaltimer, host ns) pair read together, one when the ring was made and one at the read.
/// The clocks drift apart (about 9 ppm on an H200), so times are measured back from the later
/// anchor and scaled by the clocks' ratio between the two (as the event timeline does,
/// `flight::timeline::fit`; here [`fit_ns`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Clock {
    /// The smallest step of the globaltimer seen (ns): the stamps' resolution.
    pub tick_ns: u64,
    start: (u64, u64),
    at: (u64, u64),
    scale: f64,
}

impl Clock {
    /// From the start anchor and, if one could be taken, the read's (else the start's, with
    /// no drift correction).
    pub fn new(tick_ns: u64, start: (u64, u64), at: Option<(u64, u64)>) -> Clock {
        let at = at
            .filter(|a| a.0 > start.0 && a.1 > start.1)
            .unwrap_or(start);
        let scale = if at == start {
            1.0
        } else {
            fit_ns(at.0 - start.0, at.1 - start.1)
        };
        Clock {
            tick_ns,
            start,
            at,
            scale,
        }
    }

    /// The full globaltimer value of a stamp's low 48 bits: the one nearest the read's anchor
    /// (stamps are hours, not 2^48 ns, from it).
    pub fn unwrap(&self, low: u64) -> u64 {
        let near = self.at.0;
        let base = near & !TIME_MASK;
        [
            base.wrapping_sub(1 << TIME_BITS),
            base,
            base + (1 << TIME_BITS),
        ]
        .into_iter()
        .map(|b| b | (low & TIME_MASK))
        .min_by_key(|t| t.abs_diff(near))
        .unwrap_or(low)
    }

    /// The host wall-clock ns of globaltimer value `gt`.
    pub fn host_ns(&self, gt: u64) -> u64 {
        let (g, h) = self.at;
        if gt <= g {
            h.saturating_sub(((g - gt) as f64 * self.scale) as u64)
        } else {
            h + ((gt - g) as f64 * self.scale) as u64
        }
    }
}

/// `flight::timeline::fit` in integer ns: the events' float milliseconds would cost the globaltimer
/// its nanoseconds (a 2 s span in f32 ms is 0.1 us coarse: 60 ns of error at the far anchor).
pub fn fit_ns(device_ns: u64, host_ns: u64) -> f64 {
    // Too close to tell, or a ratio no clock drifts by (0.1%): one of them is wrong.
    if device_ns < 100_000_000 {
        return 1.0;
    }
    let scale = host_ns as f64 / device_ns as f64;
    if (scale - 1.0).abs() > 1e-3 {
        1.0
    } else {
        scale
    }
}

/// The stamps of the kernel calls in `calls` ((kseq, seq) per ring slot; kseq 0: no call yet)
/// from the ring's words (`word(i)`, volatile reads of the mapped memory). A word is taken
/// only if its tag is its call's and its time is not 0 (an older call's in the same slot, no
/// write yet, or a word cleared for a later kernel is left out); a block appears only if it
/// stamped something.
pub fn decode(word: impl Fn(usize) -> u64, calls: &[(u64, u64)], clock: &Clock) -> Vec<CallStamps> {
    let mut out = Vec::new();
    let mut sorted: Vec<(u64, u64)> = calls.iter().copied().filter(|c| c.0 != 0).collect();
    sorted.sort_unstable();
    for (kseq, seq) in sorted {
        let tag = kseq & 0xFFFF;
        let mut blocks = Vec::new();
        for b in 0..BLOCKS {
            let at = |slot: usize| {
                let w = word(index(kseq, b, slot));
                // Time 0 under the call's tag: cleared for a kernel that had not stamped it yet
                // (the copy-engine reduce's words, prims.cuh `phase_clear`).
                (w & TIME_MASK != 0 && w >> TIME_BITS == tag)
                    .then(|| clock.host_ns(clock.unwrap(w)))
            };
            let peers: Vec<(usize, u64)> = (0..PEERS)
                .filter_map(|p| at(PEER + p).map(|t| (p, t)))
                .collect();
            let s = BlockStamps {
                block: b,
                start: at(START),
                peers,
                reduce: at(REDUCE),
                gather: at(GATHER),
                end: at(END),
            };
            if s.start.is_some() || s.end.is_some() || !s.peers.is_empty() {
                blocks.push(s);
            }
        }
        if !blocks.is_empty() {
            out.push(CallStamps { seq, kseq, blocks });
        }
    }
    out
}

/// Whether the kernels stamp their phases: with `IPCREDUCE_TRACE` set, unless
/// `IPCREDUCE_TRACE_PHASES=0` keeps the plain kernels (the trace then has host times and, with
/// `IPCREDUCE_TIMELINE=1`, event spans only).
pub fn wanted() -> bool {
    wanted_in(|k| std::env::var(k).ok())
}

/// [`wanted`] over any variable source.
pub fn wanted_in(get: impl Fn(&str) -> Option<String>) -> bool {
    let set = |k: &str| get(k).filter(|v| !v.trim().is_empty());
    set("IPCREDUCE_TRACE").is_some()
        && set("IPCREDUCE_FLIGHT").as_deref().map(str::trim) != Some("0")
        && set("IPCREDUCE_TRACE_PHASES").as_deref().map(str::trim) != Some("0")
}

/// Where the flight recorder gets the stamps from (the cuda backend's ring).
pub trait Source: Send + Sync {
    /// The flight recorder's number of the call being made: the kernels launched until the
    /// next are its.
    fn set_call(&self, seq: u64);
    /// Every call's stamps the ring holds, on the host's clock (a new anchor is taken, if the
    /// GPU answers within a bound; the read itself never waits for the GPU).
    fn read(&self) -> (Vec<CallStamps>, u64);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_calls_span_is_its_first_start_to_its_last_end() {
        let block = |block, start, end| BlockStamps {
            block,
            start,
            end,
            ..Default::default()
        };
        let call = |blocks| CallStamps {
            seq: 4,
            kseq: 9,
            blocks,
        };
        let done = call(vec![
            block(0, Some(1_000), Some(5_000)),
            block(1, Some(900), Some(7_000)),
            block(2, Some(1_200), Some(6_000)),
        ]);
        assert_eq!(done.span(), Some((900, 7_000)));
        // A block still running (started, no end): no span yet.
        let running = call(vec![
            block(0, Some(1_000), Some(5_000)),
            block(1, Some(900), None),
        ]);
        assert_eq!(running.span(), None);
        // Blocks that never started (their words stale) do not count.
        let partial = call(vec![
            block(0, Some(1_000), Some(5_000)),
            block(1, None, None),
        ]);
        assert_eq!(partial.span(), Some((1_000, 5_000)));
        assert_eq!(call(vec![]).span(), None);
    }

    #[test]
    fn phases_are_stamped_only_while_tracing() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| pairs.iter().find(|p| p.0 == k).map(|p| p.1.to_string())
        };
        assert!(!wanted_in(env(&[])));
        assert!(!wanted_in(env(&[("IPCREDUCE_TRACE", "")])));
        assert!(wanted_in(env(&[("IPCREDUCE_TRACE", "/tmp/t")])));
        assert!(!wanted_in(env(&[
            ("IPCREDUCE_TRACE", "/tmp/t"),
            ("IPCREDUCE_TRACE_PHASES", "0")
        ])));
    }

    #[test]
    fn stamps_come_back_per_block_on_the_host_clock_and_stale_words_are_left_out() {
        // The GPU's clock is 3 s behind the host's and runs 9 ppm slow.
        let start = (1_000_000_000_000u64, 1_000_003_000_000_000u64);
        let span = 2_000_000_000u64;
        let at = (start.0 + span - span * 9 / 1_000_000, start.1 + span);
        let clock = Clock::new(32, start, Some(at));
        // A stamp at the start anchor's globaltimer lands on its host time within a tick.
        assert!(clock.host_ns(start.0).abs_diff(start.1) < 32, "{clock:?}");
        // The 48-bit low part is restored, also across a wrap of the low bits.
        assert_eq!(clock.unwrap(at.0 & TIME_MASK), at.0);
        let wrap = Clock::new(1, ((1 << 48) - 10, 0), None);
        assert_eq!(wrap.unwrap(5), (1 << 48) + 5);

        let mut ring = vec![0u64; WORDS];
        let t = at.0 - 1_000_000;
        // Call 3 (flight seq 7), blocks 0 and 2; peer 1 seen 5 us after the start.
        for b in [0usize, 2] {
            ring[index(3, b, START)] = word(3, t);
            ring[index(3, b, PEER + 1)] = word(3, t + 5_000);
            ring[index(3, b, REDUCE)] = word(3, t + 8_000);
            ring[index(3, b, END)] = word(3, t + 9_000);
        }
        // A stale word of call 3 + CALLS in the same slot, then that call's slot owner.
        ring[index(3, 1, START)] = word(3 + CALLS as u64, t);
        let calls = vec![(3u64, 7u64), (0, 0)];
        let got = decode(|i| ring[i], &calls, &clock);
        assert_eq!(got.len(), 1);
        let c = &got[0];
        assert_eq!((c.seq, c.kseq), (7, 3));
        assert_eq!(c.blocks.iter().map(|b| b.block).collect::<Vec<_>>(), [0, 2]);
        let b = &c.blocks[0];
        let start_ns = b.start.unwrap();
        assert_eq!(b.peers.len(), 1);
        assert_eq!(b.peers[0].0, 1);
        assert!((b.peers[0].1 - start_ns).abs_diff(5_000) <= 1);
        assert!((b.end.unwrap() - start_ns).abs_diff(9_000) <= 1);
        assert_eq!(b.gather, None);
        // 1 ms before the read's anchor on the GPU's clock is about 1 ms before its host time.
        assert!((at.1 - start_ns).abs_diff(1_000_000) < 100, "{start_ns}");
        let j = c.to_json(32);
        assert_eq!(j["blocks"][0]["peers"][0][0], 1);
        assert_eq!(j["tick_ns"], 32);
    }

    #[test]
    fn words_cleared_for_a_later_kernel_are_not_stamps() {
        // A copy-engine chunk's row: its barrier stamped the start and the peer and cleared
        // the reduce and end (the call's tag, time 0) for the reduce, still running.
        let clock = Clock::new(32, (1 << 40, 1 << 50), None);
        let t = (1u64 << 40) + 1_000;
        let mut ring = vec![0u64; WORDS];
        ring[index(5, 2, START)] = word(5, t);
        ring[index(5, 2, PEER + 1)] = word(5, t + 100);
        ring[index(5, 2, REDUCE)] = word(5, 0);
        ring[index(5, 2, END)] = word(5, 0);
        let got = decode(|i| ring[i], &[(5, 9)], &clock);
        let b = &got[0].blocks[0];
        assert_eq!((b.block, b.reduce, b.end), (2, None, None));
        assert!(b.start.is_some());
        // Still running: the call has no span yet.
        assert_eq!(got[0].span(), None);
        // The reduce's blocks raised both words: the row ends.
        ring[index(5, 2, REDUCE)] = word(5, t + 900);
        ring[index(5, 2, END)] = word(5, t + 950);
        let got = decode(|i| ring[i], &[(5, 9)], &clock);
        let (s, e) = got[0].span().unwrap();
        assert_eq!(e - s, 950);
    }
}
