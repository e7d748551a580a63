//! The benchmark's timed loop on the host backend: back-to-back calls, as OSU and IMB time
//! them and as a program calls the library, with every call's data checked outside the timing.
//!
//! Host calls are synchronous and run on the rank's own core, so a check or a refresh between
//! two timed calls would be timed too: the slowest rank's check delays every peer's next call,
//! and the calls absorb that skew. Instead each round prepares its inputs first: call `j` of a
//! round reads input buffer `j` and writes output buffer `j`, each input a different iteration
//! of `pattern` (every element differs from the previous iteration's, so a result made from a
//! stale input is wrong) and each output poisoned; then a barrier, the calls back to back,
//! timed as one span, and every output checked against its iteration's exact result. When
//! the buffers of a whole round do not fit the cache budget ([`CACHE_BYTES`] shared by the
//! ranks), the round runs in segments of as many calls as fit (a barrier before each, the
//! segments' spans added): a program's back-to-back calls reuse one buffer pair that stays in
//! cache, and a segment streaming through hundreds of MiB of fresh buffers timed memory
//! bandwidth instead (up to 3.6x the library loop, examples/host_loop.rs, at mid sizes).
//! Preparing a segment's inputs just before its barrier leaves them in cache, as the loop's.
//!
//! A round has at least `iters` calls and enough for [`ROUND_SPAN`] at the warm-up's pace
//! (agreed by every rank: the slowest estimate), at most [`MAX_CALLS`]: small messages need
//! thousands of calls before one barrier's skew stops mattering. [`ROUNDS`] rounds; the row
//! reports, per round, the slowest rank's mean, and their median, minimum and maximum.

use super::pattern::{self, value};
use super::{Measure, Measured, MAX_ROUNDS};
use ipcreduce::element::store_f64;
use ipcreduce::error::{Error, Result};
use ipcreduce::Communicator;
use std::ffi::c_void;
use std::time::{Duration, Instant};

/// Rounds per measurement (each one a median candidate).
pub const ROUNDS: usize = 5;
/// Wall time a round aims for, at the warm-up's pace.
const ROUND_SPAN: Duration = Duration::from_millis(4);
/// Most calls in one round (small messages).
const MAX_CALLS: usize = 20_000;
/// Bytes of input plus output buffers the segments of all ranks may hold together: about half
/// the last-level cache (32 MiB on the 2-core machine), leaving the rest to the shared arena.
const CACHE_BYTES: usize = 16 << 20;
/// Least bytes per rank's segment (many ranks), so small messages still make long segments.
const MIN_SEGMENT_BYTES: usize = 1 << 20;

/// Calls per segment for `slot_bytes`-byte slots at `world` ranks: input and output buffers
/// of all of them within the rank's share of [`CACHE_BYTES`], at least one call.
pub fn segment_calls(slot_bytes: usize, world: usize) -> usize {
    let share = (CACHE_BYTES / world.max(1)).max(MIN_SEGMENT_BYTES);
    (share / (2 * slot_bytes.max(1))).max(1)
}

pub struct HostRunner {
    /// Inputs, then outputs, of one segment: `2 * calls` slots of `slot` bytes in u64 words
    /// (the buffers must be aligned to the element size).
    buf: Vec<u64>,
}

fn bytes_mut(v: &mut [u64]) -> &mut [u8] {
    // SAFETY: any byte pattern is a valid u64 and the length covers the same memory.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast(), v.len() * 8) }
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
        Ok(HostRunner { buf: Vec::new() })
    }

    /// One measurement: the warm-up (which also sets the calls per round), then [`ROUNDS`]
    /// rounds of back-to-back calls.
    pub fn measure(&mut self, comm: &mut Communicator, m: &Measure) -> Result<Measured> {
        let salts = pattern::salts(m.seed, m.world);
        let mut next_iter = 0u32;
        let mut wrong = 0u64;
        let mut calls = 0u64;
        // Warm-up: untimed for the row, but its pace sets the length of a round.
        let warm = m.warmup.max(1);
        let (span, _) = self.round(comm, m, &salts, &mut next_iter, warm, &mut wrong)?;
        calls += warm as u64;
        let pace = span.as_secs_f64() / warm as f64;
        let wanted = (ROUND_SPAN.as_secs_f64() / pace.max(1e-9)).ceil() as u64;
        let mine = wanted.clamp(m.iters.max(1) as u64, MAX_CALLS as u64);
        // Every rank runs the same number of calls: the most any rank asks for.
        let per_round = gather_max(comm, mine)? as usize;

        let mut rounds = [0.0f64; MAX_ROUNDS];
        let mut prep = Duration::ZERO;
        for r in rounds.iter_mut().take(ROUNDS) {
            let (span, p) = self.round(comm, m, &salts, &mut next_iter, per_round, &mut wrong)?;
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

    /// `n` calls in segments that fit the cache budget ([`segment_calls`]): for each, inputs filled and outputs
    /// poisoned, a barrier, the calls timed back to back, every output checked. Returns the
    /// summed span of the calls and the time spent preparing and checking.
    fn round(
        &mut self,
        comm: &mut Communicator,
        m: &Measure,
        salts: &[u32],
        next_iter: &mut u32,
        n: usize,
        wrong: &mut u64,
    ) -> Result<(Duration, Duration)> {
        let bytes = m.count * m.dtype.size();
        // Slots start on 8 bytes; at least one word so that empty messages have addresses.
        let slot_words = bytes.div_ceil(8).max(1);
        let fit = segment_calls(slot_words * 8, m.world);
        let rank = comm.rank();
        let mut span = Duration::ZERO;
        let mut prep = Duration::ZERO;
        let mut done = 0;
        while done < n {
            let seg = fit.min(n - done);
            let t_prep = Instant::now();
            if self.buf.len() < 2 * seg * slot_words {
                self.buf.resize(2 * seg * slot_words, 0);
            }
            let first = *next_iter;
            {
                let all = bytes_mut(&mut self.buf);
                let (inputs, outputs) = all.split_at_mut(seg * slot_words * 8);
                for j in 0..seg {
                    let it = first.wrapping_add(j as u32);
                    let input = &mut inputs[j * slot_words * 8..][..bytes];
                    for i in 0..m.count {
                        let v = value(salts[rank], rank, it, i as u64);
                        store_f64(m.dtype, input, i, f64::from(v));
                    }
                    outputs[j * slot_words * 8..][..bytes].fill(0xFF);
                }
            }
            prep += t_prep.elapsed();
            comm.bootstrap().barrier()?;
            let base = self.buf.as_mut_ptr();
            let t0 = Instant::now();
            for j in 0..seg {
                // SAFETY: input j and output j are distinct slots of `bytes` inside `buf`,
                // aligned to 8; the call is finished when it returns (host calls are
                // synchronous).
                unsafe {
                    let send = base.add(j * slot_words);
                    let recv = base.add((seg + j) * slot_words);
                    comm.all_reduce_raw(
                        send.cast::<c_void>(),
                        recv.cast::<c_void>(),
                        m.count,
                        m.dtype,
                        m.op,
                        m.algo,
                        std::ptr::null_mut(),
                    )?;
                }
            }
            span += t0.elapsed();
            let t_check = Instant::now();
            let all = bytes_mut(&mut self.buf);
            for j in 0..seg {
                let it = first.wrapping_add(j as u32);
                let out = &all[(seg + j) * slot_words * 8..][..bytes];
                *wrong += pattern::count_wrong(m.dtype, m.op, salts, it, out);
            }
            prep += t_check.elapsed();
            *next_iter = first.wrapping_add(seg as u32);
            done += seg;
        }
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
    use super::segment_calls;

    #[test]
    fn segments_stay_within_the_cache_budget() {
        // 2 KiB at 2 ranks: 8 MiB per rank, 4 KiB per call (input + output).
        assert_eq!(segment_calls(2048, 2), 2048);
        // 4 ranks: 4 MiB each.
        assert_eq!(segment_calls(2048, 4), 1024);
        // Many ranks: still 1 MiB per rank.
        assert_eq!(segment_calls(2048, 64), 256);
        // A message larger than the share: one call per segment.
        assert_eq!(segment_calls(32 << 20, 2), 1);
        // An empty message counts as one byte per slot: 8 MiB / (2 * 1 B).
        assert_eq!(segment_calls(0, 2), 4 << 20);
    }
}
