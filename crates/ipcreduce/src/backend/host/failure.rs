//! Leaving a broken collective: bounded waits that also watch for aborts, and turning a
//! failure into the caller's error while making sure nobody else waits for us in vain.

use super::sync::{self, Signal, WaitError};
use super::HostComm;
use crate::error::Error;
use std::time::Duration;

/// What a rank publishes in its arena's abort word when it gives up, so peers waiting on it
/// leave at once instead of running into their own timeouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum AbortWord {
    /// Gave up waiting for `culprit`.
    Timeout { culprit: usize },
    /// Found `culprit`'s arguments different from its own.
    Mismatch { culprit: usize },
    /// Aborted for another reason (a peer died, or a cascade).
    Other,
}

impl AbortWord {
    fn encode(self) -> u64 {
        match self {
            AbortWord::Timeout { culprit } => 1 << 56 | culprit as u64,
            AbortWord::Mismatch { culprit } => 2 << 56 | culprit as u64,
            AbortWord::Other => 3 << 56,
        }
    }

    fn decode(w: u64) -> Option<AbortWord> {
        let culprit = (w & 0xFFFF_FFFF) as usize;
        match w >> 56 {
            0 => None,
            1 => Some(AbortWord::Timeout { culprit }),
            2 => Some(AbortWord::Mismatch { culprit }),
            _ => Some(AbortWord::Other),
        }
    }
}

/// Why a protocol step stopped.
pub(super) enum Fail {
    Timeout {
        peer: usize,
        waited: Duration,
    },
    Mismatch {
        peer: usize,
        detail: String,
    },
    /// Our AbortState was set (by the liveness watcher, or an earlier failure).
    Local,
    /// Peer `by` gave up, saying `word` and `why` (while we waited for `waiting_on`).
    Peer {
        by: usize,
        word: AbortWord,
        why: String,
        waiting_on: Option<usize>,
        waited: Duration,
    },
}

impl HostComm {
    /// Bounded wait for `sig` (in peer `q`'s arena) to reach `target`.
    pub(super) fn wait_signal(&self, q: usize, sig: &Signal, target: u64) -> Result<(), Fail> {
        let mut why = None;
        let r = sync::wait(sig, target, self.timeout, self.policy, &mut || {
            why = self.poll_aborts(false);
            why.is_some()
        });
        match r {
            Ok(()) => Ok(()),
            Err(WaitError::Timeout { waited }) => Err(Fail::Timeout { peer: q, waited }),
            Err(WaitError::Stopped { waited }) => Err(match why {
                Some(Fail::Peer { by, word, why, .. }) => Fail::Peer {
                    by,
                    word,
                    why,
                    waiting_on: Some(q),
                    waited,
                },
                Some(f) => f,
                None => Fail::Local,
            }),
        }
    }

    /// Every peer's abort word, then our own abort state. At the start of a call
    /// (`entering`), a peer's mismatch verdict is not yet ours: the peer published its stamp
    /// for this call before giving up, so going on lets this rank find the mismatch itself
    /// and report it as such. The words come first because they say more: a peer that timed
    /// out on the rank we wait for makes that our timeout too, even when the same news has
    /// already reached our own state through the liveness connections.
    fn poll_aborts(&self, entering: bool) -> Option<Fail> {
        for q in self.peers() {
            let line = &self.ctrl(q).abort;
            match AbortWord::decode(line.word()) {
                None => {}
                Some(AbortWord::Mismatch { .. }) if entering => {}
                Some(word) => {
                    return Some(Fail::Peer {
                        by: q,
                        word,
                        why: line.text(),
                        waiting_on: None,
                        waited: Duration::ZERO,
                    })
                }
            }
        }
        self.abort.is_aborted().then_some(Fail::Local)
    }

    /// Fails fast when the communicator is already dead.
    pub(super) fn check_alive(&self, op: &str, seq: u64) -> Result<(), Error> {
        match self.poll_aborts(true) {
            None => Ok(()),
            Some(f) => Err(self.fail(f, op, seq)),
        }
    }

    /// Turns a protocol failure into the error to return, and makes the communicator dead:
    /// our abort word (so peers stop waiting for us), our AbortState (so later calls fail
    /// fast), and a wake-up for peers asleep on our flags.
    pub(super) fn fail(&self, f: Fail, op: &str, seq: u64) -> Error {
        let rank = self.rank;
        let aborted = |reason: String| {
            let e = Error::Aborted {
                rank,
                reason: reason.clone(),
            };
            (e, AbortWord::Other, reason)
        };
        let (err, word, reason) = match f {
            Fail::Timeout { peer, waited } => {
                let reason =
                    format!("rank {rank} timed out in {op} #{seq} waiting for rank {peer}");
                let e = Error::Timeout {
                    rank,
                    peer,
                    op: op.into(),
                    seq,
                    waited,
                };
                (e, AbortWord::Timeout { culprit: peer }, reason)
            }
            Fail::Mismatch { peer, detail } => {
                let reason = format!(
                    "{op} #{seq} arguments differ between ranks {rank} and {peer}: {detail}"
                );
                let e = Error::Mismatch {
                    rank,
                    peer,
                    op: op.into(),
                    seq,
                    detail,
                };
                (e, AbortWord::Mismatch { culprit: peer }, reason)
            }
            Fail::Local => aborted(self.abort.reason().unwrap_or_else(|| "aborted".into())),
            Fail::Peer {
                by,
                word,
                why,
                waiting_on,
                waited,
            } => {
                let why = format!("{why} (via rank {by})");
                match word {
                    // Someone already gave up on the rank we are waiting for: that is our
                    // timeout too, reported now rather than after the rest of our deadline.
                    AbortWord::Timeout { culprit } if waiting_on == Some(culprit) => {
                        let e = Error::Timeout {
                            rank,
                            peer: culprit,
                            op: op.into(),
                            seq,
                            waited,
                        };
                        (e, AbortWord::Timeout { culprit }, why)
                    }
                    _ => aborted(why),
                }
            }
        };
        let own = self.own();
        own.abort.publish(word.encode(), &reason);
        self.abort.abort(reason);
        for l in &own.ready {
            l.sig.wake_all();
        }
        for l in &own.reduced {
            l.sig.wake_all();
        }
        own.done.sig.wake_all();
        own.barrier.sig.wake_all();
        err
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn abort_words_round_trip() {
        for w in [
            AbortWord::Timeout { culprit: 7 },
            AbortWord::Mismatch { culprit: 0 },
            AbortWord::Other,
        ] {
            assert_eq!(AbortWord::decode(w.encode()), Some(w));
            assert_ne!(w.encode(), 0);
        }
        assert_eq!(AbortWord::decode(0), None);
    }
}
