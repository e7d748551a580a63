//! Frames on the bootstrap connections, and bounded waits.
//!
//! A frame is a 16-byte header (payload length u32, kind u8, 3 zero bytes, sequence number
//! u64; little endian) followed by the payload. Descriptors ride along with SCM_RIGHTS,
//! attached to the frame's first byte, so by the time a frame is complete its descriptors
//! are in [`Conn::fds`].
//!
//! Sockets are non-blocking and every wait is a `poll` bounded by a [`Deadline`]; a wait that
//! watches an [`AbortState`] wakes every [`ABORT_CHECK`] to notice it.

use super::fdpass;
use crate::abort::AbortState;
use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout};
use std::collections::VecDeque;
use std::io;
use std::net::TcpStream;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

pub(crate) const HEADER: usize = 16;
/// Payload cap for connections that have not said a valid hello yet.
pub(crate) const UNTRUSTED_MAX: usize = 4096;
/// Payload cap afterwards: bootstrap messages are small; this only stops a corrupt length
/// from allocating the machine away.
pub(crate) const TRUSTED_MAX: usize = 256 << 20;
/// How often a wait looks at the abort flag.
pub(crate) const ABORT_CHECK: Duration = Duration::from_millis(20);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Kind {
    Hello = 1,
    Welcome = 2,
    /// Rank 0 turns a connection away; payload = reason.
    Refuse = 3,
    /// Rank 0 gives up on the job (rendezvous or collective failed); payload = reason.
    Abort = 4,
    Gather = 5,
    GatherResult = 6,
    Fds = 7,
    FdsResult = 8,
    Barrier = 9,
    BarrierDone = 10,
    /// Liveness: orderly goodbye.
    Bye = 11,
    /// Liveness: payload = dead rank (u32) + reason.
    Died = 12,
    /// Liveness: a backend's notice to every peer; payload = sending rank (u32) + the notice
    /// (see notices.rs).
    Notice = 13,
}

impl Kind {
    fn from_u8(b: u8) -> Option<Kind> {
        use Kind::*;
        Some(match b {
            1 => Hello,
            2 => Welcome,
            3 => Refuse,
            4 => Abort,
            5 => Gather,
            6 => GatherResult,
            7 => Fds,
            8 => FdsResult,
            9 => Barrier,
            10 => BarrierDone,
            11 => Bye,
            12 => Died,
            13 => Notice,
            _ => return None,
        })
    }
}

#[derive(Debug)]
pub(crate) struct Frame {
    pub kind: Kind,
    pub seq: u64,
    pub payload: Vec<u8>,
}

/// Why a wire operation stopped. Callers turn it into an [`crate::Error`] naming rank, peer
/// and operation.
#[derive(Debug)]
pub(crate) enum WireError {
    Timeout,
    /// The peer closed its end (EOF, EPIPE, ECONNRESET).
    Eof,
    /// The communicator was aborted while waiting; carries the abort reason.
    Aborted(String),
    Io(io::Error),
    Protocol(String),
}

impl std::fmt::Display for WireError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WireError::Timeout => f.write_str("timed out"),
            WireError::Eof => f.write_str("connection closed by peer"),
            WireError::Aborted(r) => write!(f, "aborted: {r}"),
            WireError::Io(e) => write!(f, "{e}"),
            WireError::Protocol(m) => write!(f, "protocol error: {m}"),
        }
    }
}

impl From<io::Error> for WireError {
    fn from(e: io::Error) -> Self {
        if fdpass::is_peer_gone(&e) {
            WireError::Eof
        } else {
            WireError::Io(e)
        }
    }
}

/// When a wait must give up, and which abort flag cuts it short.
#[derive(Clone, Copy)]
pub(crate) struct Deadline<'a> {
    pub at: Instant,
    pub abort: Option<&'a AbortState>,
}

impl<'a> Deadline<'a> {
    pub fn after(d: Duration) -> Deadline<'static> {
        Deadline {
            at: Instant::now() + d,
            abort: None,
        }
    }

    pub fn watching(mut self, abort: &'a AbortState) -> Deadline<'a> {
        self.abort = Some(abort);
        self
    }

    fn check_abort(&self) -> Result<(), WireError> {
        match self.abort {
            Some(a) if a.is_aborted() => Err(WireError::Aborted(
                a.reason().unwrap_or_else(|| "aborted".into()),
            )),
            _ => Ok(()),
        }
    }
}

/// Waits until `fd` is ready for `events` (or hung up), the deadline passes, or the abort flag
/// is raised.
pub(crate) fn wait_ready(
    fd: BorrowedFd<'_>,
    events: PollFlags,
    dl: &Deadline<'_>,
) -> Result<(), WireError> {
    loop {
        dl.check_abort()?;
        let now = Instant::now();
        if now >= dl.at {
            return Err(WireError::Timeout);
        }
        let mut slice = dl.at - now;
        if dl.abort.is_some() {
            slice = slice.min(ABORT_CHECK);
        }
        match poll_one(fd, events, slice) {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(Errno::EINTR) => {}
            Err(e) => return Err(WireError::Io(e.into())),
        }
    }
}

/// One `poll` on one descriptor; true when anything (including HUP/ERR) is reported.
fn poll_one(fd: BorrowedFd<'_>, events: PollFlags, d: Duration) -> Result<bool, Errno> {
    let mut pfd = [PollFd::new(fd, events)];
    let n = nix::poll::poll(&mut pfd, poll_timeout(d))?;
    Ok(n > 0)
}

/// A poll timeout that rounds up, so a short remaining time does not turn into a busy loop.
pub(crate) fn poll_timeout(d: Duration) -> PollTimeout {
    let ms = d.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
    PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX)
}

/// The byte stream under a [`Conn`]: a Unix socket inside one host, TCP between hosts. Frames,
/// waits and liveness are the same on both; only Unix sockets carry file descriptors.
pub(crate) enum Stream {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Stream {
    fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.set_nonblocking(on),
            Stream::Tcp(s) => s.set_nonblocking(on),
        }
    }

    /// Whether file descriptors can travel on this stream (SCM_RIGHTS needs a Unix socket).
    pub fn passes_fds(&self) -> bool {
        matches!(self, Stream::Unix(_))
    }
}

impl AsFd for Stream {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Stream::Unix(s) => s.as_fd(),
            Stream::Tcp(s) => s.as_fd(),
        }
    }
}

impl From<UnixStream> for Stream {
    fn from(s: UnixStream) -> Self {
        Stream::Unix(s)
    }
}

impl From<TcpStream> for Stream {
    fn from(s: TcpStream) -> Self {
        Stream::Tcp(s)
    }
}

/// One bootstrap connection: a non-blocking stream socket plus the state of the frame
/// being read and the descriptors received but not yet claimed.
pub(crate) struct Conn {
    pub sock: Stream,
    pub fds: VecDeque<OwnedFd>,
    /// None until the peer has proved it belongs to the job: until then descriptors it sends
    /// are discarded by the kernel.
    cmsg: Option<Vec<u8>>,
    max_payload: usize,
    rbuf: Vec<u8>,
    filled: usize,
}

impl Conn {
    /// Wraps a connection whose peer has not said hello yet (small frames, no descriptors).
    pub fn untrusted(sock: impl Into<Stream>) -> io::Result<Conn> {
        let sock = sock.into();
        sock.set_nonblocking(true)?;
        Ok(Conn {
            sock,
            fds: VecDeque::new(),
            cmsg: None,
            max_payload: UNTRUSTED_MAX,
            rbuf: vec![0; HEADER],
            filled: 0,
        })
    }

    /// Wraps a connection to a known member of the job.
    pub fn trusted(sock: impl Into<Stream>) -> io::Result<Conn> {
        let mut c = Conn::untrusted(sock)?;
        c.trust();
        Ok(c)
    }

    /// The peer proved it belongs to the job: accept its descriptors and larger frames.
    pub fn trust(&mut self) {
        if self.sock.passes_fds() {
            self.cmsg = Some(fdpass::cmsg_buffer());
        }
        self.max_payload = TRUSTED_MAX;
    }

    /// Reads whatever is available without waiting; a complete frame when there is one.
    pub fn try_recv(&mut self) -> Result<Option<Frame>, WireError> {
        loop {
            let want = if self.filled < HEADER {
                HEADER
            } else {
                let len =
                    u32::from_le_bytes([self.rbuf[0], self.rbuf[1], self.rbuf[2], self.rbuf[3]]);
                let len = len as usize;
                if len > self.max_payload {
                    return Err(WireError::Protocol(format!(
                        "frame of {len} bytes exceeds the limit of {}",
                        self.max_payload
                    )));
                }
                if self.filled == HEADER + len {
                    return self.take_frame(HEADER + len).map(Some);
                }
                HEADER + len
            };
            if self.rbuf.len() < want {
                self.rbuf.resize(want, 0);
            }
            let (sock, buf) = (self.sock.as_fd(), &mut self.rbuf[self.filled..want]);
            match fdpass::recv_some(sock, buf, self.cmsg.as_mut(), &mut self.fds) {
                Ok(0) => return Err(WireError::Eof),
                Ok(n) => self.filled += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Hands out the complete frame in `rbuf[..total]` and resets for the next one.
    fn take_frame(&mut self, total: usize) -> Result<Frame, WireError> {
        let kind = Kind::from_u8(self.rbuf[4])
            .ok_or_else(|| WireError::Protocol(format!("unknown frame kind {}", self.rbuf[4])))?;
        let mut seq = [0u8; 8];
        seq.copy_from_slice(&self.rbuf[8..16]);
        let payload = self.rbuf[HEADER..total].to_vec();
        self.filled = 0;
        // Do not keep a large buffer around after an occasional large frame.
        if self.rbuf.len() > 1 << 16 {
            self.rbuf = vec![0; HEADER];
        }
        Ok(Frame {
            kind,
            seq: u64::from_le_bytes(seq),
            payload,
        })
    }

    /// Waits for the next frame.
    pub fn recv(&mut self, dl: &Deadline<'_>) -> Result<Frame, WireError> {
        loop {
            if let Some(f) = self.try_recv()? {
                return Ok(f);
            }
            wait_ready(self.sock.as_fd(), PollFlags::POLLIN, dl)?;
        }
    }

    /// Sends one frame, with `fds` attached.
    pub fn send(
        &mut self,
        kind: Kind,
        seq: u64,
        payload: &[u8],
        fds: &[RawFd],
        dl: &Deadline<'_>,
    ) -> Result<(), WireError> {
        if !fds.is_empty() && !self.sock.passes_fds() {
            return Err(WireError::Protocol(
                "file descriptors cannot travel over TCP (ranks on different hosts)".into(),
            ));
        }
        let len = u32::try_from(payload.len())
            .ok()
            .filter(|l| (*l as usize) <= TRUSTED_MAX)
            .ok_or_else(|| {
                WireError::Protocol(format!("payload of {} bytes is too large", payload.len()))
            })?;
        let mut buf = Vec::with_capacity(HEADER + payload.len());
        buf.extend_from_slice(&len.to_le_bytes());
        buf.extend_from_slice(&[kind as u8, 0, 0, 0]);
        buf.extend_from_slice(&seq.to_le_bytes());
        buf.extend_from_slice(payload);
        let mut off = 0;
        let mut fds = fds;
        while off < buf.len() {
            match fdpass::send_some(self.sock.as_fd(), &buf[off..], fds) {
                Ok(n) => {
                    off += n;
                    // The descriptors went out with the first byte that did.
                    fds = &[];
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    wait_ready(self.sock.as_fd(), PollFlags::POLLOUT, dl)?;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }
}

/// Little helpers to build and parse payloads.
pub(crate) struct Writer(pub Vec<u8>);

impl Writer {
    pub fn new() -> Writer {
        Writer(Vec::new())
    }
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn bytes(&mut self, v: &[u8]) -> &mut Self {
        self.0.extend_from_slice(v);
        self
    }
    /// Length (u32) then bytes.
    pub fn blob(&mut self, v: &[u8]) -> &mut Self {
        self.u32(v.len() as u32).bytes(v)
    }
}

pub(crate) struct Reader<'a>(pub &'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if self.0.len() < n {
            return Err(WireError::Protocol("truncated payload".into()));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    pub fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }
    pub fn u16(&mut self) -> Result<u16, WireError> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    pub fn u32(&mut self) -> Result<u32, WireError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    pub fn bytes(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        self.take(n)
    }
    pub fn blob(&mut self) -> Result<&'a [u8], WireError> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    pub fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (Conn, Conn) {
        let (a, b) = UnixStream::pair().unwrap();
        (Conn::trusted(a).unwrap(), Conn::trusted(b).unwrap())
    }

    #[test]
    fn frames_round_trip_including_large_ones() {
        let (mut a, mut b) = pair();
        let dl = Deadline::after(Duration::from_secs(5));
        let big: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        // A large frame fills the socket buffer: the reader must run concurrently.
        let big2 = big.clone();
        let t = std::thread::spawn(move || {
            let dl = Deadline::after(Duration::from_secs(5));
            a.send(Kind::Gather, 7, b"hi", &[], &dl).unwrap();
            a.send(Kind::GatherResult, 8, &big2, &[], &dl).unwrap();
            a
        });
        let f = b.recv(&dl).unwrap();
        assert_eq!(
            (f.kind, f.seq, &f.payload[..]),
            (Kind::Gather, 7, &b"hi"[..])
        );
        let f = b.recv(&dl).unwrap();
        assert_eq!((f.kind, f.seq), (Kind::GatherResult, 8));
        assert_eq!(f.payload, big);
        drop(t.join().unwrap());
        assert!(matches!(b.recv(&dl), Err(WireError::Eof)));
    }

    #[test]
    fn recv_times_out_and_sees_abort() {
        let (_a, mut b) = pair();
        let t0 = Instant::now();
        let r = b.recv(&Deadline::after(Duration::from_millis(100)));
        assert!(matches!(r, Err(WireError::Timeout)));
        assert!(t0.elapsed() >= Duration::from_millis(100));
        let abort = AbortState::new();
        abort.abort("rank 3 died");
        let r = b.recv(&Deadline::after(Duration::from_secs(5)).watching(&abort));
        assert!(matches!(r, Err(WireError::Aborted(m)) if m == "rank 3 died"));
    }

    #[test]
    fn descriptors_travel_with_their_frame() {
        let (mut a, mut b) = pair();
        let dl = Deadline::after(Duration::from_secs(5));
        let (x, _y) = UnixStream::pair().unwrap();
        use std::os::fd::AsRawFd;
        a.send(Kind::Fds, 1, &[], &[x.as_raw_fd(), x.as_raw_fd()], &dl)
            .unwrap();
        let f = b.recv(&dl).unwrap();
        assert_eq!(f.kind, Kind::Fds);
        assert_eq!(b.fds.len(), 2);
    }

    #[test]
    fn untrusted_connections_get_no_descriptors_and_small_frames() {
        let (a, b) = UnixStream::pair().unwrap();
        let mut a = Conn::trusted(a).unwrap();
        let mut b = Conn::untrusted(b).unwrap();
        let dl = Deadline::after(Duration::from_secs(5));
        let (x, _y) = UnixStream::pair().unwrap();
        use std::os::fd::AsRawFd;
        a.send(Kind::Hello, 0, b"x", &[x.as_raw_fd()], &dl).unwrap();
        let f = b.recv(&dl).unwrap();
        assert_eq!(f.payload, b"x");
        assert!(b.fds.is_empty());
        a.send(Kind::Hello, 0, &vec![0; UNTRUSTED_MAX + 1], &[], &dl)
            .unwrap();
        assert!(matches!(b.recv(&dl), Err(WireError::Protocol(_))));
    }
}
