//! Raw socket I/O that may carry file descriptors (SCM_RIGHTS), non-blocking and never
//! raising SIGPIPE (a library must not kill its host process because a peer went away).

use nix::errno::Errno;
use nix::sys::socket::{self, ControlMessage, ControlMessageOwned, MsgFlags};
use std::collections::VecDeque;
use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

/// Most descriptors Linux passes in one message (SCM_MAX_FD). Sizing the control buffer for
/// it means a message is never truncated, so no received descriptor is ever left unowned.
const SCM_MAX_FD: usize = 253;

/// Control-message buffer able to hold the largest SCM_RIGHTS message.
pub(crate) fn cmsg_buffer() -> Vec<u8> {
    nix::cmsg_space!([RawFd; SCM_MAX_FD])
}

/// Sends some of `bytes` (with `fds` attached to the first byte when not empty).
/// Returns how many bytes went out; `WouldBlock` when the socket buffer is full.
pub(crate) fn send_some(sock: BorrowedFd<'_>, bytes: &[u8], fds: &[RawFd]) -> io::Result<usize> {
    let flags = MsgFlags::MSG_NOSIGNAL | MsgFlags::MSG_DONTWAIT;
    let r = if fds.is_empty() {
        socket::send(sock.as_raw_fd(), bytes, flags)
    } else {
        socket::sendmsg::<()>(
            sock.as_raw_fd(),
            &[IoSlice::new(bytes)],
            &[ControlMessage::ScmRights(fds)],
            flags,
            None,
        )
    };
    r.map_err(io::Error::from)
}

/// Receives into `buf`. With `cmsg` given, descriptors that arrive are appended to `fds`
/// (close-on-exec); without it the kernel discards any that a sender attached, which is what
/// we want from connections that have not proved who they are yet.
/// Returns 0 at end of stream; `WouldBlock` when nothing is there.
pub(crate) fn recv_some(
    sock: BorrowedFd<'_>,
    buf: &mut [u8],
    cmsg: Option<&mut Vec<u8>>,
    fds: &mut VecDeque<OwnedFd>,
) -> io::Result<usize> {
    let Some(cmsg) = cmsg else {
        return socket::recv(sock.as_raw_fd(), buf, MsgFlags::MSG_DONTWAIT)
            .map_err(io::Error::from);
    };
    let mut iov = [IoSliceMut::new(buf)];
    let msg = socket::recvmsg::<()>(
        sock.as_raw_fd(),
        &mut iov,
        Some(cmsg),
        MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_CMSG_CLOEXEC,
    )
    .map_err(io::Error::from)?;
    let n = msg.bytes;
    // cmsgs() fails only on MSG_CTRUNC, impossible with a buffer sized for SCM_MAX_FD.
    for c in msg.cmsgs().map_err(io::Error::from)? {
        if let ControlMessageOwned::ScmRights(raw) = c {
            for fd in raw {
                // SAFETY: the kernel just installed this descriptor in our table for us;
                // nothing else owns it.
                fds.push_back(unsafe { OwnedFd::from_raw_fd(fd) });
            }
        }
    }
    Ok(n)
}

/// Whether an error means the peer closed its end.
pub(crate) fn is_peer_gone(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error().map(Errno::from_raw),
        Some(Errno::EPIPE | Errno::ECONNRESET | Errno::ENOTCONN)
    )
}
