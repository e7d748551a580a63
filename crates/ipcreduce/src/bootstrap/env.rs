//! Where a rank learns who it is: ipcreduce's own variables, or torchrun's.

use super::master::Master;
use super::nodes::{check_host_id, machine_host_id};
use crate::error::{Error, Result};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Largest job the bootstrap accepts (the star topology and fd relay are sized for it).
pub const MAX_WORLD: usize = 64;

/// Identity of this process in its job.
#[derive(Clone)]
pub struct RankInfo {
    pub rank: usize,
    pub world: usize,
    /// Index of this rank among the ranks of this host (selects the GPU).
    pub local_rank: usize,
    /// The job's rendezvous socket (unused when `master` is set).
    pub socket: PathBuf,
    /// Where rank 0 listens when the job spans several hosts (TCP); None: the Unix socket.
    pub master: Option<Master>,
    /// Which host this rank runs on: ranks with the same id form a node.
    pub host_id: String,
    /// Identifies the job; ranks of another job are refused.
    pub job_id: String,
    /// Per-job secret handed out by `ipcreduce launch`; None when started by another launcher.
    pub secret: Option<String>,
}

/// Hand-written so that logging a `RankInfo` never prints the job's secret.
impl std::fmt::Debug for RankInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankInfo")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("local_rank", &self.local_rank)
            .field("socket", &self.socket)
            .field("master", &self.master)
            .field("host_id", &self.host_id)
            .field("job_id", &self.job_id)
            .field("secret", &self.secret.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

impl RankInfo {
    /// A rank described explicitly (tests, embedding). `local_rank` is set to `rank`.
    /// Validates like [`RankInfo::from_env`] does.
    pub fn new(
        rank: usize,
        world: usize,
        socket: impl Into<PathBuf>,
        job_id: impl Into<String>,
        secret: Option<String>,
    ) -> Result<RankInfo> {
        let job_id = job_id.into();
        check_world_rank(rank, world, "rank", "world")?;
        check_job_id(&job_id, "job id")?;
        let secret = secret.map(|s| normalize_secret(&s, "secret")).transpose()?;
        Ok(RankInfo {
            rank,
            world,
            local_rank: rank,
            socket: socket.into(),
            master: None,
            host_id: machine_host_id(),
            job_id,
            secret,
        })
    }

    /// Meets over TCP at `master` instead of the Unix socket. The secret is then the only
    /// credential (peer uids cannot be checked across hosts), so it is required.
    pub fn with_master(mut self, master: Master) -> Result<RankInfo> {
        require_secret(&self.secret, &master, "the secret")?;
        self.master = Some(master);
        Ok(self)
    }

    /// Overrides the host id (tests that play several hosts on one machine).
    pub fn with_host_id(mut self, id: impl Into<String>) -> Result<RankInfo> {
        let id = id.into();
        check_host_id(&id, "host id")?;
        self.host_id = id;
        Ok(self)
    }

    /// Reads `IPCREDUCE_RANK`/`IPCREDUCE_WORLD_SIZE`/`IPCREDUCE_LOCAL_RANK`/`IPCREDUCE_SOCKET`/
    /// `IPCREDUCE_JOB_ID`/`IPCREDUCE_SECRET`, falling back to torchrun's `RANK`/`WORLD_SIZE`/
    /// `LOCAL_RANK` (socket derived from the job id).
    ///
    /// Jobs spanning several hosts meet over TCP (see [`Master::from_lookup`]):
    /// `IPCREDUCE_MASTER=host:port`, or under torchrun with `LOCAL_WORLD_SIZE < WORLD_SIZE`,
    /// `MASTER_ADDR` and `MASTER_PORT + 1`. The host id is `IPCREDUCE_HOST_ID`, else the
    /// hostname and boot id.
    ///
    /// The job id is `IPCREDUCE_JOB_ID`, else `TORCHELASTIC_RUN_ID` (unless it is torchrun's
    /// placeholder `none`), else `MASTER_PORT`. Without `IPCREDUCE_SOCKET` the socket is
    /// `/tmp/ipcreduce-<uid>/<job id>.sock`; that directory is created private (0700) and
    /// refused if someone else could have planted a socket in it.
    pub fn from_env() -> Result<RankInfo> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// [`RankInfo::from_env`] over any variable source, so parsing is testable without
    /// touching the process environment (which other test threads share).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<RankInfo> {
        // A variable set to the empty string counts as unset: shells and launchers often
        // export `VAR=` to clear it.
        let get = |k: &str| get(k).filter(|v| !v.is_empty());

        // Rank, world and local rank come from one family so a stale torchrun variable can
        // never be mixed with ipcreduce's own.
        let (rank_var, world_var, local_var) = if get("IPCREDUCE_RANK").is_some() {
            (
                "IPCREDUCE_RANK",
                "IPCREDUCE_WORLD_SIZE",
                "IPCREDUCE_LOCAL_RANK",
            )
        } else if get("RANK").is_some() {
            ("RANK", "WORLD_SIZE", "LOCAL_RANK")
        } else {
            return Err(Error::Config(
                "neither IPCREDUCE_RANK nor RANK is set: start the ranks with \
                 `ipcreduce launch -n N -- CMD` or torchrun"
                    .into(),
            ));
        };
        let rank = parse_usize(rank_var, get(rank_var))?;
        let world = parse_usize(world_var, get(world_var))?;
        check_world_rank(rank, world, rank_var, world_var)?;
        let local_rank = match get(local_var) {
            Some(v) => parse_usize(local_var, Some(v))?,
            None => rank,
        };

        let (job_var, job_id) = if let Some(j) = get("IPCREDUCE_JOB_ID") {
            ("IPCREDUCE_JOB_ID", j)
        } else if let Some(j) = get("TORCHELASTIC_RUN_ID").filter(|j| j != "none") {
            // torchrun's default rendezvous id is the literal "none", shared by every job
            // started without --rdzv-id; MASTER_PORT tells such jobs apart better.
            ("TORCHELASTIC_RUN_ID", j)
        } else if let Some(j) = get("MASTER_PORT") {
            ("MASTER_PORT", j)
        } else {
            return Err(Error::Config(
                "no job id: set IPCREDUCE_JOB_ID (or torchrun's TORCHELASTIC_RUN_ID or \
                 MASTER_PORT)"
                    .into(),
            ));
        };
        check_job_id(&job_id, job_var)?;

        let master = Master::from_lookup(&get, rank_var == "RANK", world)?;
        let socket = match get("IPCREDUCE_SOCKET") {
            Some(s) => PathBuf::from(s),
            None => {
                let dir = default_socket_dir();
                // Over TCP the socket is never bound: do not create its directory.
                if master.is_none() {
                    ensure_private_dir(&dir)?;
                }
                dir.join(format!("{job_id}.sock"))
            }
        };

        let secret = get("IPCREDUCE_SECRET")
            .map(|s| normalize_secret(&s, "IPCREDUCE_SECRET"))
            .transpose()?;
        if let Some(m) = &master {
            require_secret(&secret, m, "IPCREDUCE_SECRET")?;
        }
        let host_id = match get("IPCREDUCE_HOST_ID") {
            Some(id) => {
                check_host_id(&id, "IPCREDUCE_HOST_ID")?;
                id
            }
            None => machine_host_id(),
        };

        Ok(RankInfo {
            rank,
            world,
            local_rank,
            socket,
            master,
            host_id,
            job_id,
            secret,
        })
    }
}

/// `/tmp/ipcreduce-<uid>`: fixed rather than `$TMPDIR` because every rank must derive the
/// same path, and launchers do not always pass the same `TMPDIR` to all of them.
pub fn default_socket_dir() -> PathBuf {
    PathBuf::from(format!(
        "/tmp/ipcreduce-{}",
        nix::unistd::geteuid().as_raw()
    ))
}

/// Creates `dir` with mode 0700 if missing; refuses an existing one that another user owns
/// or that group/others can write or enter: a socket planted there could impersonate rank 0.
pub fn ensure_private_dir(dir: &Path) -> Result<()> {
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => {
            return Err(Error::Config(format!(
                "cannot create socket directory {}: {e}",
                dir.display()
            )))
        }
    }
    // symlink_metadata: a symlink (possibly planted by someone else) is refused, not followed.
    let md = std::fs::symlink_metadata(dir).map_err(|e| {
        Error::Config(format!(
            "cannot inspect socket directory {}: {e}",
            dir.display()
        ))
    })?;
    let me = nix::unistd::geteuid().as_raw();
    if !md.is_dir() {
        return Err(Error::Config(format!(
            "socket directory {} is not a directory",
            dir.display()
        )));
    }
    if md.uid() != me {
        return Err(Error::Config(format!(
            "socket directory {} belongs to uid {}, not to us (uid {me}); refusing to use it",
            dir.display(),
            md.uid()
        )));
    }
    let mode = md.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(Error::Config(format!(
            "socket directory {} has mode {mode:o}; it must not be accessible to group or \
             others (chmod 700 it)",
            dir.display()
        )));
    }
    Ok(())
}

fn parse_usize(var: &str, value: Option<String>) -> Result<usize> {
    let v = value.ok_or_else(|| Error::Config(format!("{var} is not set")))?;
    v.trim()
        .parse::<usize>()
        .map_err(|_| Error::Config(format!("{var}={v:?} is not a non-negative integer")))
}

fn check_world_rank(rank: usize, world: usize, rank_var: &str, world_var: &str) -> Result<()> {
    if !(1..=MAX_WORLD).contains(&world) {
        return Err(Error::Config(format!(
            "{world_var}={world} is out of range (1..={MAX_WORLD})"
        )));
    }
    if rank >= world {
        return Err(Error::Config(format!(
            "{rank_var}={rank} is not below {world_var}={world}"
        )));
    }
    Ok(())
}

/// Job ids end up in file names and in the hello frame: keep them short and path-safe.
fn check_job_id(job_id: &str, var: &str) -> Result<()> {
    let ok_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    if job_id.is_empty()
        || job_id.len() > 64
        || job_id.starts_with('.')
        || !job_id.chars().all(ok_char)
    {
        return Err(Error::Config(format!(
            "{var}={job_id:?} is not a valid job id (1 to 64 characters from A-Z a-z 0-9 . _ -, \
             not starting with '.')"
        )));
    }
    Ok(())
}

/// Across hosts no uid can be checked: without a secret anyone who can reach the port could
/// join the job.
fn require_secret(secret: &Option<String>, master: &Master, var: &str) -> Result<()> {
    if secret.is_none() {
        return Err(Error::Config(format!(
            "ranks meeting over TCP ({master}) need {var}: the same hexadecimal string on every \
             node (e.g. `export IPCREDUCE_SECRET=$(openssl rand -hex 16)`, passed to every node's \
             launcher); it is the job's only credential across hosts"
        )));
    }
    Ok(())
}

fn normalize_secret(s: &str, var: &str) -> Result<String> {
    if s.is_empty() || s.len() > 128 || !s.chars().all(|c| c.is_ascii_hexdigit()) {
        return Err(Error::Config(format!(
            "{var} must be 1 to 128 hexadecimal digits"
        )));
    }
    Ok(s.to_ascii_lowercase())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn lookup(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    fn config_msg(r: Result<RankInfo>) -> String {
        match r {
            Err(Error::Config(m)) => m,
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    #[test]
    fn ipcreduce_variables() {
        let info = RankInfo::from_lookup(lookup(&[
            ("IPCREDUCE_RANK", "2"),
            ("IPCREDUCE_WORLD_SIZE", "4"),
            ("IPCREDUCE_LOCAL_RANK", "1"),
            ("IPCREDUCE_SOCKET", "/x/y.sock"),
            ("IPCREDUCE_JOB_ID", "job-1"),
            ("IPCREDUCE_SECRET", "00AbFf"),
            // torchrun's are ignored when ipcreduce's are there
            ("RANK", "0"),
            ("WORLD_SIZE", "8"),
        ]))
        .unwrap();
        assert_eq!((info.rank, info.world, info.local_rank), (2, 4, 1));
        assert_eq!(info.socket, PathBuf::from("/x/y.sock"));
        assert_eq!(info.job_id, "job-1");
        assert_eq!(info.secret.as_deref(), Some("00abff"));
    }

    #[test]
    fn debug_output_hides_the_secret() {
        let info = RankInfo::new(0, 2, "/s", "j", Some("c0ffee".into())).unwrap();
        let s = format!("{info:?}");
        assert!(!s.contains("c0ffee") && s.contains("redacted"), "{s}");
    }

    #[test]
    fn local_rank_defaults_to_rank_and_secret_is_optional() {
        let info = RankInfo::from_lookup(lookup(&[
            ("IPCREDUCE_RANK", "3"),
            ("IPCREDUCE_WORLD_SIZE", "4"),
            ("IPCREDUCE_SOCKET", "/x/y.sock"),
            ("IPCREDUCE_JOB_ID", "j"),
        ]))
        .unwrap();
        assert_eq!(info.local_rank, 3);
        assert_eq!(info.secret, None);
    }

    #[test]
    fn torchrun_fallback_derives_socket() {
        let info = RankInfo::from_lookup(lookup(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "1"),
            ("TORCHELASTIC_RUN_ID", "abc123"),
            ("MASTER_PORT", "29500"),
        ]))
        .unwrap();
        assert_eq!((info.rank, info.world, info.local_rank), (1, 2, 1));
        assert_eq!(info.job_id, "abc123");
        assert_eq!(info.socket, default_socket_dir().join("abc123.sock"));
        assert_eq!(info.secret, None);
        ensure_private_dir(&default_socket_dir()).unwrap();
    }

    #[test]
    fn torchrun_placeholder_run_id_falls_back_to_master_port() {
        let info = RankInfo::from_lookup(lookup(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("TORCHELASTIC_RUN_ID", "none"),
            ("MASTER_PORT", "29500"),
        ]))
        .unwrap();
        assert_eq!(info.job_id, "29500");
        assert_eq!(info.local_rank, 0);
    }

    #[test]
    fn torchrun_without_job_id_is_refused() {
        let m = config_msg(RankInfo::from_lookup(lookup(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
        ])));
        assert!(m.contains("MASTER_PORT"), "{m}");
    }

    #[test]
    fn no_rank_at_all() {
        let m = config_msg(RankInfo::from_lookup(lookup(&[])));
        assert!(m.contains("IPCREDUCE_RANK") && m.contains("RANK"), "{m}");
    }

    #[test]
    fn bad_values_name_the_variable() {
        let base = [("IPCREDUCE_SOCKET", "/x/y.sock"), ("IPCREDUCE_JOB_ID", "j")];
        let with = |extra: &[(&'static str, &'static str)]| {
            let mut v: Vec<(&str, &str)> = base.to_vec();
            v.extend_from_slice(extra);
            config_msg(RankInfo::from_lookup(lookup(&v)))
        };
        let m = with(&[("IPCREDUCE_RANK", "x"), ("IPCREDUCE_WORLD_SIZE", "2")]);
        assert!(m.contains("IPCREDUCE_RANK"), "{m}");
        let m = with(&[("IPCREDUCE_RANK", "0")]);
        assert!(m.contains("IPCREDUCE_WORLD_SIZE is not set"), "{m}");
        let m = with(&[("IPCREDUCE_RANK", "2"), ("IPCREDUCE_WORLD_SIZE", "2")]);
        assert!(
            m.contains("IPCREDUCE_RANK=2") && m.contains("IPCREDUCE_WORLD_SIZE=2"),
            "{m}"
        );
        let m = with(&[("IPCREDUCE_RANK", "0"), ("IPCREDUCE_WORLD_SIZE", "0")]);
        assert!(
            m.contains("IPCREDUCE_WORLD_SIZE=0") && m.contains("out of range"),
            "{m}"
        );
        let m = with(&[("IPCREDUCE_RANK", "0"), ("IPCREDUCE_WORLD_SIZE", "65")]);
        assert!(m.contains("IPCREDUCE_WORLD_SIZE=65"), "{m}");
        let m = with(&[
            ("IPCREDUCE_RANK", "0"),
            ("IPCREDUCE_WORLD_SIZE", "2"),
            ("IPCREDUCE_LOCAL_RANK", "-1"),
        ]);
        assert!(m.contains("IPCREDUCE_LOCAL_RANK"), "{m}");
        let m = with(&[
            ("IPCREDUCE_RANK", "0"),
            ("IPCREDUCE_WORLD_SIZE", "2"),
            ("IPCREDUCE_SECRET", "xyz"),
        ]);
        assert!(m.contains("IPCREDUCE_SECRET"), "{m}");
        let m = config_msg(RankInfo::from_lookup(lookup(&[
            ("IPCREDUCE_RANK", "0"),
            ("IPCREDUCE_WORLD_SIZE", "2"),
            ("IPCREDUCE_SOCKET", "/x/y.sock"),
            ("IPCREDUCE_JOB_ID", "../etc"),
        ])));
        assert!(m.contains("IPCREDUCE_JOB_ID"), "{m}");
    }

    #[test]
    fn world_64_is_the_limit() {
        assert!(RankInfo::new(63, 64, "/s", "j", None).is_ok());
        // The limit is written out here, not read from MAX_WORLD: the documented 64 is what
        // a change of the constant must not move silently.
        let config = |r: Result<RankInfo>| match r {
            Err(Error::Config(m)) => m,
            other => panic!("expected Error::Config, got {other:?}"),
        };
        let m = config(RankInfo::new(0, 65, "/s", "j", None));
        assert!(m.contains("world=65") && m.contains("1..=64"), "{m}");
        let m = config(RankInfo::new(0, 0, "/s", "j", None));
        assert!(m.contains("world=0") && m.contains("1..=64"), "{m}");
        let m = config(RankInfo::new(3, 3, "/s", "j", None));
        assert!(m.contains("rank=3 is not below world=3"), "{m}");
    }

    fn scratch_dir(tag: &str) -> PathBuf {
        let d =
            std::env::temp_dir().join(format!("ipcreduce-envtest-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn private_dir_is_created_0700() {
        let d = scratch_dir("create");
        ensure_private_dir(&d).unwrap();
        let mode = std::fs::metadata(&d).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        // An existing private dir is fine.
        ensure_private_dir(&d).unwrap();
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn private_dir_with_group_access_is_refused() {
        let d = scratch_dir("perm");
        std::fs::create_dir(&d).unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o750)).unwrap();
        let e = ensure_private_dir(&d).unwrap_err().to_string();
        assert!(e.contains("750"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn private_dir_owned_by_someone_else_is_refused() {
        let d = scratch_dir("owner");
        std::fs::create_dir(&d).unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)).unwrap();
        // Only root can give a directory away; elsewhere a root-owned dir stands in.
        let target = if nix::unistd::geteuid().is_root() {
            std::os::unix::fs::chown(&d, Some(12345), None).unwrap();
            d.clone()
        } else {
            PathBuf::from("/")
        };
        let e = ensure_private_dir(&target).unwrap_err().to_string();
        assert!(e.contains("belongs to uid"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }
}
