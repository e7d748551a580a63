//! Leaving a job. Collective and bounded:
//! 1. wait for the work this rank enqueued on any stream (deadline: the timeout and a margin;
//!    past it the kernels are told to stop through the abort flag, and waited for once more);
//! 2. a barrier with every rank (bounded by the timeout), so that no peer still reads our
//!    workspace when we free it: in `ipc` mode a peer's mapping does not keep it alive;
//! 3. free. Memory that work may still use is leaked instead: a leak is better than a fault
//!    in a kernel, ours or a peer's.
//!
//! CUDA graphs that captured our calls hold the addresses of our memory and may be replayed
//! after we are gone. So when any call was captured, the private state (a few KiB) is kept and
//! its call counter set to `CALL_CLOSED`: every kernel reads that counter first and traps on
//! it (prims.cuh), so a replay fails loudly before it reads or writes any freed (or reused)
//! address, instead of waiting for peers that left or writing into another allocation.
//!
//! Never panics, never waits without a deadline. An aborted communicator skips the barrier
//! (its peers are leaving too, or gone).

use super::kernels::STATE_CALL_WORD;
use super::{driver, CudaComm};
use crate::bootstrap::Bootstrap;
use crate::config::Sharing;
use std::mem::ManuallyDrop;
use std::time::{Duration, Instant};

/// What Drop must not free.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Leak {
    Nothing,
    /// Our workspace: a peer may still read it (ipc mode, no barrier).
    Workspace,
    /// Everything kernels touch: our own work may still run.
    All,
}

/// How long stopped kernels get to leave after the abort flag is raised.
const AFTER_ABORT: Duration = Duration::from_secs(2);

impl CudaComm {
    /// Steps 1 and 2 above; Drop does step 3.
    pub(super) fn teardown(&mut self, boot: &mut Bootstrap) {
        self.left = true;
        self.quiesce();
        if self.leak == Leak::All {
            return;
        }
        if let Err(e) = boot.barrier() {
            tracing::info!(rank = self.rank, "no teardown barrier: {e}");
            if self.ws.sharing() == Some(Sharing::Ipc) {
                self.leak = Leak::Workspace;
            }
        }
    }

    /// Waits for our work on every stream; sets `leak` when it does not finish.
    fn quiesce(&mut self) {
        if self.ctx.bind_to_thread().is_err() {
            self.leak = self.leak.max(Leak::All);
            return;
        }
        self.streams.used_own();
        let deadline = Instant::now() + self.launch.timeout + Duration::from_secs(1);
        match self.streams.drain(&mut self.events, deadline) {
            Ok(true) => return,
            Ok(false) => {}
            Err(e) => tracing::warn!(rank = self.rank, "waiting for work at teardown: {e}"),
        }
        // Tell our kernels to stop, then give them a moment.
        self.launch
            .abort
            .abort("teardown: work of this communicator still ran at its deadline");
        if !matches!(
            self.streams
                .drain(&mut self.events, Instant::now() + AFTER_ABORT),
            Ok(true)
        ) {
            tracing::warn!(
                rank = self.rank,
                "work still runs at teardown: its device memory is left allocated"
            );
            self.leak = Leak::All;
        }
    }
}

/// The call counter of a closed communicator whose calls were captured (`CALL_CLOSED` in
/// kernels/prims.cuh).
const CALL_CLOSED: u64 = u64::MAX;

impl CudaComm {
    /// Sets the state's call counter to [`CALL_CLOSED`] for the graphs that captured our calls
    /// (see the module's comment) and waits for the copy; false if that failed.
    fn close_for_graphs(&mut self) -> bool {
        let at = self.launch.state.ptr + (STATE_CALL_WORD * 4) as u64;
        let word = CALL_CLOSED.to_le_bytes();
        let own = self.stream.cu_stream();
        let res = self
            .ctx
            .bind_to_thread()
            .map_err(|e| e.to_string())
            .and_then(|_| {
                // SAFETY: the state holds the counter at `at`; `word` lives until the stream (our
                // own, with no other work left: quiesce waited for it) is synchronized below.
                unsafe { driver::copy_to_device_async(at, &word, own, self.rank) }
                    .map_err(|e| e.to_string())?;
                self.stream.synchronize().map_err(|e| e.to_string())
            });
        match res {
            Ok(()) => {
                // The kernels' trap carries no message (prims.cuh, open_call_counter): this
                // line is what names the cause of a later replay's CUDA_ERROR_LAUNCH_FAILED.
                tracing::info!(
                    rank = self.rank,
                    "closed with calls captured in CUDA graphs: replaying those graphs from                      now on fails (CUDA_ERROR_LAUNCH_FAILED); destroy them"
                );
                true
            }
            Err(e) => {
                tracing::warn!(
                    rank = self.rank,
                    "could not mark the state closed for captured CUDA graphs: {e}; a replay \
                     of them would run on freed memory"
                );
                false
            }
        }
    }
}

impl Drop for CudaComm {
    fn drop(&mut self) {
        // Dropped without `teardown` (init failed half way): still wait for our own work.
        if !self.left {
            self.quiesce();
        }
        // Kept, marked closed, when graphs may still replay our calls (unmarked it would guard
        // nothing: then it is freed like the rest).
        let keep_state = self.captures.any() && self.close_for_graphs();
        if self.launch.abort.is_aborted() || self.leak != Leak::Nothing {
            if let Ok(nccl) = &mut self.nccl {
                nccl.abort_on_drop();
            }
            if let Some(inter) = &mut self.inter {
                inter.abort_on_drop();
            }
        }
        // SAFETY: each field is dropped at most once, here, and not used afterwards.
        unsafe {
            if self.leak < Leak::Workspace {
                ManuallyDrop::drop(&mut self.ws);
            }
            if self.leak < Leak::All {
                // Registered memory is cuMem memory: a peer's mapping keeps it alive, so only
                // our own unfinished work keeps it from being released.
                ManuallyDrop::drop(&mut self.registry);
                if !keep_state {
                    ManuallyDrop::drop(&mut self.launch.state);
                }
                ManuallyDrop::drop(&mut self.launch.words);
            } else if let Some(ring) = self.launch.phases.take() {
                // Kernels that may still run stamp into it: never freed.
                std::mem::forget(ring);
            }
        }
    }
}
