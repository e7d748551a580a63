//! Making the ipcreduce communicator of an NCCL communicator: two all-gathers through NCCL
//! (see the parent module), with the ipcreduce rendezvous between them.

use super::Accel;
use crate::errors::Slot;
use crate::log;
use crate::types::*;
use cudarc::driver::sys;
use ipcreduce::bootstrap::{default_socket_dir, ensure_private_dir, machine_host_id, RankInfo};
use ipcreduce::{BackendChoice, Communicator, Config};
use std::ffi::{c_int, c_void};
use std::sync::Mutex;

const MAGIC: &[u8; 8] = b"ipcrncl1";
/// One rank's record: magic, can-run flag, uid, host id hash, rank 0's nonce, pid.
const RECORD: usize = 72;

/// What every rank says before the ipcreduce rendezvous.
struct Record {
    able: bool,
    host: [u8; 16],
    uid: u32,
    pid: u32,
    /// Rank 0's: the rendezvous name (first half) and secret (second half).
    nonce: [u8; 32],
}

impl Record {
    fn encode(&self) -> [u8; RECORD] {
        let mut b = [0u8; RECORD];
        b[..8].copy_from_slice(MAGIC);
        b[8] = u8::from(self.able);
        b[12..16].copy_from_slice(&self.uid.to_le_bytes());
        b[16..32].copy_from_slice(&self.host);
        b[32..64].copy_from_slice(&self.nonce);
        b[64..68].copy_from_slice(&self.pid.to_le_bytes());
        b
    }

    fn decode(b: &[u8]) -> Option<Record> {
        if b.len() != RECORD || &b[..8] != MAGIC {
            return None;
        }
        Some(Record {
            able: b[8] == 1,
            uid: u32::from_le_bytes(b[12..16].try_into().ok()?),
            host: b[16..32].try_into().ok()?,
            nonce: b[32..64].try_into().ok()?,
            pid: u32::from_le_bytes(b[64..68].try_into().ok()?),
        })
    }
}

/// 128 bits of FNV-1a over the host id (two offsets): equal ids, equal hashes.
fn host_hash(id: &str) -> [u8; 16] {
    let fnv = |seed: u64| {
        id.bytes().fold(seed, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        })
    };
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&fnv(0xcbf2_9ce4_8422_2325).to_le_bytes());
    out[8..].copy_from_slice(&fnv(0x6c62_272e_07bb_0142).to_le_bytes());
    out
}

fn random_nonce() -> Result<[u8; 32], String> {
    let mut n = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut n))
        .map_err(|e| format!("reading /dev/urandom: {e}"))?;
    Ok(n)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Whether this process can run ipcreduce's cuda backend here, and why not.
fn able() -> Result<(), String> {
    // SAFETY: a presence probe; cudarc panics on use without the driver.
    if !unsafe { sys::is_culib_present() } {
        return Err("no CUDA driver".into());
    }
    ipcreduce::backend::cuda::usable().map_err(|e| e.to_string())
}

/// The rank and size of `comm`, from the real NCCL.
fn rank_world(comm: Comm) -> Result<(usize, usize), (NcclResult, String)> {
    let count = real_fn!(
        ncclCommCount(Comm, *mut c_int) -> NcclResult,
        Err((SYSTEM_ERROR, "no real NCCL".into()))
    );
    let user_rank = real_fn!(
        ncclCommUserRank(Comm, *mut c_int) -> NcclResult,
        Err((SYSTEM_ERROR, "no real NCCL".into()))
    );
    let (mut n, mut r) = (0, 0);
    // SAFETY: a communicator NCCL just made; our own out slots.
    let res = unsafe { count(comm, &mut n) };
    let res2 = unsafe { user_rank(comm, &mut r) };
    if res != SUCCESS || res2 != SUCCESS || n < 1 || r < 0 || r >= n {
        return Err((
            if res != SUCCESS { res } else { res2 },
            format!("ipcreduce-nccl: ncclCommCount/ncclCommUserRank failed on a new communicator ({res}, {res2})"),
        ));
    }
    Ok((r as usize, n as usize))
}

/// Makes the ipcreduce communicator for `comm`, or decides (alike on every rank) not to.
/// An error is one NCCL's own all-gather returned: the communicator is unusable then.
pub fn accelerate(comm: Comm) -> Result<Option<Accel>, (NcclResult, String)> {
    let (rank, world) = rank_world(comm)?;
    log::set_process_rank(rank as i64);
    if world < 2 {
        return Ok(None);
    }
    let local = able();
    let mine = Record {
        able: local.is_ok(),
        host: host_hash(&machine_host_id()),
        uid: nix_uid(),
        pid: std::process::id(),
        nonce: if rank == 0 {
            random_nonce().map_err(|e| (SYSTEM_ERROR, format!("ipcreduce-nccl: rank 0: {e}")))?
        } else {
            [0; 32]
        },
    };
    let all = all_gather(comm, rank, &mine.encode())?;
    let why_not = why_not(&all, rank, &local);
    if let Some(why) = why_not {
        log::note_rank(
            rank,
            format_args!("rank {rank} of {world}: not accelerated ({why}): every call forwarded"),
        );
        return Ok(None);
    }
    let nonce = Record::decode(&all[0]).expect("checked by why_not").nonce;
    let made = make(rank, world, &nonce);
    if let Err(e) = &made {
        // Unexpected where every rank could run it (a bad IPCREDUCE_* variable, a broken
        // peer check): said even without IPCREDUCE_NCCL=log, as NCCL's calls go on.
        log::write_stderr(&log::line(
            Some(rank),
            format_args!("the ipcreduce communicator failed, NCCL runs every call: {e}"),
        ));
    }
    // Second round: everyone keeps theirs only if every rank has one.
    let mut flag = [0u8; RECORD];
    flag[..8].copy_from_slice(MAGIC);
    flag[8] = u8::from(made.is_ok());
    let all = all_gather(comm, rank, &flag)?;
    if let Some(r) = all.iter().position(|b| b[8] != 1) {
        log::note_rank(
            rank,
            format_args!(
                "rank {rank} of {world}: not accelerated (rank {r}'s ipcreduce communicator \
                 failed): every call forwarded"
            ),
        );
        return Ok(None);
    }
    let comm = made.expect("every rank, this one included, made it");
    Ok(Some(Accel {
        rank,
        world,
        abort: comm.abort_handle(),
        comm: Mutex::new(comm),
        error: Slot::default(),
        scaler: std::sync::OnceLock::new(),
        windows: Mutex::new(Vec::new()),
    }))
}

/// Why the ranks whose records are `all` (by rank) stay NCCL's, if they do; the same answer on
/// every rank (only the wording of this rank's own failure, `local`, differs).
fn why_not(all: &[Vec<u8>], rank: usize, local: &Result<(), String>) -> Option<String> {
    let world = all.len();
    let records: Vec<Option<Record>> = all.iter().map(|b| Record::decode(b)).collect();
    if let Some(r) = records.iter().position(Option::is_none) {
        return Some(format!("rank {r} runs no ipcreduce-nccl of this version"));
    }
    let recs: Vec<&Record> = records.iter().flatten().collect();
    if let Some(r) = recs.iter().position(|x| !x.able) {
        return Some(match (local, r == rank) {
            (Err(e), true) => format!("this rank cannot run ipcreduce: {e}"),
            _ => format!("rank {r} cannot run ipcreduce"),
        });
    }
    if let Some(r) = recs.iter().position(|x| x.host != recs[0].host) {
        return Some(format!("ranks 0 and {r} are on different machines"));
    }
    if let Some(r) = recs.iter().position(|x| x.uid != recs[0].uid) {
        return Some(format!("ranks 0 and {r} run as different users"));
    }
    if let Some(r) = (1..world).find(|&r| recs[..r].iter().any(|x| x.pid == recs[r].pid)) {
        return Some(format!(
            "rank {r} shares its process with another rank (several GPUs per process)"
        ));
    }
    if world > ipcreduce::bootstrap::MAX_WORLD {
        return Some(format!(
            "{world} ranks, more than ipcreduce's {}",
            ipcreduce::bootstrap::MAX_WORLD
        ));
    }
    None
}

fn nix_uid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

/// The ipcreduce communicator, met at the socket rank 0's nonce names.
fn make(rank: usize, world: usize, nonce: &[u8; 32]) -> ipcreduce::Result<Communicator> {
    let dir = default_socket_dir();
    ensure_private_dir(&dir)?;
    let name = hex(&nonce[..8]);
    let info = RankInfo::new(
        rank,
        world,
        dir.join(format!("nccl-{name}.sock")),
        format!("nccl-{name}"),
        Some(hex(&nonce[16..])),
    )?;
    let config = Config {
        backend: BackendChoice::Cuda,
        ..Config::default()
    };
    Communicator::with_rank_info(info, &config)
}

/// Checks a driver call of the all-gather.
fn ck(res: sys::CUresult, rank: usize, what: &str) -> Result<(), (NcclResult, String)> {
    if res == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    Err((
        UNHANDLED_CUDA_ERROR,
        format!(
            "ipcreduce-nccl: rank {rank}: {what} failed ({res:?}) in the rendezvous all-gather"
        ),
    ))
}

/// Every rank's `mine` (all the same length), through NCCL's all-gather on `comm`, on a
/// stream of our own, waited for.
fn all_gather(
    comm: Comm,
    rank: usize,
    mine: &[u8; RECORD],
) -> Result<Vec<Vec<u8>>, (NcclResult, String)> {
    let world = rank_world(comm)?.1;
    let gather = real_fn!(
        ncclAllGather as crate::types::Gather,
        Err((SYSTEM_ERROR, "no real NCCL".into()))
    );
    let mut out = vec![0u8; RECORD * world];
    // SAFETY: our own allocations and stream, freed below on every path; the calling thread
    // has NCCL's device current (NCCL just made the communicator on it).
    unsafe {
        let (mut dev, mut stream): (sys::CUdeviceptr, sys::CUstream) = (0, std::ptr::null_mut());
        ck(
            sys::cuMemAlloc_v2(&mut dev, RECORD * (world + 1)),
            rank,
            "cuMemAlloc",
        )?;
        let send = dev + (RECORD * world) as u64;
        let result = (|| {
            ck(sys::cuStreamCreate(&mut stream, 1), rank, "cuStreamCreate")?;
            ck(
                sys::cuMemcpyHtoD_v2(send, mine.as_ptr().cast(), RECORD),
                rank,
                "cuMemcpyHtoD",
            )?;
            // ncclUint8 = 1.
            let r = gather(
                send as *const c_void,
                dev as *mut c_void,
                RECORD,
                1,
                comm,
                stream.cast(),
            );
            if r != SUCCESS {
                return Err((r, format!("ipcreduce-nccl: rank {rank}: NCCL's all-gather of the rendezvous records failed ({r})")));
            }
            ck(
                sys::cuStreamSynchronize(stream),
                rank,
                "cuStreamSynchronize",
            )?;
            ck(
                sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), dev, RECORD * world),
                rank,
                "cuMemcpyDtoH",
            )
        })();
        if !stream.is_null() {
            sys::cuStreamDestroy_v2(stream);
        }
        sys::cuMemFree_v2(dev);
        result?;
    }
    Ok(out.chunks(RECORD).map(<[u8]>::to_vec).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_foreign_bytes_are_refused() {
        let r = Record {
            able: true,
            host: host_hash("h1"),
            uid: 1000,
            pid: 4242,
            nonce: [7; 32],
        };
        let b = r.encode();
        let d = Record::decode(&b).unwrap();
        assert!(d.able && d.uid == 1000 && d.nonce == [7; 32] && d.host == host_hash("h1"));
        assert_eq!(d.pid, 4242);
        let mut bad = b;
        bad[0] ^= 1;
        assert!(Record::decode(&bad).is_none());
        assert!(Record::decode(&b[..RECORD - 1]).is_none());
    }

    fn rec(host: &str, uid: u32, pid: u32, able: bool) -> Vec<u8> {
        let r = Record {
            able,
            host: host_hash(host),
            uid,
            pid,
            nonce: [1; 32],
        };
        r.encode().to_vec()
    }

    #[test]
    fn ranks_stay_with_nccl_unless_all_can_on_one_machine() {
        let ok = Ok(());
        let two = [rec("h", 1000, 10, true), rec("h", 1000, 11, true)];
        assert_eq!(why_not(&two, 0, &ok), None);
        let w = why_not(
            &[rec("h", 1000, 10, true), rec("g", 1000, 11, true)],
            1,
            &ok,
        )
        .unwrap();
        assert!(w.contains("different machines"), "{w}");
        let w = why_not(
            &[rec("h", 1000, 10, true), rec("h", 1001, 11, true)],
            0,
            &ok,
        )
        .unwrap();
        assert!(w.contains("different users"), "{w}");
        let w = why_not(
            &[rec("h", 1000, 10, true), rec("h", 1000, 10, true)],
            0,
            &ok,
        )
        .unwrap();
        assert!(w.contains("rank 1 shares its process"), "{w}");
        let no: Result<(), String> = Err("no NVRTC".into());
        let unable = [rec("h", 1000, 10, true), rec("h", 1000, 11, false)];
        let w = why_not(&unable, 1, &no).unwrap();
        assert!(
            w.contains("this rank cannot") && w.contains("no NVRTC"),
            "{w}"
        );
        let w = why_not(&unable, 0, &ok).unwrap();
        assert!(w.contains("rank 1 cannot run ipcreduce"), "{w}");
        let mut foreign = two.to_vec();
        foreign[1][0] ^= 0xff;
        let w = why_not(&foreign, 0, &ok).unwrap();
        assert!(w.contains("rank 1 runs no ipcreduce-nccl"), "{w}");
        let many: Vec<Vec<u8>> = (0..65).map(|p| rec("h", 1000, p, true)).collect();
        let w = why_not(&many, 0, &ok).unwrap();
        assert!(w.contains("65 ranks"), "{w}");
    }

    #[test]
    fn host_hash_tells_hosts_apart() {
        assert_eq!(host_hash("node-a"), host_hash("node-a"));
        assert_ne!(host_hash("node-a"), host_hash("node-b"));
        assert_ne!(host_hash(""), host_hash("a"));
    }
}
