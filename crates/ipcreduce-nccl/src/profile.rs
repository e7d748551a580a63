//! `IPCREDUCE_NCCL_PROFILE=1`: host time of the accelerated calls, summed per phase and
//! printed to stderr at exit, so that a run shows where a call's host cost goes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

/// The phases of one accelerated call, in order.
pub const PHASES: [&str; 4] = ["check", "lock", "collective", "log"];

static ON: OnceLock<bool> = OnceLock::new();
static NS: [AtomicU64; 4] = [const { AtomicU64::new(0) }; 4];
static CALLS: AtomicU64 = AtomicU64::new(0);

/// Whether profiling is on (read once); the first time it is, the exit summary is armed.
pub fn on() -> bool {
    *ON.get_or_init(|| {
        let on = std::env::var("IPCREDUCE_NCCL_PROFILE").is_ok_and(|v| v == "1");
        if on {
            // SAFETY: `print` is an extern "C" fn that touches only statics.
            unsafe { libc::atexit(print) };
        }
        on
    })
}

/// A call's clock: `lap(i)` adds the time since the last lap to phase `i`. Inert when off.
pub struct Clock(Option<Instant>);

impl Clock {
    pub fn start() -> Clock {
        Clock(on().then(Instant::now))
    }

    pub fn lap(&mut self, phase: usize) {
        if let Some(t) = self.0 {
            let now = Instant::now();
            NS[phase].fetch_add((now - t).as_nanos() as u64, Ordering::Relaxed);
            if phase == PHASES.len() - 1 {
                CALLS.fetch_add(1, Ordering::Relaxed);
            }
            self.0 = Some(now);
        }
    }
}

/// The summary line: calls, then each phase's mean in microseconds.
pub fn summary() -> String {
    let n = CALLS.load(Ordering::Relaxed).max(1) as f64;
    let mut s = format!(
        "ipcreduce-nccl profile: calls={}",
        CALLS.load(Ordering::Relaxed)
    );
    for (i, p) in PHASES.iter().enumerate() {
        let us = NS[i].load(Ordering::Relaxed) as f64 / n / 1000.0;
        s.push_str(&format!(" {p}={us:.3}us"));
    }
    s
}

extern "C" fn print() {
    eprintln!("{}", summary());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_names_every_phase() {
        let s = summary();
        for p in PHASES {
            assert!(s.contains(&format!(" {p}=")), "{s}");
        }
    }
}
