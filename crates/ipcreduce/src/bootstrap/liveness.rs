//! Liveness: one extra connection per non-zero rank to rank 0, watched by a thread on each
//! side. A process that dies (even `kill -9`) has its sockets closed by the kernel, so the
//! other end sees end-of-stream at once; an orderly exit says BYE first.
//!
//! - Rank 0 watches every rank's connection. End-of-stream without BYE from rank k: it aborts
//!   its own communicator and sends DIED(k) to every other live rank.
//! - A non-zero rank watches its connection to rank 0: DIED(k) or end-of-stream without BYE
//!   from rank 0 aborts its communicator.
//!
//! - An abort raised on this rank (an argument error, a failed call, `Communicator::abort`)
//!   is news: an abort hook wakes the watcher, which sends DIED(itself, why) at once (a
//!   non-zero rank to rank 0, which relays it to every other rank as it does for deaths; rank 0
//!   to every rank). Every rank's calls then stop with the root cause within milliseconds,
//!   rather than at their timeout or when the failing rank leaves. An abort learnt from a peer
//!   is not sent on again, so nothing loops.
//!
//! - Notices (see notices.rs) ride the same connections: a queued one wakes the watcher as
//!   abort news does, which sends it (a non-zero rank to rank 0; rank 0 to every rank, and it
//!   relays what a non-zero rank sent to every other rank).
//!
//! Stopping: the owner writes one byte into a socketpair the watcher polls; the watcher says
//! BYE and returns. If the communicator was aborted here and that was not yet told, it says
//! DIED(itself, why) instead, so the others abort too and learn the root cause (say, a
//! mismatched call) rather than only that a rank left. The owner waits for it, bounded.

use super::notices::{Notices, NOTICE_MAX};
use super::wire::{poll_timeout, Conn, Deadline, Kind, Reader, WireError, Writer};
use crate::abort::{AbortState, Origin};
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

/// The watcher's two wake-up sockets: the owner's stop request, and news (an abort raised
/// here, or a notice queued).
struct Wakes {
    stop: UnixStream,
    news: UnixStream,
}

impl Watcher {
    /// Rank 0's watcher over `(rank, connection)` pairs.
    pub fn spawn_root(
        conns: Vec<(usize, Conn)>,
        abort: Arc<AbortState>,
        notices: Arc<Notices>,
    ) -> std::io::Result<Watcher> {
        let (a, n) = (abort.clone(), notices.clone());
        Self::spawn("ipcreduce-live0", &a, &n, move |wakes| {
            root_loop(conns, wakes, &abort, &notices)
        })
    }

    /// A non-zero rank's watcher over its connection to rank 0.
    pub fn spawn_leaf(
        rank: usize,
        conn: Conn,
        abort: Arc<AbortState>,
        notices: Arc<Notices>,
    ) -> std::io::Result<Watcher> {
        let (a, n) = (abort.clone(), notices.clone());
        Self::spawn("ipcreduce-live", &a, &n, move |wakes| {
            leaf_loop(rank, conn, wakes, &abort, &notices)
        })
    }

    fn spawn(
        name: &str,
        abort: &AbortState,
        notices: &Notices,
        body: impl FnOnce(Wakes) + Send + 'static,
    ) -> std::io::Result<Watcher> {
        let (tx, rx) = UnixStream::pair()?;
        let (news_tx, news_rx) = UnixStream::pair()?;
        for s in [&tx, &rx, &news_tx, &news_rx] {
            s.set_nonblocking(true)?;
        }
        let wakes = Wakes {
            stop: rx,
            news: news_rx,
        };
        let handle = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || body(wakes))?;
        // The hooks only poke the watcher (one non-blocking byte): they run on whatever thread
        // aborts or tells, maybe inside a call. MSG_NOSIGNAL: after the watcher ended, the
        // write fails quietly instead of raising SIGPIPE in a process that did not ignore it.
        let news_tx = Arc::new(news_tx);
        let poke = move |tx: &UnixStream| {
            let _ = nix::sys::socket::send(
                std::os::fd::AsRawFd::as_raw_fd(tx),
                &[1],
                nix::sys::socket::MsgFlags::MSG_NOSIGNAL | nix::sys::socket::MsgFlags::MSG_DONTWAIT,
            );
        };
        let tx2 = news_tx.clone();
        abort.on_abort(Box::new(move || poke(&news_tx)));
        notices.set_wake(Box::new(move || poke(&tx2)));
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

/// Polls the wake sockets plus `conns`; returns (stop fired, abort news fired, which conns
/// are ready).
fn poll_set(wakes: &Wakes, conns: &[&Conn]) -> (bool, bool, Vec<bool>) {
    let mut pfds = Vec::with_capacity(2 + conns.len());
    pfds.push(PollFd::new(wakes.stop.as_fd(), PollFlags::POLLIN));
    pfds.push(PollFd::new(wakes.news.as_fd(), PollFlags::POLLIN));
    for c in conns {
        pfds.push(PollFd::new(c.sock.as_fd(), PollFlags::POLLIN));
    }
    match nix::poll::poll(&mut pfds, poll_timeout(IDLE_WAKE)) {
        Ok(_) | Err(Errno::EINTR) => {}
        // Cannot happen with valid descriptors; back off rather than spin.
        Err(_) => std::thread::sleep(Duration::from_millis(10)),
    }
    let ready = |p: &PollFd| p.revents().is_some_and(|r| !r.is_empty());
    (
        ready(&pfds[0]),
        ready(&pfds[1]),
        pfds[2..].iter().map(ready).collect(),
    )
}

/// Empties the news socket (the bytes carry nothing; the abort state and the outbox say what
/// happened).
fn drain(mut news: &UnixStream) {
    let mut b = [0u8; 64];
    while matches!(news.read(&mut b), Ok(n) if n > 0) {}
}

/// Whether this rank has an abort of its own that its peers have not been told of.
fn untold(abort: &AbortState, told: bool) -> bool {
    !told && abort.origin() == Some(Origin::Local)
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

/// An abort raised here: tell the other end why, as a DIED about ourselves (`leaving`: we
/// are stopping, rather than telling the news as it happens).
fn say_failed(conn: &mut Conn, rank: usize, abort: &AbortState, leaving: bool) {
    let why = abort.reason().unwrap_or_else(|| "aborted".into());
    let text = if leaving {
        format!("rank {rank} left after an error: {why}")
    } else {
        format!("rank {rank} aborted: {why}")
    };
    let mut msg = Writer::new();
    msg.u32(rank as u32).bytes(text.as_bytes());
    let _ = conn.send(Kind::Died, 0, &msg.0, &[], &Deadline::after(SEND_BOUND));
}

/// Sends rank `from`'s notice over `conn` (a failure means that end is gone; liveness says so).
fn send_notice(conn: &mut Conn, from: usize, notice: &[u8]) {
    let mut msg = Writer::new();
    msg.u32(from as u32).bytes(notice);
    let _ = conn.send(Kind::Notice, 0, &msg.0, &[], &Deadline::after(SEND_BOUND));
}

/// What reading a liveness connection turned up.
enum Event {
    Nothing,
    Bye,
    /// Rank 0 reports that rank `k` died.
    Died(usize, String),
    /// Rank `k`'s notice (from rank 0: maybe relayed).
    Notice(usize, Vec<u8>),
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
                Kind::Notice => {
                    let mut r = Reader(&f.payload);
                    let Ok(k) = r.u32() else { continue };
                    let notice = r.rest();
                    if notice.len() <= NOTICE_MAX {
                        return Event::Notice(k as usize, notice.to_vec());
                    }
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

fn root_loop(mut conns: Vec<(usize, Conn)>, wakes: Wakes, abort: &AbortState, notices: &Notices) {
    // Whether every rank was told of this rank's own abort.
    let mut told = false;
    loop {
        let (stop, news, ready) = {
            let refs: Vec<&Conn> = conns.iter().map(|(_, c)| c).collect();
            poll_set(&wakes, &refs)
        };
        if news {
            drain(&wakes.news);
        }
        for notice in notices.take_outbox() {
            for (_, c) in conns.iter_mut() {
                send_notice(c, 0, &notice);
            }
        }
        let mut dead = Vec::new();
        // Downwards so removals do not shift the entries still to visit.
        for i in (0..conns.len()).rev() {
            if !ready[i] {
                continue;
            }
            match next_event(&mut conns[i].1) {
                Event::Nothing => {}
                // Rank k's notice: ours to hear, and every other rank's.
                Event::Notice(_, notice) => {
                    let k = conns[i].0;
                    notices.deliver(k, &notice);
                    for (r, c) in conns.iter_mut() {
                        if *r != k {
                            send_notice(c, k, &notice);
                        }
                    }
                }
                // A rank that aborted (at once, or when leaving) says why (see say_failed);
                // it needs no relay back, and nothing more comes from it that matters.
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
            // Relayed below, to everyone: not news of our own to broadcast again.
            abort.abort_from_peer(reason.clone());
            let mut msg = Writer::new();
            msg.u32(k as u32).bytes(reason.as_bytes());
            let dl = Deadline::after(SEND_BOUND);
            for (_, c) in conns.iter_mut() {
                // A failure here means that rank is gone too; its own end-of-stream says so.
                let _ = c.send(Kind::Died, 0, &msg.0, &[], &dl);
            }
        }
        if untold(abort, told) {
            for (_, c) in conns.iter_mut() {
                say_failed(c, 0, abort, false);
            }
            told = true;
        }
        if stop && woken(&wakes.stop) {
            for (_, c) in conns.iter_mut() {
                if untold(abort, told) {
                    say_failed(c, 0, abort, true);
                } else {
                    say_bye(c);
                }
            }
            return;
        }
    }
}

fn leaf_loop(rank: usize, mut conn: Conn, wakes: Wakes, abort: &AbortState, notices: &Notices) {
    // Whether rank 0 was told of this rank's own abort.
    let mut told = false;
    loop {
        let (stop, news, ready) = poll_set(&wakes, &[&conn]);
        if news {
            drain(&wakes.news);
        }
        for notice in notices.take_outbox() {
            send_notice(&mut conn, rank, &notice);
        }
        if ready[0] {
            match next_event(&mut conn) {
                Event::Nothing => {}
                Event::Notice(k, notice) => notices.deliver(k, &notice),
                Event::Died(k, why) => {
                    let reason = if why.is_empty() {
                        format!("rank {k} died (reported by rank 0)")
                    } else {
                        format!("{why} [reported by rank 0]")
                    };
                    if abort.is_aborted() {
                        tracing::debug!("rank {rank}: {reason}");
                    } else {
                        tracing::warn!("rank {rank}: {reason}");
                    }
                    abort.abort_from_peer(reason);
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
                    abort.abort_from_peer(reason);
                    return;
                }
            }
        }
        if untold(abort, told) {
            say_failed(&mut conn, rank, abort, false);
            told = true;
        }
        if stop && woken(&wakes.stop) {
            if untold(abort, told) {
                say_failed(&mut conn, rank, abort, true);
            } else {
                say_bye(&mut conn);
            }
            return;
        }
    }
}
