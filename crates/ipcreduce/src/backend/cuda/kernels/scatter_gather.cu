// ipcreduce reduce-scatter and all-gather kernels. Built on prims.cuh (barriers, identity,
// pieces, copies and rank-order reduction) and staged.cu's slots; they keep prims.cuh's
// invariants and the staged and zero-copy kernels' ordering arguments (staged.cu, zerocopy.cu).
//
// Shards. A call moves `total` elements cut into `world` shards of `per` elements: shard s is
// [s*per, min((s+1)*per, total)), the last ones possibly shorter or empty. The host computes the
// cut in one place (../../../shards.rs): the caller's count for the public operations, a 16-byte
// aligned cut of an all-reduce's count for the hierarchical all-reduce.
//
//   reduce-scatter: recv (shard `rank`'s length) = op over ranks 0..world-1, in rank order with
//                   f32 accumulation (invariant 4), of shard `rank` of every rank's send (total).
//   all-gather:     shard s of recv (total) = rank s's send (shard s's length).
//
// Staged (user buffers), per chunk: copy into our slot, barrier, read the peers' slots: the
// pattern of one_shot, with its slot and parity rules (staged.cu) and the same rank-wide chunk
// counter, so calls of every kind may follow each other. Reduce-scatter's slot holds one region
// of slot_bytes / world (rounded down to 16 bytes) per shard; all-gather's holds the chunk of our own shard. Block b touches
// piece b (cut from the chunk frame) of every region, and the only reader of piece b of a region
// is block b of a peer. Chunks are counted from `per`, not from this rank's own shard, so every
// rank runs the same number of chunks and barriers.
// Zero-copy (registered send, read where it is, as in zerocopy.cu): inputs-ready barrier, reads, done
// barrier. In place (NCCL's forms: reduce-scatter recv = send + rank*per, all-gather send = recv +
// rank*per) is safe on both paths: the elements of our own shard that we read are read and then
// written only by this rank's block that owns their piece, with a barrier (__syncthreads) between.

struct SgArgs {
    Args a;
    u64 total;   // elements of the whole (reduce-scatter's send, all-gather's recv)
    u64 per;     // elements per shard
};

__device__ __forceinline__ u64 sg_shard_len(const SgArgs &g, int s) {
    const u64 b = min(g.total, (u64)s * g.per);
    return min(g.total, b + g.per) - b;
}

// Elements of a shard of `len` elements inside the chunk that starts at c0.
__device__ __forceinline__ u64 sg_in_chunk(u64 len, u64 c0, u64 chunk) {
    return c0 >= len ? 0 : min(chunk, len - c0);
}

template <typename D, typename Op, int W> __device__ void reduce_scatter_staged(const SgArgs &g) {
    const Args &a = g.a;
    u32 *ctr = a.counters + 2 * blockIdx.x;
    u32 *st = a.counters + STATE_CALL;
    const u64 call = begin_call(a);
    TRACE_PHASE(a, PH_START); // (after the closed-counter check: see CALL_CLOSED)
    u32 F = ctr[0];
    const u32 L0 = *(volatile u32 *)&st[3];
    // Bytes per region, a multiple of 16 so every region starts on a whole pack (slot_bytes
    // is only a multiple of 256, and the world may be 3, 5, 6 or 7).
    const u64 region = (a.slot_bytes / a.world) & ~(u64)15;
    const u64 chunk = region / D::SIZE;
    const u64 frame = min(chunk, g.per);
    const u64 mine = sg_shard_len(g, a.rank);
    u32 L = L0;
    for (u64 c0 = 0; c0 < g.per; c0 += chunk) {
        const u64 slot_off = slot_offset(a, L);
        char *slot = a.data[a.rank] + slot_off;
        L++;
        u64 b, e;
        for (int s = 0; s < a.world; s++) {
            shard_piece<D>(frame, sg_in_chunk(sg_shard_len(g, s), c0, chunk), 1, 0, b, e);
            copy_range<D, COPY_UNROLL>(slot + s * region, a.send + (s * g.per + c0) * D::SIZE, b, e);
        }
        if (!barrier(a, F, call, c0 == 0)) break;
        shard_piece<D>(frame, sg_in_chunk(mine, c0, chunk), 1, 0, b, e);
        char *out = a.recv + c0 * D::SIZE;
        // Region `rank` of every rank's slot, ours included (it holds our copy of the shard).
        const u64 off = slot_off + a.rank * region;
        reduce_range<D, Op, W, STAGED_LOADS_IN_FLIGHT>(StagedSrc{a, off, slot + a.rank * region},
                                                        OwnDst{out, aligned16(out)}, a.world, b, e, true);
    }
    if (threadIdx.x == 0) ctr[0] = F;
    finish_call(a, call, true, L0 + (u32)((g.per + chunk - 1) / chunk));
    TRACE_PHASE(a, PH_END);
}

template <typename D> __device__ void all_gather_staged(const SgArgs &g) {
    const Args &a = g.a;
    u32 *ctr = a.counters + 2 * blockIdx.x;
    u32 *st = a.counters + STATE_CALL;
    const u64 call = begin_call(a);
    TRACE_PHASE(a, PH_START); // (after the closed-counter check: see CALL_CLOSED)
    u32 F = ctr[0];
    const u32 L0 = *(volatile u32 *)&st[3];
    const u64 chunk = a.slot_bytes / D::SIZE;
    const u64 frame = min(chunk, g.per);
    const u64 mine = sg_shard_len(g, a.rank);
    u32 L = L0;
    for (u64 c0 = 0; c0 < g.per; c0 += chunk) {
        const u64 slot_off = slot_offset(a, L);
        L++;
        u64 b, e;
        shard_piece<D>(frame, sg_in_chunk(mine, c0, chunk), 1, 0, b, e);
        copy_range<D, COPY_UNROLL>(a.data[a.rank] + slot_off, a.send + c0 * D::SIZE, b, e);
        if (!barrier(a, F, call, c0 == 0)) break;
        // Peers in rotated order, so that the ranks' reads spread over the links.
        for (int k = 0; k < a.world; k++) {
            const int s = (a.rank + k) % a.world;
            shard_piece<D>(frame, sg_in_chunk(sg_shard_len(g, s), c0, chunk), 1, 0, b, e);
            copy_range<D, COPY_UNROLL>(a.recv + (s * g.per + c0) * D::SIZE, a.data[s] + slot_off, b, e);
        }
    }
    if (threadIdx.x == 0) ctr[0] = F;
    finish_call(a, call, true, L0 + (u32)((g.per + chunk - 1) / chunk));
    TRACE_PHASE(a, PH_END);
}

// Every rank's registered send, shifted to one shard.
struct ShardSrc {
    const Args &a;
    u64 off;
    __device__ const char *operator()(int r) const { return a.rsend[r] + off; }
};

template <typename D, typename Op, int W> __device__ void reduce_scatter_reg(const SgArgs &g) {
    const Args &a = g.a;
    u32 *ctr = a.counters + 2 * blockIdx.x;
    u32 F = ctr[0];
    const u64 call = begin_call(a);
    TRACE_PHASE(a, PH_START); // (after the closed-counter check: see CALL_CLOSED)
    if (barrier(a, F, call, true)) { // inputs ready
        u64 b, e;
        piece<D>(0, sg_shard_len(g, a.rank), gridDim.x, blockIdx.x, b, e);
        // bit 0 of `aligned`: every rank's send at our shard is 16-byte aligned (host's check).
        reduce_range<D, Op, W>(ShardSrc{a, a.rank * g.per * D::SIZE}, OwnDst{a.recv, aligned16(a.recv)},
                               a.world, b, e, (a.aligned & 1) != 0);
        barrier(a, F, call); // done reading every send
    }
    if (threadIdx.x == 0) ctr[0] = F;
    finish_call(a, call);
    TRACE_PHASE(a, PH_END);
}

// rsend[s]: rank s's own shard as mapped here (its send, or its recv + s*per in place).
template <typename D> __device__ void all_gather_reg(const SgArgs &g) {
    const Args &a = g.a;
    u32 *ctr = a.counters + 2 * blockIdx.x;
    u32 F = ctr[0];
    const u64 call = begin_call(a);
    TRACE_PHASE(a, PH_START); // (after the closed-counter check: see CALL_CLOSED)
    if (barrier(a, F, call, true)) { // inputs ready
        for (int k = 0; k < a.world; k++) {
            const int s = (a.rank + k) % a.world;
            u64 b, e;
            piece<D>(0, sg_shard_len(g, s), gridDim.x, blockIdx.x, b, e);
            copy_range<D, COPY_UNROLL>(a.recv + s * g.per * D::SIZE, a.rsend[s], b, e);
        }
        barrier(a, F, call); // done reading every send
    }
    if (threadIdx.x == 0) ctr[0] = F;
    finish_call(a, call);
    TRACE_PHASE(a, PH_END);
}

// Entry points: ipcr_reducescatter{,reg}_w<W>_<dtype>_<op> and ipcr_allgather{,reg}_<dtype> (no
// reduction: one kernel per element size would do, one per dtype keeps the table uniform).
// SG_ENTRY(NAME, CALL): as prims.cuh's ENTRY, for SgArgs.
#define SG_ENTRY(NAME, CALL)                                                                  \
    extern "C" __global__ void __launch_bounds__(512, 2) NAME(const SgArgs g) {               \
        wait_for_previous_kernel();                                                           \
        CALL;                                                                                 \
    }
#define SG_RS_KERNELS_W(DT, OPN, D, OP, W)                                                    \
    SG_ENTRY(ipcr_reducescatter_w##W##_##DT##_##OPN, (reduce_scatter_staged<D, OP, W>(g)))    \
    SG_ENTRY(ipcr_reducescatterreg_w##W##_##DT##_##OPN, (reduce_scatter_reg<D, OP, W>(g)))
#define SG_RS_KERNELS_FOR(DT, OPN, D, OP, W) SG_RS_KERNELS_W(DT, OPN, D, OP, W)
#define SG_AG_KERNELS(DT, D)                                                                  \
    SG_ENTRY(ipcr_allgather_##DT, (all_gather_staged<D>(g)))                                  \
    SG_ENTRY(ipcr_allgatherreg_##DT, (all_gather_reg<D>(g)))

#define SG_RS_KERNELS(DT, OPN, D, OP) SG_RS_KERNELS_FOR(DT, OPN, D, OP, IPCR_W)
#if !defined(IPCR_ONE_GROUP) || defined(IPCR_GROUP_SCATTER_GATHER)
FOR_EACH_DTYPE_OP(SG_RS_KERNELS)
#ifndef IPCR_SEL_DT
SG_AG_KERNELS(f32, F32)
SG_AG_KERNELS(f16, F16)
SG_AG_KERNELS(bf16, BF16)
#elif defined(IPCR_SEL_GATHER)
IPCR_APPLY(SG_AG_KERNELS, IPCR_SEL_DT, IPCR_SEL_D)
#endif
#endif
