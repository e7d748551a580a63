//! `IPCREDUCE_NCCL`: off (forward everything), on (the default), log (one line per call on
//! stderr with the path taken, and the count of calls per path when the process exits).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Mode {
    Off,
    On,
    Log,
}

static MODE: OnceLock<Result<Mode, String>> = OnceLock::new();

/// Parses the variable's value (unset or empty: on).
pub fn parse(v: Option<&str>) -> Result<Mode, String> {
    match v.map(|s| s.trim().to_ascii_lowercase()).as_deref() {
        None | Some("") | Some("on") | Some("1") => Ok(Mode::On),
        Some("off") | Some("0") => Ok(Mode::Off),
        Some("log") => Ok(Mode::Log),
        Some(other) => Err(format!(
            "ipcreduce-nccl: IPCREDUCE_NCCL={other}: expected off, on or log"
        )),
    }
}

/// The mode, read once; a bad value is an error (communicators then refuse to start, so a
/// typo never silently changes the path).
pub fn mode() -> Result<Mode, &'static str> {
    MODE.get_or_init(|| {
        let m = parse(std::env::var("IPCREDUCE_NCCL").ok().as_deref());
        if m == Ok(Mode::Log) {
            // SAFETY: registering a plain extern "C" function with no arguments.
            unsafe { libc::atexit(print_counts) };
        }
        m
    })
    .as_ref()
    .map(|m| *m)
    .map_err(|e| e.as_str())
}

/// Whether calls are logged (`IPCREDUCE_NCCL=log`).
pub fn logging() -> bool {
    mode() == Ok(Mode::Log)
}

/// The collectives that may take either path.
#[derive(Clone, Copy)]
pub enum Coll {
    AllReduce = 0,
    ReduceScatter = 1,
    AllGather = 2,
}

const COLL_NAMES: [&str; 3] = ["ncclAllReduce", "ncclReduceScatter", "ncclAllGather"];

/// Calls per collective: [ours, NCCL's].
static COUNTS: [[AtomicU64; 2]; 3] = [
    [AtomicU64::new(0), AtomicU64::new(0)],
    [AtomicU64::new(0), AtomicU64::new(0)],
    [AtomicU64::new(0), AtomicU64::new(0)],
];
/// Every other entry point (always NCCL's).
static OTHER: AtomicU64 = AtomicU64::new(0);

/// A collective that ran on ipcreduce (`ours`) or was forwarded (`why` not).
pub fn collective(c: Coll, rank: Option<usize>, ours: bool, what: std::fmt::Arguments<'_>) {
    COUNTS[c as usize][usize::from(!ours)].fetch_add(1, Ordering::Relaxed);
    if logging() {
        let rank = rank.map_or_else(|| "?".to_string(), |r| r.to_string());
        let path = if ours { "ipcreduce" } else { "nccl" };
        eprintln!(
            "ipcreduce-nccl: pid {} rank {rank} {} {what} -> {path}",
            std::process::id(),
            COLL_NAMES[c as usize]
        );
    }
}

/// Any other entry point, forwarded.
pub fn forwarded(name: &str) {
    OTHER.fetch_add(1, Ordering::Relaxed);
    if logging() {
        eprintln!("ipcreduce-nccl: pid {} {name} -> nccl", std::process::id());
    }
}

/// A line about a communicator (accelerated or not, and why).
pub fn note(what: std::fmt::Arguments<'_>) {
    if logging() {
        eprintln!("ipcreduce-nccl: pid {} {what}", std::process::id());
    }
}

/// The count line printed at exit in log mode.
pub fn counts_line() -> String {
    let mut parts: Vec<String> = COLL_NAMES
        .iter()
        .zip(COUNTS.iter())
        .map(|(name, c)| {
            format!(
                "{name} ipcreduce={} nccl={}",
                c[0].load(Ordering::Relaxed),
                c[1].load(Ordering::Relaxed)
            )
        })
        .collect();
    parts.push(format!(
        "other calls nccl={}",
        OTHER.load(Ordering::Relaxed)
    ));
    format!(
        "ipcreduce-nccl: pid {} counts: {}",
        std::process::id(),
        parts.join(", ")
    )
}

extern "C" fn print_counts() {
    eprintln!("{}", counts_line());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mode_words() {
        assert_eq!(parse(None), Ok(Mode::On));
        assert_eq!(parse(Some("")), Ok(Mode::On));
        assert_eq!(parse(Some(" LOG ")), Ok(Mode::Log));
        assert_eq!(parse(Some("off")), Ok(Mode::Off));
        let e = parse(Some("of")).unwrap_err();
        assert!(
            e.contains("IPCREDUCE_NCCL=of") && e.contains("off, on or log"),
            "{e}"
        );
    }
}
