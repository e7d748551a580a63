//! `IPCREDUCE_NCCL`: off (forward everything), on (the default), log (one line per call on
//! stderr with the path taken, and the count of calls per path when the process exits).
//!
//! Every line starts `ipcreduce-nccl: rank R pid P` and goes out in one `write(2)`: the ranks
//! of a job usually share one stderr (a pipe to the launcher), and lines written in pieces
//! would interleave there.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
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

/// Whether ipcreduce may take calls (`IPCREDUCE_NCCL=on` or `log`, the default on).
pub fn accelerating() -> bool {
    matches!(mode(), Ok(Mode::On | Mode::Log))
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

/// This process's rank in the last communicator it joined (-1: none yet): the prefix of lines
/// that have no communicator of their own.
static PROCESS_RANK: AtomicI64 = AtomicI64::new(-1);

/// Records the rank this process joined a communicator as.
pub fn set_process_rank(rank: i64) {
    PROCESS_RANK.store(rank, Ordering::Relaxed);
}

/// `ipcreduce-nccl: rank R pid P ` then `what` and a newline: one whole line.
pub fn line(rank: Option<usize>, what: std::fmt::Arguments<'_>) -> String {
    let rank = match rank {
        Some(r) => r.to_string(),
        None => match PROCESS_RANK.load(Ordering::Relaxed) {
            r if r >= 0 => r.to_string(),
            _ => "?".to_string(),
        },
    };
    format!(
        "ipcreduce-nccl: rank {rank} pid {} {what}\n",
        std::process::id()
    )
}

/// Writes `text` to stderr in as few `write(2)` calls as it takes (one, for a line shorter
/// than a pipe's atomic size, the case of every line here); errors are ignored, as
/// `eprintln!`'s would panic.
pub fn write_stderr(text: &str) {
    let mut rest = text.as_bytes();
    while !rest.is_empty() {
        // SAFETY: a live buffer of that length; fd 2.
        let n = unsafe { libc::write(2, rest.as_ptr().cast(), rest.len()) };
        if n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
            continue;
        }
        if n <= 0 {
            return;
        }
        rest = &rest[n as usize..];
    }
}

fn emit(rank: Option<usize>, what: std::fmt::Arguments<'_>) {
    write_stderr(&line(rank, what));
}

/// A collective that ran on ipcreduce (`ours`) or was forwarded (`why` not).
pub fn collective(c: Coll, rank: Option<usize>, ours: bool, what: std::fmt::Arguments<'_>) {
    COUNTS[c as usize][usize::from(!ours)].fetch_add(1, Ordering::Relaxed);
    if logging() {
        let path = if ours { "ipcreduce" } else { "nccl" };
        emit(
            rank,
            format_args!("{} {what} -> {path}", COLL_NAMES[c as usize]),
        );
    }
}

/// Any other entry point, forwarded.
pub fn forwarded(name: &str) {
    OTHER.fetch_add(1, Ordering::Relaxed);
    if logging() {
        emit(None, format_args!("{name} -> nccl"));
    }
}

/// A line about a communicator (accelerated or not, and why).
pub fn note(what: std::fmt::Arguments<'_>) {
    if logging() {
        emit(None, what);
    }
}

/// A line about rank `rank`'s communicator.
pub fn note_rank(rank: usize, what: std::fmt::Arguments<'_>) {
    if logging() {
        emit(Some(rank), what);
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
    line(None, format_args!("counts: {}", parts.join(", ")))
}

extern "C" fn print_counts() {
    write_stderr(&counts_line());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_is_whole_and_names_the_rank() {
        let l = line(
            Some(3),
            format_args!("ncclAllReduce {} -> ipcreduce", "count=8"),
        );
        let want = format!(
            "ipcreduce-nccl: rank 3 pid {} ncclAllReduce count=8 -> ipcreduce\n",
            std::process::id()
        );
        assert_eq!(l, want);
        assert_eq!(l.matches('\n').count(), 1, "one line");
        // Without a communicator: the rank this process joined as, once known.
        // (The only test that sets it.)
        assert!(line(None, format_args!("x")).starts_with("ipcreduce-nccl: rank ? pid "));
        set_process_rank(5);
        assert!(line(None, format_args!("x")).starts_with("ipcreduce-nccl: rank 5 pid "));
    }

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
