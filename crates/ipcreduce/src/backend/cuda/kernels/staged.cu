// ipcreduce staged all-reduce kernels, one-shot and two-shot: the user's buffers are copied
// through the shared workspace. Built on prims.cuh (its invariants are numbered there).
//
// Layout: the data area of every rank's workspace holds two slots of slot_bytes; chunk k of a
// call lives in slot parity (L0 + k) & 1, where L0 is the rank-wide chunk counter (private
// state word STATE_CALL + 3, advanced by finish_call with the call).
//
// Ordering.
// Staged slots with a variable grid. Within one call the grid is fixed and the bytes of a slot
//     a block touches are fixed too: pieces and shards are cut from the call's chunk frame
//     (min(count, chunk elements)), not from the chunk's actual length, so the short last chunk
//     touches a subset of the same bytes. Block b of every rank cuts the same pieces, so block b
//     only ever reads what block b of a peer wrote. Chunk k lives in slot parity (L0 + k) & 1.
//     Pipelined order of one block, one-shot: copy-in 0; for each chunk k: barrier k, copy-in
//     k+1, reduce k. Two-shot: copy-in 0; for each k: barrier A_k, reduce our shard of k (reads
//     the peers' slots, stores the result back into them), barrier B_k, copy-in k+1, gather k
//     (reads our own slot only); "copy-in k+1, reduce k" and "copy-in k+1, gather k" run
//     interleaved by rounds (see interleave), which changes no block's bytes nor its barriers.
//     Before block b writes slot parity P for chunk k+1 it has passed
//     the barrier of chunk k (one-shot) or B_k and so A_k (two-shot) with block b of every peer,
//     which that block entered only after it finished every access of chunk k-1, the previous
//     use of P: its reads (one-shot), its reduce and gather (two-shot). Chunk k's reads follow
//     the barrier every peer entered after writing chunk k.
//     Across calls the parity continues from a rank-wide chunk counter (not a per-block one), so
//     the first chunk of call Y, copied in before Y's first barrier, uses the other parity than
//     the last chunk of call X, which peers may still be reading (one-shot and two-shot have no
//     end barrier). The previous use of Y's first parity was finished by every block of every
//     peer before our X passed its last barrier, and Y's second chunk is copied in after a
//     barrier of Y, which a peer enters only after its X completed. Our own contribution is read
//     from our input or our own slot's own region, which no peer touches; the reduced shard r
//     lands in region r of peer q's slot, in place of what q copied in for r, and q reads it
//     only in its gather after B_k.
//
// Staged kernels (unregistered user buffers): copy into our slot, barrier, reduce from every
// rank's slot. Chunked by the call's chunk size (a.chunk_bytes); slot parity from the rank-wide
// chunk counter; software-pipelined (see invariant 3): the copy-in of chunk k+1 is issued after
// the barrier that publishes chunk k and before chunk k's reads, so the writes into our slot and
// the reads from the peers' slots are in flight together. On the host-staged transport those
// are the two directions of the GPU's PCIe link, which would otherwise take turns.
//
// Our own contribution is read from the input (`direct`, when 16-byte aligned) rather than from
// our slot's copy, which exists for the peers: one slot read less per element, a PCIe read on
// the host-staged transport. Two-shot then never copies in its own shard nor gathers it.

__device__ __forceinline__ u64 slot_offset(const Args &a, u32 L) { return (u64)(L & 1u) * a.slot_bytes; }

// Peer r's chunk from its slot at `off`, ours from `own` (our input's chunk, or our slot).
struct StagedSrc {
    const Args &a;
    u64 off;
    const char *own;
    __device__ const char *operator()(int r) const { return r == a.rank ? own : a.data[r] + off; }
};

// Two-shot staged, the reduced shard: into `out` (our output's chunk, or our slot) and, unless
// the PCIe policy pushes it afterwards in passes (`push` false), into every peer's slot, in
// place of the input the peer copied there for us (only this thread reads and writes these
// elements there). `out` and the slots are 16-byte aligned.
struct ShardDst {
    const Args &a;
    u64 off;
    char *out;
    bool push;
    __device__ bool is_aligned() const { return true; }
    template <typename D, int W> __device__ void store(u64 p, u64 end, int world, const uint4 &w) const {
        store_pack<D>(out, p, end, false, w);
        if (!push) return;
#pragma unroll
        for (int r = 0; r < W; r++)
            if (r < world && r != a.rank) store_pack<D>(a.data[r] + off, p, end, false, w);
    }
    template <int W> __device__ void store16(u64 p, int world, const uint4 &w) const {
        *(uint4 *)(out + p * 16) = w;
        if (!push) return;
#pragma unroll
        for (int r = 0; r < W; r++)
            if (r < world && r != a.rank) *(uint4 *)(a.data[r] + off + p * 16) = w;
    }
};

// One-shot: block b's piece of chunk `k` of our input into our slot of chunk counter L.
template <typename D>
__device__ __forceinline__ void one_shot_copy_in(const Args &a, u32 L, u64 c0, u64 chunk, u64 frame) {
    u64 b, e;
    shard_piece<D>(frame, min(chunk, a.count - c0), 1, 0, b, e);
    copy_range<D, COPY_UNROLL>(a.data[a.rank] + slot_offset(a, L), a.send + c0 * D::SIZE, b, e);
}

// Runs `first` over [b, e1) and `second` over [b, e2) (element ranges cut from one frame
// piece, so they share their start) round by round: each round is MODE_ROUND packs per thread
// of `first`, then as many of `second` (0: all of `first`, then all of `second`). On the
// host-staged transport `first` writes into host memory and `second` reads from it: the two
// directions of the GPU's PCIe link. Issued one whole range after the other, a thread's reads
// wait behind its writes and the link carries one direction at a time; round by round, both
// directions stay busy. Only the order of one thread's accesses changes: which bytes a block
// touches, and so every invariant of the barriers, are as without it.
template <typename D, typename F1, typename F2>
__device__ __forceinline__ void interleave(const Args &a, u64 b, u64 e1, u64 e2, const F1 &first,
                                           const F2 &second) {
    const u32 round = ((u32)a.mode >> MODE_ROUND_SHIFT) & MODE_ROUND_MASK;
    if (round == 0u) {
        first(b, e1);
        second(b, e2);
        return;
    }
    const u64 R = (u64)round * blockDim.x * Pack<D>::N;
    const u64 end = max(e1, e2);
    for (u64 s = b; s < end; s += R) {
        first(s, min(s + R, e1));
        second(s, min(s + R, e2));
    }
}

template <typename D, typename Op, int W> __device__ void one_shot(const Args &a) {
    u32 *ctr = a.counters + 2 * blockIdx.x;
    u32 *st = a.counters + STATE_CALL;
    const u64 call = begin_call(a);
    TRACE_PHASE(a, PH_START); // (after the closed-counter check: see CALL_CLOSED)
    u32 F = ctr[0];
    const u32 L0 = *(volatile u32 *)&st[3];
    const u64 chunk = a.chunk_bytes / D::SIZE;
    const u64 frame = min(chunk, a.count);
    const u32 chunks = (u32)((a.count + chunk - 1) / chunk);
    const bool direct = aligned16(a.send);
    // Block b's piece of the frame: every chunk's piece is it, clipped to the chunk's length.
    u64 fb, fe;
    shard_piece<D>(frame, frame, 1, 0, fb, fe);
    one_shot_copy_in<D>(a, L0, 0, chunk, frame);
    for (u32 k = 0; k < chunks; k++) {
        const u64 c0 = (u64)k * chunk;
        const u64 off = slot_offset(a, L0 + k);
        if (!barrier(a, F, call, k == 0)) break;
        // Chunk k+1's copy-in (none after the last chunk) beside chunk k's reduce.
        const u64 n = min(chunk, a.count - c0);
        const u64 next = k + 1 < chunks ? min(chunk, a.count - c0 - chunk) : 0;
        char *next_slot = a.data[a.rank] + slot_offset(a, L0 + k + 1);
        const char *next_in = a.send + (k + 1 < chunks ? c0 + chunk : c0) * D::SIZE;
        const char *own = direct ? a.send + c0 * D::SIZE : a.data[a.rank] + off;
        char *out = a.recv + c0 * D::SIZE;
        interleave<D>(
            a, fb, min(fe, next), min(fe, n),
            [&](u64 s, u64 e) { copy_range<D, COPY_UNROLL>(next_slot, next_in, s, e); },
            [&](u64 s, u64 e) {
                reduce_range<D, Op, W, STAGED_LOADS_IN_FLIGHT>(StagedSrc{a, off, own}, OwnDst{out, aligned16(out)},
                                                                a.world, s, e, true);
            });
    }
    TRACE_BLOCK(a, PH_REDUCE); // the last chunk reduced
    if (threadIdx.x == 0) ctr[0] = F;
    finish_call(a, call, true, L0 + chunks);
    TRACE_PHASE(a, PH_END);
}

// Two-shot: block b's piece of every shard of chunk `k` (but our own when `direct`) into our
// slot of chunk counter L, so block b of each peer can reduce its shard's piece b after one
// barrier with us.
template <typename D>
__device__ __forceinline__ void two_shot_copy_in(const Args &a, u32 L, u64 c0, u64 chunk, u64 frame, bool direct) {
    const u64 n = min(chunk, a.count - c0);
    for (int s = 0; s < a.world; s++) {
        if (direct && s == a.rank) continue;
        u64 b, e;
        shard_piece<D>(frame, n, a.world, s, b, e);
        copy_range<D, COPY_UNROLL>(a.data[a.rank] + slot_offset(a, L), a.send + c0 * D::SIZE, b, e);
    }
}

template <typename D, typename Op, int W> __device__ void two_shot(const Args &a) {
    u32 *ctr = a.counters + 2 * blockIdx.x;
    u32 *st = a.counters + STATE_CALL;
    const u64 call = begin_call(a);
    TRACE_PHASE(a, PH_START); // (after the closed-counter check: see CALL_CLOSED)
    u32 F = ctr[0];
    const u32 L0 = *(volatile u32 *)&st[3];
    const u64 chunk = a.chunk_bytes / D::SIZE;
    const u64 frame = min(chunk, a.count);
    const u32 chunks = (u32)((a.count + chunk - 1) / chunk);
    const bool direct = aligned16(a.send) && aligned16(a.recv);
    const bool passes = (a.mode & MODE_PUSH_PASSES) != 0;
    two_shot_copy_in<D>(a, L0, 0, chunk, frame, direct);
    for (u32 k = 0; k < chunks; k++) {
        const u64 c0 = (u64)k * chunk;
        const u64 n = min(chunk, a.count - c0);
        const u64 off = slot_offset(a, L0 + k);
        char *mine = a.data[a.rank] + off;
        if (!barrier(a, F, call, k == 0)) break;
        u64 b, e;
        shard_piece<D>(frame, n, a.world, a.rank, b, e);
        // Reduce our shard's piece into our output (direct) or our slot, and into the peers'.
        char *out = direct ? a.recv + c0 * D::SIZE : mine;
        reduce_range<D, Op, W, STAGED_LOADS_IN_FLIGHT>(StagedSrc{a, off, direct ? a.send + c0 * D::SIZE : mine},
                                                        ShardDst{a, off, out, !passes}, a.world, b, e, true);
        if (passes) // the same thread reads back what it stored above (same pack mapping)
            for (int p = 0; p + 1 < a.world; p++)
                copy_range<D, COPY_UNROLL>(a.data[(a.rank + 1 + p) % a.world] + off, out, b, e);
        TRACE_BLOCK(a, PH_REDUCE); // (the last chunk's stamp stays)
        if (!barrier(a, F, call)) break;
        // Every peer's reduced shard piece b of chunk k is now in our slot: gather it (reads
        // from host memory on the host-staged transport) beside chunk k+1's copy-in (writes),
        // shard by shard. The reduce above already loads both directions of the link (it reads
        // the peers' shards and pushes the result); pairing the gather with the copy-in does
        // the same for the second half, where the gather beside the next reduce would leave
        // the copy-in alone on one direction.
        const u64 next = k + 1 < chunks ? min(chunk, a.count - c0 - chunk) : 0;
        char *next_slot = a.data[a.rank] + slot_offset(a, L0 + k + 1);
        const char *next_in = a.send + (k + 1 < chunks ? c0 + chunk : c0) * D::SIZE;
        char *gathered = a.recv + c0 * D::SIZE;
        for (int s = 0; s < a.world; s++) {
            if (direct && s == a.rank) continue;
            u64 fb, fe;
            shard_piece<D>(frame, frame, a.world, s, fb, fe);
            interleave<D>(
                a, fb, min(fe, next), min(fe, n),
                [&](u64 x, u64 y) { copy_range<D, COPY_UNROLL>(next_slot, next_in, x, y); },
                [&](u64 x, u64 y) { copy_range<D, COPY_UNROLL>(gathered, mine, x, y); });
        }
        TRACE_BLOCK(a, PH_GATHER);
    }
    if (threadIdx.x == 0) ctr[0] = F;
    finish_call(a, call, true, L0 + chunks);
    TRACE_PHASE(a, PH_END);
}

// Entry points: ipcr_{oneshot,twoshot}_w<W>_<dtype>_<op>.
#define STAGED_KERNELS_W(DT, OPN, D, OP, W)                                                   \
    ENTRY(2, ipcr_oneshot_w##W##_##DT##_##OPN, (one_shot<D, OP, W>(a)))                       \
    ENTRY(2, ipcr_twoshot_w##W##_##DT##_##OPN, (two_shot<D, OP, W>(a)))
#define STAGED_KERNELS_FOR(DT, OPN, D, OP, W) STAGED_KERNELS_W(DT, OPN, D, OP, W)
#define STAGED_KERNELS(DT, OPN, D, OP) STAGED_KERNELS_FOR(DT, OPN, D, OP, IPCR_W)
#if !defined(IPCR_ONE_GROUP) || defined(IPCR_GROUP_STAGED)
FOR_EACH_DTYPE_OP(STAGED_KERNELS)
#endif
