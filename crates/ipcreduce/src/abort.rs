//! Shared "this communicator is dead" state.
//!
//! The bootstrap's liveness watcher (a peer process died) and the backends (a wait timed out)
//! set it; every spin loop, on the host and (through a mapped host word) on the GPU, polls it,
//! so all ranks leave a broken collective quickly instead of hanging.
//!
//! Every abort says where it started ([`Origin`]): one raised on this rank (an argument
//! error, a failed call, [`crate::Communicator::abort`]) is broadcast to every rank at once by
//! the liveness watcher; one learnt from a peer is not sent on again, so news of an abort never
//! loops between ranks.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

/// Hook run once when the communicator is aborted (e.g. to raise a flag that kernels poll).
pub type AbortHook = Box<dyn Fn() + Send + Sync>;

/// Where the first reason of an abort came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// Raised on this rank: its peers do not know yet, so it is to be broadcast.
    Local,
    /// Learnt from a peer (through the liveness connections): everyone is being told already.
    Peer,
}

#[derive(Default)]
pub struct AbortState {
    /// 0 = alive, 1 = aborted. Read in hot loops, hence a bare atomic.
    flag: AtomicU32,
    reason: Mutex<Option<(String, Origin)>>,
    hooks: Mutex<Vec<AbortHook>>,
}

impl AbortState {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Cheap check for hot loops.
    #[inline]
    pub fn is_aborted(&self) -> bool {
        self.flag.load(Ordering::Acquire) != 0
    }

    /// Address of the flag word, for backends that mirror it elsewhere.
    pub fn flag(&self) -> &AtomicU32 {
        &self.flag
    }

    /// Marks the communicator aborted for a reason found on this rank (broadcast to every
    /// rank). The first reason wins; later calls are ignored.
    pub fn abort(&self, reason: impl Into<String>) {
        self.abort_from(reason, Origin::Local)
    }

    /// Marks the communicator aborted for a reason a peer reported (not sent on again).
    pub fn abort_from_peer(&self, reason: impl Into<String>) {
        self.abort_from(reason, Origin::Peer)
    }

    /// [`Self::abort`] or [`Self::abort_from_peer`] as `origin` says.
    pub fn abort_from(&self, reason: impl Into<String>, origin: Origin) {
        {
            let mut r = self.reason.lock().unwrap_or_else(|e| e.into_inner());
            if r.is_some() {
                return;
            }
            *r = Some((reason.into(), origin));
        }
        self.flag.store(1, Ordering::Release);
        for hook in self.hooks.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            hook();
        }
    }

    /// Why the communicator was aborted, if it was.
    pub fn reason(&self) -> Option<String> {
        self.first().map(|(r, _)| r)
    }

    /// Where the abort came from, if the communicator is aborted.
    pub fn origin(&self) -> Option<Origin> {
        self.first().map(|(_, o)| o)
    }

    /// The first reason and its origin.
    pub fn first(&self) -> Option<(String, Origin)> {
        self.reason
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Registers a hook; runs it at once if the communicator is already aborted.
    pub fn on_abort(&self, hook: AbortHook) {
        if self.is_aborted() {
            hook();
        }
        self.hooks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(hook);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn first_reason_wins_and_hooks_run_once() {
        let a = AbortState::new();
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        a.on_abort(Box::new(move || {
            c.fetch_add(1, Ordering::SeqCst);
        }));
        assert!(!a.is_aborted());
        a.abort("rank 2 died");
        a.abort("timeout");
        assert!(a.is_aborted());
        assert_eq!(a.reason().as_deref(), Some("rank 2 died"));
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        assert_eq!(a.origin(), Some(Origin::Local));
    }

    #[test]
    fn the_first_origin_is_kept_with_the_first_reason() {
        let a = AbortState::new();
        assert_eq!(a.origin(), None);
        a.abort_from_peer("rank 1 aborted: bad pointer");
        a.abort("rank 0 timed out");
        assert_eq!(
            a.first(),
            Some(("rank 1 aborted: bad pointer".to_string(), Origin::Peer))
        );
    }
}
