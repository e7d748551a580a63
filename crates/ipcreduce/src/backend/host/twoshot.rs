//! Two-shot: reduce-scatter (rank r reduces shard r of every rank's chunk and publishes it),
//! then all-gather (every rank copies every reduced shard). Each rank reads 2 (world-1)/world
//! of the message instead of (world-1) times it.

use super::failure::Fail;
use super::{reduce, HostComm, Job, SHARD_ALIGN_BYTES};
use crate::plan;

/// Runs `job`; returns whether peers read our input in place (see `oneshot::run`).
///
/// # Safety
/// `job.send`/`job.recv` valid for the call's bytes, equal or disjoint.
pub(super) unsafe fn run(c: &mut HostComm, job: &Job) -> Result<bool, Fail> {
    let sz = job.dtype.size();
    let align = (SHARD_ALIGN_BYTES / sz).max(1);
    let kernel = reduce::kernel(job.dtype, job.op);
    let in_place = job.send == job.recv.cast_const();
    let mut srcs = std::mem::take(&mut c.srcs);
    let result = (|| {
        for chunk in plan::chunks(job.count, c.chunk_elems(job.dtype)) {
            let (epoch, slot) = c.next_epoch();
            let len = chunk.len();
            let mine = plan::shard(len, c.world, c.rank, align);
            let slot_off = c.layout.slot_off(slot);
            // SAFETY: chunk lies inside the call's buffers; the slot holds a whole chunk.
            let (src, dst, slot_ptr) = unsafe {
                (
                    job.send.add(chunk.start * sz),
                    job.recv.add(chunk.start * sz),
                    c.bases[c.rank].add(slot_off),
                )
            };
            let heap = job.heap_off.map(|h| h + chunk.start * sz);
            let src_off = match heap {
                Some(h) => h,
                None => {
                    // Copy in everything but our own shard: nobody else reads that, we
                    // take it straight from the user's buffer. Its place in the slot will
                    // hold our reduced shard.
                    // SAFETY: both ranges lie inside the chunk; the slot is free (mod.rs).
                    unsafe {
                        std::ptr::copy_nonoverlapping(src, slot_ptr, mine.start * sz);
                        std::ptr::copy_nonoverlapping(
                            src.add(mine.end * sz),
                            slot_ptr.add(mine.end * sz),
                            (len - mine.end) * sz,
                        );
                    }
                    slot_off
                }
            };
            c.publish_ready(slot, epoch, &job.stamp, src_off as u64);

            // Reduce-scatter: shard `mine` of every rank, in rank order.
            srcs.clear();
            for q in 0..c.world {
                let p = if q == c.rank {
                    src
                } else {
                    c.wait_ready(q, slot, epoch, &job.stamp, len * sz)?
                };
                // SAFETY: p points at a whole chunk (checked by wait_ready).
                srcs.push(unsafe { p.add(mine.start * sz) });
            }
            // SAFETY: shard `mine` lies inside the chunk in dst and in the slot.
            let (out, out_slot) =
                unsafe { (dst.add(mine.start * sz), slot_ptr.add(mine.start * sz)) };
            let red_off = if in_place && heap.is_some() {
                // Our heap buffer is also the output: the result overwrites our own shard,
                // which only we read.
                // SAFETY: sources hold the shard; out is ours and equals srcs[rank].
                unsafe { kernel(&srcs, &[out], mine.len()) };
                heap.map(|h| h + mine.start * sz)
            } else {
                // SAFETY: as above; the slot's shard region is unused by anyone else.
                unsafe { kernel(&srcs, &[out, out_slot], mine.len()) };
                Some(slot_off + mine.start * sz)
            };
            let line = &c.own().reduced[slot];
            line.red_off.store(
                red_off.unwrap_or(0) as u64,
                std::sync::atomic::Ordering::Relaxed,
            );
            line.sig.publish(epoch);

            // All-gather: every peer's reduced shard into our output.
            for q in c.peers() {
                let theirs = plan::shard(len, c.world, q, align);
                let line = &c.ctrl(q).reduced[slot];
                c.wait_signal(q, &line.sig, epoch)?;
                let off = line.red_off.load(std::sync::atomic::Ordering::Relaxed);
                let bytes = theirs.len() * sz;
                if !c.arenas[q].contains(off, bytes) {
                    return Err(Fail::Mismatch {
                        peer: q,
                        detail: format!("rank {q} published its shard outside its arena"),
                    });
                }
                // SAFETY: checked to lie in peer q's arena; the target lies in our chunk.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        c.bases[q].add(off as usize),
                        dst.add(theirs.start * sz),
                        bytes,
                    );
                }
            }
        }
        Ok(job.heap_off.is_some())
    })();
    c.srcs = srcs;
    result
}
