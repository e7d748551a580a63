//! How the ranks' workspaces are shared, chosen once per communicator and the same on every rank:
//! - `peer`: device memory mapped across processes ([`super::workspace`]); kernels read and
//!   write the peers' GPUs directly (NVLink or PCIe P2P).
//! - `host`: every workspace in host memory ([`super::host_staged`]); all traffic is staged
//!   through host memory over PCIe, no peer access needed.
//!
//! `Config::transport` / `IPCREDUCE_TRANSPORT=auto|peer|host` (default `auto`). `auto` checks every pair in three steps
//! (P2P query, mapping the peers' workspaces, a cross-process write/read) and takes `host` at
//! the first step that fails anywhere, logging the pair; `peer` turns such a failure into an
//! error; `host` skips the checks. After every step the ranks exchange what they saw and decide
//! with the same pure function ([`decide`]) on the same reports, so they always agree.

use super::host_staged::HostWorkspaces;
use super::peers::{check_peer_access, mapping_test};
use super::workspace::Workspaces;
use crate::bootstrap::Bootstrap;
use crate::config::{Config, Sharing, Transport};
use crate::error::{Error, Result};
use cudarc::driver::sys;

/// The knob that forces a transport, as errors name it.
const KNOB: &str = "the transport (Config::transport or IPCREDUCE_TRANSPORT)";

/// A rank's setting of the transport in one byte of its report (`None` = auto).
fn code(forced: Option<Transport>) -> u8 {
    match forced {
        None => 0,
        Some(Transport::Peer) => 1,
        Some(Transport::Host) => 2,
    }
}

fn from_code(code: u8) -> Option<Option<Transport>> {
    match code {
        0 => Some(None),
        1 => Some(Some(Transport::Peer)),
        2 => Some(Some(Transport::Host)),
        _ => None,
    }
}

/// `rank` could not use `peer` (its GPU or its workspace) in start-up check `check`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PairFailure {
    pub rank: usize,
    pub peer: usize,
    pub check: &'static str,
    pub detail: String,
}

impl PairFailure {
    fn into_error(self) -> Error {
        Error::PeerAccess {
            rank: self.rank,
            peer: self.peer,
            op: self.check,
            detail: self.detail,
        }
    }
}

/// What the ranks do after a check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Every pair passed (and `host` is not forced): go on with peer memory.
    Peer,
    /// Use host-staged workspaces: forced (`None`), or because of this failed pair.
    Host(Option<PairFailure>),
}

/// One rank's report after a check: its setting of [`KNOB`] and the first failure it saw
/// (`(peer, why)`). Sent to every rank.
pub fn encode_report(forced: Option<Transport>, failure: Option<&(usize, String)>) -> Vec<u8> {
    let mut out = vec![code(forced)];
    if let Some((peer, why)) = failure {
        out.extend_from_slice(&(*peer as u32).to_le_bytes());
        out.extend_from_slice(why.as_bytes());
    }
    out
}

type Report = (Option<Transport>, Option<(usize, String)>);

fn decode_report(bytes: &[u8]) -> Option<Report> {
    let (&code, rest) = bytes.split_first()?;
    let forced = from_code(code)?;
    if rest.is_empty() {
        return Some((forced, None));
    }
    let peer = u32::from_le_bytes(rest.get(..4)?.try_into().ok()?) as usize;
    let why = String::from_utf8_lossy(&rest[4..]).into_owned();
    Some((forced, Some((peer, why))))
}

/// Every rank's reports after check `check` (index = rank), decoded: the agreed setting of
/// [`KNOB`] and the first failed pair (lowest rank first). `me` only names this rank in errors.
fn gather(
    check: &'static str,
    reports: &[Vec<u8>],
    me: usize,
) -> Result<(Option<Transport>, Option<PairFailure>)> {
    let mut decoded = Vec::with_capacity(reports.len());
    for (rank, bytes) in reports.iter().enumerate() {
        decoded.push(decode_report(bytes).ok_or_else(|| Error::Bootstrap {
            rank: me,
            peer: Some(rank),
            op: "transport agreement",
            detail: format!("malformed report after the {check} ({} bytes)", bytes.len()),
        })?);
    }
    let forced = decoded.first().and_then(|r| r.0);
    if let Some(rank) = decoded.iter().position(|r| r.0 != forced) {
        return Err(Error::Config(format!(
            "{KNOB} differs between ranks: rank 0 has {}, rank {rank} {}",
            forced.map_or("auto", Transport::name),
            decoded[rank].0.map_or("auto", Transport::name)
        )));
    }
    let failure = decoded
        .into_iter()
        .enumerate()
        .find_map(|(rank, (_, f))| f.map(|(peer, detail)| (rank, peer, detail)))
        .map(|(rank, peer, detail)| PairFailure {
            rank,
            peer,
            check,
            detail,
        });
    Ok((forced, failure))
}

/// The decision after peer-memory check `check`, from every rank's report. Pure, so every
/// rank reaches the same one from the same reports.
pub fn decide(check: &'static str, reports: &[Vec<u8>], me: usize) -> Result<Step> {
    match gather(check, reports, me)? {
        (Some(Transport::Host), _) => Ok(Step::Host(None)),
        (_, None) => Ok(Step::Peer),
        (Some(Transport::Peer), Some(f)) => Err(f.into_error()),
        (None, Some(f)) => Ok(Step::Host(Some(f))),
    }
}

/// After a check of the host-staged transport, the last resort: any failed pair is an error.
pub fn require_all(check: &'static str, reports: &[Vec<u8>], me: usize) -> Result<()> {
    match gather(check, reports, me)?.1 {
        Some(f) => Err(f.into_error()),
        None => Ok(()),
    }
}

/// Every rank's workspace, mapped into this process, over the chosen transport.
pub struct SharedWorkspaces {
    inner: Inner,
    pub size: usize,
    /// The pair that made `auto` stage through host memory (the same on every rank).
    pub fallback: Option<PairFailure>,
}

enum Inner {
    Peer(Workspaces),
    Host(HostWorkspaces),
}

impl SharedWorkspaces {
    /// Device address of `rank`'s workspace in this process.
    pub fn base(&self, rank: usize) -> sys::CUdeviceptr {
        match &self.inner {
            Inner::Peer(w) => w.base(rank),
            Inner::Host(w) => w.base(rank),
        }
    }

    /// What device descriptions add: nothing for peer memory, ", host-staged" otherwise.
    pub fn note(&self) -> &'static str {
        match &self.inner {
            Inner::Peer(_) => "",
            Inner::Host(_) => ", host-staged",
        }
    }

    /// How peer memory is shared; `None` on the host transport, where every rank's mapping of
    /// a memfd keeps its pages alive whoever unmaps first (as with `vmm`, unlike `ipc`).
    pub fn sharing(&self) -> Option<Sharing> {
        match &self.inner {
            Inner::Peer(w) => Some(w.mode),
            Inner::Host(_) => None,
        }
    }

    /// Zeroes the first `bytes` of this rank's own workspace.
    pub fn clear(&self, rank: usize, bytes: usize) -> Result<()> {
        match &self.inner {
            // SAFETY: the range lies in our own workspace; no kernel uses it yet.
            Inner::Peer(w) => unsafe {
                super::driver::zero(w.base(rank), bytes, rank, || {
                    "clearing the signal and LL areas".into()
                })
            },
            Inner::Host(w) => {
                w.clear(rank, bytes);
                Ok(())
            }
        }
    }

    /// Collective: creates and shares every rank's workspace of at least `bytes` over the
    /// transport that [`KNOB`] forces or `auto` finds working for every pair.
    pub fn open(
        boot: &mut Bootstrap,
        device: sys::CUdevice,
        bytes: usize,
        uuids: &[Vec<u8>],
        config: &Config,
    ) -> Result<SharedWorkspaces> {
        let rank = boot.rank();
        let forced = config.transport;
        let denied = config.deny_peer.and_then(|(r, p)| (r == rank).then_some(p));
        let mut step = if forced == Some(Transport::Host) {
            agree(boot, forced, "P2P query", None)?
        } else {
            let p2p = match denied {
                Some(peer) => Err((peer, "denied by IPCREDUCE_DENY_PEER (a test)".to_string())),
                None => check_peer_access(rank, device, uuids).map_err(|e| pair(rank, e)),
            };
            agree(boot, forced, "P2P query", p2p.err())?
        };
        if step == Step::Peer {
            match Workspaces::create(boot, device, bytes, config.sharing) {
                Err(e) => step = agree(boot, forced, "workspace mapping", Some(pair(rank, e)))?,
                Ok(ws) => {
                    step = agree(boot, forced, "workspace mapping", None)?;
                    if step == Step::Peer {
                        let what = format!("the {} mapping", ws.mode.name());
                        let seen = mapping_test(boot, |r| ws.base(r), &what)?;
                        step = agree(boot, forced, "cross-process read", seen)?;
                        if step == Step::Peer {
                            tracing::info!(rank, "cuda transport: peer memory ({what})");
                            return Ok(SharedWorkspaces {
                                size: ws.size,
                                inner: Inner::Peer(ws),
                                fallback: None,
                            });
                        }
                    }
                }
            }
        }
        match &step {
            Step::Host(Some(f)) if rank == 0 => tracing::warn!("{}", fallback_message(f)),
            _ => tracing::info!(rank, "cuda transport: staging through host memory"),
        }
        // No fallback beyond this one: every failure from here on is an error on every rank.
        let host = HostWorkspaces::create(boot, bytes)?;
        let failed = host.as_ref().err().cloned();
        let reports = boot.all_gather(&encode_report(forced, failed.as_ref()))?;
        require_all("host-staged workspace mapping", &reports, rank)?;
        let host = host.expect("agreed that every rank mapped every workspace");
        let seen = mapping_test(boot, |r| host.base(r), "the host-staged mapping")?;
        let reports = boot.all_gather(&encode_report(forced, seen.as_ref()))?;
        require_all("host-staged cross-process read", &reports, rank)?;
        Ok(SharedWorkspaces {
            size: host.size,
            inner: Inner::Host(host),
            fallback: match step {
                Step::Host(f) => f,
                Step::Peer => None,
            },
        })
    }
}

/// The log line of `auto`'s fallback: the pair (or the rank) and what failed.
fn fallback_message(f: &PairFailure) -> String {
    let who = if f.peer == f.rank {
        format!("rank {} could not set up peer memory", f.rank)
    } else {
        format!("rank {} cannot use rank {}", f.rank, f.peer)
    };
    format!(
        "cuda transport: staging through host memory, because {who} ({}: {})",
        f.check, f.detail
    )
}

/// Exchanges this rank's outcome of `check` and decides with every rank's.
fn agree(
    boot: &mut Bootstrap,
    forced: Option<Transport>,
    check: &'static str,
    failure: Option<(usize, String)>,
) -> Result<Step> {
    let reports = boot.all_gather(&encode_report(forced, failure.as_ref()))?;
    decide(check, &reports, boot.rank())
}

/// The peer an error concerns (this rank itself when it names none) and its text.
fn pair(rank: usize, e: Error) -> (usize, String) {
    match e {
        Error::PeerAccess { peer, detail, .. } => (peer, detail),
        other => (rank, other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(forced: Option<Transport>, failure: Option<(usize, &str)>) -> Vec<u8> {
        encode_report(forced, failure.map(|(p, w)| (p, w.to_string())).as_ref())
    }

    #[test]
    fn reports_round_trip() {
        for forced in [None, Some(Transport::Peer), Some(Transport::Host)] {
            assert_eq!(decode_report(&report(forced, None)), Some((forced, None)));
            let with = decode_report(&report(forced, Some((7, "no P2P path"))));
            assert_eq!(with, Some((forced, Some((7, "no P2P path".to_string())))));
        }
        assert_eq!(decode_report(&[]), None);
        assert_eq!(decode_report(&[9]), None);
        assert_eq!(
            decode_report(&[0, 1, 2]),
            None,
            "a peer index needs 4 bytes"
        );
    }

    #[test]
    fn auto_keeps_peer_memory_when_every_pair_passes() {
        let reports = vec![report(None, None); 4];
        assert_eq!(decide("P2P query", &reports, 2).unwrap(), Step::Peer);
    }

    #[test]
    fn auto_falls_back_to_host_naming_the_first_failed_pair() {
        let reports = vec![
            report(None, None),
            report(None, Some((3, "no P2P path"))),
            report(None, None),
            report(None, Some((1, "no P2P path back"))),
        ];
        let want = Step::Host(Some(PairFailure {
            rank: 1,
            peer: 3,
            check: "P2P query",
            detail: "no P2P path".into(),
        }));
        // Every rank reaches the same decision from the same reports.
        for me in 0..4 {
            assert_eq!(decide("P2P query", &reports, me).unwrap(), want);
        }
    }

    #[test]
    fn forced_peer_turns_a_failure_into_an_error_naming_the_pair() {
        let mut reports = vec![report(Some(Transport::Peer), None); 3];
        assert_eq!(
            decide("cross-process read", &reports, 0).unwrap(),
            Step::Peer
        );
        reports[2] = report(Some(Transport::Peer), Some((0, "read back garbage")));
        let err = decide("cross-process read", &reports, 0)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("rank 2") && err.contains("rank 0") && err.contains("read back garbage"),
            "{err}"
        );
    }

    #[test]
    fn forced_host_ignores_peer_checks_but_not_its_own() {
        let reports = vec![
            report(Some(Transport::Host), None),
            report(Some(Transport::Host), Some((0, "no P2P path"))),
        ];
        assert_eq!(decide("P2P query", &reports, 1).unwrap(), Step::Host(None));
        // The host-staged transport is the last resort: a failure there is an error.
        let err = require_all("host-staged cross-process read", &reports, 0)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("rank 1") && err.contains("no P2P path"),
            "{err}"
        );
        let clean = vec![report(None, None); 3];
        require_all("host-staged workspace mapping", &clean, 0).unwrap();
    }

    #[test]
    fn the_fallback_log_names_the_pair_or_the_rank() {
        let mut f = PairFailure {
            rank: 1,
            peer: 0,
            check: "P2P query",
            detail: "no P2P path".into(),
        };
        let line = fallback_message(&f);
        // scripts/device/host-staged.sh looks for this line.
        assert!(line.contains("staging through host memory, because rank 1 cannot use rank 0"));
        assert!(line.contains("P2P query: no P2P path"), "{line}");
        f.peer = 1;
        assert!(fallback_message(&f).contains("rank 1 could not set up peer memory"));
    }

    #[test]
    fn ranks_with_different_settings_all_fail() {
        let reports = vec![report(None, None), report(Some(Transport::Host), None)];
        for me in 0..2 {
            let err = decide("P2P query", &reports, me).unwrap_err().to_string();
            assert!(err.contains(KNOB) && err.contains("rank 1 host"), "{err}");
        }
    }

    #[test]
    fn malformed_report_is_an_error_naming_the_sender() {
        let reports = vec![report(None, None), vec![7]];
        let err = decide("P2P query", &reports, 0).unwrap_err().to_string();
        assert!(err.contains("rank 1") && err.contains("malformed"), "{err}");
    }
}
