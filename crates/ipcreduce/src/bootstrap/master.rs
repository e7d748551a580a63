//! Where the ranks of a job spanning several hosts meet: rank 0's TCP address.
//!
//! A single-host job keeps the Unix socket (uid-checked, fd passing). A job gets a master,
//! and so meets over TCP, when:
//! - `IPCREDUCE_MASTER=host:port` is set (`ipcreduce launch --nnodes N --master host:port`
//!   sets it), or
//! - under torchrun, `LOCAL_WORLD_SIZE` is below `WORLD_SIZE`: then `MASTER_ADDR` and
//!   `IPCREDUCE_MASTER_PORT`, else `MASTER_PORT + 1`. Not `MASTER_PORT` itself: torch's own
//!   TCP store listens there in rank 0's process or torchrun's agent.

use crate::error::{Error, Result};

/// Rank 0's TCP address: the host the others connect to (and rank 0 binds), and the port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Master {
    pub host: String,
    pub port: u16,
}

impl std::fmt::Display for Master {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

impl Master {
    /// Parses `host:port` (`[v6 address]:port` for IPv6); `what` names the source in errors.
    pub fn parse(s: &str, what: &str) -> Result<Master> {
        let bad = |why: &str| {
            Error::Config(format!(
                "{what}={s:?} is not host:port ({why}); e.g. node0.cluster:29400 or \
                 [fd00::1]:29400"
            ))
        };
        let (host, port) = s.rsplit_once(':').ok_or_else(|| bad("no port"))?;
        let host = match host.strip_prefix('[') {
            Some(h) => h.strip_suffix(']').ok_or_else(|| bad("unclosed ["))?,
            None if host.contains(':') => return Err(bad("IPv6 addresses go in brackets")),
            None => host,
        };
        if host.is_empty() || host.chars().any(|c| c.is_whitespace()) {
            return Err(bad("empty or blank host"));
        }
        let port = port_number(port).ok_or_else(|| bad("port must be 1..=65535"))?;
        Ok(Master {
            host: host.to_string(),
            port,
        })
    }

    /// The master described by the variables `get` returns (see the module notes), or None
    /// for a single-host job. `torchrun` says the rank came from torchrun's variables.
    pub fn from_lookup(
        get: &impl Fn(&str) -> Option<String>,
        torchrun: bool,
        world: usize,
    ) -> Result<Option<Master>> {
        if let Some(m) = get("IPCREDUCE_MASTER") {
            return Master::parse(&m, "IPCREDUCE_MASTER").map(Some);
        }
        if !torchrun {
            return Ok(None);
        }
        let Some(local) = get("LOCAL_WORLD_SIZE") else {
            return Ok(None);
        };
        let local: usize = local.trim().parse().map_err(|_| {
            Error::Config(format!(
                "LOCAL_WORLD_SIZE={local:?} is not a positive integer"
            ))
        })?;
        if local == 0 || local >= world {
            return Ok(None);
        }
        let host = get("MASTER_ADDR").ok_or_else(|| {
            Error::Config(format!(
                "LOCAL_WORLD_SIZE={local} < WORLD_SIZE={world}: the job spans several hosts, \
                 but MASTER_ADDR is not set (or set IPCREDUCE_MASTER=host:port)"
            ))
        })?;
        let port = if let Some(p) = get("IPCREDUCE_MASTER_PORT") {
            port_number(&p).ok_or_else(|| {
                Error::Config(format!(
                    "IPCREDUCE_MASTER_PORT={p:?} is not a port (1..=65535)"
                ))
            })?
        } else {
            let p = get("MASTER_PORT").ok_or_else(|| {
                Error::Config(
                    "a multi-host torchrun job needs MASTER_PORT (or IPCREDUCE_MASTER_PORT)".into(),
                )
            })?;
            port_number(&p)
                .and_then(|p| p.checked_add(1))
                .ok_or_else(|| {
                    Error::Config(format!(
                        "MASTER_PORT={p:?} leaves no port above it for ipcreduce; set \
                         IPCREDUCE_MASTER_PORT"
                    ))
                })?
        };
        Master::parse(&format!("{}:{port}", bracket(&host)), "MASTER_ADDR").map(Some)
    }
}

fn bracket(host: &str) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        host.to_string()
    }
}

fn port_number(s: &str) -> Option<u16> {
    s.trim().parse::<u16>().ok().filter(|p| *p != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The variables `vars`, as [`Master::from_lookup`] reads them.
    fn lookup<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        |k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn parses_hosts_and_ports() {
        let m = Master::parse("node0:29400", "X").unwrap();
        assert_eq!((m.host.as_str(), m.port), ("node0", 29400));
        assert_eq!(m.to_string(), "node0:29400");
        let m = Master::parse("[fd00::1]:7", "X").unwrap();
        assert_eq!((m.host.as_str(), m.port), ("fd00::1", 7));
        assert_eq!(m.to_string(), "[fd00::1]:7");
        for bad in [
            "node0",
            "node0:0",
            "node0:70000",
            ":5",
            "fd00::1:5",
            "[fd00::1:5",
        ] {
            let e = Master::parse(bad, "IPCREDUCE_MASTER")
                .unwrap_err()
                .to_string();
            assert!(e.contains("IPCREDUCE_MASTER"), "{bad}: {e}");
        }
    }

    #[test]
    fn explicit_master_wins() {
        let get = lookup(&[("IPCREDUCE_MASTER", "a:1"), ("MASTER_ADDR", "b")]);
        let m = Master::from_lookup(&get, false, 4).unwrap().unwrap();
        assert_eq!(m.to_string(), "a:1");
        assert_eq!(Master::from_lookup(&lookup(&[]), false, 4).unwrap(), None);
    }

    #[test]
    fn torchrun_multi_host_uses_the_port_above_master_port() {
        let multi = [
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
        ];
        let m = Master::from_lookup(&lookup(&multi), true, 4)
            .unwrap()
            .unwrap();
        assert_eq!(m.to_string(), "10.0.0.1:29501");
        // One host: the Unix socket.
        assert_eq!(Master::from_lookup(&lookup(&multi), true, 2).unwrap(), None);
        // ipcreduce's own variables never read torchrun's.
        assert_eq!(
            Master::from_lookup(&lookup(&multi), false, 4).unwrap(),
            None
        );
        let mut v = multi.to_vec();
        v.push(("IPCREDUCE_MASTER_PORT", "4000"));
        let m = Master::from_lookup(&lookup(&v), true, 4).unwrap().unwrap();
        assert_eq!(m.port, 4000);
        let e = Master::from_lookup(&lookup(&multi[..2]), true, 4).unwrap_err();
        assert!(e.to_string().contains("MASTER_PORT"), "{e}");
        let e = Master::from_lookup(&lookup(&[("LOCAL_WORLD_SIZE", "1")]), true, 4).unwrap_err();
        assert!(e.to_string().contains("MASTER_ADDR"), "{e}");
        let top = [
            ("LOCAL_WORLD_SIZE", "1"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "65535"),
        ];
        let e = Master::from_lookup(&lookup(&top), true, 4).unwrap_err();
        assert!(e.to_string().contains("IPCREDUCE_MASTER_PORT"), "{e}");
    }
}
