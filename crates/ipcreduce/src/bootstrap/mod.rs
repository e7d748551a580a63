//! Control plane: ranks of one host meet over a Unix domain socket; ranks of a job spanning
//! hosts meet over TCP at the master's address (see `master.rs`), with the same frames,
//! checks, bounded waits and liveness (only descriptors cannot cross hosts).
//!
//! Rank 0 listens on the job's socket; the others connect, prove they belong to the job
//! (same uid via SO_PEERCRED, the per-job secret) and say hello (rank, world size, job id).
//! Over these connections the ranks then exchange small byte blobs (all-gather), file
//! descriptors (SCM_RIGHTS) and barriers. A second connection per rank carries only liveness:
//! when a process dies, rank 0 notices the closed connection and tells the survivors, whose
//! [`AbortState`] is then set.
//!
//! | file | what is there |
//! |---|---|
//! | `env.rs` | [`RankInfo`]: who am I, from the environment |
//! | `master.rs` | [`Master`]: rank 0's TCP address, when the job spans hosts |
//! | `nodes.rs` | [`Layout`]: ranks grouped by host |
//! | `group.rs` | the ranks of one node as a group of their own (jobs across hosts) |
//! | `rendezvous.rs` | listen/connect, credentials, hello, welcome |
//! | `tcp.rs` | TCP listen/connect and keepalive |
//! | `wire.rs` | frames over either stream, bounded waits |
//! | `fdpass.rs` | socket I/O with SCM_RIGHTS |
//! | `liveness.rs` | the watcher threads |
//! | `notices.rs` | a backend's small messages to every peer, outside any collective |
//!
//! Collectives go through rank 0 (a star): every rank sends its part to rank 0, which
//! answers each with the whole. Messages are small and N ≤ 64, so the extra hop costs
//! nothing that matters, and rank 0 sees every mismatch.

mod env;
mod fdpass;
mod group;
mod liveness;
mod master;
mod nodes;
mod notices;
mod rendezvous;
mod tcp;
mod wire;

pub use env::{default_socket_dir, ensure_private_dir, RankInfo, MAX_WORLD};
pub use master::Master;
pub use nodes::{machine_host_id, Layout};
pub use notices::{NoticeHandler, Notices, NOTICE_MAX};

use crate::abort::AbortState;
use crate::error::{Error, Result};
use liveness::Watcher;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};
use wire::{Conn, Deadline, Frame, Kind, Reader, WireError, Writer};

/// A connected group of ranks.
pub struct Bootstrap {
    info: RankInfo,
    timeout: Duration,
    abort: Arc<AbortState>,
    /// What the backend tells every peer outside the collectives (through the watcher).
    notices: Arc<Notices>,
    /// Number of the last collective, to catch ranks calling different ones.
    seq: u64,
    /// Stopped first on drop, so the goodbye goes out before the control connections close.
    watcher: Option<Watcher>,
    links: Links,
    /// The job's nodes, learned right after the rendezvous.
    layout: Layout,
}

enum Links {
    /// World of one: nothing to talk to.
    Alone,
    /// Rank 0: the control connection of rank r at index r - 1.
    Root(Vec<Conn>),
    /// Other ranks: the control connection to rank 0.
    Leaf(Conn),
}

/// One kind of collective round.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Op {
    name: &'static str,
    req: Kind,
    resp: Kind,
}

const GATHER: Op = Op {
    name: "all_gather",
    req: Kind::Gather,
    resp: Kind::GatherResult,
};
const GATHER_FDS: Op = Op {
    name: "all_gather_fds",
    req: Kind::Fds,
    resp: Kind::FdsResult,
};
const BARRIER: Op = Op {
    name: "barrier",
    req: Kind::Barrier,
    resp: Kind::BarrierDone,
};

fn op_of(kind: Kind) -> &'static str {
    match kind {
        Kind::Gather | Kind::GatherResult => GATHER.name,
        Kind::Fds | Kind::FdsResult => GATHER_FDS.name,
        Kind::Barrier | Kind::BarrierDone => BARRIER.name,
        _ => "a control message",
    }
}

/// What a round returns: payloads (all_gather) and descriptors (all_gather_fds), by rank.
struct Round {
    payloads: Vec<Vec<u8>>,
    fds: Vec<OwnedFd>,
}

impl Bootstrap {
    /// Joins the job described by `info`. Every wait is bounded by `timeout` (non-zero ranks
    /// allow rank 0 a short grace beyond it, so that rank 0's verdict naming the missing
    /// ranks reaches them before their own timer fires).
    pub fn connect(info: RankInfo, timeout: Duration) -> Result<Bootstrap> {
        Self::connect_sharing(info, timeout, AbortState::new())
    }

    /// [`Bootstrap::connect`] with an abort state shared with another group (a node's group
    /// shares its job's, see [`Bootstrap::node_group`]).
    fn connect_sharing(
        info: RankInfo,
        timeout: Duration,
        abort: Arc<AbortState>,
    ) -> Result<Bootstrap> {
        let spawn_err = |rank, e: std::io::Error| Error::Bootstrap {
            rank,
            peer: None,
            op: "start liveness watcher",
            detail: e.to_string(),
        };
        let notices = Arc::new(Notices::default());
        let (links, watcher) = if info.world == 1 {
            (Links::Alone, None)
        } else if info.rank == 0 {
            let joined = rendezvous::root(&info, timeout)?;
            let live: Vec<(usize, Conn)> = joined
                .live
                .into_iter()
                .enumerate()
                .filter_map(|(r, c)| c.map(|c| (r, c)))
                .collect();
            let ctrl: Vec<Conn> = joined.ctrl.into_iter().flatten().collect();
            debug_assert_eq!(ctrl.len(), info.world - 1);
            let w = Watcher::spawn_root(live, abort.clone(), notices.clone())
                .map_err(|e| spawn_err(0, e))?;
            (Links::Root(ctrl), Some(w))
        } else {
            let (ctrl, live) = rendezvous::leaf(&info, timeout)?;
            let w = Watcher::spawn_leaf(info.rank, live, abort.clone(), notices.clone())
                .map_err(|e| spawn_err(info.rank, e))?;
            (Links::Leaf(ctrl), Some(w))
        };
        let layout = Layout::from_host_ids(0, std::slice::from_ref(&info.host_id))?;
        let mut boot = Bootstrap {
            info,
            timeout,
            abort,
            notices,
            seq: 0,
            watcher,
            links,
            layout,
        };
        // Every rank gets every host id, so every rank reaches the same layout, or the same
        // refusal, without another message.
        let ids = boot.all_gather(boot.info.host_id.clone().as_bytes())?;
        let ids: Vec<String> = ids
            .iter()
            .map(|b| String::from_utf8_lossy(b).into_owned())
            .collect();
        boot.layout = Layout::from_host_ids(boot.info.rank, &ids)?;
        Ok(boot)
    }

    /// The job's nodes: which ranks share a host.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Whether the ranks met over TCP (the job was started as spanning hosts).
    pub fn over_tcp(&self) -> bool {
        self.info.master.is_some()
    }

    pub fn rank(&self) -> usize {
        self.info.rank
    }

    pub fn world(&self) -> usize {
        self.info.world
    }

    pub fn info(&self) -> &RankInfo {
        &self.info
    }

    /// The bound on every wait.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The communicator's abort state; the liveness watcher sets it when a peer dies.
    pub fn abort_state(&self) -> Arc<AbortState> {
        self.abort.clone()
    }

    /// [`Bootstrap::abort_state`] borrowed: what every call looks at, without the clone's two
    /// atomic read-modify-writes of a count shared with the watcher.
    pub fn abort_state_ref(&self) -> &AbortState {
        &self.abort
    }

    /// The communicator's notices: what the backend tells every peer, and hears from them,
    /// outside the collectives (see notices.rs).
    pub fn notices(&self) -> Arc<Notices> {
        self.notices.clone()
    }

    /// Every rank contributes `mine`; returns all contributions indexed by rank.
    pub fn all_gather(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.round(GATHER, mine, None).map(|r| r.payloads)
    }

    /// Every rank contributes one file descriptor; returns one fd per rank (own = a dup).
    /// Only within one host over the Unix socket: descriptors cannot cross hosts, so a job
    /// that met over TCP is refused (on every rank alike, before anything is sent).
    pub fn all_gather_fds(&mut self, mine: BorrowedFd<'_>) -> Result<Vec<OwnedFd>> {
        if self.over_tcp() || self.layout.node_count() > 1 {
            return Err(Error::Bootstrap {
                rank: self.rank(),
                peer: None,
                op: GATHER_FDS.name,
                detail: format!(
                    "file descriptors can only be exchanged between ranks of one host over \
                     its Unix socket; this job met over {} and spans {} node(s)",
                    if self.over_tcp() {
                        "TCP"
                    } else {
                        "a Unix socket"
                    },
                    self.layout.node_count()
                ),
            });
        }
        self.round(GATHER_FDS, &[], Some(mine)).map(|r| r.fds)
    }

    /// Returns once every rank has called it.
    pub fn barrier(&mut self) -> Result<()> {
        self.round(BARRIER, &[], None).map(|_| ())
    }

    /// Runs one collective; on failure the communicator is aborted (its sequence is lost)
    /// and rank 0 tells the others why, so they fail now rather than at their timeout.
    fn round(&mut self, op: Op, mine: &[u8], fd: Option<BorrowedFd<'_>>) -> Result<Round> {
        if self.abort.is_aborted() {
            return Err(Error::Aborted {
                rank: self.rank(),
                reason: self.abort.reason().unwrap_or_default(),
            });
        }
        self.seq += 1;
        let result = match &mut self.links {
            Links::Alone => alone(self.info.rank, mine, fd),
            Links::Root(peers) => {
                let ctx = Ctx::new(&self.info, &self.abort, self.timeout, op, self.seq);
                let r = root_round(&ctx, peers, mine, fd);
                if let Err(e) = &r {
                    let why = e.to_string();
                    let dl = Deadline::after(Duration::from_millis(100));
                    for c in peers.iter_mut() {
                        let _ = c.send(Kind::Abort, ctx.seq, why.as_bytes(), &[], &dl);
                    }
                }
                r
            }
            Links::Leaf(conn) => {
                let ctx = Ctx::new(&self.info, &self.abort, self.timeout, op, self.seq);
                leaf_round(&ctx, conn, mine, fd)
            }
        };
        if let Err(e) = &result {
            self.abort.abort(e.to_string());
        }
        result
    }
}

impl Drop for Bootstrap {
    fn drop(&mut self) {
        // Bounded (see Watcher::stop); the control connections close right after.
        if let Some(mut w) = self.watcher.take() {
            w.stop();
        }
    }
}

/// What one round needs to know to wait and to word its errors.
struct Ctx<'a> {
    rank: usize,
    world: usize,
    op: Op,
    seq: u64,
    start: Instant,
    dl: Deadline<'a>,
    abort: &'a AbortState,
}

impl<'a> Ctx<'a> {
    fn new(info: &RankInfo, abort: &'a AbortState, timeout: Duration, op: Op, seq: u64) -> Self {
        Ctx {
            rank: info.rank,
            world: info.world,
            op,
            seq,
            start: Instant::now(),
            dl: Deadline::after(timeout).watching(abort),
            abort,
        }
    }

    fn wire(&self, e: WireError, peer: usize) -> Error {
        let (rank, op, seq) = (self.rank, self.op.name, self.seq);
        match e {
            WireError::Timeout => Error::Timeout {
                rank,
                peer,
                op: op.into(),
                seq,
                waited: self.start.elapsed(),
            },
            WireError::Eof => Error::PeerLost {
                rank,
                peer,
                op: op.into(),
                detail: self
                    .abort
                    .reason()
                    .unwrap_or_else(|| "connection closed".into()),
            },
            WireError::Aborted(reason) => Error::Aborted { rank, reason },
            WireError::Io(e) => self.protocol(peer, e.to_string()),
            WireError::Protocol(m) => self.protocol(peer, m),
        }
    }

    fn protocol(&self, peer: usize, detail: String) -> Error {
        Error::Bootstrap {
            rank: self.rank,
            peer: Some(peer),
            op: self.op.name,
            detail,
        }
    }

    /// Checks that `f` is the answer this round expects from `peer`.
    fn expect(&self, f: Frame, want: Kind, peer: usize) -> Result<Frame> {
        if f.kind == Kind::Abort {
            return Err(Error::Aborted {
                rank: self.rank,
                reason: format!(
                    "rank 0 aborted the job: {}",
                    String::from_utf8_lossy(&f.payload)
                ),
            });
        }
        if f.kind != want || f.seq != self.seq {
            return Err(Error::Mismatch {
                rank: self.rank,
                peer,
                op: self.op.name.into(),
                seq: self.seq,
                detail: format!(
                    "that rank is in {} #{} while this one is in {} #{}",
                    op_of(f.kind),
                    f.seq,
                    self.op.name,
                    self.seq
                ),
            });
        }
        Ok(f)
    }
}

fn dup(rank: usize, fd: BorrowedFd<'_>) -> Result<OwnedFd> {
    fd.try_clone_to_owned().map_err(|e| Error::Bootstrap {
        rank,
        peer: None,
        op: GATHER_FDS.name,
        detail: format!("dup of our own descriptor: {e}"),
    })
}

fn alone(rank: usize, mine: &[u8], fd: Option<BorrowedFd<'_>>) -> Result<Round> {
    Ok(Round {
        payloads: vec![mine.to_vec()],
        fds: fd
            .map(|fd| dup(rank, fd))
            .transpose()?
            .into_iter()
            .collect(),
    })
}

fn root_round(
    ctx: &Ctx<'_>,
    peers: &mut [Conn],
    mine: &[u8],
    fd: Option<BorrowedFd<'_>>,
) -> Result<Round> {
    let mut payloads = Vec::with_capacity(ctx.world);
    payloads.push(mine.to_vec());
    let mut fds = Vec::new();
    if let Some(fd) = fd {
        fds.push(dup(0, fd)?);
    }
    // Ranks are read in order; a missing one is named by the timeout, a dead one by EOF.
    for (i, conn) in peers.iter_mut().enumerate() {
        let r = i + 1;
        let f = conn.recv(&ctx.dl).map_err(|e| ctx.wire(e, r))?;
        let f = ctx.expect(f, ctx.op.req, r)?;
        if fd.is_some() {
            let got = conn.fds.pop_front().ok_or_else(|| {
                ctx.protocol(r, "its descriptor frame came without a descriptor".into())
            })?;
            fds.push(got);
        }
        payloads.push(f.payload);
    }
    let reply = if ctx.op == GATHER {
        let mut w = Writer::new();
        for p in &payloads {
            w.blob(p);
        }
        w.0
    } else {
        Vec::new()
    };
    for (i, conn) in peers.iter_mut().enumerate() {
        let r = i + 1;
        // Each rank gets everyone's descriptor but its own (it keeps that one).
        let raws: Vec<RawFd> = fds
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != r)
            .map(|(_, f)| f.as_raw_fd())
            .collect();
        conn.send(ctx.op.resp, ctx.seq, &reply, &raws, &ctx.dl)
            .map_err(|e| ctx.wire(e, r))?;
    }
    Ok(Round { payloads, fds })
}

fn leaf_round(
    ctx: &Ctx<'_>,
    conn: &mut Conn,
    mine: &[u8],
    fd: Option<BorrowedFd<'_>>,
) -> Result<Round> {
    let raw: Vec<RawFd> = fd.iter().map(|f| f.as_raw_fd()).collect();
    conn.send(ctx.op.req, ctx.seq, mine, &raw, &ctx.dl)
        .map_err(|e| ctx.wire(e, 0))?;
    let f = conn.recv(&ctx.dl).map_err(|e| ctx.wire(e, 0))?;
    let f = ctx.expect(f, ctx.op.resp, 0)?;

    let mut payloads = Vec::new();
    if ctx.op == GATHER {
        let mut r = Reader(&f.payload);
        for _ in 0..ctx.world {
            let p = r.blob().map_err(|e| ctx.wire(e, 0))?;
            payloads.push(p.to_vec());
        }
        if !r.rest().is_empty() {
            return Err(ctx.protocol(0, "trailing bytes in the gathered result".into()));
        }
    }

    let mut fds = Vec::new();
    if let Some(own) = fd {
        let others = ctx.world - 1;
        if conn.fds.len() < others {
            return Err(ctx.protocol(
                0,
                format!("expected {others} descriptors, received {}", conn.fds.len()),
            ));
        }
        fds.extend(conn.fds.drain(..others));
        fds.insert(ctx.rank, dup(ctx.rank, own)?);
    }
    Ok(Round { payloads, fds })
}

#[cfg(test)]
mod tests {
    //! Ranks as threads of one process: quick checks of the protocol. The real multi-process
    //! tests (kill -9, strangers, timeouts) are in tests/bootstrap.rs.
    use super::*;
    use std::path::PathBuf;

    fn sock(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("ipcreduce-unit-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir.join("s.sock")
    }

    fn run_world<T: Send + 'static>(
        tag: &str,
        world: usize,
        f: impl Fn(Bootstrap) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        let path = sock(tag);
        let f = Arc::new(f);
        let handles: Vec<_> = (0..world)
            .map(|r| {
                let (f, path) = (f.clone(), path.clone());
                std::thread::spawn(move || {
                    let info = RankInfo::new(r, world, path, "unit", Some("beef".into())).unwrap();
                    f(Bootstrap::connect(info, Duration::from_secs(10)).unwrap())
                })
            })
            .collect();
        let out = handles.into_iter().map(|h| h.join().unwrap()).collect();
        assert!(!path.exists(), "rank 0 removes its socket file");
        let _ = std::fs::remove_dir_all(path.parent().unwrap());
        out
    }

    #[test]
    fn gather_fds_barrier_in_threads() {
        let out = run_world("threads", 3, |mut b| {
            let r = b.rank();
            let all = b.all_gather(&vec![r as u8; r + 1]).unwrap();
            for (i, v) in all.iter().enumerate() {
                assert_eq!(v, &vec![i as u8; i + 1]);
            }
            b.barrier().unwrap();
            let (a, _keep) = std::os::unix::net::UnixStream::pair().unwrap();
            use std::os::fd::AsFd;
            let fds = b.all_gather_fds(a.as_fd()).unwrap();
            assert_eq!(fds.len(), 3);
            b.barrier().unwrap();
            assert!(!b.abort_state().is_aborted());
            let state = b.abort_state();
            // Dropping stops and joins this rank's liveness watcher, the only thread that
            // could still raise an abort on `state`; rank 0's socket goes with the last drop.
            drop(b);
            state
        });
        // Every rank's drop has returned (the threads are joined), so every watcher has
        // stopped: whatever the peers' goodbyes caused has happened by now, with no wait.
        for (r, a) in out.iter().enumerate() {
            assert!(
                !a.is_aborted(),
                "rank {r} aborted after orderly drops: {:?}",
                a.reason()
            );
        }
    }

    #[test]
    fn bootstrap_can_move_between_threads() {
        // The communicator (and language bindings) may hand it to another thread.
        fn is_send<T: Send>() {}
        is_send::<Bootstrap>();
    }

    #[test]
    fn world_of_one_needs_no_socket() {
        let info = RankInfo::new(0, 1, "/nonexistent/dir/s.sock", "solo", None).unwrap();
        let mut b = Bootstrap::connect(info, Duration::from_secs(1)).unwrap();
        assert_eq!(b.all_gather(b"x").unwrap(), vec![b"x".to_vec()]);
        b.barrier().unwrap();
        let (a, _k) = std::os::unix::net::UnixStream::pair().unwrap();
        use std::os::fd::AsFd;
        assert_eq!(b.all_gather_fds(a.as_fd()).unwrap().len(), 1);
    }

    #[test]
    fn mismatched_collectives_are_reported() {
        let out = run_world("mismatch", 2, |mut b| {
            let r = if b.rank() == 0 {
                b.all_gather(b"x").map(|_| ())
            } else {
                b.barrier()
            };
            (b.rank(), r.map_err(|e| e.to_string()))
        });
        let (_, r0) = &out[0];
        let e = r0.as_ref().unwrap_err();
        assert!(e.contains("barrier") && e.contains("all_gather"), "{e}");
        let (_, r1) = &out[1];
        assert!(
            r1.as_ref().unwrap_err().contains("rank 0 aborted"),
            "{r1:?}"
        );
    }
}
