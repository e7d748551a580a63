//! Liveness: one extra connection per non-zero rank to rank 0, watched by a thread on each
//! side. A process that dies (even `kill -9`) has its sockets closed by the kernel, so the
//! other end sees end-of-stream at once; an orderly exit says BYE first.
//!
//! - Rank 0 watches every rank's connection. End-of-stream without BYE from rank k: it aborts
//!   its own communicator and sends DIED(k) to every other live rank.
//! - A non-zero rank watches its connection to rank 0: DIED(k) or end-of-stream without BYE
//!   from rank 0 aborts its communicator.
//!
//! Stopping: the owner writes one byte into a socketpair the watcher polls; the watcher says
//! BYE and returns. If the communicator is aborted it says DIED(itself, why) instead, so the
//! others abort too and learn the root cause (say, a mismatched call) rather than only that a
//! rank left. The owner waits for it, bounded.

use super::wire::{poll_timeout, Conn, Deadline, Kind, Reader, WireError, Writer};
use crate::abort::AbortState;
use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags};
use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Bound on liveness messages: they are tiny, a full socket buffer means a stuck peer.
const SEND_BOUND: Duration = Duration::from_millis(100);
/// How long stopping waits for the watcher before leaving it behind.
const STOP_BOUND: Duration = Duration::from_secs(2);
/// Polls also wake this often, so a lost wake-up byte cannot strand the thread.
const IDLE_WAKE: Duration = Duration::from_millis(500);

/// A running watcher thread.
pub(crate) struct Watcher {
    wake: Option<UnixStream>,
    handle: Option<JoinHandle<()>>,
}

impl Watcher {
    /// Rank 0's watcher over `(rank, connection)` pairs.
    pub fn spawn_root(
        conns: Vec<(usize, Conn)>,
        abort: Arc<AbortState>,
    ) -> std::io::Result<Watcher> {
        Self::spawn("ipcreduce-live0", move |wake| {
            root_loop(conns, wake, &abort)
        })
    }

    /// A non-zero rank's watcher over its connection to rank 0.
    pub fn spawn_leaf(rank: usize, conn: Conn, abort: Arc<AbortState>) -> std::io::Result<Watcher> {
        Self::spawn("ipcreduce-live", move |wake| {
            leaf_loop(rank, conn, wake, &abort)
        })
    }

    fn spawn(
        name: &str,
        body: impl FnOnce(UnixStream) + Send + 'static,
    ) -> std::io::Result<Watcher> {
        let (tx, rx) = UnixStream::pair()?;
        rx.set_nonblocking(true)?;
        tx.set_nonblocking(true)?;
        let handle = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || body(rx))?;
        Ok(Watcher {
            wake: Some(tx),
            handle: Some(handle),
        })
    }

    /// Stops the watcher (it says BYE unless aborted) and waits for it, at most
    /// [`STOP_BOUND`]. Idempotent.
    pub fn stop(&mut self) {
        if let Some(mut tx) = self.wake.take() {
            let _ = tx.write(&[1]);
            // Dropping `tx` also wakes it (end-of-stream), should the byte not fit.
        }
        let Some(handle) = self.handle.take() else {
            return;
        };
        let until = Instant::now() + STOP_BOUND;
        while !handle.is_finished() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(1));
        }
        if handle.is_finished() {
            let _ = handle.join();
        } else {
            // Never hang a Drop: the thread only holds its own sockets and ends with the process.
            tracing::warn!(
                "ipcreduce liveness watcher did not stop within {STOP_BOUND:?}; leaving it"
            );
        }
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Polls the wake socket plus `conns`; returns (wake fired, which conns are ready).
fn poll_set(wake: &UnixStream, conns: &[&Conn]) -> (bool, Vec<bool>) {
    let mut pfds = Vec::with_capacity(1 + conns.len());
    pfds.push(PollFd::new(wake.as_fd(), PollFlags::POLLIN));
    for c in conns {
        pfds.push(PollFd::new(c.sock.as_fd(), PollFlags::POLLIN));
    }
    match nix::poll::poll(&mut pfds, poll_timeout(IDLE_WAKE)) {
        Ok(_) | Err(Errno::EINTR) => {}
        // Cannot happen with valid descriptors; back off rather than spin.
        Err(_) => std::thread::sleep(Duration::from_millis(10)),
    }
    let ready = |p: &PollFd| p.revents().is_some_and(|r| !r.is_empty());
    (ready(&pfds[0]), pfds[1..].iter().map(ready).collect())
}

/// Drains the wake socket; true when the owner asked us to stop.
fn woken(mut wake: &UnixStream) -> bool {
    let mut b = [0u8; 16];
    // A byte, end-of-stream (owner dropped its end) or an error: the owner is done with us.
    // Only "nothing there" (a spurious wake-up) means carry on.
    let r = wake.read(&mut b);
    !matches!(r, Err(ref e) if e.kind() == std::io::ErrorKind::WouldBlock)
}

fn say_bye(conn: &mut Conn) {
    let _ = conn.send(Kind::Bye, 0, &[], &[], &Deadline::after(SEND_BOUND));
}

/// Leaving an aborted communicator: tell the other end why, as a DIED about ourselves.
fn say_failed(conn: &mut Conn, rank: usize, abort: &AbortState) {
    let why = abort.reason().unwrap_or_else(|| "aborted".into());
    let mut msg = Writer::new();
    msg.u32(rank as u32)
        .bytes(format!("rank {rank} left after an error: {why}").as_bytes());
    let _ = conn.send(Kind::Died, 0, &msg.0, &[], &Deadline::after(SEND_BOUND));
}

/// What reading a liveness connection turned up.
enum Event {
    Nothing,
    Bye,
    /// Rank 0 reports that rank `k` died.
    Died(usize, String),
    Gone(String),
}

fn next_event(conn: &mut Conn) -> Event {
    loop {
        match conn.try_recv() {
            Ok(None) => return Event::Nothing,
            Ok(Some(f)) => match f.kind {
                Kind::Bye => return Event::Bye,
                Kind::Died => {
                    let mut r = Reader(&f.payload);
                    let k = r.u32().map(|k| k as usize).unwrap_or(usize::MAX);
                    let why = String::from_utf8_lossy(r.rest()).into_owned();
                    return Event::Died(k, why);
                }
                // Nothing else travels here; ignore rather than tear the job down.
                _ => continue,
            },
            // End-of-stream is the normal sign of death; anything else is worth quoting.
            Err(WireError::Eof) => return Event::Gone(String::new()),
            Err(e) => return Event::Gone(format!(" ({e})")),
        }
    }
}

fn root_loop(mut conns: Vec<(usize, Conn)>, wake: UnixStream, abort: &AbortState) {
    loop {
        let (stop, ready) = {
            let refs: Vec<&Conn> = conns.iter().map(|(_, c)| c).collect();
            poll_set(&wake, &refs)
        };
        let mut dead = Vec::new();
        // Downwards so removals do not shift the entries still to visit.
        for i in (0..conns.len()).rev() {
            if !ready[i] {
                continue;
            }
            match next_event(&mut conns[i].1) {
                Event::Nothing => {}
                // A rank leaving after an error says why (see say_failed).
                Event::Died(_, why) => {
                    dead.push((conns[i].0, why));
                    conns.swap_remove(i);
                }
                Event::Bye => {
                    tracing::debug!("rank 0: rank {} left", conns[i].0);
                    conns.swap_remove(i);
                }
                Event::Gone(how) => {
                    let k = conns[i].0;
                    dead.push((
                        k,
                        format!(
                            "rank {k} died: its connection to rank 0 closed without a goodbye{how} \
                             (crashed, killed, or exited after an error)"
                        ),
                    ));
                    conns.swap_remove(i);
                }
            }
        }
        for (k, reason) in dead {
            if abort.is_aborted() {
                tracing::debug!("rank 0: {reason}");
            } else {
                tracing::warn!("rank 0: {reason}");
            }
            abort.abort(reason.clone());
            let mut msg = Writer::new();
            msg.u32(k as u32).bytes(reason.as_bytes());
            let dl = Deadline::after(SEND_BOUND);
            for (_, c) in conns.iter_mut() {
                // A failure here means that rank is gone too; its own end-of-stream says so.
                let _ = c.send(Kind::Died, 0, &msg.0, &[], &dl);
            }
        }
        if stop && woken(&wake) {
            for (_, c) in conns.iter_mut() {
                if abort.is_aborted() {
                    say_failed(c, 0, abort);
                } else {
                    say_bye(c);
                }
            }
            return;
        }
    }
}

fn leaf_loop(rank: usize, mut conn: Conn, wake: UnixStream, abort: &AbortState) {
    loop {
        let (stop, ready) = poll_set(&wake, &[&conn]);
        if ready[0] {
            match next_event(&mut conn) {
                Event::Nothing => {}
                Event::Died(k, why) => {
                    let reason = if why.is_empty() {
                        format!("rank {k} died (reported by rank 0)")
                    } else {
                        format!("{why} [reported by rank 0]")
                    };
                    tracing::warn!("rank {rank}: {reason}");
                    abort.abort(reason);
                }
                Event::Bye => {
                    tracing::debug!("rank {rank}: rank 0 left");
                    return;
                }
                Event::Gone(how) => {
                    let reason = format!(
                        "rank 0 died: its liveness connection closed without a goodbye{how}"
                    );
                    // After an abort, rank 0 leaving silently is expected, not news.
                    if abort.is_aborted() {
                        tracing::debug!("rank {rank}: {reason}");
                    } else {
                        tracing::warn!("rank {rank}: {reason}");
                    }
                    abort.abort(reason);
                    return;
                }
            }
        }
        if stop && woken(&wake) {
            if abort.is_aborted() {
                say_failed(&mut conn, rank, abort);
            } else {
                say_bye(&mut conn);
            }
            return;
        }
    }
}
