//! The benchmark's timed loop on the host backend: the same contract as the cuda one
//! (cuda.rs), with the refresh (`pattern::Refresh`) run by the rank itself after each call.
//! Host calls are synchronous, so each call is timed alone by the wall clock (no
//! subtraction needed); the refresh's own time is reported beside it.

use super::pattern::{self, Refresh};
use super::{Measure, Measured};
use ipcreduce::error::{Error, Result};
use ipcreduce::Communicator;
use std::ffi::c_void;
use std::time::Instant;

pub struct HostRunner {
    /// u64 words: the buffers must be aligned to the element size.
    send: Vec<u64>,
    recv: Vec<u64>,
}

fn bytes_mut(v: &mut [u64]) -> &mut [u8] {
    // SAFETY: any byte pattern is a valid u64 and the length covers the same memory.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast(), v.len() * 8) }
}

impl HostRunner {
    pub fn new(comm: &Communicator, capacity: usize, registered: bool) -> Result<HostRunner> {
        if registered {
            return Err(Error::invalid(
                comm.rank(),
                "bench --registered",
                "registered buffers need the cuda backend",
            ));
        }
        let words = capacity.div_ceil(8);
        Ok(HostRunner {
            send: vec![0; words],
            recv: vec![0; words],
        })
    }

    /// One measurement: first input, then `warmup` + `iters` (all-reduce, refresh) pairs,
    /// then the final output checked.
    pub fn measure(&mut self, comm: &mut Communicator, m: &Measure) -> Result<Measured> {
        let bytes = m.count * m.dtype.size();
        if bytes > self.send.len() * 8 {
            return Err(Error::invalid(
                comm.rank(),
                "bench",
                "message exceeds the buffers",
            ));
        }
        let salts = pattern::salts(m.seed, m.world);
        let f = Refresh {
            dtype: m.dtype,
            op: m.op,
            salts: &salts,
            rank: comm.rank(),
        };
        bytes_mut(&mut self.recv)[..bytes].fill(0xFF);
        // The first input (iteration u32::MAX + 1 = 0); nothing to check yet.
        f.run(
            u32::MAX,
            false,
            &[],
            &mut bytes_mut(&mut self.send)[..bytes],
        );
        comm.bootstrap().barrier()?;

        let mut iter = 0u32;
        let mut wrong_calls = 0;
        // Time spent in the all-reduces and in the refreshes, timed calls only.
        let (mut in_calls, mut in_refresh) = (0.0f64, 0.0f64);
        let (send_p, recv_p) = (self.send.as_ptr(), self.recv.as_mut_ptr());
        let call = |comm: &mut Communicator,
                    iter: &mut u32,
                    wrong: &mut u64,
                    times: Option<(&mut f64, &mut f64)>|
         -> Result<()> {
            let t0 = Instant::now();
            // SAFETY: both vectors hold at least `bytes`, are aligned to 8 and distinct.
            unsafe {
                comm.all_reduce_raw(
                    send_p.cast::<c_void>(),
                    recv_p.cast::<c_void>(),
                    m.count,
                    m.dtype,
                    m.op,
                    m.algo,
                    std::ptr::null_mut(),
                )?;
            }
            let t1 = Instant::now();
            // SAFETY: as above; the call is finished (host calls are synchronous).
            unsafe {
                let recv = std::slice::from_raw_parts(recv_p.cast::<u8>(), bytes);
                let send = std::slice::from_raw_parts_mut(send_p.cast_mut().cast::<u8>(), bytes);
                *wrong += f.run(*iter, true, recv, send);
            }
            if let Some((calls, refresh)) = times {
                *calls += (t1 - t0).as_secs_f64();
                *refresh += t1.elapsed().as_secs_f64();
            }
            *iter += 1;
            Ok(())
        };
        for _ in 0..m.warmup {
            call(comm, &mut iter, &mut wrong_calls, None)?;
        }
        let iters = m.iters.max(1);
        for _ in 0..iters {
            call(
                comm,
                &mut iter,
                &mut wrong_calls,
                Some((&mut in_calls, &mut in_refresh)),
            )?;
        }
        let refresh_us = in_refresh * 1e6 / iters as f64;
        // Reported as the bench's gross (call + refresh): the row's time is gross - refresh.
        let gross_us = (in_calls + in_refresh) * 1e6 / iters as f64;
        let out = bytes_mut(&mut self.recv)[..bytes].to_vec();
        let wrong_final = pattern::count_wrong(m.dtype, m.op, &salts, iter - 1, &out);

        Ok(Measured {
            gross_us,
            refresh_us,
            calls: u64::from(iter),
            wrong_calls,
            wrong_final,
        })
    }
}
