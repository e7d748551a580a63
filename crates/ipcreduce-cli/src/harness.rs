//! What `bench` and `check` share: run one call on backend-owned buffers with fresh data and
//! poisoned outputs, then check every element against the float64 reference. Also what the
//! benchmarks' reports share (gathers over ranks, the date).

use ipcreduce::backend::{BufId, Call};
use ipcreduce::error::Result;
use ipcreduce::reference::{count_wrong_nodes_par, fill_input_par, fingerprint};
use ipcreduce::Communicator;

/// Poison byte for outputs and guard areas: all-ones is NaN in every dtype.
const POISON: u8 = 0xFF;
/// Untouchable bytes after every call's data, checked after each run.
pub const GUARD: usize = 64;

/// Outcome of one checked call on this rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// Elements outside the tolerance, plus guard bytes that were overwritten.
    pub wrong: usize,
    /// Fingerprint of the output, to compare ranks and algorithms bitwise.
    pub fingerprint: u64,
}

/// A send/recv pair large enough for `bytes` of data at any offset below 64, plus guards.
pub struct Buffers {
    pub send: BufId,
    pub recv: BufId,
}

impl Buffers {
    pub fn new(comm: &mut Communicator, bytes: usize) -> Result<Buffers> {
        // IPCREDUCE_TEST_REGISTERED=1: every command's test buffers are registered (zero-copy),
        // so that the benchmark can time the zero-copy paths as well.
        if std::env::var_os("IPCREDUCE_TEST_REGISTERED").is_some_and(|v| v == "1") {
            return Self::registered(comm, bytes);
        }
        let capacity = bytes + 64 + GUARD;
        Ok(Buffers {
            send: comm.test_alloc(capacity)?,
            recv: comm.test_alloc(capacity)?,
        })
    }

    /// Registered (zero-copy) buffers: collective.
    pub fn registered(comm: &mut Communicator, bytes: usize) -> Result<Buffers> {
        let capacity = bytes + 64 + GUARD;
        Ok(Buffers {
            send: comm.test_alloc_registered(capacity)?,
            recv: comm.test_alloc_registered(capacity)?,
        })
    }

    pub fn free(self, comm: &mut Communicator) {
        comm.test_free(self.send);
        comm.test_free(self.recv);
    }
}

/// Writes this rank's input for `seed` into the send buffer (or recv, in place) and poisons
/// the output, so unwritten elements cannot pass.
pub fn prepare(comm: &mut Communicator, call: &Call, seed: u64) -> Result<()> {
    let bytes = call.count * call.dtype.size();
    let mut data = vec![POISON; call.offset + bytes + GUARD];
    fill_input_par(
        call.dtype,
        seed,
        comm.rank(),
        &mut data[call.offset..call.offset + bytes],
    );
    comm.test_write(call.send, &data)?;
    if call.recv != call.send {
        data.fill(POISON);
        comm.test_write(call.recv, &data)?;
    }
    Ok(())
}

/// Reads the output back and checks it (elements and guards).
pub fn verify(comm: &mut Communicator, call: &Call, seed: u64) -> Result<Outcome> {
    let bytes = call.count * call.dtype.size();
    let mut out = vec![0u8; call.offset + bytes + GUARD];
    comm.test_read(call.recv, &mut out)?;
    let data = &out[call.offset..call.offset + bytes];
    // Across nodes the hierarchical all-reduce rounds each node's partial sum (see
    // count_wrong_nodes_par); within one node this is count_wrong_par.
    let layout = comm.bootstrap().layout().clone();
    let nodes: Vec<Vec<usize>> = (0..layout.node_count())
        .map(|n| layout.node_ranks(n).to_vec())
        .collect();
    let mut wrong = count_wrong_nodes_par(call.dtype, call.op, seed, &nodes, data);
    // Bytes before and after the data must be untouched (poison; for in-place the input's
    // poison prefix and suffix too).
    wrong += out[..call.offset]
        .iter()
        .chain(&out[call.offset + bytes..])
        .filter(|b| **b != POISON)
        .count();
    Ok(Outcome {
        wrong,
        fingerprint: fingerprint(data),
    })
}

/// prepare + run + verify.
pub fn run_checked(comm: &mut Communicator, call: &Call, seed: u64) -> Result<Outcome> {
    prepare(comm, call, seed)?;
    comm.test_run(call)?;
    verify(comm, call, seed)
}

/// What every report (bench, overlap) says about the run: machine, versions, commit, date.
#[derive(Debug, serde::Serialize)]
pub struct RunMeta {
    pub backend: ipcreduce::BackendKind,
    pub world: usize,
    pub devices: Vec<String>,
    pub driver: Option<String>,
    pub nccl_version: Option<String>,
    pub commit: &'static str,
    pub date: String,
    pub host_cores: usize,
}

impl RunMeta {
    pub fn collect(comm: &Communicator) -> RunMeta {
        let m = comm.meta();
        RunMeta {
            backend: comm.backend(),
            world: comm.world(),
            devices: m.devices,
            driver: m.driver,
            nccl_version: m.nccl_version,
            commit: env!("IPCREDUCE_GIT_COMMIT"),
            date: utc_now(),
            host_cores: ipcreduce::machine_cores(),
        }
    }
}

/// Gathers one u64 from every rank.
pub fn gather_u64(comm: &mut Communicator, v: u64) -> Result<Vec<u64>> {
    let all = comm.bootstrap().all_gather(&v.to_le_bytes())?;
    Ok(all
        .iter()
        .map(|b| u64::from_le_bytes(b[..8].try_into().unwrap_or([0xFF; 8])))
        .collect())
}

/// Gathers one f64 from every rank.
pub fn gather_f64(comm: &mut Communicator, v: f64) -> Result<Vec<f64>> {
    Ok(gather_u64(comm, v.to_bits())?
        .into_iter()
        .map(f64::from_bits)
        .collect())
}

/// Current UTC time as ISO 8601 / RFC 3339, whole seconds (e.g. 2026-11-30T20:03:00Z).
pub fn utc_now() -> String {
    let now = time::OffsetDateTime::now_utc();
    now.replace_nanosecond(0)
        .unwrap_or(now)
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_else(|e| format!("(no date: {e})"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn date_is_iso_utc_and_now() {
        let d = utc_now();
        assert_eq!(d.len(), 20, "{d}");
        assert!(d.ends_with('Z'), "{d}");
        let parsed =
            time::OffsetDateTime::parse(&d, &time::format_description::well_known::Rfc3339)
                .unwrap();
        let age = time::OffsetDateTime::now_utc() - parsed;
        assert!(age.whole_seconds().abs() < 5, "{d} is {age} away from now");
    }
}
