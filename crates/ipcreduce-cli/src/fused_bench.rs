//! `ipcreduce fused-bench`: the fused all-reduce + residual add + RMSNorm against the unfused
//! sequence (our all-reduce, then our reference add + RMSNorm kernel, same numerics), both in
//! CUDA-graph replay, side by side per (hidden, tokens). Every result is checked: before timing
//! and after it, the fused outputs must equal the unfused ones bit for bit on every rank.
//! Times are the median of `--rounds` rounds (each the mean of `--iters` calls), with the
//! rounds' spread (min-max); the ratio is unfused / fused (above 1: fused is faster). Each row
//! names the fused call's path and the unfused all-reduce's (`IPCREDUCE_FUSED_PATH` forces
//! the fused one).

use crate::gpu::{comm_context, cu, driver, Memory};
use cudarc::driver::{result, sys};
use ipcreduce::error::{Error, Result};
use ipcreduce::{AddRmsNorm, Algorithm, BackendKind, Communicator, DType, ReduceOp};
use std::ffi::c_void;

#[derive(clap::Args, Debug)]
pub struct FusedBenchArgs {
    #[command(flatten)]
    pub rank: crate::cli::RankArgs,
    /// Row widths (elements), comma separated.
    #[arg(long, value_delimiter = ',', default_value = "4096,8192,16384")]
    pub hidden: Vec<usize>,
    /// Rows (tokens), comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,128,512")]
    pub tokens: Vec<usize>,
    #[arg(long, default_value = "bf16")]
    pub dtype: DType,
    /// Calls captured per CUDA graph.
    #[arg(short = 'G', long, default_value_t = 20)]
    pub graph: usize,
    /// Calls timed per round (whole graphs).
    #[arg(long, default_value_t = 200)]
    pub iters: usize,
    /// Rounds per measurement; fused and unfused take turns.
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// Buffers registered with every peer (`Communicator::alloc`) instead of plain ones.
    #[arg(long)]
    pub registered: bool,
    /// Also write the rows as JSON lines to this file (rank 0).
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
}

pub fn run(args: FusedBenchArgs) -> i32 {
    if let Some(code) = crate::cli::relaunch_unless_rank(&args.rank) {
        return code;
    }
    if args.hidden.contains(&0) || args.tokens.contains(&0) || args.graph == 0 || args.rounds == 0 {
        return crate::cli::refuse("--hidden, --tokens, -G and --rounds must be at least 1");
    }
    match body(&args) {
        Ok(0) => 0,
        Ok(wrong) => {
            eprintln!("error: {wrong} wrong results");
            1
        }
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    }
}

/// One size's buffers.
struct Bufs {
    mems: Vec<Memory>,
}

impl Bufs {
    const INPUT: usize = 0;
    const RESIDUAL: usize = 1;
    const WEIGHT: usize = 2;
    const OUT: usize = 3;
    const RES_OUT: usize = 4;
    const SUM: usize = 5;
    const REF_OUT: usize = 6;
    const REF_RES_OUT: usize = 7;

    fn ptr(&self, i: usize) -> u64 {
        self.mems[i].ptr()
    }
}

fn body(args: &FusedBenchArgs) -> Result<usize> {
    let mut comm = crate::cli::join(&args.rank, false)?;
    let rank = comm.rank();
    if comm.backend() != BackendKind::Cuda {
        return Err(Error::invalid(
            rank,
            "fused-bench",
            "needs the cuda backend",
        ));
    }
    let ctx = comm_context(&comm)?;
    ctx.bind_to_thread()
        .map_err(cu(rank, "binding the context"))?;
    let stream = ctx.new_stream().map_err(cu(rank, "cuStreamCreate"))?;
    let d = args.dtype;
    if rank == 0 {
        println!(
            "# fused all-reduce + add + RMSNorm vs all-reduce + reference add + RMSNorm, {d}, \
             world {}, graphs of {} calls, {} rounds, {} buffers",
            comm.world(),
            args.graph,
            args.rounds,
            if args.registered {
                "registered"
            } else {
                "plain"
            }
        );
        println!(
            "{:>7} {:>7} {:>10} {:>22} {:>22} {:>7} {:>6} {:>14} {:>14}",
            "hidden",
            "tokens",
            "bytes/rank",
            "fused us (min-max)",
            "unfused us (min-max)",
            "ratio",
            "wrong",
            "fused path",
            "all-reduce"
        );
    }
    let mut wrong_total = 0;
    let mut json = Vec::new();
    for &hidden in &args.hidden {
        for &tokens in &args.tokens {
            let n = tokens * hidden;
            let bytes = n * d.size();
            let sizes = [
                bytes,
                bytes,
                hidden * d.size(),
                bytes,
                bytes,
                bytes,
                bytes,
                bytes,
            ];
            let mut mems = Vec::new();
            for b in sizes {
                mems.push(Memory::new(&mut comm, b, args.registered)?);
            }
            let bufs = Bufs { mems };
            fill(&bufs, d, n, hidden, rank, stream.cu_stream())?;
            let sp = stream.cu_stream() as *mut c_void;
            let fused = fused_args(&bufs, tokens, hidden, d, false);
            let unfused = fused_args(&bufs, tokens, hidden, d, true);
            let mut fused_call = |c: &mut Communicator| -> Result<()> {
                // SAFETY: the buffers hold the shape, on this communicator's GPU.
                unsafe { c.all_reduce_add_rms_norm_raw(&fused, Algorithm::Auto, sp) }
            };
            let mut unfused_call = |c: &mut Communicator| -> Result<()> {
                // SAFETY: as above.
                unsafe {
                    c.all_reduce_raw(
                        bufs.ptr(Bufs::INPUT) as *const c_void,
                        bufs.ptr(Bufs::SUM) as *mut c_void,
                        n,
                        d,
                        ReduceOp::Sum,
                        Algorithm::Auto,
                        sp,
                    )?;
                    c.add_rms_norm_reference_raw(&unfused, sp)
                }
            };
            // The paths the two calls take (the reference kernel records none: the unfused
            // sequence's is its all-reduce's). Every call of the row takes the same.
            let path = |c: &Communicator| c.last_path().map_or("?", |p| p.name);
            fused_call(&mut comm)?;
            let fused_path = path(&comm);
            unfused_call(&mut comm)?;
            let unfused_path = path(&comm);
            let mut wrong = check(&mut comm, &bufs, bytes, stream.cu_stream())?;
            let (mut tf, mut tu) = (Vec::new(), Vec::new());
            let ft = Timer::new(&ctx, &stream, &mut comm, args.graph, &mut fused_call)?;
            let ut = Timer::new(&ctx, &stream, &mut comm, args.graph, &mut unfused_call)?;
            for _ in 0..args.rounds {
                tf.push(ft.time(&mut comm, args.iters)?);
                tu.push(ut.time(&mut comm, args.iters)?);
            }
            wrong += check(&mut comm, &bufs, bytes, stream.cu_stream())?;
            wrong_total += wrong;
            let (f, u) = (spread(&mut tf), spread(&mut tu));
            if rank == 0 {
                println!(
                    "{hidden:>7} {tokens:>7} {bytes:>10} {:>22} {:>22} {:>7.2} {wrong:>6} \
                     {fused_path:>14} {unfused_path:>14}",
                    format!("{:.2} ({:.2}-{:.2})", f.0, f.1, f.2),
                    format!("{:.2} ({:.2}-{:.2})", u.0, u.1, u.2),
                    u.0 / f.0
                );
                json.push(serde_json::json!({
                    "hidden": hidden, "tokens": tokens, "dtype": d.name(), "bytes": bytes,
                    "world": comm.world(), "registered": args.registered,
                    "fused_us": f.0, "fused_min_us": f.1, "fused_max_us": f.2,
                    "unfused_us": u.0, "unfused_min_us": u.1, "unfused_max_us": u.2,
                    "ratio": u.0 / f.0, "wrong": wrong,
                    "fused_path": fused_path, "unfused_path": unfused_path,
                }));
            }
            drop(ft);
            drop(ut);
            stream
                .synchronize()
                .map_err(cu(rank, "cuStreamSynchronize"))?;
            for m in bufs.mems {
                m.free(&mut comm);
            }
        }
    }
    if let (Some(path), 0) = (&args.json, rank) {
        let text: String = json.iter().map(|j| format!("{j}\n")).collect();
        std::fs::write(path, text).map_err(|e| Error::io("writing the JSON rows", e))?;
    }
    comm.synchronize()?;
    Ok(wrong_total)
}

/// The call's arguments: the fused one reads the input, the unfused one's reference kernel the
/// all-reduced sum; each writes its own outputs (out of place, so every replay computes the
/// same values from the same inputs).
fn fused_args(b: &Bufs, tokens: usize, hidden: usize, dtype: DType, unfused: bool) -> AddRmsNorm {
    let (input, out, res_out) = if unfused {
        (Bufs::SUM, Bufs::REF_OUT, Bufs::REF_RES_OUT)
    } else {
        (Bufs::INPUT, Bufs::OUT, Bufs::RES_OUT)
    };
    AddRmsNorm {
        input: b.ptr(input) as *const c_void,
        residual: b.ptr(Bufs::RESIDUAL) as *const c_void,
        weight: b.ptr(Bufs::WEIGHT) as *const c_void,
        out: b.ptr(out) as *mut c_void,
        residual_out: b.ptr(res_out) as *mut c_void,
        fp8_out: std::ptr::null_mut(),
        fp8_scale: std::ptr::null(),
        tokens,
        hidden,
        dtype,
        eps: 1e-6,
    }
}

/// Values of `dtype` in [-2, 2) from a per-rank pattern (exact in every dtype: multiples of
/// 1/64 below 2).
fn pattern(dtype: DType, n: usize, seed: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(n * dtype.size());
    for i in 0..n {
        let v =
            ((i.wrapping_mul(2_654_435_761).wrapping_add(seed * 977)) % 256) as f32 / 64.0 - 2.0;
        match dtype {
            DType::F32 => out.extend_from_slice(&v.to_le_bytes()),
            DType::F16 => out.extend_from_slice(&half::f16::from_f32(v).to_le_bytes()),
            _ => out.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes()),
        }
    }
    out
}

fn fill(b: &Bufs, d: DType, n: usize, hidden: usize, rank: usize, s: sys::CUstream) -> Result<()> {
    for (i, data) in [
        (Bufs::INPUT, pattern(d, n, rank + 1)),
        (Bufs::RESIDUAL, pattern(d, n, 100)),
        (Bufs::WEIGHT, pattern(d, hidden, 200)),
    ] {
        // SAFETY: the buffer holds the bytes; synchronized before `data` goes away.
        unsafe { result::memcpy_htod_async(b.ptr(i), &data, s) }
            .map_err(driver(rank, "uploading the inputs"))?;
        // SAFETY: a live stream.
        unsafe { result::stream::synchronize(s) }.map_err(driver(rank, "cuStreamSynchronize"))?;
    }
    Ok(())
}

/// Elements where the fused outputs differ from the unfused ones, and every rank's outputs
/// must be the same (a rank whose outputs differ counts them all wrong).
fn check(comm: &mut Communicator, b: &Bufs, bytes: usize, s: sys::CUstream) -> Result<usize> {
    let rank = comm.rank();
    comm.synchronize()?;
    let get = |i: usize| -> Result<Vec<u8>> {
        let mut v = vec![0u8; bytes];
        // SAFETY: the buffer holds `bytes`; synchronized below before `v` is read.
        unsafe { result::memcpy_dtoh_async(&mut v, b.ptr(i), s) }
            .map_err(driver(rank, "downloading the outputs"))?;
        // SAFETY: a live stream.
        unsafe { result::stream::synchronize(s) }.map_err(driver(rank, "cuStreamSynchronize"))?;
        Ok(v)
    };
    let (out, res) = (get(Bufs::OUT)?, get(Bufs::RES_OUT)?);
    let (rout, rres) = (get(Bufs::REF_OUT)?, get(Bufs::REF_RES_OUT)?);
    let differ = |a: &[u8], b: &[u8]| a.iter().zip(b).filter(|(x, y)| x != y).count();
    let mut wrong = differ(&out, &rout) + differ(&res, &rres);
    let fp = fnv(&[&out, &res]).to_le_bytes();
    let all = comm.bootstrap().all_gather(&fp)?;
    if !all.iter().all(|f| f[..] == fp) {
        wrong += bytes;
    }
    Ok(wrong)
}

fn fnv(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for x in p.iter() {
            h ^= *x as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// (median, min, max) of `v`.
fn spread(v: &mut [f64]) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

/// A graph of `k` calls, and the events that time its replays.
struct Timer<'a> {
    graph: cudarc::driver::safe::CudaGraph,
    stream: &'a std::sync::Arc<cudarc::driver::safe::CudaStream>,
    start: cudarc::driver::safe::CudaEvent,
    end: cudarc::driver::safe::CudaEvent,
    k: usize,
}

impl<'a> Timer<'a> {
    fn new(
        ctx: &std::sync::Arc<cudarc::driver::safe::CudaContext>,
        stream: &'a std::sync::Arc<cudarc::driver::safe::CudaStream>,
        comm: &mut Communicator,
        k: usize,
        one: &mut dyn FnMut(&mut Communicator) -> Result<()>,
    ) -> Result<Timer<'a>> {
        let rank = comm.rank();
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = ctx.new_event(flags).map_err(cu(rank, "cuEventCreate"))?;
        let end = ctx.new_event(flags).map_err(cu(rank, "cuEventCreate"))?;
        stream
            .synchronize()
            .map_err(cu(rank, "cuStreamSynchronize"))?;
        let graph = crate::gpu::capture(stream, comm, k, one)?;
        // Warm-up replay.
        graph.launch().map_err(cu(rank, "cuGraphLaunch"))?;
        stream
            .synchronize()
            .map_err(cu(rank, "cuStreamSynchronize"))?;
        Ok(Timer {
            graph,
            stream,
            start,
            end,
            k,
        })
    }

    /// Microseconds per call over about `iters` calls (whole graphs).
    fn time(&self, comm: &mut Communicator, iters: usize) -> Result<f64> {
        let rank = comm.rank();
        let reps = iters.div_ceil(self.k).max(1);
        self.start
            .record(self.stream)
            .map_err(cu(rank, "cuEventRecord"))?;
        for _ in 0..reps {
            self.graph.launch().map_err(cu(rank, "cuGraphLaunch"))?;
        }
        self.end
            .record(self.stream)
            .map_err(cu(rank, "cuEventRecord"))?;
        self.stream
            .synchronize()
            .map_err(cu(rank, "cuStreamSynchronize"))?;
        comm.synchronize()?;
        let ms = self
            .start
            .elapsed_ms(&self.end)
            .map_err(cu(rank, "cuEventElapsedTime"))?;
        Ok(f64::from(ms) * 1e3 / (reps * self.k) as f64)
    }
}
