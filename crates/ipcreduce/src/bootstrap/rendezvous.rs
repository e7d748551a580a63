//! Rendezvous: rank 0 listens on the job's socket; every other rank connects twice (control,
//! liveness), checks that rank 0 runs as our user, and says hello. Rank 0 checks each caller's
//! uid (SO_PEERCRED) before reading anything, then its hello (protocol, job id, secret, world,
//! rank); strangers are logged and dropped while rank 0 keeps waiting for the real ranks.
//! Once everyone is in, rank 0 welcomes them all.
//!
//! Jobs spanning hosts do the same over TCP (see `tcp.rs`): no uid can be checked there, so
//! the secret is the credential (required), and the process claiming a rank is named by its
//! address and the pid its hello states.

use super::wire::{Conn, Deadline, Frame, Kind, Reader, Stream, WireError, Writer};
use super::{tcp, RankInfo};
use crate::error::{Error, Result};
use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags};
use nix::sys::socket::{self, sockopt, AddressFamily, Backlog, SockFlag, SockType, UnixAddr};
use std::net::TcpListener;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const MAGIC: &[u8; 8] = b"IPCRBOOT";
/// 2: the hello states the sender's pid.
const VERSION: u16 = 2;
/// Connections that have not said hello yet are capped, so a flood of idle strangers cannot
/// exhaust rank 0's descriptors.
const MAX_PENDING: usize = 256;
/// Bound on courtesy messages (refusals, abort notices) that nobody must wait for.
const COURTESY: Duration = Duration::from_millis(100);

/// Which of a rank's two connections a hello opens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Channel {
    Ctrl = 0,
    Live = 1,
}

impl Channel {
    fn name(self) -> &'static str {
        match self {
            Channel::Ctrl => "control",
            Channel::Live => "liveness",
        }
    }
}

struct Hello {
    channel: Channel,
    rank: usize,
    world: usize,
    pid: u32,
    job_id: String,
    secret: Vec<u8>,
}

fn encode_hello(info: &RankInfo, channel: Channel) -> Vec<u8> {
    let secret = info.secret.as_deref().unwrap_or("").as_bytes();
    let mut w = Writer::new();
    w.bytes(MAGIC)
        .u16(VERSION)
        .u8(channel as u8)
        .u32(info.rank as u32)
        .u32(info.world as u32)
        .u32(std::process::id())
        .u16(info.job_id.len() as u16)
        .bytes(info.job_id.as_bytes())
        .u16(secret.len() as u16)
        .bytes(secret);
    w.0
}

fn decode_hello(payload: &[u8]) -> std::result::Result<Hello, String> {
    let mut r = Reader(payload);
    let parse = |r: &mut Reader| -> std::result::Result<Hello, WireError> {
        if r.bytes(MAGIC.len())? != MAGIC {
            return Err(WireError::Protocol("not an ipcreduce hello".into()));
        }
        let version = r.u16()?;
        if version != VERSION {
            return Err(WireError::Protocol(format!(
                "protocol version {version}, ours is {VERSION} (mixed ipcreduce builds?)"
            )));
        }
        let channel = match r.u8()? {
            0 => Channel::Ctrl,
            1 => Channel::Live,
            c => return Err(WireError::Protocol(format!("unknown channel {c}"))),
        };
        let rank = r.u32()? as usize;
        let world = r.u32()? as usize;
        let pid = r.u32()?;
        let n = r.u16()? as usize;
        let job_id = String::from_utf8_lossy(r.bytes(n)?).into_owned();
        let n = r.u16()? as usize;
        let secret = r.bytes(n)?.to_vec();
        Ok(Hello {
            channel,
            rank,
            world,
            pid,
            job_id,
            secret,
        })
    };
    parse(&mut r).map_err(|e| e.to_string())
}

/// Compares secrets in time independent of where they differ, so a local attacker cannot
/// learn the secret a byte at a time by timing refusals.
fn secrets_match(ours: &[u8], theirs: &[u8]) -> bool {
    if ours.len() != theirs.len() {
        return false;
    }
    let diff = ours
        .iter()
        .zip(theirs)
        .fold(0u8, |acc, (a, b)| acc | (a ^ b));
    std::hint::black_box(diff) == 0
}

/// Why rank 0 must refuse this hello, if it must (duplicates are checked by the caller).
fn check_hello(info: &RankInfo, h: &Hello) -> std::result::Result<(), String> {
    if h.job_id != info.job_id {
        return Err(format!(
            "job id {:?} is not ours ({:?})",
            h.job_id, info.job_id
        ));
    }
    let ours = info.secret.as_deref().unwrap_or("").as_bytes();
    if !secrets_match(ours, &h.secret) {
        return Err("wrong secret".into());
    }
    if h.world != info.world {
        return Err(format!(
            "claims world size {}, ours is {}",
            h.world, info.world
        ));
    }
    if h.rank == 0 || h.rank >= info.world {
        return Err(format!("claims rank {}, outside 1..{}", h.rank, info.world));
    }
    Ok(())
}

fn fmt_ranks(ranks: &[usize]) -> String {
    let list: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
    if ranks.len() == 1 {
        format!("rank {}", list[0])
    } else {
        format!("ranks {}", list.join(", "))
    }
}

/// Extra time a non-zero rank gives rank 0's verdict beyond its own timeout: when ranks are
/// missing, rank 0 says which ones, and that message should win over a bare local timeout.
fn verdict_grace(timeout: Duration) -> Duration {
    (timeout / 10).clamp(Duration::from_millis(200), Duration::from_secs(1))
}

/// Rank 0's listening socket. Unlinks the socket file when dropped, unless someone else's
/// file has taken its place meanwhile.
struct Listener {
    sock: UnixListener,
    path: PathBuf,
    id: (u64, u64),
}

impl Listener {
    fn bind(info: &RankInfo) -> Result<Listener> {
        let path = &info.socket;
        let err = |detail: String| Error::Bootstrap {
            rank: 0,
            peer: None,
            op: "listen",
            detail,
        };
        let addr = UnixAddr::new(path.as_path())
            .map_err(|e| err(format!("unusable socket path {}: {e}", path.display())))?;
        for attempt in 0..2 {
            let fd = socket::socket(
                AddressFamily::Unix,
                SockType::Stream,
                SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
                None,
            )
            .map_err(|e| err(format!("socket(): {e}")))?;
            match socket::bind(fd.as_raw_fd(), &addr) {
                Ok(()) => {}
                Err(Errno::EADDRINUSE) if attempt == 0 => {
                    remove_stale(path, &info.job_id).map_err(err)?;
                    continue;
                }
                Err(e) => return Err(err(format!("cannot bind {}: {e}", path.display()))),
            }
            // Nobody can connect before listen(): tighten the mode in between. SO_PEERCRED
            // stays the real check; this only keeps other users from reaching us at all.
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
                .map_err(|e| err(format!("chmod {}: {e}", path.display())))?;
            let md = std::fs::symlink_metadata(path)
                .map_err(|e| err(format!("stat {}: {e}", path.display())))?;
            let listener = Listener {
                sock: UnixListener::from(fd),
                path: path.clone(),
                id: (md.dev(), md.ino()),
            };
            let backlog = Backlog::new(128).unwrap_or(Backlog::MAXCONN);
            socket::listen(&listener.sock, backlog)
                .map_err(|e| err(format!("listen on {}: {e}", path.display())))?;
            return Ok(listener);
        }
        Err(err(format!(
            "cannot bind {}: still in use after removing a stale socket",
            path.display()
        )))
    }
}

/// Where rank 0 waits for the others: the job's Unix socket, or a TCP port across hosts.
enum Door {
    Unix(Listener),
    Tcp(TcpListener, String),
}

impl Door {
    fn open(info: &RankInfo) -> Result<Door> {
        match &info.master {
            None => Listener::bind(info).map(Door::Unix),
            Some(m) => tcp::listen(m)
                .map(|l| Door::Tcp(l, m.to_string()))
                .map_err(|detail| Error::Bootstrap {
                    rank: 0,
                    peer: None,
                    op: "listen",
                    detail,
                }),
        }
    }

    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Door::Unix(l) => l.sock.as_fd(),
            Door::Tcp(l, _) => l.as_fd(),
        }
    }

    /// Accepts every waiting connection into `pending`, after the identity checks the
    /// transport allows.
    fn accept_all(&self, me: u32, pending: &mut Vec<Pending>) {
        match self {
            Door::Unix(l) => accept_unix(l, me, pending),
            Door::Tcp(l, name) => accept_tcp(l, name, pending),
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Ok(md) = std::fs::symlink_metadata(&self.path) {
            if (md.dev(), md.ino()) == self.id {
                let _ = std::fs::remove_file(&self.path);
            }
        }
    }
}

/// Removes a socket file left by a dead rank 0 — only if it is a socket, ours, and dead.
fn remove_stale(path: &Path, job_id: &str) -> std::result::Result<(), String> {
    let md =
        std::fs::symlink_metadata(path).map_err(|e| format!("stat {}: {e}", path.display()))?;
    if !md.file_type().is_socket() {
        return Err(format!(
            "{} exists and is not a socket; refusing to replace it",
            path.display()
        ));
    }
    let me = nix::unistd::geteuid().as_raw();
    if md.uid() != me {
        return Err(format!(
            "{} is a socket of uid {}, not ours (uid {me}); refusing to replace it",
            path.display(),
            md.uid()
        ));
    }
    match connect_once(path) {
        Ok(_) => Err(format!(
            "a process is already listening on {}: is another job with job id {job_id:?} running?",
            path.display()
        )),
        Err(Errno::ECONNREFUSED) => {
            tracing::debug!("removing stale socket {}", path.display());
            std::fs::remove_file(path).map_err(|e| format!("remove stale {}: {e}", path.display()))
        }
        Err(e) => Err(format!("cannot probe {}: {e}", path.display())),
    }
}

/// One non-blocking connect: a Unix stream connect either completes at once or fails
/// (EAGAIN when the backlog is full), so it never waits.
fn connect_once(path: &Path) -> std::result::Result<UnixStream, Errno> {
    let addr = UnixAddr::new(path)?;
    let fd = socket::socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        None,
    )?;
    loop {
        match socket::connect(fd.as_raw_fd(), &addr) {
            Ok(()) => return Ok(UnixStream::from(fd)),
            Err(Errno::EINTR) => {}
            Err(e) => return Err(e),
        }
    }
}

/// The connections rank 0 ends up with, indexed by rank (entry 0 unused).
pub(crate) struct Joined {
    pub ctrl: Vec<Option<Conn>>,
    pub live: Vec<Option<Conn>>,
    /// The process that claimed each rank (see [`Pending::owner`]): both connections of a
    /// rank must come from it, so two processes claiming one rank cannot end up with one
    /// connection each.
    owner: Vec<Option<String>>,
}

struct Pending {
    conn: Conn,
    /// Who connected, for logs: `pid N` (Unix, from SO_PEERCRED) or the TCP peer address.
    from: String,
    /// The pid the kernel vouches for (Unix sockets only).
    pid: Option<i32>,
}

impl Pending {
    /// The claimant of a rank: the kernel's pid on a Unix socket; across hosts the peer's
    /// IP address and the pid its hello states (it proved the secret, so it is a rank of
    /// the job, and a rank has no reason to lie about its pid).
    fn owner(&self, h: &Hello) -> String {
        match (self.pid, &self.conn.sock) {
            (Some(pid), _) => format!("pid {pid}"),
            (None, Stream::Tcp(s)) => match s.peer_addr() {
                Ok(a) => format!("pid {} at {}", h.pid, a.ip()),
                Err(_) => format!("pid {} at an unknown address", h.pid),
            },
            (None, Stream::Unix(_)) => format!("pid {}", h.pid),
        }
    }
}

/// Rank 0: waits until every other rank has opened both connections, then welcomes them.
pub(crate) fn root(info: &RankInfo, timeout: Duration) -> Result<Joined> {
    let listener = Door::open(info)?;
    let deadline = Instant::now() + timeout;
    let world = info.world;
    let mut joined = Joined {
        ctrl: (0..world).map(|_| None).collect(),
        live: (0..world).map(|_| None).collect(),
        owner: vec![None; world],
    };
    let mut pending: Vec<Pending> = Vec::new();
    let me = nix::unistd::geteuid().as_raw();
    let bootstrap_err = |peer, op, detail| Error::Bootstrap {
        rank: 0,
        peer,
        op,
        detail,
    };

    loop {
        let missing: Vec<usize> = (1..world)
            .filter(|&r| joined.ctrl[r].is_none() || joined.live[r].is_none())
            .collect();
        if missing.is_empty() {
            break;
        }
        let now = Instant::now();
        if now >= deadline {
            let reason = format!("{} did not join within {timeout:?}", fmt_ranks(&missing));
            tell_all(&mut joined, Kind::Abort, reason.as_bytes());
            return Err(bootstrap_err(Some(missing[0]), "rendezvous", reason));
        }

        let ready: Vec<bool> = {
            let mut pfds = Vec::with_capacity(1 + pending.len());
            pfds.push(PollFd::new(listener.as_fd(), PollFlags::POLLIN));
            for p in &pending {
                pfds.push(PollFd::new(p.conn.sock.as_fd(), PollFlags::POLLIN));
            }
            let slice = (deadline - now).min(Duration::from_millis(200));
            match nix::poll::poll(&mut pfds, super::wire::poll_timeout(slice)) {
                Ok(_) | Err(Errno::EINTR) => {}
                Err(e) => return Err(bootstrap_err(None, "rendezvous", format!("poll: {e}"))),
            }
            pfds.iter()
                .map(|p| p.revents().is_some_and(|r| !r.is_empty()))
                .collect()
        };

        // Downwards, so swap_remove only moves entries already looked at.
        for i in (0..pending.len()).rev() {
            if !ready[i + 1] {
                continue;
            }
            match pending[i].conn.try_recv() {
                Ok(None) => {}
                Ok(Some(frame)) => {
                    let p = pending.swap_remove(i);
                    admit(info, &mut joined, p, frame);
                }
                Err(e) => {
                    let p = pending.swap_remove(i);
                    tracing::warn!(
                        "rank 0: dropped a connection from {} before its hello: {e}",
                        p.from
                    );
                }
            }
        }

        if ready[0] {
            listener.accept_all(me, &mut pending);
        }
        if pending.len() > MAX_PENDING {
            let p = pending.remove(0);
            tracing::warn!(
                "rank 0: too many connections without hello; dropped the oldest (from {})",
                p.from
            );
        }
    }

    // Everyone is in: nobody else may connect, and the file has served its purpose.
    drop(listener);
    drop(pending);

    let welcome = Writer::new().u32(world as u32).0.clone();
    let dl = Deadline::after(timeout);
    for r in 1..world {
        let sent = [&mut joined.ctrl[r], &mut joined.live[r]]
            .into_iter()
            .flatten()
            .try_for_each(|conn| conn.send(Kind::Welcome, 0, &welcome, &[], &dl));
        if let Err(e) = sent {
            let reason = format!("rank {r} left during the rendezvous: {e}");
            tell_all(&mut joined, Kind::Abort, reason.as_bytes());
            return Err(Error::PeerLost {
                rank: 0,
                peer: r,
                op: "rendezvous".into(),
                detail: e.to_string(),
            });
        }
    }
    tracing::debug!("rank 0: all {world} ranks joined {}", info.job_id);
    Ok(joined)
}

/// Whether an accept loop goes on after `r`: the socket on success; None to retry (EINTR);
/// Err(()) to stop (nothing left, or an error, which is logged: running out of descriptors
/// is worth reporting, not worth dying over).
fn accepted<S, A>(r: std::io::Result<(S, A)>, door: &str) -> std::result::Result<Option<S>, ()> {
    match r {
        Ok((s, _)) => Ok(Some(s)),
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Err(()),
        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => Ok(None),
        Err(e) => {
            tracing::warn!("rank 0: accept on {door} failed: {e}");
            Err(())
        }
    }
}

fn accept_tcp(listener: &TcpListener, name: &str, pending: &mut Vec<Pending>) {
    loop {
        let Ok(got) = accepted(listener.accept(), name) else {
            return;
        };
        let Some(sock) = got else { continue };
        let from = sock
            .peer_addr()
            .map_or_else(|_| "an unknown address".into(), |a| a.to_string());
        // Nothing to check before the hello: its secret is the credential.
        let conn = tcp::tune(&sock).and_then(|()| Conn::untrusted(sock));
        match conn {
            Ok(conn) => pending.push(Pending {
                conn,
                from,
                pid: None,
            }),
            Err(e) => tracing::warn!("rank 0: dropped a connection from {from}: {e}"),
        }
    }
}

fn accept_unix(listener: &Listener, me: u32, pending: &mut Vec<Pending>) {
    let door = listener.path.display().to_string();
    loop {
        let Ok(got) = accepted(listener.sock.accept(), &door) else {
            return;
        };
        let Some(sock) = got else { continue };
        // Identity first: nothing is read from or sent to another user's process.
        let cred = match socket::getsockopt(&sock, sockopt::PeerCredentials) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(
                    "rank 0: dropped a connection whose credentials are unreadable: {e}"
                );
                continue;
            }
        };
        if cred.uid() != me {
            tracing::warn!(
                "rank 0: refused a connection from pid {} running as uid {} (we are uid {me})",
                cred.pid(),
                cred.uid()
            );
            continue;
        }
        match Conn::untrusted(sock) {
            Ok(conn) => pending.push(Pending {
                conn,
                from: format!("pid {}", cred.pid()),
                pid: Some(cred.pid()),
            }),
            Err(e) => tracing::warn!("rank 0: dropped a connection: {e}"),
        }
    }
}

/// Places a connection that said hello, or refuses it (logged; the job goes on waiting).
fn admit(info: &RankInfo, joined: &mut Joined, mut p: Pending, frame: Frame) {
    let hello = if frame.kind == Kind::Hello {
        decode_hello(&frame.payload)
    } else {
        Err(format!("sent a {:?} frame instead of hello", frame.kind))
    };
    let verdict = hello.and_then(|h| {
        check_hello(info, &h)?;
        let slot = match h.channel {
            Channel::Ctrl => &joined.ctrl[h.rank],
            Channel::Live => &joined.live[h.rank],
        };
        if slot.is_some() {
            return Err(format!(
                "rank {} already has a {} connection (duplicate rank)",
                h.rank,
                h.channel.name()
            ));
        }
        match &joined.owner[h.rank] {
            Some(owner) if *owner != p.owner(&h) => Err(format!(
                "rank {} was already claimed by {owner} (duplicate rank)",
                h.rank
            )),
            _ => Ok(h),
        }
    });
    match verdict {
        Ok(h) => {
            tracing::debug!(
                "rank 0: rank {} joined ({} connection, {})",
                h.rank,
                h.channel.name(),
                p.from
            );
            p.conn.trust();
            joined.owner[h.rank] = Some(p.owner(&h));
            let slot = match h.channel {
                Channel::Ctrl => &mut joined.ctrl[h.rank],
                Channel::Live => &mut joined.live[h.rank],
            };
            *slot = Some(p.conn);
        }
        Err(reason) => {
            tracing::warn!(
                "rank 0: refused a connection from {} to job {}: {reason}",
                p.from,
                info.job_id
            );
            // Same uid (or, over TCP, someone who reached the port: the reasons name only
            // the job id and sizes, never the secret), so telling it why helps a
            // misconfigured rank.
            let _ = p.conn.send(
                Kind::Refuse,
                0,
                reason.as_bytes(),
                &[],
                &Deadline::after(COURTESY),
            );
        }
    }
}

/// Best-effort message to every joined connection (both channels).
fn tell_all(joined: &mut Joined, kind: Kind, payload: &[u8]) {
    let dl = Deadline::after(COURTESY);
    for conn in joined
        .ctrl
        .iter_mut()
        .chain(joined.live.iter_mut())
        .flatten()
    {
        let _ = conn.send(kind, 0, payload, &[], &dl);
    }
}

/// A non-zero rank: connects both channels to rank 0 and waits for its welcome.
/// Returns (control, liveness).
pub(crate) fn leaf(info: &RankInfo, timeout: Duration) -> Result<(Conn, Conn)> {
    let start = Instant::now();
    let dl = Deadline {
        at: start + timeout,
        abort: None,
    };
    let mut ctrl = connect_to_root(info, Channel::Ctrl, &dl)?;
    let mut live = connect_to_root(info, Channel::Live, &dl)?;
    let verdict = Deadline {
        at: start + timeout + verdict_grace(timeout),
        abort: None,
    };
    await_welcome(info, &mut ctrl, &verdict, timeout)?;
    await_welcome(info, &mut live, &verdict, timeout)?;
    Ok((ctrl, live))
}

fn connect_to_root(info: &RankInfo, channel: Channel, dl: &Deadline<'_>) -> Result<Conn> {
    let err = |op, detail| Error::Bootstrap {
        rank: info.rank,
        peer: Some(0),
        op,
        detail,
    };
    let sock: Stream = match &info.master {
        None => connect_unix(info, dl)?.into(),
        // No uid to check across hosts: the hello's secret is what rank 0 trusts.
        Some(m) => tcp::connect(m, dl.at)
            .map_err(|d| err("connect", d))?
            .into(),
    };
    let mut conn = Conn::trusted(sock).map_err(|e| err("connect", e.to_string()))?;
    conn.send(Kind::Hello, 0, &encode_hello(info, channel), &[], dl)
        .map_err(|e| {
            err(
                "hello",
                format!("on the {} connection: {e}", channel.name()),
            )
        })?;
    Ok(conn)
}

/// Connects to the job's Unix socket and checks that rank 0 runs as our user.
fn connect_unix(info: &RankInfo, dl: &Deadline<'_>) -> Result<UnixStream> {
    let err = |op, detail| Error::Bootstrap {
        rank: info.rank,
        peer: Some(0),
        op,
        detail,
    };
    let path = &info.socket;
    let mut backoff = Duration::from_millis(5);
    let sock = loop {
        match connect_once(path) {
            Ok(s) => break s,
            // Not there yet (rank 0 may start after us), a stale file, or a full backlog.
            Err(e @ (Errno::ENOENT | Errno::ECONNREFUSED | Errno::EAGAIN)) => {
                let now = Instant::now();
                if now >= dl.at {
                    return Err(err(
                        "connect",
                        format!(
                            "nobody accepted on {} within the timeout (is rank 0 running?): {e}",
                            path.display()
                        ),
                    ));
                }
                std::thread::sleep(backoff.min(dl.at - now));
                backoff = (backoff * 2).min(Duration::from_millis(50));
            }
            Err(e) => {
                return Err(err(
                    "connect",
                    format!("cannot connect to {}: {e}", path.display()),
                ))
            }
        }
    };
    // Check rank 0's identity before our hello, which carries the job's secret, goes out.
    let cred = socket::getsockopt(&sock, sockopt::PeerCredentials)
        .map_err(|e| err("connect", format!("cannot read rank 0's credentials: {e}")))?;
    let me = nix::unistd::geteuid().as_raw();
    if cred.uid() != me {
        return Err(err(
            "connect",
            format!(
                "the process listening on {} (pid {}) runs as uid {}, not as us (uid {me}); \
                 not talking to it",
                path.display(),
                cred.pid(),
                cred.uid()
            ),
        ));
    }
    Ok(sock)
}

fn await_welcome(
    info: &RankInfo,
    conn: &mut Conn,
    dl: &Deadline<'_>,
    timeout: Duration,
) -> Result<()> {
    let err = |peer, op, detail| Error::Bootstrap {
        rank: info.rank,
        peer,
        op,
        detail,
    };
    let text = |p: &[u8]| String::from_utf8_lossy(p).into_owned();
    match conn.recv(dl) {
        Ok(f) if f.kind == Kind::Welcome => {
            let world = Reader(&f.payload).u32().map(|w| w as usize);
            match world {
                Ok(w) if w == info.world => Ok(()),
                _ => Err(err(
                    Some(0),
                    "rendezvous",
                    "rank 0's welcome does not match our world size".into(),
                )),
            }
        }
        Ok(f) if f.kind == Kind::Refuse => Err(err(
            Some(0),
            "hello",
            format!("rank 0 refused us: {}", text(&f.payload)),
        )),
        // Rank 0 names the missing ranks: the peer that matters is not rank 0.
        Ok(f) if f.kind == Kind::Abort => Err(err(
            None,
            "rendezvous",
            format!("rank 0 gave up: {}", text(&f.payload)),
        )),
        Ok(f) => Err(err(
            Some(0),
            "rendezvous",
            format!("expected a welcome, got a {:?} frame", f.kind),
        )),
        Err(WireError::Eof) => Err(err(
            Some(0),
            "rendezvous",
            "rank 0 closed the connection before welcoming us".into(),
        )),
        Err(WireError::Timeout) => Err(err(
            Some(0),
            "rendezvous",
            format!("no welcome from rank 0 within {timeout:?} (are other ranks missing?)"),
        )),
        Err(e) => Err(err(Some(0), "rendezvous", e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(rank: usize, world: usize, secret: Option<&str>) -> RankInfo {
        RankInfo::new(rank, world, "/unused", "job", secret.map(str::to_string)).unwrap()
    }

    #[test]
    fn hello_round_trip_and_checks() {
        let root = info(0, 4, Some("abcd"));
        let h = decode_hello(&encode_hello(&info(2, 4, Some("abcd")), Channel::Live)).unwrap();
        assert_eq!((h.rank, h.world, h.channel), (2, 4, Channel::Live));
        assert!(check_hello(&root, &h).is_ok());

        let bad = |i: RankInfo| {
            let h = decode_hello(&encode_hello(&i, Channel::Ctrl)).unwrap();
            check_hello(&root, &h).unwrap_err()
        };
        assert!(bad(info(1, 4, Some("abce"))).contains("secret"));
        assert!(bad(info(1, 4, None)).contains("secret"));
        assert!(bad(info(1, 3, Some("abcd"))).contains("world size"));
        let other_job = RankInfo::new(1, 4, "/unused", "other", Some("abcd".into())).unwrap();
        assert!(bad(other_job).contains("job id"));
        assert!(bad(info(0, 4, Some("abcd"))).contains("rank 0"));
        assert!(decode_hello(b"GET / HTTP/1.1\r\n").is_err());
    }

    #[test]
    fn secret_comparison() {
        assert!(secrets_match(b"", b""));
        assert!(secrets_match(b"00ff", b"00ff"));
        assert!(!secrets_match(b"00ff", b"00fe"));
        assert!(!secrets_match(b"00ff", b"00ff0"));
    }

    #[test]
    fn rank_lists() {
        assert_eq!(fmt_ranks(&[2]), "rank 2");
        assert_eq!(fmt_ranks(&[1, 3]), "ranks 1, 3");
    }
}
