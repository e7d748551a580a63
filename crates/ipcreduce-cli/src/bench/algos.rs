//! `bench -a`: the algorithm list, with `nccl-shm` (NCCL over its shared-memory transport,
//! `NCCL_P2P_DISABLE=1`) beside the plain `nccl` column.
//!
//! NCCL reads `NCCL_P2P_DISABLE` once per process, at its first communicator: the two NCCL
//! flavors cannot both run in one process, so a list with both is refused. For `nccl-shm` the
//! benchmark sets the variable in its own rank process before anything initializes NCCL (the
//! library itself never sets environment variables); NCCL then runs on the same buffers in the
//! same run as ipcreduce. A variable already set decides what plain `nccl` rows are.

use ipcreduce::types::Algorithm;

/// Which NCCL the NCCL rows measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum NcclFlavor {
    /// NCCL's own choice of transport (P2P / NVLink where it can).
    Default,
    /// Peer access off (`NCCL_P2P_DISABLE=1`): NCCL's shared-memory transport through host
    /// memory, the one it takes on GPUs without peer access.
    Shm,
}

impl NcclFlavor {
    /// The path name of NCCL rows.
    pub fn path(self) -> &'static str {
        match self {
            NcclFlavor::Default => "nccl",
            NcclFlavor::Shm => "nccl-shm",
        }
    }
}

/// What `-a` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selection {
    pub algos: Vec<Algorithm>,
    /// The flavor of the NCCL rows (when NCCL is among `algos`).
    pub nccl: NcclFlavor,
    /// Whether this process must set `NCCL_P2P_DISABLE=1` before NCCL's first init.
    pub set_p2p_disable: bool,
}

/// Parses `-a` (comma separated: auto, oneshot, twoshot, nccl, nccl-shm, or all) against the
/// process's `NCCL_P2P_DISABLE` (`p2p_disable`, as set or None).
pub fn select(list: &str, p2p_disable: Option<&str>) -> Result<Selection, String> {
    let env_off = match p2p_disable.map(str::trim) {
        None | Some("") => None,
        // NCCL takes any value but 0 as "off".
        Some(v) => Some(v.parse::<i64>() != Ok(0)),
    };
    let mut algos = Vec::new();
    let (mut plain, mut shm) = (false, false);
    let tokens: Vec<&str> = if list.trim().eq_ignore_ascii_case("all") {
        vec!["auto", "oneshot", "twoshot", "nccl"]
    } else {
        list.split(',').map(str::trim).collect()
    };
    for t in tokens {
        let a = if t.to_ascii_lowercase().replace('_', "-") == "nccl-shm" {
            shm = true;
            Algorithm::Nccl
        } else {
            let a: Algorithm = t
                .parse()
                .map_err(|e: String| format!("-a {list}: {e} (or nccl-shm)"))?;
            plain |= a == Algorithm::Nccl;
            a
        };
        if !algos.contains(&a) {
            algos.push(a);
        }
    }
    if plain && shm {
        return Err(format!(
            "-a {list}: nccl and nccl-shm cannot run in one process (NCCL reads \
             NCCL_P2P_DISABLE once, at its first init); run bench once with each"
        ));
    }
    if shm && env_off == Some(false) {
        return Err(format!(
            "-a {list}: nccl-shm needs NCCL_P2P_DISABLE=1, and the environment sets it to 0"
        ));
    }
    let nccl = if shm || env_off == Some(true) {
        NcclFlavor::Shm
    } else {
        NcclFlavor::Default
    };
    Ok(Selection {
        algos,
        nccl,
        set_p2p_disable: shm && env_off.is_none(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nccl_shm_is_nccl_with_p2p_off() {
        let s = select("auto,nccl-shm", None).unwrap();
        assert_eq!(s.algos, vec![Algorithm::Auto, Algorithm::Nccl]);
        assert_eq!(s.nccl, NcclFlavor::Shm);
        assert!(s.set_p2p_disable);
        // Already set: nothing to set.
        let s = select("nccl-shm", Some("1")).unwrap();
        assert_eq!((s.nccl, s.set_p2p_disable), (NcclFlavor::Shm, false));
    }

    #[test]
    fn both_flavors_in_one_process_are_refused() {
        let err = select("auto,nccl,nccl-shm", None).unwrap_err();
        assert!(err.contains("cannot run in one process"), "{err}");
        let err = select("nccl-shm", Some("0")).unwrap_err();
        assert!(err.contains("NCCL_P2P_DISABLE"), "{err}");
    }

    #[test]
    fn plain_nccl_follows_the_environment() {
        assert_eq!(select("nccl", None).unwrap().nccl, NcclFlavor::Default);
        assert_eq!(select("nccl", Some("0")).unwrap().nccl, NcclFlavor::Default);
        let s = select("all", Some("1")).unwrap();
        assert_eq!(s.algos.len(), 4);
        assert!(s.algos.contains(&Algorithm::Nccl));
        assert_eq!((s.nccl, s.set_p2p_disable), (NcclFlavor::Shm, false));
        assert_eq!(select("all", None).unwrap().nccl, NcclFlavor::Default);
    }

    #[test]
    fn bad_names_are_errors_and_repeats_collapse() {
        assert!(select("ring", None).unwrap_err().contains("nccl-shm"));
        let s = select("oneshot, oneshot,twoshot", None).unwrap();
        assert_eq!(s.algos, vec![Algorithm::OneShot, Algorithm::TwoShot]);
        assert_eq!(NcclFlavor::Shm.path(), "nccl-shm");
    }
}
