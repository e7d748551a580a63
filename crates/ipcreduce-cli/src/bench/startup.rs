//! The benchmark's start-up figures: how long the communicator took to start and how long the
//! first checked all-reduce took after it (on cuda that includes compiling its kernels, or
//! reading them from the cache, see `ipcreduce warmup`), each the slowest rank's.

use super::{Measure, Runner};
use crate::harness::gather_f64;
use ipcreduce::error::Result;
use ipcreduce::types::{Algorithm, BackendKind, DType, ReduceOp};
use ipcreduce::Communicator;
use std::time::{Duration, Instant};

/// The start-up figures of one run (seconds, slowest rank), for the header and the JSON.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Startup {
    /// `Communicator::init`.
    pub init_s: f64,
    /// The first call's buffers and the benchmark's own kernels (input refresh).
    pub setup_s: f64,
    /// The first all-reduce after init, checked, kernels compiled or loaded on first use.
    pub first_call_s: f64,
    /// What that call was.
    pub first_call: String,
    /// Wrong elements of that call (0: right).
    pub wrong: u64,
    /// Where the cuda backend keeps compiled kernels (None on host).
    pub kernel_cache_dir: Option<String>,
}

/// The call [`measure`] times.
#[derive(Debug, Clone, Copy)]
pub struct Probe {
    pub dtype: DType,
    pub op: ReduceOp,
    pub algo: Algorithm,
    pub bytes: usize,
    /// Calls captured in one CUDA graph (None: eager).
    pub graph: Option<usize>,
}

/// Runs one checked all-reduce of `dtype`, `bytes` and `algo` (the table's first row), or with
/// `graph` K of them captured in a CUDA graph and replayed (so the kernels are first needed
/// inside a stream capture), and returns the start-up figures with `init` (this rank's init
/// time).
pub fn measure(
    comm: &mut Communicator,
    init: Duration,
    first: Probe,
    pdl: super::cuda::RefreshPdl,
) -> Result<Startup> {
    let Probe {
        dtype,
        op,
        algo,
        bytes,
        graph,
    } = first;
    let count = (bytes / dtype.size()).max(1);
    let t0 = Instant::now();
    let mut runner = Runner::new(comm, count * dtype.size(), false, pdl)?;
    let setup = t0.elapsed();
    let m = Measure {
        dtype,
        op,
        algo,
        count,
        world: comm.world(),
        seed: 0x0057_4741_5254_5550,
        warmup: 0,
        iters: 1,
        graph,
    };
    let t1 = Instant::now();
    let got = runner.measure(comm, &m)?;
    let first = t1.elapsed();
    runner.free(comm);
    let slowest = |comm: &mut Communicator, d: Duration| -> Result<f64> {
        Ok(gather_f64(comm, d.as_secs_f64())?
            .into_iter()
            .fold(0.0, f64::max))
    };
    let wrong = got.wrong_calls + got.wrong_final;
    Ok(Startup {
        init_s: slowest(comm, init)?,
        setup_s: slowest(comm, setup)?,
        first_call_s: slowest(comm, first)?,
        first_call: format!(
            "{} {} of {} B, {}{}",
            dtype.name(),
            op.name(),
            count * dtype.size(),
            algo.name(),
            if wrong == 0 { ", checked" } else { ", WRONG" }
        ) + &graph.map_or(String::new(), |k| {
            format!(", {k} calls captured in a CUDA graph, replayed")
        }),
        wrong,
        kernel_cache_dir: (comm.backend() == BackendKind::Cuda).then(|| {
            ipcreduce::backend::cuda::kernels::cache::default_dir()
                .display()
                .to_string()
        }),
    })
}

impl Startup {
    /// The header lines (rank 0).
    pub fn print(&self) {
        let setup = match self.kernel_cache_dir {
            Some(_) => format!(", its buffers and refresh kernels {:.3} s", self.setup_s),
            None => String::new(),
        };
        println!(
            "# start-up (slowest rank): init {:.3} s, first call {:.3} s ({}){setup}",
            self.init_s, self.first_call_s, self.first_call
        );
        if let Some(dir) = &self.kernel_cache_dir {
            println!(
                "#   kernels are compiled on first use and kept in {dir} (IPCREDUCE_CACHE_DIR; \
                 `ipcreduce warmup` fills it ahead)"
            );
        }
    }
}
