// ipcreduce fused all-reduce + residual add + RMSNorm (sum only) over the LL protocol of ll.cu,
// for small calls; after fused.cu (fused_row, the numerics) and ll.cu (the lines).
//
// For small calls, ll.cu's protocol with rows. Every rank pushes each line of its input
// (8 data bytes, LL8 lines of ll.cu) into every peer's LL area, flag = ll_flag(digest, call),
// parity = call & 1, then each block sums its rows line by line from its own area in rank order
// into `out` (s = round(x_0 + ... + x_{W-1}), the one-shot's first step), and normalises them
// from there as the reference kernel normalises an all-reduced row (fused_row with one source):
// bitwise the outputs of the other paths. No barrier, no slot, no remote read. The host takes
// this path only when a row is a whole number of lines (hidden * size a multiple of 8) and the
// call fits the area (at most LL_MAX_BYTES per rank), so every line holds elements of one row.
// Rows are dealt to blocks in passes of P = pass_rows rows as in the one-shot kernel (pass p to
// block p mod grid), the same on every rank.
//
// Lines. ll.cu's argument that a line holds only zero or the current call's flag holds as it
// is: a line of ours is written only by its source rank, in calls of its parity, and read and
// cleared only by us in the call that consumes it (ll_wait clears it: one thread reads each
// line); a wait accepts a line only with both halves carrying our flag and reports any other
// non-zero flag as a mismatch. The grid is within the agreed CTA cap, so every block of every
// rank is resident while our blocks wait for their lines.
//
// The sum reads one line per thread, two ranks' lines at a time: the waits of a row overlap,
// where taking the row element by element through fused_row (as this kernel did) waited for
// each element's lines in turn.
//
// Aliasing. Line l of a pass is pushed and summed by the same thread (thread l mod blockDim
// of the pass's lines), which reads our input's line l in both before it writes out's line l:
// so out == input is safe. The block sums all its passes before it normalises any (the waits
// of every pass overlap, and fused_row's registers are not held across the waits); out's sums
// are read back by the block's threads after a barrier (fused_row's first pass, before any
// store to out in its second); residual and residual_out are as in the one-shot kernel.

// The pass's rows from their sums in out (the reference kernel's row, at out).
template <typename D> struct FusedLlRow {
    const FusedArgs &f;
    FusedShared<D> &sh;
    __device__ void run(u64 row, u32 G) const {
        fused_row<D, 1>(f, FusedOneSrc{f.a.recv + row * f.hidden * D::SIZE}, 1, row, sh, G);
    }
};

template <typename D, int W> __device__ void fused_ll(const FusedArgs &f) {
    __shared__ FusedShared<D> sh;
    const Args &a = f.a;
    const u64 call = begin_call(a);
    TRACE_PHASE(a, PH_START); // (after the closed-counter check: see CALL_CLOSED)
    const u32 flag = opaque(ll_flag(a.digest, call));
    const u32 parity = (u32)call & 1u;
    const u64 row_lines = f.hidden * D::SIZE / 8;
    const u64 total = f.tokens * f.hidden * D::SIZE;
    const u64 P = f.pass_rows;
    // Push: the lines of the block's passes, every peer in rotated order (links load evenly).
    for (u64 p = blockIdx.x; P * p < f.tokens; p += gridDim.x) {
        const u64 l0 = P * p * row_lines, l1 = min(P * p + P, f.tokens) * row_lines;
        for (u64 l = l0 + threadIdx.x; l < l1; l += blockDim.x) {
            const uint2 w = load_unit(a.send, l, total);
#pragma unroll
            for (int k = 1; k < W; k++) {
                if (k >= a.world) break;
                const int r = a.rank + k < a.world ? a.rank + k : a.rank + k - a.world;
                ll_put(ll_line(a, r, parity, a.rank, l), w.x, w.y, flag);
            }
        }
    }
    // After a failed wait no more waits: the call has failed, the values do not matter (every
    // thread still takes every barrier).
    bool ok = true;
    constexpr int E = 8 / D::SIZE; // elements per line
    for (u64 p = blockIdx.x; P * p < f.tokens; p += gridDim.x) {
        const u64 l0 = P * p * row_lines, l1 = min(P * p + P, f.tokens) * row_lines;
        for (u64 l = l0 + threadIdx.x; l < l1; l += blockDim.x) {
            // Two ranks' lines at a time, both peeked before either wait (every peer's at
            // once spills at four and eight ranks: 64 registers).
            float s[E];
#pragma unroll
            for (int r0 = 0; r0 < W; r0 += 2) {
                if (r0 >= a.world) break;
                ulonglong2 got[2];
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int r = r0 + h;
                    got[h] = make_ulonglong2(0ull, 0ull);
                    if (r < a.world && r != a.rank) got[h] = ll_peek(ll_line(a, a.rank, parity, r, l));
                }
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int r = r0 + h;
                    if (r >= a.world) break;
                    uint2 w = make_uint2(0u, 0u);
                    if (r == a.rank) w = load_unit(a.send, l, total);
                    else if (ok && ll_wait(a, parity, r, l, flag, got[h])) {
                        w = ll_data(got[h]);
                        // Thread 0's first line from r: when the block first saw r.
                        TRACE_PEER(a, threadIdx.x == 0 && l == l0 && p == blockIdx.x, r);
                    } else ok = false;
                    const char *b = (const char *)&w;
#pragma unroll
                    for (int k = 0; k < E; k++) {
                        const float x = D::load(b + k * D::SIZE);
                        s[k] = r == 0 ? x : __fadd_rn(s[k], x);
                    }
                }
            }
            uint2 o;
#pragma unroll
            for (int k = 0; k < E; k++) D::store((char *)&o + k * D::SIZE, s[k]);
            store_unit(a.recv, l, total, o);
        }
    }
    // The block's sums, written by every thread of it, read by the others; then its rows.
    __syncthreads();
    TRACE_PHASE(a, PH_REDUCE); // (the barrier above: the block's rows summed)
    for (u64 p = blockIdx.x; P * p < f.tokens; p += gridDim.x)
        fused_pass(P * p, min(P, f.tokens - P * p), FusedLlRow<D>{f, sh});
    TRACE_BLOCK(a, PH_GATHER); // the block's rows added and normalised
    finish_call(a, current_call(a));
    TRACE_PHASE(a, PH_END);
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
