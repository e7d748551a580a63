//! The on-disk cache of compiled kernels (`IPCREDUCE_CACHE_DIR`, default
//! `~/.cache/ipcreduce/kernels`, see [`default_dir`]): one file per key, shared by the ranks of a node and by jobs.
//!
//! - A file is written to a temporary name and renamed into place, so a reader sees the whole
//!   file or none (rename is atomic within a directory). A writer killed before its rename
//!   leaves its temporary file; the next writer of that key removes it.
//! - A file carries its key, its length and a hash of its bytes; one that does not match (torn
//!   by a crash, truncated, another key's, edited) is compiled again and replaced, never used.
//! - One process compiles a key at a time: it holds an exclusive `flock` on the key's lock file
//!   while it compiles and writes; the others poll for the finished file and take it. A lock
//!   holder that dies releases the lock with its file descriptor; one that hangs is waited for at
//!   most `IPCREDUCE_CACHE_WAIT_MS` (default 120 s), after which the waiter compiles itself.
//! - A directory that cannot be created or written (read-only, full, not a directory) is not
//!   an error: the compiled bytes are used from memory, with one warning per process. Files that
//!   are already there are still read (a read-only cache filled when an image was built).

use crate::error::{Error, Result};
use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// First bytes of every cache file (and the format's version).
const MAGIC: &[u8; 8] = b"IPCRKC01";
/// Default bound on the wait for another process's compilation of the same key.
const DEFAULT_WAIT_MS: u64 = 120_000;
/// How often a waiter looks for the file the lock holder writes.
const POLL: Duration = Duration::from_millis(10);

/// 64-bit FNV-1a: stable across builds and platforms (std's hasher is not promised to be).
pub fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    h
}

/// The key of a compiled kernel: the hash of its source, the architecture, NVRTC's and the
/// driver's versions, and every compile option, as text (stored in the file and compared in
/// full on read, so two keys whose file names collide are still told apart).
pub fn key_text(source: &str, arch: &str, nvrtc: &str, driver: i32, options: &[String]) -> String {
    format!(
        "source {:016x} ({} bytes)\narch {arch}\nnvrtc {nvrtc}\ndriver {driver}\noptions {}\n",
        fnv1a(source.as_bytes()),
        source.len(),
        options.join(" ")
    )
}

/// Where a request was served from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// This process had it already (see `kernel_variants::cubin`).
    Memory,
    /// A valid file in the cache directory.
    Disk,
    /// A valid file another process wrote while this one waited for its lock.
    Waited,
    /// Compiled here and stored. `replaced`: a corrupt file was there.
    Compiled { replaced: bool },
    /// Compiled here and kept in memory only: the directory cannot be used (why).
    Uncached { why: String },
}

impl Outcome {
    /// Whether this process ran the compiler.
    pub fn compiled(&self) -> bool {
        matches!(self, Outcome::Compiled { .. } | Outcome::Uncached { .. })
    }
}

/// A cache directory and the bound on waiting for another process's compilation.
#[derive(Debug, Clone)]
pub struct Cache {
    pub dir: PathBuf,
    pub wait: Duration,
}

/// Whether the one warning about an unusable directory was given in this process.
static WARNED: AtomicBool = AtomicBool::new(false);

impl Cache {
    /// [`default_dir`] (`/tmp/ipcreduce-<uid>/kernels` where there is no home), with
    /// `IPCREDUCE_CACHE_WAIT_MS`.
    pub fn from_env() -> Cache {
        let wait = std::env::var("IPCREDUCE_CACHE_WAIT_MS")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(DEFAULT_WAIT_MS);
        Cache {
            dir: default_dir(),
            wait: Duration::from_millis(wait),
        }
    }

    pub fn at(dir: impl Into<PathBuf>) -> Cache {
        Cache {
            dir: dir.into(),
            wait: Duration::from_millis(DEFAULT_WAIT_MS),
        }
    }

    /// The file of `key` in this directory.
    pub fn path_of(&self, key: &str) -> PathBuf {
        self.dir.join(format!("{:016x}.bin", fnv1a(key.as_bytes())))
    }

    /// The bytes stored under `key`, or `compile`'s (stored for the next process). Only
    /// `compile`'s own error is an error; anything wrong with the directory falls back to memory.
    pub fn get(
        &self,
        key: &str,
        compile: impl FnOnce() -> Result<Vec<u8>>,
    ) -> Result<(Arc<[u8]>, Outcome)> {
        let path = self.path_of(key);
        let mut corrupt = false;
        let mut waited = false;
        match read_valid(&path, key) {
            FileState::Valid(b) => return Ok((b, Outcome::Disk)),
            FileState::Corrupt(why) => {
                tracing::warn!(
                    "kernel cache file {} is corrupt ({why}): compiling again",
                    path.display()
                );
                corrupt = true;
            }
            FileState::Missing => {}
        }
        let lock = match self.lock(&path, key) {
            Ok(Locked::Found(b)) => return Ok((b, Outcome::Waited)),
            Ok(Locked::Held(l, w)) => {
                waited = w;
                Some(l)
            }
            Ok(Locked::TimedOut) => {
                tracing::warn!(
                    "kernel cache: waited {:?} for another process compiling {}: compiling here",
                    self.wait,
                    path.display()
                );
                None
            }
            Err(e) => return self.uncached(e, compile),
        };
        // The previous holder may have written it between our read and our lock.
        if lock.is_some() {
            match read_valid(&path, key) {
                FileState::Valid(b) if waited => return Ok((b, Outcome::Waited)),
                FileState::Valid(b) => return Ok((b, Outcome::Disk)),
                FileState::Corrupt(_) => corrupt = true,
                FileState::Missing => {}
            }
        }
        if lock.is_some() {
            remove_leftovers(&path);
        }
        let bytes = compile()?;
        let stored = self.store(&path, key, &bytes);
        drop(lock);
        match stored {
            Ok(()) => Ok((bytes.into(), Outcome::Compiled { replaced: corrupt })),
            Err(e) => Ok((bytes.into(), self.fallback(e))),
        }
    }

    fn uncached(
        &self,
        e: std::io::Error,
        compile: impl FnOnce() -> Result<Vec<u8>>,
    ) -> Result<(Arc<[u8]>, Outcome)> {
        let bytes = compile()?;
        Ok((bytes.into(), self.fallback(e)))
    }

    /// The outcome of a directory that cannot be used, warning once per process.
    fn fallback(&self, e: std::io::Error) -> Outcome {
        let why = format!(
            "kernel cache directory {} cannot be used ({e}): compiled kernels are kept in memory \
             for this process only (IPCREDUCE_CACHE_DIR names another directory)",
            self.dir.display()
        );
        if !WARNED.swap(true, Ordering::Relaxed) {
            tracing::warn!("{why}");
            eprintln!("warning: {why}");
        }
        Outcome::Uncached { why }
    }

    /// Takes the key's lock, or finds the file another holder wrote while we waited.
    fn lock(&self, path: &Path, key: &str) -> std::io::Result<Locked> {
        use nix::fcntl::{Flock, FlockArg};
        fs::create_dir_all(&self.dir)?;
        let lock_path = path.with_extension("lock");
        let mut file = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)?;
        let start = Instant::now();
        let mut tried = false;
        loop {
            match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
                Ok(held) => return Ok(Locked::Held(held, tried)),
                Err((f, nix::errno::Errno::EWOULDBLOCK)) | Err((f, nix::errno::Errno::EINTR)) => {
                    file = f;
                    tried = true;
                }
                Err((_, e)) => return Err(e.into()),
            }
            if let FileState::Valid(b) = read_valid(path, key) {
                return Ok(Locked::Found(b));
            }
            if start.elapsed() >= self.wait {
                return Ok(Locked::TimedOut);
            }
            std::thread::sleep(POLL);
        }
    }

    /// Writes `bytes` under `key`: a temporary file in the same directory, renamed into place.
    fn store(&self, path: &Path, key: &str, bytes: &[u8]) -> std::io::Result<()> {
        fs::create_dir_all(&self.dir)?;
        static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let tmp = path.with_extension(format!(
            "tmp.{}.{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let write = || -> std::io::Result<()> {
            let mut f = fs::File::create(&tmp)?;
            f.write_all(&encode(key, bytes))?;
            // On disk before the name is: a crash leaves the old file or the whole new one.
            f.sync_all()?;
            fs::rename(&tmp, path)
        };
        let r = write();
        if r.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        r
    }
}

/// A writer's temporary files are as old as its write (milliseconds): one older than this was
/// left by a writer that was killed before its rename.
const LEFTOVER_AGE: Duration = Duration::from_secs(10);

/// Removes temporary files of `path`'s key that writers killed mid-write left behind. Called
/// while holding the key's lock (no other locked writer is writing it); the age keeps it off a
/// file a writer that gave up waiting for the lock may be writing right now.
fn remove_leftovers(path: &Path) {
    let (Some(dir), Some(stem)) = (path.parent(), path.file_stem().and_then(|s| s.to_str())) else {
        return;
    };
    let prefix = format!("{stem}.tmp.");
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        if !name.to_str().is_some_and(|n| n.starts_with(&prefix)) {
            continue;
        }
        let old = entry
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age >= LEFTOVER_AGE);
        if old {
            let _ = fs::remove_file(entry.path());
        }
    }
}

enum Locked {
    /// The lock, and whether another process held it first.
    Held(nix::fcntl::Flock<fs::File>, bool),
    Found(Arc<[u8]>),
    TimedOut,
}

enum FileState {
    Valid(Arc<[u8]>),
    Corrupt(String),
    Missing,
}

/// `IPCREDUCE_CACHE_DIR`, else `$XDG_CACHE_HOME/ipcreduce/kernels`, else
/// `$HOME/.cache/ipcreduce/kernels` (as the tuning table's directory).
pub fn default_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("IPCREDUCE_CACHE_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    if let Some(x) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(x).join("ipcreduce/kernels");
    }
    match std::env::var_os("HOME").filter(|h| !h.is_empty()) {
        Some(h) => PathBuf::from(h).join(".cache/ipcreduce/kernels"),
        None => std::env::temp_dir().join(format!(
            "ipcreduce-{}/kernels",
            nix::unistd::geteuid().as_raw()
        )),
    }
}

/// The file's bytes: magic, key length and key, payload length, payload hash, payload.
pub fn encode(key: &str, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(32 + key.len() + payload.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(key.len() as u64).to_le_bytes());
    out.extend_from_slice(key.as_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&fnv1a(payload).to_le_bytes());
    out.extend_from_slice(payload);
    out
}

/// The payload of a file's bytes for `key`, or why they are not one.
pub fn decode(key: &str, b: &[u8]) -> std::result::Result<Vec<u8>, String> {
    let word = |at: usize| -> std::result::Result<u64, String> {
        b.get(at..at + 8)
            .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")))
            .ok_or_else(|| format!("{} bytes: cut short", b.len()))
    };
    if b.get(..8) != Some(MAGIC.as_slice()) {
        return Err("not an ipcreduce kernel cache file".into());
    }
    let klen = word(8)? as usize;
    let kend = 16usize.checked_add(klen).ok_or("bad key length")?;
    let stored_key = b.get(16..kend).ok_or("cut short in the key")?;
    if stored_key != key.as_bytes() {
        return Err("another key's file (file name collision)".into());
    }
    let len = word(kend)? as usize;
    let hash = word(kend + 8)?;
    let payload = &b[(kend + 16).min(b.len())..];
    if payload.len() != len {
        return Err(format!(
            "{} payload bytes, header says {len}",
            payload.len()
        ));
    }
    if fnv1a(payload) != hash {
        return Err("payload hash differs from the header's".into());
    }
    Ok(payload.to_vec())
}

fn read_valid(path: &Path, key: &str) -> FileState {
    let mut b = Vec::new();
    match fs::File::open(path).and_then(|mut f| f.read_to_end(&mut b)) {
        Ok(_) => match decode(key, &b) {
            Ok(p) => FileState::Valid(p.into()),
            Err(why) => FileState::Corrupt(why),
        },
        Err(_) => FileState::Missing,
    }
}

/// For errors of callers that need the directory itself (`ipcreduce warmup`).
pub fn dir_error(dir: &Path, e: std::io::Error) -> Error {
    Error::Config(format!("kernel cache directory {}: {e}", dir.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_round_trips_and_any_damage_is_found() {
        let key = key_text("src", "sm_90", "13.0", 13000, &["-DX=1".into()]);
        let payload: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
        let file = encode(&key, &payload);
        assert_eq!(decode(&key, &file).unwrap(), payload);
        // Cut anywhere: refused.
        for cut in [0, 7, 8, 20, file.len() - payload.len(), file.len() - 1] {
            assert!(decode(&key, &file[..cut]).is_err(), "cut at {cut} accepted");
        }
        // One byte flipped in the payload: the hash differs.
        let mut bad = file.clone();
        *bad.last_mut().unwrap() ^= 1;
        assert!(decode(&key, &bad).unwrap_err().contains("hash"));
        // Bytes appended: the length differs.
        let mut long = file.clone();
        long.push(0);
        assert!(decode(&key, &long).unwrap_err().contains("payload bytes"));
        // Another key's file.
        let other = key_text("src", "sm_80", "13.0", 13000, &["-DX=1".into()]);
        assert!(decode(&other, &file).unwrap_err().contains("another key"));
    }

    #[test]
    fn the_key_changes_with_source_options_and_versions() {
        let o = |s: &str| vec!["--fmad=false".to_string(), s.to_string()];
        let base = key_text("kernel a", "sm_90", "13.0", 13000, &o("-DIPCR_W=2"));
        for (what, k) in [
            (
                "source",
                key_text("kernel b", "sm_90", "13.0", 13000, &o("-DIPCR_W=2")),
            ),
            (
                "options",
                key_text("kernel a", "sm_90", "13.0", 13000, &o("-DIPCR_W=4")),
            ),
            (
                "arch",
                key_text("kernel a", "sm_100", "13.0", 13000, &o("-DIPCR_W=2")),
            ),
            (
                "nvrtc",
                key_text("kernel a", "sm_90", "13.1", 13000, &o("-DIPCR_W=2")),
            ),
            (
                "driver",
                key_text("kernel a", "sm_90", "13.0", 13010, &o("-DIPCR_W=2")),
            ),
        ] {
            assert_ne!(base, k, "the key ignores the {what}");
        }
        assert_eq!(
            base,
            key_text("kernel a", "sm_90", "13.0", 13000, &o("-DIPCR_W=2"))
        );
        assert_eq!(fnv1a(b""), 0xcbf29ce484222325);
        assert_eq!(fnv1a(b"a"), 0xaf63dc4c8601ec8c);
    }
}
