//! Progress of the long commands (`check`, `bench` sweeps, `tune`) on a terminal.
//!
//! The ranks' output goes through the launcher (a pipe, never a terminal), so the bar is drawn
//! by the launching process: rank 0 writes a marker line after each case or size (between
//! measurements, never inside a timed loop), and the launcher turns those lines into the bar
//! instead of printing them. It happens only when the command was started on a terminal
//! (stdout and stderr) and writes no `--json`: the launcher then sets [`ENV`] for its ranks.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

/// Set by the launching command for its ranks when it draws a bar.
pub const ENV: &str = "IPCREDUCE_PROGRESS";
/// Starts a progress line of rank 0: `MARKER done total unit`.
pub const MARKER: &str = "@@ipcreduce-progress ";
/// Marker lines at most this often (the bar redraws at its own rate anyway).
const EVERY: Duration = Duration::from_millis(100);

/// Whether the launching command should draw a bar for ranks it starts.
pub fn wanted(asked: bool) -> bool {
    asked && std::io::stdout().is_terminal() && std::io::stderr().is_terminal()
}

/// The launcher's bar, fed by rank 0's marker lines.
#[derive(Clone, Debug)]
pub struct Bar(ProgressBar);

impl Bar {
    pub fn new() -> Bar {
        let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
        bar.set_style(
            ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} ({elapsed}, {eta} left)")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        Bar(bar)
    }

    /// Takes a marker line (true), or leaves the line to be printed (false).
    pub fn take(&self, line: &[u8]) -> bool {
        let Some(rest) = line.strip_prefix(MARKER.as_bytes()) else {
            return false;
        };
        let text = String::from_utf8_lossy(rest);
        let mut words = text.split_whitespace();
        let num = |w: Option<&str>| w.and_then(|w| w.parse::<u64>().ok());
        if let (Some(done), Some(total)) = (num(words.next()), num(words.next())) {
            self.0.set_length(total);
            self.0.set_position(done);
            self.0.set_message(words.collect::<Vec<_>>().join(" "));
        }
        true
    }

    /// Prints around the bar (hidden while `f` writes).
    pub fn suspend<R>(&self, f: impl FnOnce() -> R) -> R {
        self.0.suspend(f)
    }

    pub fn finish(&self) {
        self.0.finish_and_clear();
    }
}

/// Rank 0's side: marker lines, when the launcher asked for them.
pub struct Reporter {
    on: bool,
    total: u64,
    unit: &'static str,
    last: Option<Instant>,
}

impl Reporter {
    /// `total` steps of `unit` (e.g. "cases"); silent on other ranks and without [`ENV`].
    pub fn new(rank: usize, total: u64, unit: &'static str) -> Reporter {
        let on = rank == 0 && std::env::var_os(ENV).is_some_and(|v| v == "1");
        Reporter {
            on,
            total,
            unit,
            last: None,
        }
    }

    /// `done` steps are done (called between measurements).
    pub fn step(&mut self, done: u64) {
        if !self.on {
            return;
        }
        let now = Instant::now();
        if done < self.total && self.last.is_some_and(|t| now - t < EVERY) {
            return;
        }
        self.last = Some(now);
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{MARKER}{done} {} {}", self.total, self.unit);
        let _ = out.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marker_lines_feed_the_bar_and_others_pass() {
        let bar = Bar(ProgressBar::hidden());
        assert!(bar.take(format!("{MARKER}3 10 cases\n").as_bytes()));
        assert_eq!((bar.0.position(), bar.0.length()), (3, Some(10)));
        assert_eq!(bar.0.message(), "cases");
        assert!(!bar.take(b"  8 2 float sum\n"));
        assert!(!bar.take(b"@@ OK 0 of 2\n"));
    }
}
