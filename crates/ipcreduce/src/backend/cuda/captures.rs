//! Where each call comes from: eager, or captured into a CUDA graph (see
//! [`Captured`](super::identity::Captured)). The number of a graph is the order in which its
//! first call of this communicator was captured; its calls are numbered in capture order. Both
//! go into the call's identity, so ranks that capture the same graphs pair a replay's calls
//! with the same calls of the same graph on every peer, and anything else (an eager call, a
//! call of another graph, graphs captured in another order) is a mismatch every rank reports.
//!
//! CUDA names each capture by an id unique in the process; captures may be open on several
//! streams at once, so a few are followed together. An id never comes back once its capture
//! ended, so forgetting the oldest beyond [`OPEN_CAPTURES`] only matters for a capture that
//! is still running after that many newer ones began (its later calls would then count as a
//! new graph on this rank, and a mismatch is raised rather than a wrong pairing).

use super::identity::{Captured, ORIGIN_WRAP};

/// Captures followed at once.
const OPEN_CAPTURES: usize = 8;

#[derive(Default)]
pub(super) struct Captures {
    /// Graphs numbered so far.
    graphs: u32,
    /// The captures seen lately: {CUDA's id, our graph number, the next call's index}; newest
    /// last.
    open: Vec<(u64, u32, u32)>,
}

impl Captures {
    /// The origin of a call issued under `capture` (CUDA's capture id, None: eager).
    pub fn origin(&mut self, capture: Option<u64>) -> Option<Captured> {
        let id = capture?;
        let at = match self.open.iter().position(|o| o.0 == id) {
            Some(at) => at,
            None => {
                if self.open.len() == OPEN_CAPTURES {
                    self.open.remove(0);
                }
                self.graphs = self.graphs % (ORIGIN_WRAP - 1) + 1;
                self.open.push((id, self.graphs, 0));
                self.open.len() - 1
            }
        };
        let o = &mut self.open[at];
        let index = o.2;
        o.2 = (o.2 + 1) % ORIGIN_WRAP;
        Some(Captured { graph: o.1, index })
    }

    /// Whether any call was captured: graphs may hold our memory's addresses (see
    /// teardown.rs).
    pub fn any(&self) -> bool {
        self.graphs > 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(graph: u32, index: u32) -> Option<Captured> {
        Some(Captured { graph, index })
    }

    #[test]
    fn graphs_are_numbered_in_capture_order_and_calls_within_each() {
        let mut c = Captures::default();
        assert_eq!(c.origin(None), None);
        assert!(!c.any(), "eager calls capture nothing");
        // CUDA's ids are arbitrary: only their order of appearance counts.
        assert_eq!(c.origin(Some(907)), at(1, 0));
        assert_eq!(c.origin(Some(907)), at(1, 1));
        assert_eq!(c.origin(None), None);
        assert_eq!(c.origin(Some(12)), at(2, 0));
        // Two captures open at once keep their own counts.
        assert_eq!(c.origin(Some(907)), at(1, 2));
        assert_eq!(c.origin(Some(12)), at(2, 1));
        assert_eq!(c.origin(Some(5000)), at(3, 0));
        assert!(c.any());
    }

    #[test]
    fn the_oldest_capture_is_forgotten_and_numbers_wrap_without_zero() {
        let mut c = Captures::default();
        for id in 0..OPEN_CAPTURES as u64 + 1 {
            c.origin(Some(id));
        }
        // Capture 0 was forgotten: its next call counts as a new graph.
        assert_eq!(c.origin(Some(0)), at(OPEN_CAPTURES as u32 + 2, 0));
        // ... which pushed out capture 1; capture 2 is still followed.
        assert_eq!(c.origin(Some(2)), at(3, 1));
        assert_eq!(c.origin(Some(1)), at(OPEN_CAPTURES as u32 + 3, 0));
        let mut c = Captures::default();
        for id in 0..ORIGIN_WRAP as u64 {
            c.origin(Some(id));
        }
        // Graph numbers run 1..ORIGIN_WRAP-1, then start again at 1 (never 0).
        assert_eq!(c.origin(Some(u64::MAX)), at(2, 0));
        let mut c = Captures::default();
        for k in 0..ORIGIN_WRAP + 2 {
            assert_eq!(c.origin(Some(3)), at(1, k % ORIGIN_WRAP));
        }
    }
}
