//! What the caller's buffers are (which GPU, what kind of memory), asked of the driver once
//! per allocation and kept by address range, so that a call on buffers seen before makes no
//! driver query.
//!
//! Why ask at all: a kernel handed another GPU's memory or host memory faults, and a fault
//! ends the CUDA context of the whole process; one query per allocation buys a clear error
//! instead. The query ([`query`]) asks everything in one `cuPointerGetAttributes` call,
//! including the allocation's address range, which is what the facts are kept under.
//!
//! A buffer must also end inside memory the kernels may use ([`check_range`]): a count larger
//! than the caller's allocation would have the kernels read and write past it, into whatever
//! lies there (another allocation of the caller's: silent corruption). A classic allocation
//! (`cuMemAlloc`, legacy-IPC capable) must hold the whole buffer. Memory mapped piece by piece
//! (`cuMemMap`: PyTorch's expandable segments, pools) reports each piece as its own range, and
//! a tensor may span several: there every piece the buffer covers must be this GPU's device
//! memory, up to [`MAX_PIECES`] of them.
//!
//! When facts go stale: when their allocation is freed. Registered buffers are ours to free,
//! and their ranges are forgotten then ([`PointerCache::forget`]). CUDA does not tell us when
//! the caller frees its own memory, so a refusal that rests on kept facts is never final: the
//! driver is asked again first ([`PointerCache::check`]), and a larger allocation made where a
//! smaller one was passes. If freed addresses come back holding memory of another GPU or of
//! the host, or a smaller allocation where a larger one was, a call on them is not refused
//! here and fails as the kernel's access does (a CUDA error at this call or a later one).
//! Allocators hand freed ranges back to the same device (PyTorch's caching allocator keeps
//! them), which is the case this serves.

use super::registry::find;
use cudarc::driver::sys;

/// Kept ranges at most; past it the cache starts over (a workload cycling through more
/// allocations than this re-asks, as every call did before there was a cache). Room for many
/// mapped pieces: a buffer in PyTorch's expandable segments spans one range per 2 or 20 MiB
/// piece, each kept, and a cache smaller than a job's pieces would ask again on every call.
const CAPACITY: usize = 1024;
/// Mapped pieces a buffer's range is followed through; past them the rest is not checked
/// (PyTorch maps 2 MiB or 20 MiB pieces: 64 cover 128 MiB-1.25 GiB).
pub(super) const MAX_PIECES: usize = 64;

/// What kind of memory a pointer lies in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    /// Device memory (`cuMemAlloc`, `cuMemCreate` on a device, pools).
    Device,
    /// Managed (unified) memory: the kernel's access migrates it.
    Managed,
    /// Page-locked host memory (`cuMemHostAlloc`, `cuMemHostRegister`).
    Host,
    /// Not memory CUDA knows (pageable host memory, a wild pointer) or an array.
    Other,
}

/// One allocation as the driver describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Facts {
    pub kind: Kind,
    /// The GPU the memory belongs to (meaningful for device and managed memory).
    pub ordinal: i32,
    /// The allocation's address range (`bytes` 0: unknown, then nothing is kept).
    pub start: u64,
    pub bytes: u64,
    /// A classic allocation (`cuMemAlloc`: legacy-IPC capable), which its range is whole; else
    /// a mapped piece of memory that may continue in the next range.
    pub whole: bool,
}

impl Facts {
    /// Whether the kernels of the communicator on GPU `mine` may use this memory; else why
    /// not, for an error naming the buffer (`what`: "send" or "recv").
    pub fn judge(&self, ptr: u64, what: &str, mine: usize) -> Result<(), String> {
        match self.kind {
            Kind::Device | Kind::Managed if self.ordinal as usize == mine => Ok(()),
            Kind::Device | Kind::Managed => Err(format!(
                "{what} buffer {ptr:#x} is on GPU {}, the communicator on GPU {mine}",
                self.ordinal
            )),
            Kind::Host => Err(format!(
                "{what} buffer {ptr:#x} is page-locked host memory: the cuda backend all-reduces \
                 device memory of GPU {mine} (copy it there, or use the host backend)"
            )),
            Kind::Other => Err(format!(
                "{what} buffer {ptr:#x} is not CUDA device memory (pageable host memory or an \
                 invalid pointer?)"
            )),
        }
    }
}

/// Whether `[ptr, ptr + bytes)` lies in memory the kernels of the communicator on GPU `mine`
/// may use, the first range's facts `first` (of the allocation holding `ptr`); else why not,
/// for an error naming the buffer (`what`). `facts_at` gives the facts of the range holding an
/// address (cached or asked) for a buffer that runs past its first range.
pub(super) fn check_range(
    first: Facts,
    ptr: u64,
    bytes: usize,
    what: &str,
    mine: usize,
    mut facts_at: impl FnMut(u64) -> Result<Facts, String>,
) -> Result<(), String> {
    first.judge(ptr, what, mine)?;
    let end = ptr.saturating_add(bytes as u64);
    let mut f = first;
    for _ in 0..MAX_PIECES {
        let range_end = f.start.saturating_add(f.bytes);
        // An unknown range (bytes 0) cannot be followed: nothing more to check.
        if f.bytes == 0 || end <= range_end {
            return Ok(());
        }
        let start = f.start;
        let past = |why: String| {
            format!(
                "{what} buffer {ptr:#x} of {bytes} bytes runs past the end of its allocation \
                 [{start:#x}, {range_end:#x}) by {} bytes{why}: is the count larger than the \
                 buffer?",
                end - range_end
            )
        };
        if f.whole {
            return Err(past(String::new()));
        }
        // A mapped piece: the buffer goes on in the next one, which must be ours too. An
        // address the driver cannot describe (reserved but unmapped, say) is not.
        let not_ours = |why: String| {
            past(format!(
                ", into memory at {range_end:#x} that is not GPU {mine}'s{why}"
            ))
        };
        f = facts_at(range_end).map_err(|e| not_ours(format!(" ({e})")))?;
        let ours = matches!(f.kind, Kind::Device | Kind::Managed) && f.ordinal as usize == mine;
        if !ours || f.start != range_end {
            return Err(not_ours(String::new()));
        }
    }
    Ok(())
}

/// Facts by address range: sorted by start, never overlapping.
#[derive(Default)]
pub(super) struct PointerCache {
    ranges: Vec<Facts>,
    last_hit: std::cell::Cell<usize>,
}

impl PointerCache {
    /// The facts of the allocation holding `ptr`, if known.
    pub fn get(&self, ptr: u64) -> Option<Facts> {
        let i = find(&self.ranges, self.last_hit.get(), ptr, 1, |f| {
            (f.start, f.bytes as usize)
        })?;
        self.last_hit.set(i);
        Some(self.ranges[i])
    }

    /// Whether `[ptr, ptr + bytes)` passes [`check_range`], with the facts kept here and the
    /// rest asked of `ask` (the driver's [`query`], its error in words), which are kept once
    /// the buffer passes (a refused range may be freed and come back as memory of this GPU,
    /// and is then asked about again).
    ///
    /// A refusal that rests on kept facts is not final: the caller may have freed that
    /// allocation and made another at the same address (a larger buffer where a smaller one
    /// was, which the kept range would say the buffer runs past). The kept ranges the buffer
    /// touches are then forgotten and the driver asked afresh; only its answer refuses. So a
    /// valid buffer is never refused, and a call on buffers seen before still asks nothing.
    pub fn check(
        &mut self,
        ptr: u64,
        bytes: usize,
        what: &str,
        mine: usize,
        mut ask: impl FnMut(u64) -> Result<Facts, String>,
    ) -> Result<(), String> {
        let (mut verdict, mut asked, kept_used) =
            self.check_once(true, ptr, bytes, what, mine, &mut ask);
        if verdict.is_err() && kept_used {
            self.forget(ptr, bytes as u64);
            (verdict, asked, _) = self.check_once(false, ptr, bytes, what, mine, &mut ask);
        }
        if verdict.is_ok() {
            for f in asked {
                self.insert(f);
            }
        }
        verdict
    }

    /// One [`check_range`] of the buffer, from kept facts where `use_kept` and there are any,
    /// else from `ask`; with the facts asked and whether any kept ones were used.
    fn check_once(
        &self,
        use_kept: bool,
        ptr: u64,
        bytes: usize,
        what: &str,
        mine: usize,
        ask: &mut impl FnMut(u64) -> Result<Facts, String>,
    ) -> (Result<(), String>, Vec<Facts>, bool) {
        let mut asked = Vec::new();
        let mut kept_used = false;
        let mut find = |at: u64| -> Result<Facts, String> {
            if let Some(f) = self.get(at).filter(|_| use_kept) {
                kept_used = true;
                return Ok(f);
            }
            let f = ask(at)?;
            asked.push(f);
            Ok(f)
        };
        let verdict =
            find(ptr).and_then(|first| check_range(first, ptr, bytes, what, mine, &mut find));
        (verdict, asked, kept_used)
    }

    /// Keeps `f` (when its range is known), replacing what overlaps it: the driver's latest
    /// answer describes those addresses now.
    pub fn insert(&mut self, f: Facts) {
        if f.bytes == 0 {
            return;
        }
        self.forget(f.start, f.bytes);
        if self.ranges.len() >= CAPACITY {
            self.ranges.clear();
        }
        let at = self.ranges.partition_point(|r| r.start < f.start);
        self.ranges.insert(at, f);
    }

    /// Drops every range overlapping `[start, start + bytes)` (its memory was freed).
    pub fn forget(&mut self, start: u64, bytes: u64) {
        let end = start.saturating_add(bytes);
        self.ranges
            .retain(|r| r.start.saturating_add(r.bytes) <= start || end <= r.start);
        self.last_hit.set(0);
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.ranges.len()
    }
}

/// Asks the driver about `ptr`: one `cuPointerGetAttributes` call. For a pointer CUDA does
/// not know it still succeeds and leaves every attribute zero (memory type 0: `Other`). A
/// driver that refuses the newer attributes (the mapping's range, legacy IPC) is asked again
/// without them; the range then counts as a mapped piece (`whole` false: followed, never
/// refused for being whole).
pub(super) fn query(ptr: u64) -> Result<Facts, sys::CUresult> {
    use sys::CUpointer_attribute as A;
    let base = [
        A::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        A::CU_POINTER_ATTRIBUTE_IS_MANAGED,
        A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
        A::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
        A::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
    ];
    let [b0, b1, b2, b3, b4] = base;
    let all = [
        b0,
        b1,
        b2,
        b3,
        b4,
        A::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
        A::CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR,
        A::CU_POINTER_ATTRIBUTE_MAPPING_SIZE,
    ];
    match super::driver::pointer_attributes(ptr, all) {
        Ok([t, m, o, s, n, legacy, map_start, map_bytes]) => Ok(facts_of(
            [t, m, o, s, n],
            Some((legacy as u32 != 0, map_start, map_bytes)),
        )),
        Err(_) => Ok(facts_of(
            super::driver::pointer_attributes(ptr, base)?,
            None,
        )),
    }
}

/// The facts from the driver's attributes: memory type, managed, ordinal, range start and
/// size, then (where the driver gave them) legacy-IPC capable and the mapping's start and
/// size. A classic allocation (`cuMemAlloc`: legacy-IPC capable) is its range, whole. Memory
/// mapped with `cuMemMap` is described by the piece mapped at the pointer (its mapping), since
/// its range may be the whole reservation, holes included (seen on an H100, driver 580: a
/// buffer running from a mapped piece into the unmapped rest of its reservation passed).
fn facts_of(
    [memory_type, managed, ordinal, start, bytes]: [u64; 5],
    newer: Option<(bool, u64, u64)>,
) -> Facts {
    let (whole, start, bytes) = match newer {
        Some((true, _, _)) => (true, start, bytes),
        Some((false, map_start, map_bytes)) if map_bytes != 0 => (false, map_start, map_bytes),
        _ => (false, start, bytes),
    };
    Facts {
        kind: kind_of(memory_type as u32, managed != 0),
        ordinal: ordinal as u32 as i32,
        start,
        bytes,
        whole,
    }
}

/// The kind from `CU_POINTER_ATTRIBUTE_MEMORY_TYPE` and `IS_MANAGED`.
fn kind_of(memory_type: u32, managed: bool) -> Kind {
    use sys::CUmemorytype as M;
    match memory_type {
        _ if managed => Kind::Managed,
        t if t == M::CU_MEMORYTYPE_DEVICE as u32 || t == M::CU_MEMORYTYPE_UNIFIED as u32 => {
            Kind::Device
        }
        t if t == M::CU_MEMORYTYPE_HOST as u32 => Kind::Host,
        _ => Kind::Other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(start: u64, bytes: u64, ordinal: i32) -> Facts {
        Facts {
            kind: Kind::Device,
            ordinal,
            start,
            bytes,
            whole: true,
        }
    }

    /// A mapped piece (not a classic allocation).
    fn piece(start: u64, bytes: u64, ordinal: i32) -> Facts {
        Facts {
            whole: false,
            ..dev(start, bytes, ordinal)
        }
    }

    /// What the driver says of an address in none of `ranges`: nothing (memory type 0).
    fn lookup(ranges: &[Facts]) -> impl FnMut(u64) -> Result<Facts, String> + '_ {
        move |a| {
            Ok(ranges
                .iter()
                .copied()
                .find(|f| f.start <= a && a < f.start + f.bytes)
                .unwrap_or(Facts {
                    kind: Kind::Other,
                    ordinal: 0,
                    start: 0,
                    bytes: 0,
                    whole: false,
                }))
        }
    }

    #[test]
    fn a_classic_allocation_must_hold_the_whole_buffer() {
        let a = dev(0x1000, 0x1000, 0);
        // The next allocation of the same GPU right behind it does not make it longer.
        let next = dev(0x2000, 0x1000, 0);
        let ranges = [a, next];
        assert_eq!(
            check_range(a, 0x1000, 0x1000, "send", 0, lookup(&ranges)),
            Ok(())
        );
        assert_eq!(
            check_range(a, 0x1800, 0x800, "send", 0, lookup(&ranges)),
            Ok(())
        );
        assert_eq!(
            check_range(a, 0x1fff, 0, "send", 0, lookup(&ranges)),
            Ok(())
        );
        let e = check_range(a, 0x1800, 0x801, "recv", 0, lookup(&ranges)).unwrap_err();
        assert!(
            e.contains("recv buffer 0x1800 of 2049 bytes runs past the end of its allocation")
                && e.contains("[0x1000, 0x2000) by 1 bytes"),
            "{e}"
        );
    }

    #[test]
    fn mapped_pieces_are_followed_while_they_are_this_gpus() {
        let p = [
            piece(0x1000, 0x1000, 1),
            piece(0x2000, 0x1000, 1),
            piece(0x3000, 0x1000, 1),
        ];
        let f = p[0];
        assert_eq!(
            check_range(f, 0x1800, 0x2800, "send", 1, lookup(&p)),
            Ok(())
        );
        // Into a hole (nothing mapped behind the last piece).
        let e = check_range(f, 0x1800, 0x2801, "send", 1, lookup(&p)).unwrap_err();
        assert!(
            e.contains("runs past the end") && e.contains("at 0x4000 that is not GPU 1's"),
            "{e}"
        );
        // Into another GPU's piece, or page-locked host memory.
        let other = [piece(0x1000, 0x1000, 1), piece(0x2000, 0x1000, 0)];
        assert!(check_range(other[0], 0x1000, 0x1001, "send", 1, lookup(&other)).is_err());
        let host = [
            piece(0x1000, 0x1000, 1),
            Facts {
                kind: Kind::Host,
                ..piece(0x2000, 0x1000, 1)
            },
        ];
        assert!(check_range(host[0], 0x1000, 0x1001, "send", 1, lookup(&host)).is_err());
        // A classic allocation behind a piece ends the pieces but is still this GPU's memory:
        // followed, and must hold the rest.
        let mixed = [piece(0x1000, 0x1000, 1), dev(0x2000, 0x1000, 1)];
        assert_eq!(
            check_range(mixed[0], 0x1000, 0x2000, "send", 1, lookup(&mixed)),
            Ok(())
        );
        assert!(check_range(mixed[0], 0x1000, 0x2001, "send", 1, lookup(&mixed)).is_err());
        // An address behind a piece the driver cannot describe (reserved, unmapped): refused
        // as memory that is not ours, the driver's words kept.
        let e = check_range(p[0], 0x1800, 0x1000, "recv", 1, |_| {
            Err("CUDA_ERROR_INVALID_VALUE".to_string())
        })
        .unwrap_err();
        assert_eq!(
            e,
            "recv buffer 0x1800 of 4096 bytes runs past the end of its allocation [0x1000, \
             0x2000) by 2048 bytes, into memory at 0x2000 that is not GPU 1's \
             (CUDA_ERROR_INVALID_VALUE): is the count larger than the buffer?"
        );
    }

    #[test]
    fn the_first_range_is_judged_and_unknown_ranges_end_the_check() {
        let far = dev(0x1000, 0x1000, 0);
        let e = check_range(far, 0x1000, 8, "send", 1, lookup(&[])).unwrap_err();
        assert!(e.contains("is on GPU 0"), "{e}");
        // Range unknown: as much as the driver told.
        let unknown = dev(0, 0, 1);
        assert_eq!(
            check_range(unknown, 0x1000, 1 << 40, "send", 1, lookup(&[])),
            Ok(())
        );
        // At most MAX_PIECES pieces are followed: a buffer over more is not refused.
        let many: Vec<Facts> = (0..2 * MAX_PIECES as u64)
            .map(|i| piece(0x1000 * (i + 1), 0x1000, 0))
            .collect();
        let long = 0x1000 * (MAX_PIECES + 10);
        assert_eq!(
            check_range(many[0], 0x1000, long, "send", 0, lookup(&many)),
            Ok(())
        );
    }

    #[test]
    fn only_this_gpus_device_or_managed_memory_passes() {
        assert_eq!(dev(0, 8, 1).judge(0x10, "send", 1), Ok(()));
        let managed = Facts {
            kind: Kind::Managed,
            ..dev(0, 8, 1)
        };
        assert_eq!(managed.judge(0x10, "send", 1), Ok(()));
        let e = dev(0, 8, 0).judge(0x10, "recv", 1).unwrap_err();
        assert!(
            e.contains("recv buffer 0x10 is on GPU 0, the communicator on GPU 1"),
            "{e}"
        );
        let host = Facts {
            kind: Kind::Host,
            ..dev(0, 8, 1)
        };
        assert!(host
            .judge(0x10, "send", 1)
            .unwrap_err()
            .contains("host memory"));
        let other = Facts {
            kind: Kind::Other,
            ..dev(0, 0, 0)
        };
        assert!(other
            .judge(0x10, "send", 0)
            .unwrap_err()
            .contains("not CUDA device memory"));
    }

    #[test]
    fn ranges_from_the_driver_attributes() {
        use sys::CUmemorytype as M;
        let dev = M::CU_MEMORYTYPE_DEVICE as u64;
        // cuMemAlloc: its range, whole, whatever mapping holds it.
        let f = facts_of([dev, 0, 1, 0x1000, 0x400], Some((true, 0x0, 0x20_0000)));
        assert_eq!(
            (f.start, f.bytes, f.whole, f.ordinal),
            (0x1000, 0x400, true, 1)
        );
        // cuMemMap: the piece mapped there, not the reservation.
        let f = facts_of(
            [dev, 0, 0, 0x0, 0x40_0000],
            Some((false, 0x20_0000, 0x20_0000)),
        );
        assert_eq!((f.start, f.bytes, f.whole), (0x20_0000, 0x20_0000, false));
        // No mapping given: the range, as a piece.
        let f = facts_of([dev, 0, 0, 0x0, 0x40_0000], Some((false, 0, 0)));
        assert_eq!((f.start, f.bytes, f.whole), (0x0, 0x40_0000, false));
        // A driver without the newer attributes: the range, as a piece.
        let f = facts_of([dev, 0, 0, 0x1000, 0x400], None);
        assert_eq!((f.start, f.bytes, f.whole), (0x1000, 0x400, false));
        // A pointer the driver does not know: all zero.
        let f = facts_of([0; 5], Some((false, 0, 0)));
        assert_eq!((f.kind, f.bytes), (Kind::Other, 0));
    }

    #[test]
    fn kinds_from_the_driver_attributes() {
        use sys::CUmemorytype as M;
        assert_eq!(kind_of(M::CU_MEMORYTYPE_DEVICE as u32, false), Kind::Device);
        assert_eq!(kind_of(M::CU_MEMORYTYPE_DEVICE as u32, true), Kind::Managed);
        assert_eq!(kind_of(M::CU_MEMORYTYPE_HOST as u32, false), Kind::Host);
        assert_eq!(kind_of(M::CU_MEMORYTYPE_ARRAY as u32, false), Kind::Other);
        // What the driver leaves for a pointer it does not know.
        assert_eq!(kind_of(0, false), Kind::Other);
    }

    #[test]
    fn facts_are_found_anywhere_in_their_range() {
        let mut c = PointerCache::default();
        c.insert(dev(0x1000, 0x1000, 0));
        c.insert(dev(0x4000, 0x100, 1));
        assert_eq!(c.get(0x1000).map(|f| f.ordinal), Some(0));
        assert_eq!(c.get(0x1fff).map(|f| f.ordinal), Some(0));
        assert_eq!(c.get(0x40ff).map(|f| f.ordinal), Some(1));
        assert_eq!(c.get(0x2000), None);
        assert_eq!(c.get(0xfff), None);
        assert_eq!(c.get(0x4100), None);
        // An unknown range is not kept.
        c.insert(dev(0x9000, 0, 0));
        assert_eq!(c.get(0x9000), None);
    }

    #[test]
    fn freed_or_reallocated_ranges_are_forgotten() {
        let mut c = PointerCache::default();
        c.insert(dev(0x1000, 0x1000, 0));
        c.insert(dev(0x3000, 0x1000, 0));
        c.insert(dev(0x5000, 0x1000, 0));
        // Freed: [0x2800, 0x3800) overlaps only the middle range.
        c.forget(0x2800, 0x1000);
        assert_eq!(c.get(0x3000), None);
        assert!(c.get(0x1800).is_some() && c.get(0x5800).is_some());
        // The driver now reports a larger allocation over the first one: it replaces it.
        c.insert(dev(0x0, 0x2000, 1));
        assert_eq!(c.get(0x1800).map(|f| f.ordinal), Some(1));
        assert_eq!(c.len(), 2);
    }

    /// A driver that knows `ranges` and counts the questions.
    fn driver<'a>(
        ranges: &'a [Facts],
        asked: &'a std::cell::Cell<usize>,
    ) -> impl FnMut(u64) -> Result<Facts, String> + 'a {
        let mut know = lookup(ranges);
        move |a| {
            asked.set(asked.get() + 1);
            know(a)
        }
    }

    #[test]
    fn a_buffer_is_checked_against_kept_facts_without_asking() {
        let mut c = PointerCache::default();
        let asked = std::cell::Cell::new(0);
        let now = [dev(0x10_0000, 0x1_0000, 0)];
        assert_eq!(
            c.check(0x10_0000, 0x1_0000, "send", 0, driver(&now, &asked)),
            Ok(())
        );
        assert_eq!(asked.get(), 1);
        // Seen before: no question, any buffer inside it.
        assert_eq!(
            c.check(0x10_0400, 0x8000, "recv", 0, driver(&now, &asked)),
            Ok(())
        );
        assert_eq!(asked.get(), 1);
    }

    /// The caller freed a 4000-byte allocation and made a 64 KiB one at the same address
    /// (seen on an H100: the kept range refused a valid buffer): the driver is asked again
    /// before a refusal, and its answer replaces the kept range.
    #[test]
    fn a_stale_kept_range_never_refuses_a_valid_buffer() {
        let mut c = PointerCache::default();
        c.insert(dev(0x30_0600, 4000, 0));
        let asked = std::cell::Cell::new(0);
        let now = [dev(0x30_0600, 0x1_0000, 0)];
        assert_eq!(
            c.check(0x30_0600, 0x1_0000, "send", 0, driver(&now, &asked)),
            Ok(())
        );
        assert_eq!(asked.get(), 1);
        assert_eq!(c.get(0x30_0600 + 0xffff).map(|f| f.bytes), Some(0x1_0000));
        // Kept now: the next call asks nothing.
        assert_eq!(
            c.check(0x30_0600, 0x1_0000, "send", 0, driver(&now, &asked)),
            Ok(())
        );
        assert_eq!(asked.get(), 1);
        // Kept as another GPU's memory, now this GPU's: passes too.
        let mut c = PointerCache::default();
        c.insert(dev(0x30_0600, 0x1_0000, 1));
        assert_eq!(
            c.check(0x30_0600, 0x100, "send", 0, driver(&now, &asked)),
            Ok(())
        );
    }

    #[test]
    fn a_buffer_the_driver_says_overruns_is_refused_and_not_kept() {
        let mut c = PointerCache::default();
        c.insert(dev(0x30_0600, 4000, 0));
        let asked = std::cell::Cell::new(0);
        let now = [dev(0x30_0600, 4000, 0)];
        let e = c
            .check(0x30_0600, 0x1_0000, "send", 0, driver(&now, &asked))
            .unwrap_err();
        assert_eq!(
            e,
            "send buffer 0x300600 of 65536 bytes runs past the end of its allocation \
             [0x300600, 0x3015a0) by 61536 bytes: is the count larger than the buffer?"
        );
        // Asked once more before refusing; what it said is not kept for a refused buffer.
        assert_eq!(asked.get(), 1);
        assert_eq!(c.get(0x30_0600), None);
        // Refused from a fresh answer alone: asked once, not twice.
        let e2 = c
            .check(0x30_0600, 0x1_0000, "send", 0, driver(&now, &asked))
            .unwrap_err();
        assert_eq!(e2, e);
        assert_eq!(asked.get(), 2);
    }

    #[test]
    fn the_cache_stays_bounded() {
        let mut c = PointerCache::default();
        for i in 0..(3 * CAPACITY as u64) {
            c.insert(dev(i * 0x100, 0x100, 0));
            assert!(c.len() <= CAPACITY);
            // The latest is always kept.
            assert!(c.get(i * 0x100 + 1).is_some());
        }
    }
}
