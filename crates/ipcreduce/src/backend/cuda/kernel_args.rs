//! The kernels' one by-value parameter ([`KernelArgs`], `struct Args` in kernels/prims.cuh)
//! and how one call's is made: from the fields every call of a communicator passes alike,
//! built once when the launcher is made ([`KernelArgs::shared`]), with the call's buffers,
//! identity and number written over them ([`KernelArgs::for_call`]). An eager call costs a
//! copy of the struct then, not the loop over the ranks' workspaces it took before.

use super::identity::{self, IDENT_WORDS};
use super::kernels::{MAX_RANKS, SIG_BYTES};
use std::time::Duration;

/// Kernel arguments; must match `struct Args` in kernels/prims.cuh field by field.
#[repr(C)]
#[derive(Clone, Copy, Default, PartialEq, Eq, Debug)]
pub(super) struct KernelArgs {
    pub send: u64,
    pub recv: u64,
    pub count: u64,
    pub data: [u64; MAX_RANKS],
    pub ll: [u64; MAX_RANKS],
    pub sig: [u64; MAX_RANKS],
    pub rsend: [u64; MAX_RANKS],
    pub rrecv: [u64; MAX_RANKS],
    pub counters: u64,
    pub abort_flag: u64,
    pub err: u64,
    pub host_err: u64,
    pub slot_bytes: u64,
    pub timeout_ns: u64,
    pub digest: u64,
    pub seq: u64,
    pub ident: [u32; IDENT_WORDS],
    pub rank: i32,
    pub world: i32,
    pub aligned: i32,
    pub lane: i32,
    pub check: i32,
    pub mode: i32,
    /// Traced copy-engine kernels: their phase-stamp row (`ce::Rows`); the others stamp their
    /// block's.
    pub trace_row: i32,
    pub chunk_bytes: u64,
    /// The phase-stamp ring (0: not tracing); set per call (`Launcher::phases_for_call`).
    pub phases: u64,
}

/// Where the data slots of a `world`-rank workspace start: after the signal and LL areas.
pub(super) fn data_offset(world: usize) -> u64 {
    (SIG_BYTES + super::kernels::ll_bytes(world)) as u64
}

/// What [`KernelArgs::shared`] is made of: fixed for the communicator's life.
pub(super) struct Shared {
    pub rank: usize,
    pub world: usize,
    /// Every rank's workspace as mapped here.
    pub bases: [u64; MAX_RANKS],
    /// The private device state: counters, then the error word at `err`.
    pub counters: u64,
    pub err: u64,
    /// The host-mapped abort flag and error record, as the device sees them.
    pub abort_flag: u64,
    pub host_err: u64,
    pub slot_bytes: usize,
    pub timeout: Duration,
    /// MODE_* bits of every call (the fabric's, MODE_LET_NEXT_LAUNCH).
    pub mode: i32,
}

impl KernelArgs {
    /// The fields every call passes alike; the call's own are zero (no buffers, no identity,
    /// call 0), and `chunk_bytes` is the slot.
    pub fn shared(s: &Shared) -> KernelArgs {
        let mut a = KernelArgs::default();
        for r in 0..s.world {
            a.sig[r] = s.bases[r];
            a.ll[r] = s.bases[r] + SIG_BYTES as u64;
            a.data[r] = s.bases[r] + data_offset(s.world);
        }
        KernelArgs {
            counters: s.counters,
            abort_flag: s.abort_flag,
            err: s.err,
            host_err: s.host_err,
            slot_bytes: s.slot_bytes as u64,
            timeout_ns: s.timeout.as_nanos().min(u64::MAX as u128) as u64,
            rank: s.rank as i32,
            world: s.world as i32,
            mode: s.mode,
            chunk_bytes: s.slot_bytes as u64,
            ..a
        }
    }

    /// `self` (a [`KernelArgs::shared`]) for call number `seq` on `send`, `recv` and `count`
    /// elements, stamped with the identity `words` (their digest computed here).
    /// `zero_copy`: every rank's send and recv as mapped here (registered buffers).
    pub fn for_call(
        &self,
        (send, recv, count): (u64, u64, usize),
        words: &[u32; IDENT_WORDS],
        seq: u64,
        zero_copy: Option<([u64; MAX_RANKS], [u64; MAX_RANKS])>,
    ) -> KernelArgs {
        let world = self.world as usize;
        let (rsend, rrecv) = zero_copy.unwrap_or(([0; MAX_RANKS], [0; MAX_RANKS]));
        let all16 = |v: &[u64; MAX_RANKS]| v[..world].iter().all(|p| p % 16 == 0);
        KernelArgs {
            send,
            recv,
            count: count as u64,
            rsend,
            rrecv,
            digest: identity::digest(words),
            seq,
            ident: *words,
            aligned: all16(&rsend) as i32 | (all16(&rrecv) as i32) << 1,
            ..*self
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shared() -> KernelArgs {
        let mut bases = [0; MAX_RANKS];
        bases[..3].copy_from_slice(&[0x10_0000, 0x20_0000, 0x30_0000]);
        KernelArgs::shared(&Shared {
            rank: 1,
            world: 3,
            bases,
            counters: 0x900,
            err: 0x980,
            abort_flag: 0x7000,
            host_err: 0x7004,
            slot_bytes: 1 << 22,
            timeout: Duration::from_secs(5),
            mode: 6,
        })
    }

    #[test]
    fn shared_fields_cover_the_world_and_calls_add_only_their_own() {
        let s = shared();
        for r in 0..3 {
            let base = 0x10_0000 * (r as u64 + 1);
            assert_eq!(s.sig[r], base);
            assert_eq!(s.ll[r], base + SIG_BYTES as u64);
            assert_eq!(s.data[r], base + data_offset(3));
        }
        assert!(s.sig[3..]
            .iter()
            .chain(&s.ll[3..])
            .chain(&s.data[3..])
            .all(|p| *p == 0));
        assert_eq!((s.rank, s.world, s.mode), (1, 3, 6));
        assert_eq!((s.slot_bytes, s.chunk_bytes), (1 << 22, 1 << 22));
        assert_eq!(s.timeout_ns, 5_000_000_000);
        assert_eq!(
            (s.counters, s.err, s.abort_flag, s.host_err),
            (0x900, 0x980, 0x7000, 0x7004)
        );

        let words = [7u32; IDENT_WORDS];
        let mut rsend = [0u64; MAX_RANKS];
        rsend[..3].copy_from_slice(&[0x1000, 0x2000, 0x3008]);
        let rrecv = [0x4000u64; MAX_RANKS];
        let a = s.for_call((0xa0, 0xb0, 12), &words, 42, Some((rsend, rrecv)));
        assert_eq!((a.send, a.recv, a.count, a.seq), (0xa0, 0xb0, 12, 42));
        assert_eq!((a.ident, a.digest), (words, identity::digest(&words)));
        assert_eq!((a.rsend, a.rrecv), (rsend, rrecv));
        // Send has a peer's address off 16 bytes, recv none.
        assert_eq!(a.aligned, 0b10);
        // Everything else is the shared fields'.
        let back = KernelArgs {
            send: 0,
            recv: 0,
            count: 0,
            rsend: [0; MAX_RANKS],
            rrecv: [0; MAX_RANKS],
            digest: 0,
            seq: 0,
            ident: [0; IDENT_WORDS],
            aligned: 0,
            ..a
        };
        assert_eq!(back, s);
        let plain = s.for_call((0xa0, 0xb0, 12), &words, 43, None);
        assert_eq!((plain.rsend, plain.aligned), ([0; MAX_RANKS], 0b11));
    }
}
