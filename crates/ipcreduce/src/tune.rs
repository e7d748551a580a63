//! The measured tuning table: which algorithm (and CTA count and chunk, where measured) is
//! fastest on this machine for a world size, an element size and a message size.
//!
//! `ipcreduce tune` measures and writes the table to a cache file (a plain text format of its
//! own, read strictly: see `tune/text.rs`) keyed by the GPU model, the topology (GPU count,
//! P2P between every pair and used: not on the host-staged transport) and the driver version.
//! Calls through host memory have a table of their own (`tune-staged.txt`, [`TuneKey::through`]):
//! a machine with P2P may run them too (`IPCREDUCE_TRANSPORT=host`), and their choices would
//! be wrong for its calls through peer memory. The host backend has a table of its own
//! (`tune-host.txt`, same format), keyed by the CPU model and core count ([`TuneKey::of_host`]):
//! a machine with GPUs may run both backends. At communicator init rank 0 loads it and
//! every rank uses rank 0's copy (the choice must be the same on every rank); `Auto` consults
//! it before the plan's size rules. A missing file, a file that does not parse (the note names
//! the file and line) or one measured on another machine (the note says what differs) gives
//! the built-in defaults (no entries: the plan's rules).
//!
//! Everything here is pure except [`TuneKey::of_machine`] (driver queries) and [`agree`]
//! (the communicator's init hook: file and bootstrap).

use crate::plan::Fabric;
use crate::types::{Algorithm, BackendKind};
use std::path::{Path, PathBuf};

mod text;
pub use text::ParseError;

/// Version of the file format; another version is ignored with a note. (Version 1 was JSON:
/// such a file is refused with a note saying so, and `ipcreduce tune` replaces it.)
pub const FORMAT_VERSION: u32 = 2;

/// The table's name in the cache directory.
pub const FILE_NAME: &str = "tune.txt";

/// The host backend's table in the cache directory.
pub const HOST_FILE_NAME: &str = "tune-host.txt";

/// The cuda backend's table for the host-staged transport in the cache directory.
pub const STAGED_FILE_NAME: &str = "tune-staged.txt";

/// What a host table's `gpu` line starts with (the rest names the CPU).
pub const HOST_KEY_PREFIX: &str = "host: ";

/// What a table was measured on. For the host backend: `gpu` names the CPU
/// ([`HOST_KEY_PREFIX`], model, cores), `gpus` is 0, `p2p` false and `driver` the kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TuneKey {
    /// GPU model (the device name).
    pub gpu: String,
    /// GPUs visible to the process.
    pub gpus: usize,
    /// Whether the calls went through peer memory: every pair of visible GPUs can access each
    /// other's memory, and the transport used it (not the host-staged one).
    pub p2p: bool,
    /// Driver version.
    pub driver: String,
}

/// One row: for `world` ranks and `elem_bytes`-byte elements, messages of
/// `min_bytes..=max_bytes` run `algo` (with `ctas` CTAs and `chunk`-byte chunks when set).
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    pub world: usize,
    pub elem_bytes: usize,
    pub min_bytes: usize,
    pub max_bytes: usize,
    pub algo: String,
    pub ctas: Option<u32>,
    pub chunk: Option<usize>,
    /// The measured time at the size this row was chosen at (for reading the file).
    pub time_us: f64,
    /// That size.
    pub measured_bytes: usize,
}

impl Entry {
    /// The algorithm of this row, if the library knows it.
    pub fn algorithm(&self) -> Option<Algorithm> {
        self.algo.parse().ok().filter(|a| *a != Algorithm::Auto)
    }
}

/// The table and the machine it was measured on.
#[derive(Debug, Clone, PartialEq)]
pub struct Table {
    pub version: u32,
    pub key: Option<TuneKey>,
    pub entries: Vec<Entry>,
}

/// One measurement `ipcreduce tune` made.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub bytes: usize,
    pub algo: String,
    pub ctas: Option<u32>,
    pub chunk: Option<usize>,
    pub time_us: f64,
}

/// Why the built-in defaults are used instead of a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Note {
    /// No file at that path (the machine was never tuned): not a problem.
    Missing(PathBuf),
    /// The file is there but unusable: it says why.
    Bad(String),
}

impl Table {
    /// The built-in defaults: no entries, so `Auto` follows the plan's size rules.
    pub fn builtin() -> Table {
        Table {
            version: FORMAT_VERSION,
            key: None,
            entries: Vec::new(),
        }
    }

    /// The row for a call, if the table has rows for its world and element size. Between
    /// the measured sizes the rows' ranges meet at the geometric midpoint (see
    /// [`from_samples`]); below the smallest measured size the first row holds, above the
    /// largest the last one.
    pub fn lookup(&self, world: usize, elem_bytes: usize, bytes: usize) -> Option<&Entry> {
        // One pass, no list: every cuda call asks (twice: the algorithm, then its CTAs). The
        // answer is that of the rows sorted stably by `min_bytes`: the first row, the first
        // that holds `bytes`, else the last (see the test against that definition).
        let (mut first, mut holds, mut last) = (None::<&Entry>, None::<&Entry>, None::<&Entry>);
        for e in &self.entries {
            if e.world != world || e.elem_bytes != elem_bytes {
                continue;
            }
            if first.is_none_or(|f| e.min_bytes < f.min_bytes) {
                first = Some(e);
            }
            if last.is_none_or(|l| e.min_bytes >= l.min_bytes) {
                last = Some(e);
            }
            let inside = e.min_bytes <= bytes && bytes <= e.max_bytes;
            if inside && holds.is_none_or(|h| e.min_bytes < h.min_bytes) {
                holds = Some(e);
            }
        }
        let first = first?;
        if bytes < first.min_bytes {
            return Some(first);
        }
        holds.or(last)
    }

    /// The table in the file format (`tune/text.rs`); [`Table::parse`] reads it back exactly.
    pub fn to_text(&self) -> String {
        text::write(self)
    }

    /// Reads the file format, strictly: any line it does not expect is an error naming it.
    pub fn parse(text: &str) -> Result<Table, ParseError> {
        text::parse(text)
    }

    /// Replaces the rows of (world, elem_bytes) with `rows`, keeping the others.
    pub fn replace(&mut self, world: usize, elem_bytes: usize, rows: Vec<Entry>) {
        self.entries
            .retain(|e| !(e.world == world && e.elem_bytes == elem_bytes));
        self.entries.extend(rows);
        self.entries
            .sort_by_key(|e| (e.world, e.elem_bytes, e.min_bytes));
    }
}

/// The rows for one (world, element size) from its samples: the fastest choice at every
/// measured size, neighbouring sizes with the same choice merged, and the boundary between
/// two choices at the geometric midpoint of the sizes they won at.
pub fn from_samples(world: usize, elem_bytes: usize, samples: &[Sample]) -> Vec<Entry> {
    let mut sizes: Vec<usize> = samples.iter().map(|s| s.bytes).collect();
    sizes.sort_unstable();
    sizes.dedup();
    let best: Vec<&Sample> = sizes
        .iter()
        .filter_map(|&b| {
            samples
                .iter()
                .filter(|s| s.bytes == b && s.time_us.is_finite() && s.time_us > 0.0)
                .min_by(|x, y| x.time_us.total_cmp(&y.time_us))
        })
        .collect();
    let mut rows: Vec<Entry> = Vec::new();
    for s in best {
        let same = rows
            .last()
            .is_some_and(|r| r.algo == s.algo && r.ctas == s.ctas && r.chunk == s.chunk);
        if same {
            let r = rows.last_mut().expect("checked");
            r.max_bytes = s.bytes;
            continue;
        }
        if let Some(prev) = rows.last_mut() {
            // prev.max_bytes is still the last size it won at.
            let mid = ((prev.max_bytes as f64) * (s.bytes as f64)).sqrt() as usize;
            prev.max_bytes = mid.clamp(prev.max_bytes, s.bytes - 1);
        }
        let min = rows.last().map_or(0, |p| p.max_bytes + 1);
        rows.push(Entry {
            world,
            elem_bytes,
            min_bytes: min,
            max_bytes: s.bytes,
            algo: s.algo.clone(),
            ctas: s.ctas,
            chunk: s.chunk,
            time_us: s.time_us,
            measured_bytes: s.bytes,
        });
    }
    if let Some(last) = rows.last_mut() {
        last.max_bytes = usize::MAX;
    }
    rows
}

/// Where the table lives: `IPCREDUCE_TUNE_FILE`, else `$XDG_CACHE_HOME/ipcreduce/tune.txt`,
/// else `$HOME/.cache/ipcreduce/tune.txt`. `env` reads a variable (tests pass their own).
pub fn cache_path(env: impl Fn(&str) -> Option<String>) -> Option<PathBuf> {
    cache_path_for(BackendKind::Cuda, Fabric::Peer, env)
}

/// [`cache_path`] for `backend`'s table on `fabric`: the host backend's is [`HOST_FILE_NAME`]
/// and the host-staged transport's [`STAGED_FILE_NAME`], in the same directory;
/// `IPCREDUCE_TUNE_FILE` names the file for any (the key inside tells them apart: a table of
/// another backend or transport is not used).
pub fn cache_path_for(
    backend: BackendKind,
    fabric: Fabric,
    env: impl Fn(&str) -> Option<String>,
) -> Option<PathBuf> {
    let set = |k: &str| env(k).filter(|v| !v.is_empty());
    let name = match (backend, fabric) {
        (BackendKind::Host, _) => HOST_FILE_NAME,
        (BackendKind::Cuda, Fabric::HostStaged) => STAGED_FILE_NAME,
        (BackendKind::Cuda, Fabric::Peer | Fabric::PciePeer) => FILE_NAME,
    };
    if let Some(p) = set("IPCREDUCE_TUNE_FILE") {
        return Some(PathBuf::from(p));
    }
    let base = set("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| set("HOME").map(|h| Path::new(&h).join(".cache")))?;
    Some(base.join("ipcreduce").join(name))
}

/// The table for this machine from `path` (None: no path known), or the built-in defaults
/// and why.
pub fn load(path: Option<&Path>, key: &TuneKey) -> (Table, Option<Note>) {
    let Some(path) = path else {
        return (
            Table::builtin(),
            Some(Note::Bad("no cache directory (HOME unset)".into())),
        );
    };
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return (Table::builtin(), Some(Note::Missing(path.to_path_buf())))
        }
        Err(e) => {
            return (
                Table::builtin(),
                Some(Note::Bad(format!("reading {}: {e}", path.display()))),
            )
        }
    };
    match Table::parse(&text) {
        Err(e) => (
            Table::builtin(),
            Some(Note::Bad(format!(
                "{}:{}: {}",
                path.display(),
                e.line,
                e.msg
            ))),
        ),
        Ok(t) if t.key.as_ref() != Some(key) => {
            let why = match &t.key {
                None => "names no machine".to_string(),
                Some(theirs) => format!("was measured on another machine ({})", theirs.diff(key)),
            };
            (
                Table::builtin(),
                Some(Note::Bad(format!("{} {why}", path.display()))),
            )
        }
        Ok(t) => (t, None),
    }
}

impl TuneKey {
    /// What differs between the machine a table was measured on (`self`) and `here`.
    pub fn diff(&self, here: &TuneKey) -> String {
        let mut d = Vec::new();
        if self.gpu != here.gpu {
            d.push(format!("GPU '{}' there, '{}' here", self.gpu, here.gpu));
        }
        if (self.gpus, self.p2p) != (here.gpus, here.p2p) {
            let topo =
                |k: &TuneKey| format!("{} GPUs, P2P {}", k.gpus, if k.p2p { "on" } else { "off" });
            d.push(format!(
                "topology {} there, {} here",
                topo(self),
                topo(here)
            ));
        }
        if self.driver != here.driver {
            d.push(format!(
                "driver {} there, {} here",
                self.driver, here.driver
            ));
        }
        d.join("; ")
    }

    /// This key for calls over `fabric`: through host memory (the host-staged transport) no
    /// peer memory is used, whatever the GPUs could do, so `p2p` is false. A machine without
    /// P2P keeps its key; one with P2P gets another, so a table tuned there with
    /// `IPCREDUCE_TRANSPORT=host` does not steer its calls through peer memory.
    pub fn through(self, fabric: Fabric) -> TuneKey {
        match fabric {
            Fabric::HostStaged => TuneKey { p2p: false, ..self },
            Fabric::Peer | Fabric::PciePeer => self,
        }
    }

    /// This machine's key for the host backend: the CPU model and the cores online (what the
    /// one-shot/two-shot crossover depends on), no GPU, the kernel release.
    pub fn of_host() -> TuneKey {
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|t| {
                t.lines()
                    .find(|l| l.starts_with("model name"))
                    .and_then(|l| l.split_once(':'))
                    .map(|(_, v)| v.split_whitespace().collect::<Vec<_>>().join(" "))
            })
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| std::env::consts::ARCH.to_string());
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_string())
            .ok()
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| "unknown".into());
        TuneKey {
            gpu: format!("{HOST_KEY_PREFIX}{cpu}, {} cores", crate::machine_cores()),
            gpus: 0,
            p2p: false,
            driver: kernel,
        }
    }

    /// This machine's key: the model of GPU `ordinal`, the visible GPUs, P2P between every
    /// pair, the driver version.
    pub fn of_machine(ordinal: usize) -> Option<TuneKey> {
        use cudarc::driver::{safe as cs, sys};
        let count = cs::CudaContext::device_count().ok()?;
        let ctx = cs::CudaContext::new(ordinal).ok()?;
        // Trimmed: the file keeps values without surrounding blanks, and must match them. A
        // key without a GPU name or driver version would match any machine: none then.
        let known = |s: String| Some(s.trim().to_string()).filter(|s| !s.is_empty());
        let gpu = known(ctx.name().ok()?)?;
        let driver = known(crate::backend::cuda::driver::driver_version()?)?;
        let mut p2p = true;
        for a in 0..count {
            for b in 0..count {
                if a == b {
                    continue;
                }
                let mut can = 0;
                // SAFETY: writes one int; both ordinals are below the device count.
                let res = unsafe { sys::cuDeviceCanAccessPeer(&mut can, a, b) };
                p2p &= res == sys::CUresult::CUDA_SUCCESS && can == 1;
            }
        }
        Some(TuneKey {
            gpu,
            gpus: usize::try_from(count).unwrap_or(0),
            p2p,
            driver,
        })
    }
}

/// The communicator's init hook (collective): rank 0 loads the table for this machine (the
/// host backend's, or the cuda backend's on `device` over `fabric`) and every rank takes rank
/// 0's, so every rank's `Auto` decides alike.
pub(crate) fn agree(
    boot: &mut crate::bootstrap::Bootstrap,
    backend: BackendKind,
    device: Option<usize>,
    fabric: Fabric,
) -> crate::error::Result<Table> {
    let key = match (boot.rank(), backend, device) {
        (0, BackendKind::Host, _) => Some(Some(TuneKey::of_host())),
        (0, BackendKind::Cuda, Some(ordinal)) => {
            Some(TuneKey::of_machine(ordinal).map(|k| k.through(fabric)))
        }
        _ => None,
    };
    let mine = match key {
        Some(key) => {
            let path = cache_path_for(backend, fabric, |k| std::env::var(k).ok());
            match key {
                None => {
                    tracing::warn!("tuning table not used: this machine's key cannot be read");
                    Table::builtin()
                }
                Some(key) => {
                    let (table, note) = load(path.as_deref(), &key);
                    match note {
                        Some(Note::Missing(p)) => tracing::info!(
                            "no tuning table at {} (run `ipcreduce tune`): built-in choices",
                            p.display()
                        ),
                        Some(Note::Bad(why)) => {
                            tracing::warn!("tuning table not used: {why}; built-in choices")
                        }
                        None => {}
                    }
                    table
                }
            }
        }
        None => Table::builtin(),
    };
    let text = if boot.rank() == 0 {
        mine.to_text()
    } else {
        String::new()
    };
    let all = boot.all_gather(text.as_bytes())?;
    let theirs = String::from_utf8_lossy(all.first().map_or(&[][..], |v| v.as_slice()));
    Table::parse(&theirs).map_err(|e| crate::error::Error::Bootstrap {
        rank: boot.rank(),
        peer: Some(0),
        op: "tuning table",
        detail: format!("rank 0's table does not parse: {e}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> TuneKey {
        TuneKey {
            gpu: "NVIDIA H200".into(),
            gpus: 2,
            p2p: true,
            driver: "580.159.04".into(),
        }
    }

    fn sample(bytes: usize, algo: &str, ctas: u32, t: f64) -> Sample {
        Sample {
            bytes,
            algo: algo.into(),
            ctas: Some(ctas),
            chunk: None,
            time_us: t,
        }
    }

    fn table() -> Table {
        let samples = vec![
            sample(1024, "oneshot", 1, 3.0),
            sample(1024, "twoshot", 8, 5.0),
            sample(4096, "oneshot", 1, 3.2),
            sample(4096, "twoshot", 8, 5.1),
            sample(1 << 20, "oneshot", 8, 20.0),
            sample(1 << 20, "twoshot", 8, 15.0),
            sample(16 << 20, "twoshot", 8, 60.0),
            sample(16 << 20, "twoshot", 16, 55.0),
            sample(16 << 20, "nccl", 0, f64::NAN),
        ];
        let mut t = Table::builtin();
        t.key = Some(key());
        t.replace(2, 2, from_samples(2, 2, &samples));
        t
    }

    #[test]
    fn best_choice_per_size_with_geometric_boundaries() {
        let t = table();
        let rows: Vec<(usize, usize, &str, Option<u32>)> = t
            .entries
            .iter()
            .map(|e| (e.min_bytes, e.max_bytes, e.algo.as_str(), e.ctas))
            .collect();
        // 1 KiB and 4 KiB merge; one-shot/two-shot meet at sqrt(4 KiB x 1 MiB) = 64 KiB; the
        // CTA change at sqrt(1 MiB x 16 MiB) = 4 MiB; NaN samples never win.
        assert_eq!(
            rows,
            vec![
                (0, 64 << 10, "oneshot", Some(1)),
                ((64 << 10) + 1, 4 << 20, "twoshot", Some(8)),
                ((4 << 20) + 1, usize::MAX, "twoshot", Some(16)),
            ]
        );
        assert_eq!(t.entries[2].measured_bytes, 16 << 20);
        assert_eq!(t.entries[2].time_us, 55.0);
    }

    /// [`Table::lookup`] is, without the list, what it was defined as: the rows of the world
    /// and element size sorted stably by `min_bytes`; below the first its row, else the first
    /// row holding the size, else the last. Checked on tables with gaps, overlaps, ties and
    /// rows of other worlds, stored in every order.
    #[test]
    fn lookup_is_the_sorted_rows_definition() {
        fn reference(t: &Table, world: usize, elem: usize, bytes: usize) -> Option<&Entry> {
            let mut rows: Vec<&Entry> = t
                .entries
                .iter()
                .filter(|e| e.world == world && e.elem_bytes == elem)
                .collect();
            rows.sort_by_key(|e| e.min_bytes);
            let first = *rows.first()?;
            if bytes < first.min_bytes {
                return Some(first);
            }
            rows.iter()
                .copied()
                .find(|e| e.min_bytes <= bytes && bytes <= e.max_bytes)
                .or(rows.last().copied())
        }
        let row = |world, min, max, ctas| Entry {
            world,
            elem_bytes: 2,
            min_bytes: min,
            max_bytes: max,
            algo: "oneshot".into(),
            ctas: Some(ctas),
            chunk: None,
            time_us: 1.0,
            measured_bytes: min,
        };
        let rows = [
            row(2, 100, 200, 1),
            row(2, 100, 300, 2),
            row(2, 150, 160, 3),
            row(2, 400, 500, 4),
            row(2, 400, 450, 5),
            row(4, 0, 1000, 6),
        ];
        let sizes = [
            0,
            99,
            100,
            155,
            200,
            250,
            301,
            399,
            400,
            460,
            500,
            501,
            1 << 30,
        ];
        // Every rotation of the rows and of their reverse: ties come in both orders.
        for reversed in [false, true] {
            for k in 0..rows.len() {
                let mut entries = rows.to_vec();
                if reversed {
                    entries.reverse();
                }
                entries.rotate_left(k);
                let t = Table {
                    entries,
                    ..Table::builtin()
                };
                for world in [2, 4, 8] {
                    for b in sizes {
                        let (got, want) = (t.lookup(world, 2, b), reference(&t, world, 2, b));
                        assert_eq!(
                            got.map(|e| e.ctas),
                            want.map(|e| e.ctas),
                            "world {world}, {b} bytes, rows {:?}",
                            t.entries.iter().map(|e| e.ctas).collect::<Vec<_>>()
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn lookup_by_world_element_and_size() {
        let t = table();
        let algo = |w, e, b| t.lookup(w, e, b).map(|x| x.algo.clone());
        assert_eq!(algo(2, 2, 8).as_deref(), Some("oneshot"));
        assert_eq!(algo(2, 2, 64 << 10).as_deref(), Some("oneshot"));
        assert_eq!(algo(2, 2, (64 << 10) + 2).as_deref(), Some("twoshot"));
        assert_eq!(t.lookup(2, 2, 1 << 30).unwrap().ctas, Some(16));
        // Nothing measured for this world or element size: the plan decides.
        assert!(t.lookup(4, 2, 8).is_none());
        assert!(t.lookup(2, 4, 8).is_none());
        assert!(Table::builtin().lookup(2, 2, 8).is_none());
        assert_eq!(
            t.lookup(2, 2, 8).unwrap().algorithm(),
            Some(Algorithm::OneShot)
        );
    }

    /// A fresh directory for one test's files.
    fn scratch(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("ipcreduce-tune-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn text_round_trips_exactly() {
        let mut t = table();
        // Every kind of field: unset and set options, the open upper bound, floats that need
        // all their digits, a GPU name with spaces.
        t.entries.push(Entry {
            world: 8,
            elem_bytes: 4,
            min_bytes: 0,
            max_bytes: usize::MAX,
            algo: "nccl".into(),
            ctas: None,
            chunk: Some(1 << 20),
            time_us: 0.1 + 0.2,
            measured_bytes: 1 << 30,
        });
        t.entries[0].time_us = std::f64::consts::PI;
        let text = t.to_text();
        assert!(
            text.starts_with("ipcreduce-tune 2\ngpu NVIDIA H200\n"),
            "{text}"
        );
        assert_eq!(Table::parse(&text).unwrap(), t);
        // The built-in table (no key, no rows) too: rank 0 sends it when it has no file.
        let b = Table::builtin();
        assert_eq!(Table::parse(&b.to_text()).unwrap(), b);
    }

    #[test]
    fn a_file_for_this_machine_loads_and_a_missing_one_is_noted() {
        let dir = scratch("load");
        let good = dir.join(FILE_NAME);
        std::fs::write(&good, table().to_text()).unwrap();
        assert_eq!(load(Some(&good), &key()), (table(), None));

        let missing = dir.join("none.txt");
        let (t, note) = load(Some(&missing), &key());
        assert_eq!(t, Table::builtin());
        assert_eq!(note, Some(Note::Missing(missing)));
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn a_table_of_another_gpu_topology_or_driver_is_not_used() {
        let dir = scratch("key");
        let good = dir.join(FILE_NAME);
        std::fs::write(&good, table().to_text()).unwrap();
        let cases = [
            (
                TuneKey {
                    gpu: "NVIDIA H100".into(),
                    ..key()
                },
                "GPU 'NVIDIA H200' there, 'NVIDIA H100' here",
            ),
            (
                TuneKey { gpus: 8, ..key() },
                "topology 2 GPUs, P2P on there, 8 GPUs, P2P on here",
            ),
            (
                TuneKey {
                    p2p: false,
                    ..key()
                },
                "topology 2 GPUs, P2P on there, 2 GPUs, P2P off here",
            ),
            (
                TuneKey {
                    driver: "590.1".into(),
                    ..key()
                },
                "driver 580.159.04 there, 590.1 here",
            ),
        ];
        for (here, why) in cases {
            let (t, note) = load(Some(&good), &here);
            assert_eq!(t, Table::builtin(), "{why}");
            let Some(Note::Bad(m)) = note else {
                panic!("{why}: {note:?}")
            };
            assert!(m.contains("measured on another machine"), "{m}");
            assert!(m.contains(why), "{m} lacks {why}");
        }
        // A table that names no machine is no machine's.
        let keyless = dir.join("keyless.txt");
        let mut t = table();
        t.key = None;
        std::fs::write(&keyless, t.to_text()).unwrap();
        let (t, note) = load(Some(&keyless), &key());
        assert_eq!(t, Table::builtin());
        assert!(matches!(note, Some(Note::Bad(m)) if m.ends_with("names no machine")));
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn bad_text_is_refused_naming_the_line() {
        const HEAD: &str = "ipcreduce-tune 2\ngpu G\ngpus 2\np2p yes\ndriver 1\n";
        const ROW: &str = "row 2 2 0 - oneshot 8 - 3 4096";
        let body = |row: &str| format!("{HEAD}# a comment\n\n{row}\n");
        let cases: Vec<(String, usize, &str)> = vec![
            ("".into(), 1, "expected 'ipcreduce-tune 2', found ''"),
            (
                r#"{"version": 1, "entries": []}"#.into(),
                1,
                "JSON table from an older build",
            ),
            (
                "ipcreduce-tune 1\n".into(),
                1,
                "format version 1 (this build reads 2)",
            ),
            (
                "ipcreduce-tune two\n".into(),
                1,
                "format version 'two' is not a whole number",
            ),
            (
                body("rows 2 2 0 - oneshot 8 - 3 4096"),
                8,
                "unknown line 'rows'",
            ),
            (body("row 2 2 0 - oneshot 8 - 3"), 8, "a row has 9 fields"),
            (body("row 2 2 0 - oneshot 8 - 3 4096 1"), 8, "this one 10"),
            (body("row 2 x 0 - oneshot 8 - 3 4096"), 8, "elem_bytes 'x'"),
            (body("row 2 2 -1 - oneshot 8 - 3 4096"), 8, "min_bytes '-1'"),
            (body("row 0 2 0 - oneshot 8 - 3 4096"), 8, "at least 1"),
            (
                body("row 2 2 9 8 oneshot 8 - 3 4096"),
                8,
                "min_bytes 9 is above max_bytes 8",
            ),
            (
                body("row 2 2 0 - ring 8 - 3 4096"),
                8,
                "unknown algorithm 'ring'",
            ),
            (
                body("row 2 2 0 - auto 8 - 3 4096"),
                8,
                "unknown algorithm 'auto'",
            ),
            (
                body("row 2 2 0 - oneshot 8 - NaN 4096"),
                8,
                "not a finite time",
            ),
            (
                body("row 2 2 0 - oneshot 8 - -1 4096"),
                8,
                "not a finite time",
            ),
            (
                body("row 2 2 0 - oneshot 8 - fast 4096"),
                8,
                "time_us 'fast'",
            ),
            (body("row 2 2 0 - oneshot 8.5 - 3 4096"), 8, "ctas '8.5'"),
            (body("gpu H"), 8, "gpu given twice"),
            (body("p2p maybe"), 8, "p2p is 'maybe'"),
            (
                format!("ipcreduce-tune 2\ngpu\n{ROW}\n"),
                2,
                "gpu has no value",
            ),
            (
                format!("ipcreduce-tune 2\ngpu G\ndriver 1\n{ROW}\n"),
                4,
                "the machine key lacks gpus, p2p",
            ),
        ];
        let dir = scratch("strict");
        for (i, (text, line, why)) in cases.into_iter().enumerate() {
            let e = Table::parse(&text).unwrap_err();
            assert_eq!(e.line, line, "{text:?}: {e}");
            assert!(e.msg.contains(why), "{text:?}: '{e}' lacks '{why}'");
            // Through a file: the note names the file and the line, and the defaults hold.
            let p = dir.join(format!("bad{i}.txt"));
            std::fs::write(&p, &text).unwrap();
            let (t, note) = load(Some(&p), &key());
            assert_eq!(t, Table::builtin());
            let at = format!("{}:{line}: ", p.display());
            assert!(
                matches!(&note, Some(Note::Bad(m)) if m.starts_with(&at) && m.contains(why)),
                "{note:?}: not {at}...{why}"
            );
        }
        // The good row in the same frame parses: the cases fail for their own reason.
        assert_eq!(Table::parse(&body(ROW)).unwrap().entries.len(), 1);
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn cache_path_order() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert_eq!(
            cache_path(env(&[("IPCREDUCE_TUNE_FILE", "/x/t.json"), ("HOME", "/h")])),
            Some(PathBuf::from("/x/t.json"))
        );
        assert_eq!(
            cache_path(env(&[("XDG_CACHE_HOME", "/c"), ("HOME", "/h")])),
            Some(PathBuf::from("/c/ipcreduce/tune.txt"))
        );
        assert_eq!(
            cache_path(env(&[("HOME", "/h")])),
            Some(PathBuf::from("/h/.cache/ipcreduce/tune.txt"))
        );
        assert_eq!(cache_path(env(&[])), None);
        // The host backend's table beside the cuda one; the explicit file names either.
        assert_eq!(
            cache_path_for(BackendKind::Host, Fabric::Peer, env(&[("HOME", "/h")])),
            Some(PathBuf::from("/h/.cache/ipcreduce/tune-host.txt"))
        );
        assert_eq!(
            cache_path_for(
                BackendKind::Host,
                Fabric::Peer,
                env(&[("IPCREDUCE_TUNE_FILE", "/x/t.txt"), ("HOME", "/h")])
            ),
            Some(PathBuf::from("/x/t.txt"))
        );
        // The host-staged transport's table beside the peer one (PCIe P2P is peer memory).
        for (fabric, name) in [
            (Fabric::Peer, "tune.txt"),
            (Fabric::PciePeer, "tune.txt"),
            (Fabric::HostStaged, "tune-staged.txt"),
        ] {
            assert_eq!(
                cache_path_for(BackendKind::Cuda, fabric, env(&[("HOME", "/h")])),
                Some(PathBuf::from("/h/.cache/ipcreduce").join(name)),
                "{fabric:?}"
            );
            assert_eq!(
                cache_path_for(
                    BackendKind::Cuda,
                    fabric,
                    env(&[("IPCREDUCE_TUNE_FILE", "/x/t.txt"), ("HOME", "/h")])
                ),
                Some(PathBuf::from("/x/t.txt"))
            );
        }
    }

    /// A table measured through host memory on a machine with P2P is not used for its calls
    /// through peer memory, nor the other way round (even from one file named by
    /// `IPCREDUCE_TUNE_FILE`); on a machine without P2P the key is the same either way.
    #[test]
    fn staged_and_peer_tables_are_kept_apart() {
        let peer = key();
        assert!(peer.p2p);
        let staged = peer.clone().through(Fabric::HostStaged);
        assert_eq!(
            staged,
            TuneKey {
                p2p: false,
                ..key()
            }
        );
        assert_eq!(peer.clone().through(Fabric::Peer), peer);
        assert_eq!(peer.clone().through(Fabric::PciePeer), peer);
        let no_p2p = TuneKey {
            p2p: false,
            ..key()
        };
        assert_eq!(no_p2p.clone().through(Fabric::HostStaged), no_p2p);
        let dir = scratch("staged");
        let file = dir.join("one-file.txt");
        for (measured, used) in [(&staged, &peer), (&peer, &staged)] {
            let mut t = table();
            t.key = Some(measured.clone());
            std::fs::write(&file, t.to_text()).unwrap();
            let (got, note) = load(Some(&file), used);
            assert_eq!(got, Table::builtin(), "{measured:?} used for {used:?}");
            assert!(matches!(note, Some(Note::Bad(m)) if m.contains("P2P")));
            assert_eq!(load(Some(&file), measured), (t, None));
        }
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn the_host_key_names_the_cpu_and_round_trips() {
        let k = TuneKey::of_host();
        assert!(k.gpu.starts_with(HOST_KEY_PREFIX), "{k:?}");
        let cores = format!(", {} cores", crate::machine_cores());
        assert!(k.gpu.ends_with(&cores), "{k:?}");
        assert_eq!((k.gpus, k.p2p), (0, false));
        assert!(!k.driver.is_empty() && !k.driver.contains('\n'));
        let mut t = table();
        t.key = Some(k.clone());
        assert_eq!(Table::parse(&t.to_text()).unwrap(), t);
        // A cuda table is another machine's for the host backend.
        let dir = scratch("hostkey");
        let p = dir.join(HOST_FILE_NAME);
        std::fs::write(&p, table().to_text()).unwrap();
        let (got, note) = load(Some(&p), &k);
        assert_eq!(got, Table::builtin());
        assert!(matches!(note, Some(Note::Bad(m)) if m.contains("another machine")));
        std::fs::remove_dir_all(&dir).ok();
    }
}
