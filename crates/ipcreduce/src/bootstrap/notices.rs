//! Notices: small messages a backend tells every peer outside any collective, through the
//! liveness connections (so no call has to wait for them). Today one kind: the cuda backend's
//! count-0 calls (backend/cuda/calls.rs), which on a GPU shared by the ranks may otherwise be
//! compared with their peers' calls only at the timeout.
//!
//! A notice is opaque bytes to this layer. [`Notices::tell`] queues it and wakes the watcher,
//! which sends it (a non-zero rank to rank 0, which relays it to every other rank; rank 0 to
//! every rank); every rank but the sender hands it to the handler the backend installed, with
//! the sending rank. Delivery is best effort (a peer that is gone is reported by liveness, not
//! here) and in order per sender. A peer may tell before this rank installed its handler (its
//! init ran ahead): those notices are held, and handed to the handler when it comes.

use std::sync::{Mutex, OnceLock};

/// What a backend does with a peer's notice: `(sending rank, notice)`. Runs on the watcher
/// thread; it must not block.
pub type NoticeHandler = Box<dyn Fn(usize, &[u8]) + Send + Sync>;

/// Notices are a few words; a longer one is a bug, not something to send.
pub const NOTICE_MAX: usize = 1024;
/// Notices queued and not yet sent, at most: the watcher sends them within microseconds, so a
/// full box means it is gone (the job is ending) and the oldest can go.
const OUTBOX_MAX: usize = 1024;
/// Peers' notices held for a handler not yet installed, at most (the oldest go first).
const EARLY_MAX: usize = 1024;

/// One communicator's notices: the outbox the watcher sends from, and the handler of those
/// received.
#[derive(Default)]
pub struct Notices {
    outbox: Mutex<Vec<Vec<u8>>>,
    handler: OnceLock<NoticeHandler>,
    /// Peers' notices that came before the handler, oldest first. Its lock also orders
    /// delivery: a notice is handed over only with this held, so the held ones go first.
    early: Mutex<Vec<(usize, Vec<u8>)>>,
    /// Wakes the watcher; unset where there is none (a world of one), and then nothing is
    /// queued.
    wake: OnceLock<Box<dyn Fn() + Send + Sync>>,
}

impl Notices {
    /// Sends `notice` to every peer, soon (it is queued; this does not block).
    pub fn tell(&self, notice: Vec<u8>) {
        debug_assert!(
            notice.len() <= NOTICE_MAX,
            "a notice of {} bytes",
            notice.len()
        );
        let Some(wake) = self.wake.get() else {
            return;
        };
        {
            let mut out = self.outbox.lock().unwrap_or_else(|e| e.into_inner());
            if out.len() >= OUTBOX_MAX {
                out.remove(0);
            }
            out.push(notice);
        }
        wake();
    }

    /// Installs the handler of peers' notices, and hands it those that came before it; false
    /// if one was installed already (it stays).
    pub fn on_notice(&self, handler: NoticeHandler) -> bool {
        // Under the lock, so that no notice is handed over between the set and the held ones.
        let mut early = self.early.lock().unwrap_or_else(|e| e.into_inner());
        if self.handler.set(handler).is_err() {
            return false;
        }
        if let Some(h) = self.handler.get() {
            for (from, notice) in early.drain(..) {
                h(from, &notice);
            }
        }
        true
    }

    /// The watcher's (and tests'): how it is woken when a notice is queued.
    pub(crate) fn set_wake(&self, wake: Box<dyn Fn() + Send + Sync>) {
        let _ = self.wake.set(wake);
    }

    /// The watcher's: the notices queued since it last looked.
    pub(crate) fn take_outbox(&self) -> Vec<Vec<u8>> {
        std::mem::take(&mut *self.outbox.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// The watcher's: a notice from rank `from` arrived.
    pub(crate) fn deliver(&self, from: usize, notice: &[u8]) {
        let mut early = self.early.lock().unwrap_or_else(|e| e.into_inner());
        match self.handler.get() {
            // Installed, and it took the held ones under this lock: this one follows them.
            Some(h) => h(from, notice),
            None => {
                if early.len() >= EARLY_MAX {
                    early.remove(0);
                }
                early.push((from, notice.to_vec()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    #[test]
    fn without_a_watcher_nothing_is_queued() {
        let n = Notices::default();
        n.tell(vec![1, 2]);
        assert!(n.take_outbox().is_empty());
    }

    #[test]
    fn queued_notices_wake_the_watcher_and_come_out_in_order() {
        let n = Notices::default();
        let wakes = Arc::new(AtomicUsize::new(0));
        let w = wakes.clone();
        n.set_wake(Box::new(move || {
            w.fetch_add(1, Ordering::SeqCst);
        }));
        n.tell(vec![1]);
        n.tell(vec![2, 3]);
        assert_eq!(wakes.load(Ordering::SeqCst), 2);
        assert_eq!(n.take_outbox(), vec![vec![1], vec![2, 3]]);
        assert!(n.take_outbox().is_empty());
    }

    #[test]
    fn the_first_handler_stays_and_hears_the_sender() {
        let n = Notices::default();
        let heard = Arc::new(Mutex::new(Vec::new()));
        let h = heard.clone();
        assert!(n.on_notice(Box::new(move |from, b| {
            h.lock().unwrap().push((from, b.to_vec()))
        })));
        assert!(!n.on_notice(Box::new(|_, _| panic!("second handler ran"))));
        n.deliver(3, &[9, 9]);
        assert_eq!(*heard.lock().unwrap(), vec![(3, vec![9, 9])]);
    }

    #[test]
    fn notices_before_the_handler_are_handed_to_it_in_order() {
        let n = Notices::default();
        n.deliver(1, &[1]);
        n.deliver(2, &[2]);
        let heard = Arc::new(Mutex::new(Vec::new()));
        let h = heard.clone();
        assert!(n.on_notice(Box::new(move |from, b| {
            h.lock().unwrap().push((from, b.to_vec()))
        })));
        n.deliver(1, &[3]);
        assert_eq!(
            *heard.lock().unwrap(),
            vec![(1, vec![1]), (2, vec![2]), (1, vec![3])]
        );
    }
}
