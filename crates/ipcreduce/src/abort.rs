//! Shared "this communicator is dead" state.
//!
//! The bootstrap's liveness watcher (a peer process died) and the backends (a wait timed out)
//! set it; every spin loop, on the host and (through a mapped host word) on the GPU, polls it,
//! so all ranks leave a broken collective quickly instead of hanging.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

/// Hook run once when the communicator is aborted (e.g. to raise a flag that kernels poll).
pub type AbortHook = Box<dyn Fn() + Send + Sync>;

#[derive(Default)]
pub struct AbortState {
    /// 0 = alive, 1 = aborted. Read in hot loops, hence a bare atomic.
    flag: AtomicU32,
    reason: Mutex<Option<String>>,
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

    /// Marks the communicator aborted. The first reason wins; later calls are ignored.
    pub fn abort(&self, reason: impl Into<String>) {
        {
            let mut r = self.reason.lock().unwrap_or_else(|e| e.into_inner());
            if r.is_some() {
                return;
            }
            *r = Some(reason.into());
        }
        self.flag.store(1, Ordering::Release);
        for hook in self.hooks.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            hook();
        }
    }

    /// Why the communicator was aborted, if it was.
    pub fn reason(&self) -> Option<String> {
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
    }
}
