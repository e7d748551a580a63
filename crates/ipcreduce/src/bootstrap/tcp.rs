//! TCP sockets for jobs that span hosts: rank 0's listener, the others' bounded connect, and
//! the socket options that make a vanished host visible to liveness.
//!
//! A killed process's connections are closed by its kernel (FIN), so its peers see
//! end-of-stream at once, as on a Unix socket. A host that loses power or its network sends
//! nothing; keepalive probes (after [`KEEPALIVE_IDLE`], every [`KEEPALIVE_INTERVAL`],
//! [`KEEPALIVE_COUNT`] of them) and `TCP_USER_TIMEOUT` for unacknowledged data turn that
//! silence into an error within a few seconds.

use super::master::Master;
use nix::sys::socket::{setsockopt, sockopt};
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

const KEEPALIVE_IDLE: u32 = 1;
const KEEPALIVE_INTERVAL: u32 = 1;
const KEEPALIVE_COUNT: u32 = 3;
/// Unacknowledged data older than this fails the connection (ms).
const USER_TIMEOUT_MS: u32 = 5000;
/// One connect attempt's bound; attempts repeat until the caller's deadline.
const CONNECT_SLICE: Duration = Duration::from_secs(1);

/// Resolves the master's host (the one unbounded step: name resolution has no timeout of
/// its own; numeric addresses do not wait).
fn resolve(m: &Master) -> Result<Vec<SocketAddr>, String> {
    let addrs: Vec<SocketAddr> = (m.host.as_str(), m.port)
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {m}: {e}"))?
        .collect();
    if addrs.is_empty() {
        return Err(format!("{m} resolves to no address"));
    }
    Ok(addrs)
}

/// Where rank 0 binds for the master address `addr`: a loopback address as it is (a job on
/// loopback stays there), any other on every interface of its family, as torch's store does:
/// the name other hosts resolve may reach this host through another interface or a NAT.
fn bind_addr(addr: SocketAddr) -> SocketAddr {
    if addr.ip().is_loopback() {
        return addr;
    }
    let any: IpAddr = match addr {
        SocketAddr::V4(_) => Ipv4Addr::UNSPECIFIED.into(),
        SocketAddr::V6(_) => Ipv6Addr::UNSPECIFIED.into(),
    };
    SocketAddr::new(any, addr.port())
}

/// Rank 0: listens for the master address (see [`bind_addr`]), non-blocking.
pub(crate) fn listen(m: &Master) -> Result<TcpListener, String> {
    let mut last = String::new();
    for addr in resolve(m)?.into_iter().map(bind_addr) {
        match TcpListener::bind(addr) {
            Ok(l) => {
                l.set_nonblocking(true)
                    .map_err(|e| format!("listen on {addr}: {e}"))?;
                return Ok(l);
            }
            Err(e) if e.kind() == io::ErrorKind::AddrInUse => {
                return Err(format!(
                    "port {} on {addr} is in use (another job with the same master, or \
                     another program); choose another port",
                    m.port
                ))
            }
            Err(e) => last = format!("cannot bind {addr}: {e} (is {} this host?)", m.host),
        }
    }
    Err(last)
}

/// Sets the options every bootstrap TCP connection gets.
pub(crate) fn tune(s: &TcpStream) -> io::Result<()> {
    s.set_nodelay(true)?;
    setsockopt(s, sockopt::KeepAlive, &true)?;
    setsockopt(s, sockopt::TcpKeepIdle, &KEEPALIVE_IDLE)?;
    setsockopt(s, sockopt::TcpKeepInterval, &KEEPALIVE_INTERVAL)?;
    setsockopt(s, sockopt::TcpKeepCount, &KEEPALIVE_COUNT)?;
    setsockopt(s, sockopt::TcpUserTimeout, &USER_TIMEOUT_MS)?;
    Ok(())
}

/// Connects to the master, retrying while nobody listens yet (rank 0 may start later),
/// until `until`.
pub(crate) fn connect(m: &Master, until: Instant) -> Result<TcpStream, String> {
    let mut backoff = Duration::from_millis(5);
    loop {
        let mut last = String::new();
        for addr in resolve(m)? {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            match TcpStream::connect_timeout(&addr, left.min(CONNECT_SLICE)) {
                Ok(s) => {
                    tune(&s).map_err(|e| format!("socket options on {addr}: {e}"))?;
                    return Ok(s);
                }
                Err(e) => last = format!("{addr}: {e}"),
            }
        }
        let now = Instant::now();
        if now >= until {
            return Err(format!(
                "nobody accepted on {m} within the timeout (is rank 0 running?): {last}"
            ));
        }
        std::thread::sleep(backoff.min(until - now));
        backoff = (backoff * 2).min(Duration::from_millis(100));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_masters_stay_on_loopback() {
        let a: SocketAddr = "127.0.0.1:5000".parse().unwrap();
        assert_eq!(bind_addr(a), a);
        let a: SocketAddr = "[::1]:5000".parse().unwrap();
        assert_eq!(bind_addr(a), a);
        let a: SocketAddr = "10.1.2.3:5000".parse().unwrap();
        assert_eq!(bind_addr(a), "0.0.0.0:5000".parse().unwrap());
        let a: SocketAddr = "[fd00::1]:5000".parse().unwrap();
        assert_eq!(bind_addr(a), "[::]:5000".parse().unwrap());
    }
}
