//! A stopwatch for start-up: how long each phase of a communicator's init took on this rank,
//! logged as one line (`IPCREDUCE_LOG=ipcreduce=debug`), so a slow start names its phase
//! (context creation under MPS, the workspaces' mapping, a peer that arrived late) instead of
//! showing one total.

use std::time::{Duration, Instant};

pub(crate) struct Phases {
    what: &'static str,
    start: Instant,
    last: Instant,
    done: Vec<(&'static str, Duration)>,
}

impl Phases {
    /// Starts timing `what` (named at the head of the line).
    pub fn start(what: &'static str) -> Phases {
        let now = Instant::now();
        Phases {
            what,
            start: now,
            last: now,
            done: Vec::new(),
        }
    }

    /// Ends the phase `name` (it began where the previous one ended).
    pub fn mark(&mut self, name: &'static str) {
        let now = Instant::now();
        self.done.push((name, now - self.last));
        self.last = now;
    }

    /// "what 0.412 s: a 0.301, b 0.100, c 0.011" (seconds).
    pub fn line(&self) -> String {
        let parts: Vec<String> = self
            .done
            .iter()
            .map(|(n, d)| format!("{n} {:.3}", d.as_secs_f64()))
            .collect();
        format!(
            "{} {:.3} s: {}",
            self.what,
            (self.last - self.start).as_secs_f64(),
            parts.join(", ")
        )
    }

    /// Logs [`Self::line`] at debug level for `rank`.
    pub fn log(&self, rank: usize) {
        tracing::debug!(rank, "{}", self.line());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_names_every_phase_in_order_and_the_parts_add_up() {
        let mut p = Phases::start("init");
        std::thread::sleep(Duration::from_millis(20));
        p.mark("first");
        p.mark("second");
        std::thread::sleep(Duration::from_millis(10));
        p.mark("third");
        let line = p.line();
        assert!(line.starts_with("init "), "{line}");
        let order: Vec<usize> = ["first ", "second ", "third "]
            .iter()
            .map(|n| {
                line.find(n)
                    .unwrap_or_else(|| panic!("{n} missing: {line}"))
            })
            .collect();
        assert!(order.windows(2).all(|w| w[0] < w[1]), "{line}");
        let total: f64 = line["init ".len()..]
            .split(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        let sum: f64 = p.done.iter().map(|(_, d)| d.as_secs_f64()).sum();
        assert!((total - sum).abs() < 0.0006 && total >= 0.030, "{line}");
        assert!(p.done[0].1 >= Duration::from_millis(20), "{line}");
        assert!(p.done[2].1 >= Duration::from_millis(10), "{line}");
    }
}
