//! The benchmark's timed loop on the host backend: the same contract as the cuda one
//! (cuda.rs), with the refresh (`pattern::Refresh`) run by the rank itself after each call and
//! wall-clock times.

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
    /// then the refresh alone on a scratch copy, then the final output checked.
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
        let (send_p, recv_p) = (self.send.as_ptr(), self.recv.as_mut_ptr());
        let call = |comm: &mut Communicator, iter: &mut u32, wrong: &mut u64| -> Result<()> {
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
                let recv = std::slice::from_raw_parts(recv_p.cast::<u8>(), bytes);
                let send = std::slice::from_raw_parts_mut(send_p.cast_mut().cast::<u8>(), bytes);
                *wrong += f.run(*iter, true, recv, send);
            }
            *iter += 1;
            Ok(())
        };
        for _ in 0..m.warmup {
            call(comm, &mut iter, &mut wrong_calls)?;
        }
        let iters = m.iters.max(1);
        let t = Instant::now();
        for _ in 0..iters {
            call(comm, &mut iter, &mut wrong_calls)?;
        }
        let gross_us = t.elapsed().as_secs_f64() * 1e6 / iters as f64;
        let out = bytes_mut(&mut self.recv)[..bytes].to_vec();
        let wrong_final = pattern::count_wrong(m.dtype, m.op, &salts, iter - 1, &out);

        // The refresh alone, as often, on copies (its checks fail: ignored).
        let mut scratch = vec![0u8; bytes];
        let t = Instant::now();
        for k in 0..iters {
            std::hint::black_box(f.run(k as u32, true, &out, &mut scratch));
        }
        let refresh_us = t.elapsed().as_secs_f64() * 1e6 / iters as f64;
        Ok(Measured {
            gross_us,
            refresh_us,
            calls: u64::from(iter),
            wrong_calls,
            wrong_final,
        })
    }
}
