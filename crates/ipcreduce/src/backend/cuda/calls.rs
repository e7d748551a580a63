//! Count-0 calls, compared on the host as well as on the device.
//!
//! A count-0 call still meets its peers' calls on the device: a one-block kernel posts its
//! identity and compares theirs (launcher.rs, `empty`). But on a GPU the ranks share (MPS),
//! that one block may not get onto the GPU while the peers' full grids wait for it, and then
//! the mismatch of a count-0 call against a real one would be found only at the timeout. So
//! every eager count-0 call is also told to every peer as a notice (bootstrap/notices.rs):
//! its call number and identity words. Each peer compares them with the identity of its own
//! eager call of that number, kept here for the last [`RECENT`] calls; on a difference it
//! aborts the communicator with both calls in words (the abort reaches every rank, and the
//! kernels waiting on the GPU stop at once). A notice that arrives before the peer made that
//! call waits here until it does.
//!
//! Why the numbers agree: every rank numbers its calls in the launcher (`seq`, one per call,
//! captures included, replays not), and ranks that make the same calls number them alike;
//! only eager calls are kept and told (a graph's calls run when it is replayed, which the host
//! does not see), so a count-0 call is compared with the same eager call on every rank. Where
//! the numbers do not agree, the ranks' calls are out of step, which is a mismatch too.

use super::identity::{describe_mismatch, CallIdentity, IDENT_WORDS};
use crate::abort::AbortState;
use crate::bootstrap::Notices;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

/// This rank's eager calls kept for comparison: a peer's notice is sent within microseconds of
/// its call, while a rank's host may run ahead of its peers by as many calls as its streams
/// queue.
pub const RECENT: usize = 1024;
/// Peers' notices kept until this rank makes the call they name.
const PENDING: usize = 256;
/// A notice: call number (u64) and the identity words (u32 each), little endian.
const NOTICE_BYTES: usize = 8 + 4 * IDENT_WORDS;

pub(super) type Words = [u32; IDENT_WORDS];

/// One communicator's record of its eager calls and of its peers' count-0 calls.
pub(super) struct CallLedger {
    rank: usize,
    inner: Mutex<Inner>,
    abort: Arc<AbortState>,
    notices: Arc<Notices>,
}

#[derive(Default)]
struct Inner {
    /// (call number, identity words) of this rank's latest eager calls, oldest first.
    recent: VecDeque<(u64, Words)>,
    /// Peers' count-0 calls that this rank has not made yet: (peer, call number, words).
    pending: Vec<(usize, u64, Words)>,
}

impl CallLedger {
    /// The ledger of rank `rank`, hearing its peers' notices through `notices`.
    pub fn new(rank: usize, abort: Arc<AbortState>, notices: Arc<Notices>) -> Arc<CallLedger> {
        let ledger = Arc::new(CallLedger {
            rank,
            inner: Mutex::new(Inner::default()),
            abort,
            notices: notices.clone(),
        });
        // Weak: the handler lives as long as the bootstrap, the ledger as long as the
        // communicator's launcher.
        let weak = Arc::downgrade(&ledger);
        notices.on_notice(Box::new(move |from, bytes| {
            if let (Some(l), Some((seq, words))) = (weak.upgrade(), decode(bytes)) {
                l.heard(from, seq, words);
            }
        }));
        ledger
    }

    /// Keeps eager call `seq`'s identity `ident`, encoded as `words` (a call of several kernels
    /// is kept once); a count-0 call is told to every peer.
    pub fn record(&self, seq: u64, ident: &CallIdentity, words: &Words) {
        debug_assert!(
            ident.origin.is_none(),
            "a captured call in the eager ledger"
        );
        let words = *words;
        let due = {
            let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            if g.recent.back().is_some_and(|(s, _)| *s >= seq) {
                return;
            }
            if g.recent.len() == RECENT {
                g.recent.pop_front();
            }
            g.recent.push_back((seq, words));
            take_due(&mut g.pending, seq)
        };
        for (peer, theirs) in due {
            self.compare(seq, &words, peer, &theirs);
        }
        if ident.count == 0 {
            self.notices.tell(encode(seq, &words));
        }
    }

    /// Peer `from`'s count-0 call `seq`: compared now if this rank made that call, else kept
    /// until it does (or forgotten if it is older than every call kept).
    fn heard(&self, from: usize, seq: u64, theirs: Words) {
        let mine = {
            let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            let newest = g.recent.back().map_or(0, |(s, _)| *s);
            if seq > newest {
                if g.pending.len() == PENDING {
                    g.pending.remove(0);
                }
                g.pending.push((from, seq, theirs));
                return;
            }
            match g.recent.iter().rev().find(|(s, _)| *s == seq) {
                Some((_, w)) => *w,
                // Older than what is kept, or a call of ours that was captured, not eager.
                None => return,
            }
        };
        self.compare(seq, &mine, from, &theirs);
    }

    /// Aborts the communicator when call `seq` differs between this rank and `peer`.
    fn compare(&self, seq: u64, mine: &Words, peer: usize, theirs: &Words) {
        if mine == theirs {
            return;
        }
        let detail = match CallIdentity::decode(mine) {
            Some(m) => {
                describe_mismatch(self.rank, &m, peer, CallIdentity::decode(theirs).as_ref())
            }
            None => format!(
                "rank {}: an unreadable call; rank {peer}: a count-0 call",
                self.rank
            ),
        };
        self.abort.abort(format!(
            "call {seq} does not match (rank {peer}'s count-0 call, compared on the host): \
             {detail}"
        ));
    }
}

/// The pending notices of call `seq`, taken out; those of older calls are dropped (this rank's
/// call of that number was captured, not eager: the ranks are out of step, which the device
/// finds, as a replay against an eager call).
fn take_due(pending: &mut Vec<(usize, u64, Words)>, seq: u64) -> Vec<(usize, Words)> {
    if pending.is_empty() {
        return Vec::new();
    }
    let mut due = Vec::new();
    pending.retain(|&(peer, s, w)| {
        if s == seq {
            due.push((peer, w));
        }
        s > seq
    });
    due
}

fn encode(seq: u64, words: &Words) -> Vec<u8> {
    let mut b = Vec::with_capacity(NOTICE_BYTES);
    b.extend_from_slice(&seq.to_le_bytes());
    for w in words {
        b.extend_from_slice(&w.to_le_bytes());
    }
    b
}

fn decode(b: &[u8]) -> Option<(u64, Words)> {
    if b.len() != NOTICE_BYTES {
        return None;
    }
    let seq = u64::from_le_bytes(b[..8].try_into().ok()?);
    let mut words = [0u32; IDENT_WORDS];
    for (w, c) in words.iter_mut().zip(b[8..].chunks_exact(4)) {
        *w = u32::from_le_bytes(c.try_into().ok()?);
    }
    Some((seq, words))
}

#[cfg(test)]
mod tests {
    use super::super::paths::CudaPath;
    use super::*;
    use crate::backend::SgOp;
    use crate::types::{DType, ReduceOp};

    fn call(path: CudaPath, count: u64) -> CallIdentity {
        CallIdentity {
            op: SgOp::AllReduce,
            path,
            dtype: DType::F32,
            reduce: ReduceOp::Sum,
            count,
            in_place: false,
            send: None,
            recv: None,
            fused: None,
            origin: None,
        }
    }

    fn empty() -> CallIdentity {
        call(CudaPath::Empty, 0)
    }

    /// A rank's ledger, its abort state and its notices (whose outbox the test carries to the
    /// peers by hand, as the watcher would).
    struct Rank {
        ledger: Arc<CallLedger>,
        abort: Arc<AbortState>,
        notices: Arc<Notices>,
    }

    fn rank(r: usize) -> Rank {
        let abort = AbortState::new();
        let notices = Arc::new(Notices::default());
        notices.set_wake(Box::new(|| {}));
        Rank {
            ledger: CallLedger::new(r, abort.clone(), notices.clone()),
            abort,
            notices,
        }
    }

    impl Rank {
        fn make(&self, seq: u64, ident: &CallIdentity) {
            self.ledger.record(seq, ident, &ident.encode());
        }
        /// Hands what this rank told to `to`, as from rank `from`.
        fn tell(&self, from: usize, to: &Rank) -> usize {
            let out = self.notices.take_outbox();
            for n in &out {
                to.notices.deliver(from, n);
            }
            out.len()
        }
    }

    #[test]
    fn only_count_0_calls_are_told() {
        let a = rank(0);
        a.make(1, &call(CudaPath::TwoShotStaged, 1 << 20));
        a.make(2, &empty());
        // A call of two kernels is recorded (and told) once.
        a.make(2, &empty());
        let out = a.notices.take_outbox();
        assert_eq!(out.len(), 1);
        assert_eq!(decode(&out[0]), Some((2, empty().encode())));
    }

    #[test]
    fn the_same_count_0_call_on_both_ranks_is_no_mismatch() {
        let (a, b) = (rank(0), rank(1));
        for seq in 1..=3 {
            a.make(seq, &empty());
            b.make(seq, &empty());
        }
        assert_eq!(a.tell(0, &b), 3);
        assert_eq!(b.tell(1, &a), 3);
        assert!(!a.abort.is_aborted() && !b.abort.is_aborted());
    }

    #[test]
    fn a_count_0_call_against_a_real_one_aborts_naming_both() {
        let (a, b) = (rank(0), rank(1));
        let real = call(CudaPath::TwoShotStaged, 1 << 20);
        a.make(1, &real);
        b.make(1, &empty());
        b.tell(1, &a);
        let why = a.abort.reason().expect("rank 0 aborted");
        for w in [
            "call 1",
            "rank 0: all-reduce twoshot",
            "1048576 x float",
            "rank 1: all-reduce empty 0 x float",
            "differ in",
        ] {
            assert!(why.contains(w), "`{w}` not in: {why}");
        }
        // Told on, so every rank stops (the liveness watcher broadcasts a local abort).
        assert_eq!(a.abort.origin(), Some(crate::abort::Origin::Local));
        // Rank 1 told; it finds nothing itself (rank 0 did not call count 0).
        assert_eq!(a.tell(0, &b), 0);
        assert!(!b.abort.is_aborted());
    }

    #[test]
    fn a_notice_ahead_of_the_call_is_compared_when_the_call_is_made() {
        let (a, b) = (rank(0), rank(1));
        b.make(1, &empty());
        b.tell(1, &a);
        assert!(!a.abort.is_aborted(), "compared before rank 0 made call 1");
        a.make(1, &call(CudaPath::OneShotLl, 64));
        let why = a.abort.reason().expect("rank 0 aborted");
        assert!(why.contains("differ in") && why.contains("count"), "{why}");
    }

    #[test]
    fn a_notice_ahead_that_matches_is_dropped_when_the_call_is_made() {
        let (a, b) = (rank(0), rank(1));
        b.make(5, &empty());
        b.tell(1, &a);
        a.make(5, &empty());
        a.make(6, &call(CudaPath::OneShotLl, 64));
        assert!(!a.abort.is_aborted());
        assert!(a.ledger.inner.lock().unwrap().pending.is_empty());
    }

    #[test]
    fn notices_of_calls_not_kept_are_not_compared() {
        let (a, b) = (rank(0), rank(1));
        // Rank 0's call 1 was captured (not kept): a count-0 notice of call 1 finds nothing.
        a.make(2, &call(CudaPath::OneShotLl, 64));
        b.make(1, &empty());
        b.tell(1, &a);
        assert!(!a.abort.is_aborted());
        // Calls older than the last RECENT are forgotten.
        let c = rank(0);
        for seq in 1..=(RECENT as u64 + 1) {
            c.make(seq, &call(CudaPath::OneShotLl, 64));
        }
        c.notices.deliver(1, &encode(1, &empty().encode()));
        assert!(!c.abort.is_aborted());
        c.notices.deliver(1, &encode(2, &empty().encode()));
        assert!(c.abort.is_aborted());
    }

    #[test]
    fn malformed_notices_are_ignored() {
        let a = rank(0);
        a.make(1, &call(CudaPath::OneShotLl, 64));
        a.notices.deliver(1, &[1, 2, 3]);
        let mut long = encode(1, &empty().encode());
        long.push(0);
        a.notices.deliver(1, &long);
        assert!(!a.abort.is_aborted());
    }
}
