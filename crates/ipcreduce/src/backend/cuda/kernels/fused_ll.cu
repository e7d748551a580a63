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
// (local row 2p + h to half h of block p mod grid), so every line of a row is pushed, read and
// cleared by the one half-block that owns the row on every rank.
//
// Lines. ll.cu's argument that a line holds only zero or the current call's flag holds as it
// is: a line of ours is written only by its source rank, in calls of its parity, and read and
// cleared only by us in the call that consumes it; a wait accepts a line only with both halves
// carrying our flag and reports any other non-zero flag as a mismatch. Several lanes read one
// line (4 bf16 elements, 2 f32 elements per line), so the wait does not clear: lane l mod 256 of
// the row's half-block clears line l of the row from every peer after fused_row returns, behind
// the tree's __syncthreads that follow every read of the row. The grid is within the agreed CTA
// cap, so block b of every rank is resident while our block b waits for its lines.
//
// Aliasing. Our input is read by the push (before any wait, so before the first __syncthreads
// of fused_row) and by the sum of our own rows; out is written in the epilogue after the tree's
// __syncthreads; residual and residual_out are as in the one-shot kernel.

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
    static constexpr int STEP = 1; // one wait at a time (fused.cu's FUSED_STEP)
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
    __shared__ float lanes[2][FUSED_LANES];
    const Args &a = f.a;
    const u64 call = begin_call(a);
    const u32 flag = opaque(ll_flag(a.digest, call));
    const u32 parity = (u32)call & 1u;
    const u64 row_bytes = f.hidden * D::SIZE, row_lines = row_bytes / 8;
    const int half = threadIdx.x / FUSED_LANES;
    const u32 j = threadIdx.x % FUSED_LANES;
    // Push: the lines of the block's rows, every peer in rotated order (links load evenly).
    for (u64 p = blockIdx.x; 2 * p < f.tokens; p += gridDim.x) {
        const u64 row = 2 * p + half;
        if (row >= f.tokens) continue;
        const char *src = a.send + row * row_bytes;
        for (u64 l = j; l < row_lines; l += FUSED_LANES) {
            const uint2 w = load_unit(src, l, row_bytes);
#pragma unroll
            for (int k = 1; k < W; k++) {
                if (k >= a.world) break;
                const int r = a.rank + k < a.world ? a.rank + k : a.rank + k - a.world;
                ll_put(ll_line(a, r, parity, a.rank, row * row_lines + l), w.x, w.y, flag);
            }
        }
    }
    bool ok = true;
    for (u64 p = blockIdx.x; 2 * p < f.tokens; p += gridDim.x) {
        const u64 lr = 2 * p + half;
        const bool active = lr < f.tokens;
        const u64 row = active ? lr : 2 * p;
        fused_row<D, W>(f, FusedLlSrc{a, a.send + row * row_bytes, row * row_lines, parity, flag, &ok},
                        a.world, row, active, lanes[half]);
        // Every lane's reads of the row are behind fused_row's __syncthreads: clear its lines.
        if (active)
            for (u64 l = j; l < row_lines; l += FUSED_LANES)
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
