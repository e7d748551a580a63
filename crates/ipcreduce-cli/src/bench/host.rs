//! The benchmark's timed loop on the host backend: back-to-back calls, as OSU and IMB time
//! them and as a program calls the library, with every call's data checked outside the timing.
//!
//! Host calls are synchronous and run on the rank's own core, so a check or a refresh between
//! two timed calls would be timed too: the slowest rank's check delays every peer's next call,
//! and the calls absorb that skew. Instead the calls cycle through `slots` input/output buffer
//! pairs (call `j` on slot `j mod slots`), slot `k`'s input being iteration `k` of `pattern`
//! (every element differs from the next iteration's, so a result made from the previous
//! call's input is wrong). A round poisons every slot's output, then one barrier, the calls
//! back to back, timed as one span, and every slot's output compared with its iteration's
//! exact result (a slot's last call: with more calls than slots, what an earlier call on the
//! slot wrote is overwritten by the same values). The slots of all ranks stay within a cache
//! budget ([`CACHE_BYTES`]), at least two: a program's back-to-back calls reuse one buffer
//! pair that stays in cache, and two is the fewest with which no call has the input of the
//! call before it. (Barriers between segments of fresh buffers, which this replaced, put one
//! barrier before every call of a message larger than a rank's share, and the calls absorbed
//! the ranks' skew: up to 7.6x the library's own loop, examples/host_loop.rs, at 2 MiB and 4
//! ranks.)
//!
//! The inputs and the results they must give are made once per measurement, when a round
//! first needs their slot ([`Slots`]); a round's own work is the poisoning and a comparison of
//! bytes. Why: with more ranks than cores, CPU work between the timed spans slowed the calls
//! after it, even past the lead-in below. On the 2-core machine, 4 ranks at 512 KiB
//! (2026-12-08, 8-12 runs in turns): the bench took 255-309 us a call (median) where the
//! library's loop took 213-218; without the per-round check 244, with 3 ms of spinning in its
//! place 270, with 3 ms of sleep 197-217. Made once, in turns with the per-round version five
//! times: 218 us against 282 (bench/results/2026-12-08-host-slots-once/).
//!
//! A round has at least `iters` calls and enough for [`ROUND_SPAN`] at the warm-up's pace
//! (agreed by every rank: the slowest estimate), at most [`MAX_CALLS`]: small messages need
//! thousands of calls before one barrier's skew stops mattering. [`ROUNDS`] rounds; the row
//! reports, per round, the slowest rank's mean, and their median, minimum and maximum.
//!
//! Between the barrier and the timed span, as many untimed lead-in calls as timed ones (OSU's
//! `skip`, per round): the barrier leaves the cores idle or busy with other work, and the
//! calls right after ran slower than a program's steady back-to-back calls. On the 2-core
//! machine, 4 ranks at 2 MiB (2026-12-07): after 50 ms of idling, the next round took
//! 921-1311 us a call against 750-828 without the gap; 20 lead-in calls brought it to 743-802
//! (one run 1108), 80 to 748-825. The lead-in calls write each result into the next slot's
//! output, so that a timed call that writes nothing still leaves a wrong result (the previous
//! slot's iteration, or the poison) where its check looks.

use super::pattern::{self, Pattern};
use super::{Measure, Measured, MAX_ROUNDS};
use ipcreduce::element::{load_f64, store_f64};
use ipcreduce::error::{Error, Result};
use ipcreduce::Communicator;
use std::ffi::c_void;
use std::time::{Duration, Instant};

/// Rounds per measurement (each one a median candidate), and the wall time a round aims for
/// at the warm-up's pace. Seven of 10 ms: on the 2-core machine (2 ranks, 8 B-512 KiB, three
/// alternations of five runs each, 2026-12-04) the run-to-run spread of the medians was 7-76 %
/// (median 25 %) with five rounds of 4 ms, 2-32 % (median 7 %) with these.
pub const ROUNDS: usize = 7;
const ROUND_SPAN: Duration = Duration::from_millis(10);
/// Most calls in one round (small messages).
const MAX_CALLS: usize = 20_000;
/// Bytes of input plus output buffers the slots of all ranks may hold together: one core's L2
/// on the 2-core machine (1 MiB). A program's back-to-back calls on one buffer pair keep it
/// there; slots through 16 MiB (half the L3) timed L3 misses: 1.8-6.6x the library's own loop
/// at 512 B-128 KiB with 4 ranks (2026-12-04, bench/results/2026-12-04-host-mpi5-check/).
const CACHE_BYTES: usize = 1 << 20;
/// Least bytes of one rank's slots (many ranks), so small messages still get many slots.
const MIN_SLOT_BYTES: usize = 128 << 10;

/// Slots (input and output buffer pairs) a round of `calls` calls of `slot_bytes` bytes cycles
/// through at `world` ranks: as many as fit the rank's share of [`CACHE_BYTES`], at least two
/// (so that no call has the input of the call before it) and at most one per call.
pub fn slots_for(slot_bytes: usize, world: usize, calls: usize) -> usize {
    let share = (CACHE_BYTES / world.max(1)).max(MIN_SLOT_BYTES);
    (share / (2 * slot_bytes.max(1))).clamp(2, calls.max(2))
}

pub struct HostRunner {
    slots: Slots,
}

/// Largest message whose slots hold their expected results ([`Slots`]): two slots of it, the
/// fewest a round has, then hold 64 MiB. Larger messages compute them again at every check
/// (from the [`Pattern`]), so that the bench needs the memory of the inputs and outputs only,
/// as before; their calls take long enough that the check's cost matters less.
const HELD_RESULT_MAX_BYTES: usize = 32 << 20;

/// One measurement's buffers: slot `k`'s input (iteration `k` of the pattern), output, and
/// the exact result of its input (up to [`HELD_RESULT_MAX_BYTES`]), each `words` u64 words
/// (so aligned to any element size). Slots are made when a round first needs them and kept
/// for the measurement's later rounds.
#[derive(Default)]
struct Slots {
    words: usize,
    /// Whether `expected` holds each slot's result (else the check computes it).
    held: bool,
    /// Slots whose input (and expected result) are made.
    made: usize,
    inputs: Vec<u64>,
    outputs: Vec<u64>,
    expected: Vec<u64>,
}

impl Slots {
    /// Empty slots of `words` words each, for a new measurement; their results held or not.
    fn reset(&mut self, words: usize, held: bool) {
        self.words = words;
        self.held = held;
        self.made = 0;
        if !held {
            self.expected = Vec::new();
        }
    }

    /// Makes slots up to `slots`: rank `rank`'s input of iteration `k` in slot `k`, and the
    /// result every rank must get from it.
    fn make(&mut self, m: &Measure, pattern: &Pattern, rank: usize, slots: usize) {
        if slots <= self.made {
            return;
        }
        let len = slots * self.words;
        for v in [&mut self.inputs, &mut self.outputs] {
            if v.len() < len {
                v.resize(len, 0);
            }
        }
        if self.held && self.expected.len() < len {
            self.expected.resize(len, 0);
        }
        let bytes = m.count * m.dtype.size();
        for k in self.made..slots {
            let it = k as u32;
            let input = &mut bytes_mut(&mut self.inputs[k * self.words..])[..bytes];
            for i in 0..m.count {
                store_f64(m.dtype, input, i, f64::from(pattern.value(rank, it, i)));
            }
            if !self.held {
                continue;
            }
            let want = &mut bytes_mut(&mut self.expected[k * self.words..])[..bytes];
            for i in 0..m.count {
                store_f64(m.dtype, want, i, pattern.expected(m.op, it, i));
            }
        }
        self.made = slots;
    }

    /// Fills the first `slots` outputs with a value no call gives (all bits set: NaN).
    fn poison(&mut self, slots: usize) {
        self.outputs[..slots * self.words].fill(u64::MAX);
    }

    /// Elements of slot `k`'s output (`bytes` long) that differ from its expected result.
    fn wrong(&self, m: &Measure, pattern: &Pattern, k: usize, bytes: usize) -> u64 {
        let slot = k * self.words..(k + 1) * self.words;
        let out = &bytes_of(&self.outputs[slot.clone()])[..bytes];
        if !self.held {
            return pattern.count_wrong(m.dtype, m.op, k as u32, out, m.world);
        }
        let want = &bytes_of(&self.expected[slot])[..bytes];
        // Equal bytes are equal values (small integers have one encoding in each dtype);
        // only a mismatch pays for the element by element count.
        if out == want {
            return 0;
        }
        pattern::count_wrong_by(m.dtype, out, m.world, |i| load_f64(m.dtype, want, i))
    }
}

/// The calls of one round: untimed lead-in calls, then the timed ones.
#[derive(Clone, Copy)]
struct Calls {
    lead_in: usize,
    timed: usize,
}

/// The input and output slots of call `j` of a round: input `j mod slots`; output the same
/// slot for a timed call, the next one for a lead-in call (whose result is then the wrong
/// iteration for that slot, until a timed call overwrites it).
fn slots_of_call(j: usize, slots: usize, lead_in: bool) -> (usize, usize) {
    (j % slots, (j + usize::from(lead_in)) % slots)
}

fn bytes_mut(v: &mut [u64]) -> &mut [u8] {
    // SAFETY: any byte pattern is a valid u64 and the length covers the same memory.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast(), v.len() * 8) }
}

fn bytes_of(v: &[u64]) -> &[u8] {
    // SAFETY: the length covers the same memory, and u8 has no invalid values.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), v.len() * 8) }
}

impl HostRunner {
    pub fn new(comm: &Communicator, _capacity: usize, registered: bool) -> Result<HostRunner> {
        if registered {
            return Err(Error::invalid(
                comm.rank(),
                "bench --registered",
                "registered buffers need the cuda backend",
            ));
        }
        Ok(HostRunner {
            slots: Slots::default(),
        })
    }

    /// One measurement: the warm-up (which also sets the calls per round), then [`ROUNDS`]
    /// rounds of back-to-back calls.
    pub fn measure(&mut self, comm: &mut Communicator, m: &Measure) -> Result<Measured> {
        let pattern = Pattern::new(m.seed, m.world, m.count);
        // Slots start on 8 bytes; at least one word so that empty messages have addresses.
        let bytes = m.count * m.dtype.size();
        self.slots
            .reset(bytes.div_ceil(8).max(1), bytes <= HELD_RESULT_MAX_BYTES);
        let mut wrong = 0u64;
        let mut calls = 0u64;
        // Warm-up: untimed for the row, but its pace sets the length of a round.
        let warm = m.warmup.max(1);
        let warm_calls = Calls {
            lead_in: 0,
            timed: warm,
        };
        let (span, _) = self.round(comm, m, &pattern, warm_calls, &mut wrong)?;
        calls += warm as u64;
        let pace = span.as_secs_f64() / warm as f64;
        let wanted = (ROUND_SPAN.as_secs_f64() / pace.max(1e-9)).ceil() as u64;
        let mine = wanted.clamp(m.iters.max(1) as u64, MAX_CALLS as u64);
        // Every rank runs the same number of calls: the most any rank asks for.
        let per_round = gather_max(comm, mine)? as usize;

        let mut rounds = [0.0f64; MAX_ROUNDS];
        let mut prep = Duration::ZERO;
        for r in rounds.iter_mut().take(ROUNDS) {
            let round_calls = Calls {
                lead_in: per_round,
                timed: per_round,
            };
            let (span, p) = self.round(comm, m, &pattern, round_calls, &mut wrong)?;
            *r = span.as_secs_f64() * 1e6 / per_round as f64;
            prep += p;
            calls += per_round as u64;
        }
        let mut sorted = rounds[..ROUNDS].to_vec();
        sorted.sort_by(f64::total_cmp);
        let median = sorted[ROUNDS / 2];
        let refresh_us = prep.as_secs_f64() * 1e6 / (ROUNDS * per_round) as f64;
        Ok(Measured {
            gross_us: median + refresh_us,
            refresh_us,
            calls,
            wrong_calls: wrong,
            wrong_final: 0,
            rounds,
            nrounds: ROUNDS,
        })
    }

    /// `n` calls back to back over the slots that fit the cache budget ([`slots_for`]): the
    /// slots made if this is the first round to use them, their outputs poisoned, a barrier,
    /// `lead_in` untimed calls (call `j` from slot `j mod slots` into the next slot's output),
    /// the `n` calls timed as one span (call `j` on slot `j mod slots`), then every slot's
    /// output compared with its expected result. Returns the span and the time spent
    /// preparing and checking.
    fn round(
        &mut self,
        comm: &mut Communicator,
        m: &Measure,
        pattern: &Pattern,
        Calls { lead_in, timed: n }: Calls,
        wrong: &mut u64,
    ) -> Result<(Duration, Duration)> {
        let bytes = m.count * m.dtype.size();
        let words = self.slots.words;
        let slots = slots_for(words * 8, m.world, n);
        let t_prep = Instant::now();
        self.slots.make(m, pattern, comm.rank(), slots);
        self.slots.poison(slots);
        let mut prep = t_prep.elapsed();
        comm.bootstrap().barrier()?;
        let send_base = self.slots.inputs.as_mut_ptr();
        let recv_base = self.slots.outputs.as_mut_ptr();
        let mut call = |j: usize, lead_in: bool| -> Result<()> {
            let (k, o) = slots_of_call(j, slots, lead_in);
            // SAFETY: input k and output o are slots of `bytes` inside their buffers (made
            // above), aligned to 8; the call is finished when it returns (host calls are
            // synchronous).
            unsafe {
                comm.all_reduce_raw(
                    send_base.add(k * words).cast::<c_void>(),
                    recv_base.add(o * words).cast::<c_void>(),
                    m.count,
                    m.dtype,
                    m.op,
                    m.algo,
                    std::ptr::null_mut(),
                )
            }
        };
        for j in 0..lead_in {
            call(j, true)?;
        }
        let t0 = Instant::now();
        for j in 0..n {
            call(j, false)?;
        }
        let span = t0.elapsed();
        let t_check = Instant::now();
        for k in 0..slots.min(n) {
            *wrong += self.slots.wrong(m, pattern, k, bytes);
        }
        prep += t_check.elapsed();
        Ok((span, prep))
    }
}

/// The largest of every rank's `v` (collective, untimed).
fn gather_max(comm: &mut Communicator, v: u64) -> Result<u64> {
    let all = comm.bootstrap().all_gather(&v.to_le_bytes())?;
    Ok(all
        .iter()
        .filter_map(|b| b.get(..8).and_then(|b| b.try_into().ok()))
        .map(u64::from_le_bytes)
        .max()
        .unwrap_or(v))
}

#[cfg(test)]
mod tests {
    use super::{slots_for, slots_of_call, Measure, Pattern, Slots};
    use crate::bench::pattern;
    use ipcreduce::element::{load_f64, store_f64};
    use ipcreduce::types::{Algorithm, DType, ReduceOp};

    /// Slots made for a measurement hold each rank's input of their iteration, and `wrong`
    /// counts exactly the elements of an output that differ from the exact result of every
    /// rank's (computed here from the pattern's free functions, rank by rank): none for the
    /// right result, one for one changed element, all for the poison and for the result of
    /// the next slot's iteration (a stale call). With the results held and without.
    #[test]
    fn slots_hold_their_iteration_and_count_wrong_elements() {
        let cases = [DType::F32, DType::F16, DType::Bf16]
            .into_iter()
            .flat_map(|d| [(d, true), (d, false)]);
        for (dtype, held) in cases {
            let (world, count, seed) = (4, 1001, 9);
            let m = Measure {
                dtype,
                op: ReduceOp::Sum,
                algo: Algorithm::Auto,
                count,
                world,
                seed,
                warmup: 1,
                iters: 1,
                graph: None,
            };
            let bytes = count * dtype.size();
            let salts = pattern::salts(seed, world);
            let p = Pattern::new(seed, world, count);
            let mut slots = Slots::default();
            slots.reset(bytes.div_ceil(8), held);
            slots.make(&m, &p, 2, 2);
            // More slots later keep the first ones and add the next iteration.
            slots.make(&m, &p, 2, 3);
            assert_eq!(slots.made, 3);
            let words = slots.words;
            let view = |v: &[u64], k: usize| -> Vec<u8> {
                v[k * words..][..words]
                    .iter()
                    .flat_map(|w| w.to_le_bytes())
                    .take(bytes)
                    .collect()
            };
            for k in 0..3 {
                let input = view(&slots.inputs, k);
                for i in 0..count {
                    let want = pattern::value(salts[2], 2, k as u32, i as u64);
                    assert_eq!(
                        load_f64(dtype, &input, i),
                        f64::from(want),
                        "{dtype} held {held} slot {k}"
                    );
                }
            }
            let result = |it: u32| -> Vec<u8> {
                let mut out = vec![0u8; bytes];
                for i in 0..count {
                    let sum: i32 = (0..world)
                        .map(|r| pattern::value(salts[r], r, it, i as u64))
                        .sum();
                    store_f64(dtype, &mut out, i, f64::from(sum));
                }
                out
            };
            let mut put = |k: usize, data: &[u8]| {
                for (w, chunk) in slots.outputs[k * words..][..words]
                    .iter_mut()
                    .zip(data.chunks(8))
                {
                    let mut b = w.to_le_bytes();
                    b[..chunk.len()].copy_from_slice(chunk);
                    *w = u64::from_le_bytes(b);
                }
            };
            put(0, &result(0));
            let mut one_off = result(1);
            store_f64(dtype, &mut one_off, 500, 99.0);
            put(1, &one_off);
            put(2, &result(0));
            assert_eq!(slots.wrong(&m, &p, 0, bytes), 0, "{dtype} held {held}");
            assert_eq!(slots.wrong(&m, &p, 1, bytes), 1, "{dtype} held {held}");
            assert_eq!(
                slots.wrong(&m, &p, 2, bytes),
                count as u64,
                "{dtype} held {held}: stale"
            );
            slots.poison(3);
            for k in 0..3 {
                assert_eq!(
                    slots.wrong(&m, &p, k, bytes),
                    count as u64,
                    "{dtype} held {held}: poison"
                );
            }
        }
    }

    /// A round as `round` runs it, on iteration numbers instead of data: every slot the check
    /// reads holds its own iteration when every timed call writes, and a wrong one when the
    /// timed calls on that slot write nothing, although lead-in calls ran before them. (Timed
    /// calls on one slot write the same values, so the check sees the slot's last write.)
    #[test]
    fn timed_calls_that_write_nothing_leave_a_wrong_slot_despite_the_lead_in() {
        const POISON: usize = usize::MAX;
        for slots in 2..6 {
            for n in 1..13 {
                // The round: lead-in calls, then the timed ones but those on slot `skip`.
                let run = |skip: Option<usize>| {
                    let mut out = vec![POISON; slots];
                    for j in 0..n {
                        let (k, o) = slots_of_call(j, slots, true);
                        out[o] = k;
                    }
                    for j in 0..n {
                        let (k, o) = slots_of_call(j, slots, false);
                        assert_eq!(k, o, "a timed call writes its own slot");
                        if Some(k) != skip {
                            out[o] = k;
                        }
                    }
                    out
                };
                let checked = slots.min(n);
                let all = run(None);
                assert!(
                    (0..checked).all(|k| all[k] == k),
                    "slots {slots} n {n}: {all:?}"
                );
                for k in 0..checked {
                    assert_ne!(run(Some(k))[k], k, "slots {slots} n {n}: slot {k} unseen");
                }
            }
        }
    }

    #[test]
    fn slots_stay_within_the_cache_budget() {
        // 2 KiB at 2 ranks: 512 KiB per rank, 4 KiB per slot (input + output).
        assert_eq!(slots_for(2048, 2, 1 << 20), 128);
        // 4 ranks: 256 KiB each.
        assert_eq!(slots_for(2048, 4, 1 << 20), 64);
        // Many ranks: still 128 KiB per rank.
        assert_eq!(slots_for(2048, 64, 1 << 20), 32);
        // A message larger than the share: two slots, so consecutive calls differ.
        assert_eq!(slots_for(32 << 20, 2, 100), 2);
        // Never more slots than calls (but two): 8 B messages, 500 calls.
        assert_eq!(slots_for(8, 2, 500), 500);
        assert_eq!(slots_for(8, 2, 1), 2);
        // An empty message counts as one byte per slot.
        assert_eq!(slots_for(0, 2, 1 << 30), 256 << 10);
    }
}
