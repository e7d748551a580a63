// ipcreduce fused all-reduce + residual add + RMSNorm (sum only) over the LL protocol of ll.cu,
// for small calls; after fused.cu (fused_row, the numerics) and ll.cu (the lines).
//
// For small calls, ll.cu's protocol with rows. Every rank pushes each line of its input
// (8 data bytes, LL8 lines of ll.cu) into every peer's LL area, flag = ll_flag(digest, call),
// parity = call & 1, then each block sums its rows from its own area in rank order and
// normalises them as fused_row does (bitwise the outputs of the other paths): no barrier, no
// slot, no remote read. The host takes this path only when a row is a whole number of lines
// (hidden * size a multiple of 8) and the call fits the area (at most LL_MAX_BYTES per rank), so
// every line holds elements of one row, and rows are dealt to blocks as in the one-shot kernel
// (rows 2p and 2p + 1 to block p mod grid), so every line of a row is pushed, read and cleared
// by the one block that owns the row on every rank.
//
// Lines. ll.cu's argument that a line holds only zero or the current call's flag holds as it
// is: a line of ours is written only by its source rank, in calls of its parity, and read and
// cleared only by us in the call that consumes it; a wait accepts a line only with both halves
// carrying our flag and reports any other non-zero flag as a mismatch. Several threads read one
// line (4 bf16 elements, 2 f32 elements per line), so the wait does not clear: thread l mod 512
// of the block clears line l of the row from every peer after fused_row returns, behind its
// last barrier, which follows every read of the row. The grid is within the agreed CTA
// cap, so block b of every rank is resident while our block b waits for its lines.
//
// Aliasing. Our input is read by the push (before any wait, so before the first barrier
// of fused_row) and by the sum of our own rows; out is written in the epilogue after the tree's
// barrier; residual and residual_out are as in the one-shot kernel.

// Waits for peer `from`'s line i of this call (ll_wait without the clear), into `v`.
__device__ bool fused_ll_wait(const Args &a, u32 parity, int from, u64 i, u32 flag, ulonglong2 &v) {
    const ulonglong2 *line = ll_line(a, a.rank, parity, from, i);
    u64 deadline = 0;
    u32 spins = 0;
    v = ll_peek(line);
    while (!ll_ready(v, flag)) {
        if ((++spins & 1023u) == 0u) {
            const u64 call = current_call(a);
            if (ll_foreign(v, flag)) {
                report(a, ERR_MISMATCH, from, (u32)i, call);
                return false;
            }
            if (wait_must_end(a, from, (u32)i, call, deadline)) return false;
        }
        v = ll_peek(line);
    }
    return true;
}

// Element i of rank r's row `row`: ours from our input, peers' from their lines in our LL area.
// After a failed wait (`ok` false) no more waits: the call has failed, the values do not matter.
struct FusedLlSrc {
    const Args &a;
    const char *own;
    u64 line0; // the row's first line
    u32 parity, flag;
    bool *ok;
    __device__ bool wide() const { return false; } // every element a wait: never in packs
    __device__ uint4 load16(int, u64) const { return make_uint4(0u, 0u, 0u, 0u); }
    template <typename D> __device__ float load(int r, u64 i) const {
        if (r == a.rank) return D::load(own + i * D::SIZE);
        const u64 b = i * D::SIZE;
        ulonglong2 v = make_ulonglong2(0ull, 0ull);
        if (*ok && !fused_ll_wait(a, parity, r, line0 + b / 8, flag, v)) *ok = false;
        const u32 word = (b & 4) ? (u32)v.y : (u32)v.x; // the line's data: x low word first
        char e[4];
        if (D::SIZE == 4) *(u32 *)e = word;
        else *(u16 *)e = (b & 2) ? (u16)(word >> 16) : (u16)word;
        return D::load(e);
    }
};

template <typename D, int W> __device__ void fused_ll(const FusedArgs &f) {
    __shared__ FusedShared<D> sh;
    const Args &a = f.a;
    const u64 call = begin_call(a);
    const u32 flag = opaque(ll_flag(a.digest, call));
    const u32 parity = (u32)call & 1u;
    const u64 row_bytes = f.hidden * D::SIZE, row_lines = row_bytes / 8;
    // Push: the lines of the block's pair of rows, every peer in rotated order (links load
    // evenly).
    for (u64 p = blockIdx.x; 2 * p < f.tokens; p += gridDim.x) {
        const u64 l0 = 2 * p * row_lines, l1 = min(2 * p + 2, f.tokens) * row_lines;
        for (u64 l = l0 + threadIdx.x; l < l1; l += blockDim.x) {
            const uint2 w = load_unit(a.send, l, f.tokens * row_bytes);
#pragma unroll
            for (int k = 1; k < W; k++) {
                if (k >= a.world) break;
                const int r = a.rank + k < a.world ? a.rank + k : a.rank + k - a.world;
                ll_put(ll_line(a, r, parity, a.rank, l), w.x, w.y, flag);
            }
        }
    }
    bool ok = true;
    for (u64 p = blockIdx.x; 2 * p < f.tokens; p += gridDim.x)
        for (u64 row = 2 * p; row < min(2 * p + 2, f.tokens); row++) {
            fused_row<D, W>(f, FusedLlSrc{a, a.send + row * row_bytes, row * row_lines, parity, flag, &ok},
                            a.world, row, sh, FUSED_THREADS);
            // Every thread's reads of the row are behind fused_row's last barrier: clear
            // its lines.
            for (u64 l = threadIdx.x; l < row_lines; l += blockDim.x)
#pragma unroll
                for (int r = 0; r < W; r++)
                    if (r < a.world && r != a.rank) ll_clear(ll_line(a, a.rank, parity, r, row * row_lines + l));
        }
    finish_call(a, current_call(a));
}

// Entry points: ipcr_fusedll_w<W>_<dtype> (sum only, like fused.cu's).
#define FUSED_LL_KERNELS_W(DT, D, W) FUSED_ENTRY(ipcr_fusedll_w##W##_##DT, (fused_ll<D, W>(f)))
#define FUSED_LL_KERNELS_FOR(DT, D, W) FUSED_LL_KERNELS_W(DT, D, W)
#define FUSED_LL_KERNELS(DT, D) FUSED_LL_KERNELS_FOR(DT, D, IPCR_W)
#if !defined(IPCR_ONE_GROUP) || defined(IPCR_GROUP_FUSED)
#ifndef IPCR_SEL_DT
FUSED_LL_KERNELS(f32, F32)
FUSED_LL_KERNELS(f16, F16)
FUSED_LL_KERNELS(bf16, BF16)
#elif defined(IPCR_SEL_GATHER)
IPCR_APPLY(FUSED_LL_KERNELS, IPCR_SEL_DT, IPCR_SEL_D)
#endif
#endif
