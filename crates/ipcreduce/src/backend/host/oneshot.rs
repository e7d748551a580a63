//! One-shot: every rank publishes its whole chunk and reduces all ranks' chunks itself.
//! One synchronisation per chunk; best while latency dominates.

use super::arena::{INLINE_BYTES, SRC_INLINE};
use super::failure::Fail;
use super::{reduce, HostComm, Job};
use crate::plan;

/// Runs `job`; returns whether peers read our input in place (zero-copy: the caller must
/// then wait for them before returning).
///
/// # Safety
/// `job.send`/`job.recv` valid for the call's bytes, equal or disjoint.
pub(super) unsafe fn run(c: &mut HostComm, job: &Job) -> Result<bool, Fail> {
    let sz = job.dtype.size();
    let kernel = reduce::kernel(job.dtype, job.op);
    let inline = job.count * sz <= INLINE_BYTES;
    // Peers may read our heap buffer in place unless we overwrite it with the result while
    // they still read it (in place): then it goes through the slot like any user buffer.
    let zero_copy = job
        .heap_off
        .filter(|_| job.send != job.recv.cast_const() && !inline);
    let mut srcs = std::mem::take(&mut c.srcs);
    let result = (|| {
        for chunk in plan::chunks(job.count, c.chunk_elems(job.dtype)) {
            let (epoch, slot) = c.next_epoch();
            let bytes = chunk.len() * sz;
            // SAFETY: chunk lies inside the call's buffers.
            let (src, dst) = unsafe {
                (
                    job.send.add(chunk.start * sz),
                    job.recv.add(chunk.start * sz),
                )
            };
            let src_off = if inline {
                // SAFETY: bytes <= INLINE_BYTES; the protocol guarantees no peer reads the
                // line's data until we publish the epoch below.
                unsafe {
                    let line = &c.own().ready[slot];
                    std::ptr::copy_nonoverlapping(src, line.inline.get().cast::<u8>(), bytes);
                }
                SRC_INLINE
            } else if let Some(h) = zero_copy {
                (h + chunk.start * sz) as u64
            } else {
                let off = c.layout.slot_off(slot);
                // SAFETY: the slot holds a whole chunk; no peer reads it before we publish
                // (the epoch that last used it is finished everywhere: see mod.rs).
                unsafe { std::ptr::copy_nonoverlapping(src, c.bases[c.rank].add(off), bytes) };
                off as u64
            };
            c.publish_ready(slot, epoch, &job.stamp, src_off);
            srcs.clear();
            for q in 0..c.world {
                // Our own part straight from the user's buffer: same bits as our slot copy.
                srcs.push(if q == c.rank {
                    src
                } else {
                    c.wait_ready(q, slot, epoch, &job.stamp, bytes)?
                });
            }
            // SAFETY: every source holds the chunk (checked by wait_ready); dst is ours.
            unsafe { kernel(&srcs, &[dst], chunk.len()) };
        }
        Ok(zero_copy.is_some())
    })();
    c.srcs = srcs;
    result
}
