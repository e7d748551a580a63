// ipcreduce fused all-reduce + residual add + RMSNorm (sum only), after staged.cu (its slots):
// the one-shot and two-shot kernels (the LL one is fused_ll.cu), and the reference kernel (add + norm of an already
// all-reduced buffer) the tests compare them with, bit for bit. Built on prims.cuh (its
// invariants are numbered there); the two-shot kernel's layout and ordering are at it, below.
//
// Numerics (crate::fused, docs/fused.md), per row: s = round(x_0 + ... + x_{W-1}) (rank order,
// f32); residual_out = round(s + residual); ss = sum of squares of f32(residual_out) over a
// fixed tree of FUSED_LANES = 256 lanes (lane j accumulates elements j, j + 256, ... in order
// with fmaf, then lane j += lane j + h for h = 128, ..., 1); rstd = 1 / sqrt(ss / hidden + eps)
// (IEEE division and square root); y = (f32(residual_out) * rstd) * f32(weight); out = round(y);
// fp8 = e4m3 satfinite of y / scale. Every step is written with its _rn intrinsic, so neither
// contraction nor a fast approximation can change a rounding. The tree does not depend on the
// grid, the chunking or the path: a rank's outputs are bitwise the same on every path, and equal
// to the all-reduce followed by the reference kernel with that rank's residual, weight and scale
// (each rank may pass its own).
//
// Work split. 512 threads per block (prims.cuh's ENTRY bounds, so the CTA caps hold). Rows are
// dealt to blocks in passes of P = FusedArgs::pass_rows rows (1, or 2: a pair), chosen by the
// host from the identity: one row per block while a chunk's rows fit the grid, pairs beyond.
// In the one-shot kernel local rows Pp .. Pp + P - 1 of a chunk go to block p mod grid (the
// two-shot kernel deals the passes to ranks first, see there). A lone row is taken by the
// whole block, a pair by the block's two halves of 256 threads, a row each at once
// (fused_pass). Which threads take a row never enters the numerics (fused_row_as).
//
// One-shot layout and ordering: staged.cu's, with chunks of whole rows. Chunk k (rows_per_chunk rows,
// set by the host so that a chunk fits a slot; the same on every rank) lives in slot parity
// (L0 + k) & 1 of every rank's data area, local row lr at lr * hidden elements. Block b copies
// in exactly the rows it reduces (the same on every rank: the grid and rows_per_chunk follow
// from the identity), then barriers with block b of every peer, so block b reads only what
// block b of a peer wrote; the short last chunk touches a subset of the same bytes. Copy-in of
// chunk k+1 follows the barrier of chunk k, the chunk counter L advances by the call's chunks,
// and there is no end barrier: staged.cu's argument for reuse across chunks and calls holds
// unchanged. Our own rows are read from the input, never from our slot. Each output element is
// read (residual, input) and written (residual_out, out) by one thread (fused_row's mapping),
// and the row's reads precede its barriers, so residual_out == residual and out == input are
// safe; peers only read our slot.
//
// No early trigger of the next kernel (programmatic dependent launch), on either path: the
// dependent launch happens at completion, after every output is written.

#define FUSED_LANES 256
#define FUSED_THREADS 512

// A row is taken in segments of FUSED_SEG_PACKS 16-byte packs per thread: every load of a
// segment (all ranks' elements, the residual) is issued before its first store (residual_out),
// which the compiler may not move a load across (they may alias an input). One element per
// lane and step, waiting for each step's loads, made a decode row latency-bound (a 16384-wide
// row was ~18 us). One pack (a bf16 segment of 4096 elements for the whole block, 2048 for a
// half) is what fits the 64 registers of two 512-thread blocks per SM (two spilled).
#define FUSED_SEG_PACKS 1

// The fused kernels' argument (backend/cuda/fused.rs `FusedKernelArgs`, field by field): the
// protocol's arguments (send = input, recv = out, count = tokens * hidden), then the rest.
struct FusedArgs {
    Args a;
    const char *residual;    // [tokens, hidden]
    const char *weight;      // [hidden]
    char *residual_out;      // [tokens, hidden]
    unsigned char *fp8_out;  // null, or [tokens, hidden]
    const float *fp8_scale;  // null, or one f32
    u64 tokens;
    u64 hidden;
    u64 rows_per_chunk;      // rows per chunk (a chunk fits a slot)
    u64 slot_stride;         // two-shot: bytes per row in a slot (16-byte multiple)
    float eps;
    u32 pass_rows;           // rows dealt to a block at a time: 1 or 2
};

// f32 -> e4m3, round to nearest even, finite values saturated to +-448, NaN -> 0x7F.
__device__ __forceinline__ unsigned char fused_e4m3(float x) {
#if __CUDA_ARCH__ >= 890
    u16 pair;
    // The second source goes to the low byte.
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.0f), "f"(x));
    return (unsigned char)(pair & 0xFF);
#else
    if (x != x) return 0x7F;
    const u32 bits = __float_as_uint(x);
    const unsigned char sign = (bits >> 24) & 0x80;
    const float a = fabsf(x);
    if (a >= 448.0f) return sign | 0x7E;
    const int e = (int)((bits >> 23) & 0xFF) - 127;
    u32 q;
    if (e < -6) {
        q = (u32)__float2int_rn(__fmul_rn(a, 512.0f)); // multiples of 2^-9, ties to even
    } else {
        const u32 mant = bits & 0x7FFFFF, keep = mant >> 20, rest = mant & 0xFFFFF;
        const u32 up = rest > 0x80000 || (rest == 0x80000 && (keep & 1));
        q = (((u32)(e + 7) << 3) | keep) + up;
    }
    return sign | (unsigned char)(q < 0x7E ? q : 0x7E);
#endif
}

// `v` rounded to D and back.
template <typename D> __device__ __forceinline__ float fused_round(float v) {
    char b[4];
    D::store(b, v);
    return D::load(b);
}

// One element of a source row as f32, loaded around L1 (.cg, as every load of peer-written
// memory in prims.cuh: a slot line cached in L1 from an earlier call would be stale).
template <typename D> __device__ __forceinline__ float fused_load_cg(const char *p) {
    char b[4];
    copy_elem_cg<D>(b, p);
    return D::load(b);
}

// A source of fused_row: `load(r, i)`, element i of rank r's row as f32; where `wide()` (block
// uniform), `load16(r, b)`, the 16 bytes at byte b of rank r's row (b a multiple of 16).

// Element i of rank r's row: peers' from their slot, ours from our input.
struct FusedSrc {
    const Args &a;
    u64 slot_row; // byte offset of the row in a slot
    const char *own;
    __device__ const char *of(int r) const { return r == a.rank ? own : a.data[r] + slot_row; }
    template <typename D> __device__ float load(int r, u64 i) const {
        return fused_load_cg<D>(of(r) + i * D::SIZE);
    }
    __device__ uint4 load16(int r, u64 b) const { return ld_cg16(of(r) + b); }
    __device__ bool wide() const {
        bool ok = true;
        for (int r = 0; r < a.world; r++) ok = ok && aligned16(of(r));
        return ok;
    }
};
// The reference kernel's and the two-shot epilogue's only source: the all-reduced row.
struct FusedOneSrc {
    const char *row;
    template <typename D> __device__ float load(int, u64 i) const { return fused_load_cg<D>(row + i * D::SIZE); }
    __device__ uint4 load16(int, u64 b) const { return ld_cg16(row + b); }
    __device__ bool wide() const { return aligned16(row); }
};

// What fused_row shares between the threads of a row: a segment's values of residual_out as
// f32 (for the lanes' sums of squares), the lanes' sums, and the row's rstd. A block's halves
// (two rows at once) take half of seg each, and a lanes and rstd each.
template <typename D> struct FusedShared {
    static const int SEG = FUSED_THREADS * FUSED_SEG_PACKS * (16 / D::SIZE); // elements
    float seg[SEG];
    float lanes[2][FUSED_LANES];
    float rstd[2];
};

// The barrier of the G threads that take a row (G = FUSED_THREADS or FUSED_THREADS / 2): the
// whole block's (named barrier 1) or its half's (1 and 2; prims.cuh uses only barrier 0). Like
// __syncthreads, it orders the shared and global memory accesses of the threads it joins.
__device__ __forceinline__ void fused_sync(u32 G) {
    asm volatile("bar.sync %0, %1;" ::"r"(threadIdx.x < G ? 1 : 2), "r"(G) : "memory");
}

// The f32 elements of a 16-byte pack, and back.
template <typename D> __device__ __forceinline__ float fused_unpack(const uint4 &w, int u) {
    return D::load((const char *)&w + u * D::SIZE);
}
template <typename D> __device__ __forceinline__ void fused_pack(uint4 &w, int u, float v) {
    D::store((char *)&w + u * D::SIZE, v);
}

// One row's sum and epilogue, by G threads (the whole block, G = FUSED_THREADS, or one half of
// it, G = FUSED_THREADS / 2: every thread of them calls it together, barriers). t is a thread's
// place among the G. The numerics' lanes are t = 0..FUSED_LANES-1: lane j's sum of squares
// takes elements j, j + FUSED_LANES, ... in increasing order from the segment's values in
// shared memory (segments are whole multiples of FUSED_LANES, so the order runs on across
// them), then the first warp adds the lanes' sums in the tree's order. Which thread loads and
// rounds an element does not enter the numerics: with 16-byte packs (WIDE: every pointer
// aligned, rows a whole number of packs) thread t takes packs t, t + G, ... of a segment,
// otherwise elements t, t + G, ...; each thread reads back (epilogue) only what it stored
// itself. Indices within a row are 32-bit (the host bounds hidden).
// G is a run-time value (one body of code for both: two would be over the register budget).
template <bool WIDE, typename D, int W, typename Src>
__device__ __forceinline__ void fused_row_as(const FusedArgs &f, const Src &src, int world, u64 row,
                                             FusedShared<D> &sh, u32 G) {
    static_assert(FUSED_THREADS / 2 >= FUSED_LANES, "a lane per thread at most");
    constexpr int N = 16 / D::SIZE;        // elements per pack
    constexpr int K = FUSED_SEG_PACKS * N; // elements per thread and segment
    const u32 SEG = G == FUSED_THREADS ? FusedShared<D>::SEG : FusedShared<D>::SEG / 2; // elements per segment
    // (No division by G: it is a power of two, but not a constant.)
    const u32 half = threadIdx.x < G ? 0 : 1; // 0 for the whole block
    const u32 t = threadIdx.x & (G - 1);
    float *seg = sh.seg + half * SEG;
    float *lanes = sh.lanes[half];
    const u32 H = (u32)f.hidden;
    const u64 o = row * f.hidden * D::SIZE;
    const char *residual = f.residual + o;
    char *residual_out = f.residual_out + o;
    char *out = f.a.recv + o;
    const bool one_segment = H <= SEG;
    // This thread's k-th element of the segment at e0 (the mapping above); in WIDE, k % N == 0
    // is the first element of a pack.
    auto elem = [&](u32 e0, int k) -> u32 {
        return WIDE ? e0 + (t + (u32)(k / N) * G) * N + k % N : e0 + t + (u32)k * G;
    };
    float v[K]; // WIDE: the sums, then residual_out as rounded, then y
    float acc = 0.0f;
    for (u32 e0 = 0; e0 < H; e0 += SEG) {
        // The sums in rank order (the loads of every rank go out before the first store).
#pragma unroll
        for (int k = 0; k < K; k++) v[k] = 0.0f;
        if (WIDE) {
            auto add_rank = [&](int r) {
#pragma unroll
                for (int m = 0; m < FUSED_SEG_PACKS; m++) {
                    const u32 i = elem(e0, m * N);
                    if (i < H) {
                        const uint4 x = src.load16(r, (u64)i * D::SIZE);
#pragma unroll
                        for (int u = 0; u < N; u++)
                            v[m * N + u] = r == 0 ? fused_unpack<D>(x, u) : __fadd_rn(v[m * N + u], fused_unpack<D>(x, u));
                    }
                }
            };
            // f32 above four ranks: four ranks' packs at a time (all of them at once spill; the
            // 16-bit types fit with every rank's loads at once, and spill in batches).
            if (W <= 4 || D::SIZE != 4) {
#pragma unroll
                for (int r = 0; r < W; r++)
                    if (r < world) add_rank(r);
            } else {
#pragma unroll 4
                for (int r = 0; r < W; r++)
                    if (r < world) add_rank(r);
            }
        }
        if (!WIDE) {
            // Element by element, the values straight to shared memory (no registers held), the
            // stores to residual_out after every load of the segment.
#pragma unroll 1
            for (int k = 0; k < K; k++) {
                const u32 i = elem(e0, k);
                if (i < H) {
                    float x = src.template load<D>(0, i);
                    // Above four ranks, four ranks' loads at a time: all eight beside the WIDE
                    // body's values are over the register budget.
                    if (W <= 4) {
#pragma unroll
                        for (int r = 1; r < W; r++)
                            if (r < world) x = __fadd_rn(x, src.template load<D>(r, i));
                    } else {
#pragma unroll 4
                        for (int r = 1; r < W; r++)
                            if (r < world) x = __fadd_rn(x, src.template load<D>(r, i));
                    }
                    seg[i - e0] = fused_round<D>(__fadd_rn(fused_round<D>(x), D::load(residual + (u64)i * D::SIZE)));
                }
            }
        }
        // residual_out = round(round(s) + residual): stored, and kept for the lanes.
        if (WIDE) {
#pragma unroll
            for (int m = 0; m < FUSED_SEG_PACKS; m++) {
                const u32 i = elem(e0, m * N);
                if (i < H) {
                    const uint4 rr = *(const uint4 *)(residual + (u64)i * D::SIZE);
                    uint4 w;
#pragma unroll
                    for (int u = 0; u < N; u++) {
                        float &x = v[m * N + u];
                        x = fused_round<D>(__fadd_rn(fused_round<D>(x), fused_unpack<D>(rr, u)));
                        fused_pack<D>(w, u, x);
                        seg[i - e0 + u] = x;
                    }
                    *(uint4 *)(residual_out + (u64)i * D::SIZE) = w;
                }
            }
        } else {
#pragma unroll 4
            for (int k = 0; k < K; k++) {
                const u32 i = elem(e0, k);
                if (i < H) D::store(residual_out + (u64)i * D::SIZE, seg[i - e0]);
            }
        }
        fused_sync(G);
        if (t < FUSED_LANES) {
            const u32 end = min(SEG, H - e0);
#pragma unroll 4
            for (u32 c = t; c < end; c += FUSED_LANES) acc = __fmaf_rn(seg[c], seg[c], acc);
        }
        // The next segment's values overwrite these.
        if (e0 + SEG < H) fused_sync(G);
    }
    if (t < FUSED_LANES) lanes[t] = acc;
    fused_sync(G);
    if (t < 32) {
        // The tree, lane j += lane j + h for h = 128, ..., 1: warp lane t holds lanes t + 32m
        // (m < 8) and takes h = 128, 64, 32 in registers, then h = 16, ..., 1 by shuffles (lane t
        // < h reads lane t + h, as in the tree; the other lanes' values are not read again).
        float x[8];
#pragma unroll
        for (int m = 0; m < 8; m++) x[m] = lanes[t + 32 * m];
#pragma unroll
        for (int m = 0; m < 4; m++) x[m] = __fadd_rn(x[m], x[m + 4]);
#pragma unroll
        for (int m = 0; m < 2; m++) x[m] = __fadd_rn(x[m], x[m + 2]);
        float ss = __fadd_rn(x[0], x[1]);
#pragma unroll
        for (int h = 16; h > 0; h /= 2) ss = __fadd_rn(ss, __shfl_down_sync(0xffffffffu, ss, h));
        if (t == 0) sh.rstd[half] = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, (float)H), f.eps)));
    }
    fused_sync(G);
    const float rstd = sh.rstd[half];
    const float scale = f.fp8_out ? *f.fp8_scale : 1.0f;
    for (u32 e0 = 0; e0 < H; e0 += SEG) {
        // y = (residual_out * rstd) * weight, residual_out as this thread stored it (in one
        // segment still in shared memory), in place of v.
        if (WIDE) {
#pragma unroll
            for (int m = 0; m < FUSED_SEG_PACKS; m++) {
                const u32 i = elem(e0, m * N);
                if (i < H) {
                    const uint4 ww = *(const uint4 *)(f.weight + (u64)i * D::SIZE);
                    uint4 rr = make_uint4(0u, 0u, 0u, 0u), yy;
                    if (!one_segment) rr = *(const uint4 *)(residual_out + (u64)i * D::SIZE);
#pragma unroll
                    for (int u = 0; u < N; u++) {
                        float &x = v[m * N + u];
                        x = one_segment ? seg[i - e0 + u] : fused_unpack<D>(rr, u);
                        x = __fmul_rn(__fmul_rn(x, rstd), fused_unpack<D>(ww, u));
                        fused_pack<D>(yy, u, x);
                    }
                    *(uint4 *)(out + (u64)i * D::SIZE) = yy;
                }
            }
            if (f.fp8_out)
#pragma unroll
                for (int k = 0; k < K; k++) {
                    const u32 i = elem(e0, k);
                    if (i < H) f.fp8_out[row * f.hidden + i] = fused_e4m3(__fdiv_rn(v[k], scale));
                }
        } else {
            // residual_out from shared memory in one segment (this segment's, still there).
#pragma unroll 4
            for (int k = 0; k < K; k++) {
                const u32 i = elem(e0, k);
                if (i < H) {
                    const float x = one_segment ? seg[i - e0] : D::load(residual_out + (u64)i * D::SIZE);
                    const float y = __fmul_rn(__fmul_rn(x, rstd), D::load(f.weight + (u64)i * D::SIZE));
                    D::store(out + (u64)i * D::SIZE, y);
                    if (f.fp8_out) f.fp8_out[row * f.hidden + i] = fused_e4m3(__fdiv_rn(y, scale));
                }
            }
        }
    }
    // rstd and seg were read by every thread: the next row's writes wait for all of them.
    fused_sync(G);
}

// fused_row_as with 16-byte packs where the row's pointers allow (uniform across the G threads).
template <typename D, int W, typename Src>
__device__ void fused_row(const FusedArgs &f, const Src &src, int world, u64 row, FusedShared<D> &sh, u32 G) {
    const bool wide = (f.hidden * D::SIZE) % 16 == 0 && src.wide() && aligned16(f.residual) &&
                      aligned16(f.residual_out) && aligned16(f.a.recv) && aligned16(f.weight);
    if (wide) fused_row_as<true, D, W>(f, src, world, row, sh, G);
    else fused_row_as<false, D, W>(f, src, world, row, sh, G);
}

// The rows of a pass, lr0 .. lr0 + n - 1 (n = 1 or 2; block-uniform), by the block: a lone row
// by the whole block, a pair by its two halves at once. row_of.run(lr, G) runs fused_row (or a
// fused_row_as) of local row lr by G threads.
template <typename RowOf>
__device__ __forceinline__ void fused_pass(u64 lr0, u64 n, const RowOf &row_of) {
    const u32 G = n == 2 ? FUSED_THREADS / 2 : FUSED_THREADS;
    row_of.run(threadIdx.x >= G ? lr0 + 1 : lr0, G);
}

// Block b's rows of chunk k (starting at row r0, n rows) from our input into our slot of
// chunk counter L.
template <typename D>
__device__ void fused_copy_in(const FusedArgs &f, u32 L, u64 r0, u64 n) {
    const Args &a = f.a;
    const u64 row_bytes = f.hidden * D::SIZE;
    char *slot = a.data[a.rank] + slot_offset(a, L);
    const bool wide = row_bytes % 16 == 0 && aligned16(a.send);
    const u64 P = f.pass_rows;
    for (u64 p = blockIdx.x; P * p < n; p += gridDim.x) {
        const u64 lr0 = P * p, rows = min(P, n - lr0);
        char *dst = slot + lr0 * row_bytes;
        const char *src = a.send + (r0 + lr0) * row_bytes;
        const u64 bytes = rows * row_bytes;
        if (wide) {
            for (u64 b = threadIdx.x * 16; b < bytes; b += blockDim.x * 16)
                *(uint4 *)(dst + b) = ld_cg16(src + b);
        } else {
            for (u64 e = threadIdx.x; e * D::SIZE < bytes; e += blockDim.x)
                copy_elem_cg<D>(dst + e * D::SIZE, src + e * D::SIZE);
        }
    }
}

// Local row lr of the one-shot chunk at slot offset `off` (row r0).
template <typename D, int W> struct FusedOneShotRow {
    const FusedArgs &f;
    u64 off, r0;
    FusedShared<D> &sh;
    __device__ void run(u64 lr, u32 G) const {
        const u64 row_bytes = f.hidden * D::SIZE;
        fused_row<D, W>(f, FusedSrc{f.a, off + lr * row_bytes, f.a.send + (r0 + lr) * row_bytes}, f.a.world,
                        r0 + lr, sh, G);
    }
};

template <typename D, int W> __device__ void fused_one_shot(const FusedArgs &f) {
    __shared__ FusedShared<D> sh;
    const Args &a = f.a;
    u32 *ctr = a.counters + 2 * blockIdx.x;
    u32 *st = a.counters + STATE_CALL;
    const u64 call = begin_call(a);
    TRACE_PHASE(a, PH_START); // (after the closed-counter check: see CALL_CLOSED)
    u32 F = ctr[0];
    const u32 L0 = *(volatile u32 *)&st[3];
    const u64 rpc = f.rows_per_chunk;
    const u32 chunks = (u32)((f.tokens + rpc - 1) / rpc);
    const u64 row_bytes = f.hidden * D::SIZE;
    const u64 P = f.pass_rows;
    fused_copy_in<D>(f, L0, 0, min(rpc, f.tokens));
    for (u32 k = 0; k < chunks; k++) {
        const u64 r0 = (u64)k * rpc;
        const u64 n = min(rpc, f.tokens - r0);
        const u64 off = slot_offset(a, L0 + k);
        if (!barrier(a, F, call, k == 0)) break;
        if (k + 1 < chunks) fused_copy_in<D>(f, L0 + k + 1, r0 + rpc, min(rpc, f.tokens - r0 - rpc));
        const FusedOneShotRow<D, W> row_of{f, off, r0, sh};
        for (u64 p = blockIdx.x; P * p < n; p += gridDim.x) fused_pass(P * p, min(P, n - P * p), row_of);
    }
    TRACE_BLOCK(a, PH_REDUCE); // the last chunk's rows summed and normalised
    if (threadIdx.x == 0) ctr[0] = F;
    finish_call(a, call, true, L0 + chunks);
    TRACE_PHASE(a, PH_END);
}

// ---------------------------------------------------------------------------------------------
// Two-shot: rows dealt to ranks. Each rank sums its share of the rows once (reduce-scatter) and
// leaves the rounded sums in its slot, from where every rank reads every row's sum and runs the
// epilogue with its own residual, weight, eps and fp8 scale (all-gather of the sums): every rank
// reads 1/W of the peers' input rows instead of all of them, and its outputs are bitwise the
// one-shot's and the reference's whatever the other ranks' residual and weight are.
//
// Layout. Chunk k (rows_per_chunk rows, so that a chunk fits a slot) lives in slot parity
// (L0 + k) & 1 of every rank's data area, as in the one-shot kernel, local row lr at
// lr * slot_stride bytes (hidden elements, on a 16-byte stride). The place of a row a peer owns
// holds our input row, for its owner; the place of a row we own (which no copy-in writes: our
// own rows are read from our input) holds the row's sum s = round(x_0 + ... + x_{W-1}), for
// every rank. Local rows go in passes of P rows (1 or 2, the host's pass_rows): pass p = lr / P
// is owned by rank p mod W and handled by block (p / W) mod grid on every rank (the grid,
// rows_per_chunk and P follow from the identity). So block b of every rank touches the same rows of every slot, in
// both phases, and in the short last chunk a subset of them.
//
// One block, per chunk k: (1) copy-in: our input rows of block b's passes that a peer owns, into
// our slot; (2) barrier A_k with block b of every peer; (3) reduce: each row of a pass we own,
// summed in rank order in f32 from the peers' copies in their slots and our input, rounded to
// the dtype (the one-shot's first step), stored at the row's place in our slot; (4) barrier B_k
// with block b of every peer; (5) epilogue: every row of block b's passes, its sum read from the
// owner's slot (ours for our rows) and normalised by fused_row with our residual, weight and
// scale (the one-shot's numerics and tree: s is the one-shot's s, bit for bit); then copy-in (1)
// of chunk k+1.
//
// Reuse of the slots. Our slot's rows of block b in chunk k are written by us only, in (1)
// (peers' rows, before A_k) and (3) (ours, between A_k and B_k, at places (1) never writes);
// they are read by the owners in (3) (between A_k and B_k, the peers' rows) and by every rank in
// (5) (after B_k and before it enters A_{k+1}, our rows), so no write races a read of the same
// chunk. The next writes of that parity, chunk k+2's copy-in and sums, follow B_{k+1}, which
// every peer enters only after its epilogue (5) of chunk k; our own (5) of k precedes them in
// program order (barriers begin with __syncthreads). Chunk k+1's copy-in, after our (5) of k,
// writes the other parity, last read by the peers in their (5) of chunk k-1, before they entered
// A_k, which we passed. Across calls: peers may still be reading the last chunk's sums from our
// slot when the call ends (no end barrier), exactly as peers of staged.cu's one-shot kernel may
// still read it; the next call's first chunk takes the other parity (the rank-wide chunk
// counter), and nothing writes the last chunk's parity before the next call's first barriers,
// which a peer enters only after this call completed. So staged.cu's argument holds unchanged.
//
// Aliasing. Our input is read only by us, in (1) and (3) of its chunk, before B_k; with
// out == input the epilogue (5) of chunk k writes only rows of chunk k, after B_k (and block b
// only the rows of its passes, which no other block reads). residual is read only in (5), by the
// thread that then writes residual_out there (as in the one-shot kernel), and out is written by
// that thread after the row's tree. Peers only read our slot.

// The unsigned integer of an element's size (copies move bits, converting nothing).
template <int S> struct FusedUnit;
template <> struct FusedUnit<4> { typedef unsigned int T; };
template <> struct FusedUnit<2> { typedef unsigned short T; };
template <> struct FusedUnit<1> { typedef unsigned char T; };

// `n` units of T from `src` to `dst` by the whole block, 16 bytes at a time where both
// addresses and the length allow.
template <typename T> __device__ __forceinline__ void fused_copy(char *dst, const char *src, u64 n) {
    const u64 bytes = n * sizeof(T);
    if ((((u64)dst | (u64)src | bytes) & 15) == 0) {
        for (u64 b = threadIdx.x * 16; b < bytes; b += blockDim.x * 16)
            *(uint4 *)(dst + b) = ld_cg16(src + b);
    } else {
        for (u64 i = threadIdx.x; i < n; i += blockDim.x) ((T *)dst)[i] = __ldcg((const T *)src + i);
    }
}

// (1): our input rows of block b's passes a peer owns, of the chunk at row r0 (n rows), into our
// slot of chunk counter L.
template <typename D> __device__ void fused_two_copy_in(const FusedArgs &f, u32 L, u64 r0, u64 n) {
    const Args &a = f.a;
    const u64 row_bytes = f.hidden * D::SIZE;
    char *slot = a.data[a.rank] + slot_offset(a, L);
    const u64 P = f.pass_rows;
    for (u64 q = blockIdx.x; P * q * a.world < n; q += gridDim.x)
        for (int r = 0; r < a.world; r++) {
            const u64 p = q * a.world + r;
            if (r == a.rank) continue;
            for (u64 lr = P * p; lr < min(P * p + P, n); lr++)
                fused_copy<typename FusedUnit<D::SIZE>::T>(slot + lr * f.slot_stride, a.send + (r0 + lr) * row_bytes, f.hidden);
        }
}

// (3): the sums of block b's passes we own, of the chunk at slot offset `off` (row r0, n rows),
// each element by one thread, in rank order as fused_row sums them, into our slot.
template <typename D, int W> __device__ void fused_two_sum(const FusedArgs &f, u64 off, u64 r0, u64 n) {
    const Args &a = f.a;
    const u64 H = f.hidden, row_bytes = H * D::SIZE;
    char *slot = a.data[a.rank] + off;
    const u64 P = f.pass_rows;
    for (u64 q = blockIdx.x;; q += gridDim.x) {
        const u64 p = q * a.world + a.rank;
        if (P * p >= n) break;
        for (u64 lr = P * p; lr < min(P * p + P, n); lr++) {
            const FusedSrc src{a, off + lr * f.slot_stride, a.send + (r0 + lr) * row_bytes};
            char *dst = slot + lr * f.slot_stride;
            // One element at a time: more spill from two ranks on (64 registers).
            for (u64 i = threadIdx.x; i < H; i += blockDim.x) {
                float s = src.template load<D>(0, i);
#pragma unroll
                for (int r = 1; r < W; r++)
                    if (r < a.world) s = __fadd_rn(s, src.template load<D>(r, i));
                D::store(dst + i * D::SIZE, s);
            }
        }
    }
}

// Local row lr of a chunk (row r0) from its sums at `sums` (a slot's chunk), element by element
// (the two-shot epilogue; the reference's rows, with r0 = 0, are its input).
template <typename D> struct FusedSumRow {
    const FusedArgs &f;
    const char *sums;
    u64 r0;
    FusedShared<D> &sh;
    __device__ void run(u64 lr, u32 G) const {
        fused_row_as<false, D, 1>(f, FusedOneSrc{sums + lr * f.slot_stride}, 1, r0 + lr, sh, G);
    }
};

template <typename D, int W> __device__ void fused_two_shot(const FusedArgs &f) {
    __shared__ FusedShared<D> sh;
    const Args &a = f.a;
    u32 *ctr = a.counters + 2 * blockIdx.x;
    u32 *st = a.counters + STATE_CALL;
    const u64 call = begin_call(a);
    TRACE_PHASE(a, PH_START); // (after the closed-counter check: see CALL_CLOSED)
    u32 F = ctr[0];
    const u32 L0 = *(volatile u32 *)&st[3];
    const u64 rpc = f.rows_per_chunk;
    const u32 chunks = (u32)((f.tokens + rpc - 1) / rpc);
    const u64 P = f.pass_rows;
    fused_two_copy_in<D>(f, L0, 0, min(rpc, f.tokens));
    for (u32 k = 0; k < chunks; k++) {
        const u64 r0 = (u64)k * rpc;
        const u64 n = min(rpc, f.tokens - r0);
        const u64 off = slot_offset(a, L0 + k);
        if (!barrier(a, F, call, k == 0)) break;
        fused_two_sum<D, W>(f, off, r0, n);
        TRACE_BLOCK(a, PH_REDUCE); // (the last chunk's stamp stays)
        if (!barrier(a, F, call)) break;
        // Every pass of block b: pass q * W + r, owned by rank r (block-uniform).
        for (u64 q = blockIdx.x; P * q * a.world < n; q += gridDim.x)
            for (int r = 0; r < a.world; r++) {
                const u64 p = q * a.world + r;
                if (P * p >= n) break;
                fused_pass(P * p, min(P, n - P * p), FusedSumRow<D>{f, a.data[r] + off, r0, sh});
            }
        if (k + 1 < chunks) fused_two_copy_in<D>(f, L0 + k + 1, r0 + rpc, min(rpc, f.tokens - r0 - rpc));
        TRACE_BLOCK(a, PH_GATHER); // the chunk's rows normalised (the last chunk's stamp stays)
    }
    if (threadIdx.x == 0) ctr[0] = F;
    finish_call(a, call, true, L0 + chunks);
    TRACE_PHASE(a, PH_END);
}

// The reference: no peers, no protocol state (it is not a call: the call counter stays). Its
// rows are its input, 16 bytes at a time where aligned, as the one-shot kernel's.
template <typename D> struct FusedRefRow {
    const FusedArgs &f;
    FusedShared<D> &sh;
    __device__ void run(u64 row, u32 G) const {
        fused_row<D, 1>(f, FusedOneSrc{f.a.send + row * f.hidden * D::SIZE}, 1, row, sh, G);
    }
};
template <typename D> __device__ void fused_reference(const FusedArgs &f) {
    __shared__ FusedShared<D> sh;
    const FusedRefRow<D> row_of{f, sh};
    const u64 P = f.pass_rows;
    for (u64 p = blockIdx.x; P * p < f.tokens; p += gridDim.x) fused_pass(P * p, min(P, f.tokens - P * p), row_of);
}

// Entry points: ipcr_fused{oneshot,twoshot}_w<W>_<dtype> and ipcr_fusedref_<dtype> (sum only: emitted in
// the sum variant, IPCR_SEL_GATHER, like the all-gather kernels).
#define FUSED_ENTRY(NAME, CALL)                                                               \
    extern "C" __global__ void __launch_bounds__(512, 2) NAME(const FusedArgs f) {            \
        wait_for_previous_kernel();                                                           \
        CALL;                                                                                 \
    }
#define FUSED_KERNELS_W(DT, D, W)                                                             \
    FUSED_ENTRY(ipcr_fusedoneshot_w##W##_##DT, (fused_one_shot<D, W>(f)))                     \
    FUSED_ENTRY(ipcr_fusedtwoshot_w##W##_##DT, (fused_two_shot<D, W>(f)))                     \
    FUSED_ENTRY(ipcr_fusedref_##DT, (fused_reference<D>(f)))
#define FUSED_KERNELS_FOR(DT, D, W) FUSED_KERNELS_W(DT, D, W)
#define FUSED_KERNELS(DT, D) FUSED_KERNELS_FOR(DT, D, IPCR_W)
#if !defined(IPCR_ONE_GROUP) || defined(IPCR_GROUP_FUSED)
#ifndef IPCR_SEL_DT
FUSED_KERNELS(f32, F32)
FUSED_KERNELS(f16, F16)
FUSED_KERNELS(bf16, BF16)
#elif defined(IPCR_SEL_GATHER)
IPCR_APPLY(FUSED_KERNELS, IPCR_SEL_DT, IPCR_SEL_D)
#endif
#endif
