//! Back-to-back host all-reduces as a program makes them: the same buffers every call, no
//! checks between calls. The reference that `ipcreduce bench`'s host figures are compared with
//! (scripts/host/mpi-compare.sh, its library phase).
//!
//! Per size: 10 warm-up calls (their pace sets the calls per round: 10 ms worth, at least 20,
//! the most any rank asks for), then 7 rounds (the bench's), each a barrier and the calls timed
//! as one span;
//! per round the slowest rank's mean per call. Rank 0 prints `bytes,median_us,min_us,max_us`.
//! The last call's result is checked; a wrong element fails the run.
//!
//! Run: `ipcreduce launch -n 2 target/release/examples/host_loop [MIN MAX FACTOR]`.

use ipcreduce::{Algorithm, BackendChoice, Communicator, Config, ReduceOp};
use std::time::{Duration, Instant};

const ROUNDS: usize = 7;
const ROUND_SPAN: Duration = Duration::from_millis(10);

fn arg(i: usize, default: usize) -> usize {
    std::env::args()
        .nth(i)
        .map(|s| {
            s.parse()
                .unwrap_or_else(|_| panic!("argument {i}: '{s}' is not a number"))
        })
        .unwrap_or(default)
}

/// The largest of every rank's `v` (through the bootstrap: untimed).
fn max_of(comm: &mut Communicator, v: f64) -> ipcreduce::Result<f64> {
    let all = comm.bootstrap().all_gather(&v.to_le_bytes())?;
    Ok(all
        .iter()
        .filter_map(|b| b.get(..8)?.try_into().ok().map(f64::from_le_bytes))
        .fold(v, f64::max))
}

fn main() -> ipcreduce::Result<()> {
    let (min, max, factor) = (arg(1, 8), arg(2, 16 << 20), arg(3, 4).max(2));
    let config = Config {
        backend: BackendChoice::Host,
        ..Config::default()
    };
    let mut comm = Communicator::init(&config)?;
    let (rank, world) = (comm.rank(), comm.world());
    let mut bytes = min.max(4);
    while bytes <= max {
        let n = bytes / 4;
        // Small integers: the float sum is exact.
        let send: Vec<f32> = (0..n).map(|i| ((i + 3 * rank) % 13) as f32).collect();
        let mut recv = vec![0f32; n];
        let t = Instant::now();
        for _ in 0..10 {
            comm.all_reduce_host(&send, &mut recv, ReduceOp::Sum, Algorithm::Auto)?;
        }
        let pace = t.elapsed().as_secs_f64() / 10.0;
        let want = (ROUND_SPAN.as_secs_f64() / pace.max(1e-9)).ceil().max(20.0);
        let calls = max_of(&mut comm, want)? as usize;
        let mut rounds = Vec::with_capacity(ROUNDS);
        for _ in 0..ROUNDS {
            recv.fill(f32::NAN);
            comm.bootstrap().barrier()?;
            let t = Instant::now();
            for _ in 0..calls {
                comm.all_reduce_host(&send, &mut recv, ReduceOp::Sum, Algorithm::Auto)?;
            }
            let mean = t.elapsed().as_secs_f64() * 1e6 / calls as f64;
            rounds.push(max_of(&mut comm, mean)?);
        }
        let wrong = (0..n)
            .filter(|&i| {
                let want: f32 = (0..world).map(|r| ((i + 3 * r) % 13) as f32).sum();
                recv[i] != want
            })
            .count();
        if wrong != 0 {
            return Err(ipcreduce::Error::invalid(
                rank,
                "host_loop",
                format!("{wrong} wrong elements at {bytes} B"),
            ));
        }
        rounds.sort_by(f64::total_cmp);
        if rank == 0 {
            println!(
                "{bytes},{:.3},{:.3},{:.3}",
                rounds[ROUNDS / 2],
                rounds[0],
                rounds[ROUNDS - 1]
            );
        }
        bytes *= factor;
    }
    Ok(())
}
