// Low-latency one-shot all-reduce (LL) for messages up to LL_MAX_BYTES, and the empty call
// (count 0, any operation). Built on prims.cuh.
//
// Layout. The LL area of rank o holds lines[2][world][LL_LINES] of 16 bytes: lines[p][s][i] is
// written only by rank s (its pushes of call numbers of parity p) and read and cleared only by
// rank o. LL8: line i carries data bytes [8i, 8i+8) as two halves {4 data bytes, flag}, each one
// single-copy-atomic 64-bit element of a .v2.u64 access (prims.cuh). LL12 (IPCREDUCE_LL_DATA=12):
// line i carries bytes [12i, 12i+12) as {d0, d1, d2, flag}, which relies on 16-byte single-copy
// atomicity: NVLink and a GPU's own memory give it in practice, PTX does not promise it, so the
// host allows LL12 only on the NVLink peer fabric.
//
// Protocol. Every rank pushes each line of its input into every peer's area (parity = call & 1,
// flag = ll_flag(digest, call)), then reduces by polling its OWN area, in rank order: no
// barrier, no remote reads. A line is accepted only when both halves carry our flag; after
// reading it the reader clears it to zero. The empty call pushes one line of no data (line 0),
// so a count-0 call still meets its peers' calls and is compared with them.
//
// Why a line holds only zero or the current call's flag (so stale data is impossible, not just
// improbable, and any other non-zero flag is a mismatch): consider lines[p][s][i] of rank o and
// a write W of it by s in call N. The next write of it by s is in some call M >= N + 2 (the same
// parity). Rank o reads and clears the line in its call N (only o's call N consumes it: the
// identities agree, else the communicator fails, so o waits for exactly the lines s writes).
// s starts call M only after its call N + 1 completed, and N + 1 (of any protocol: LL lines,
// barrier flags) needs data o wrote in its call N + 1, which o starts only after its kernel of
// call N ended, clear included (stream order; kernel completion makes the kernel's writes
// visible). So the clear is ordered before o's N + 1 write, which s observed before its N + 1
// ended, which is before s's write in M: the clear precedes the next write of the line and
// cannot erase it, and the line is zero from the clear until then. So no argument rests on the
// flag differing from an earlier call's (it is 32 bits and repeats after 2^32 calls): what a
// reader accepts was written in its own call; and every rank's call numbers are paired
// (prims.cuh, invariant 1).
// A peer that called with another identity writes lines with another flag (seen on the wait's
// slow path) or none at all (its board entry differs): a mismatch, named at once. (Two
// identities whose digests agree in their low 32 bits would share flags: a 2^-32 chance per
// pair of different calls, as for any 32-bit flag.)
//
// Each thread owns 16-byte pairs of lines (grid-stride): one 16-byte load of its input, two lines
// to every peer, then the lines of every peer peeked at once before it waits on any (both lines
// at two ranks, one line at a time at more), so a thread has several polls in flight, not one.
// The fast path of a wait is one load and a compare; the board, foreign flags, abort and the
// deadline are looked at every 1024 reads.

// The push order of both LL kernels: every peer in one pass, in rotated order so links load
// evenly, or under the PCIe policy (MODE_PUSH_PASSES) one peer per pass, the whole input to one
// peer and then to the next.
__device__ __forceinline__ int ll_passes(const Args &a) {
    return (a.mode & MODE_PUSH_PASSES) != 0 ? a.world - 1 : 1;
}
// Whether pass `pass` pushes to the k-th peer after this rank (1 <= k < W), which is rank `r`.
__device__ __forceinline__ bool ll_pushes_to(const Args &a, int pass, int k, int &r) {
    const bool all = (a.mode & MODE_PUSH_PASSES) == 0;
    r = a.rank + k;
    if (r >= a.world) r -= a.world;
    return k < a.world && (all || k == pass + 1);
}

// 8 bytes of `src` at unit i (zero past `total` bytes); byte by byte when not 8-byte aligned.
// Never dereferences `src` when total is 0.
__device__ __forceinline__ uint2 load_unit(const char *src, u64 i, u64 total) {
    if ((((u64)src) & 7u) == 0 && (i + 1) * 8 <= total) return *(const uint2 *)(src + i * 8);
    uint2 w = make_uint2(0u, 0u);
    char *b = (char *)&w;
    for (int k = 0; k < 8; k++)
        if (i * 8 + k < total) b[k] = src[i * 8 + k];
    return w;
}

__device__ __forceinline__ void store_unit(char *dst, u64 i, u64 total, uint2 w) {
    if ((((u64)dst) & 7u) == 0 && (i + 1) * 8 <= total) {
        *(uint2 *)(dst + i * 8) = w;
        return;
    }
    const char *b = (const char *)&w;
    for (int k = 0; k < 8; k++)
        if (i * 8 + k < total) dst[i * 8 + k] = b[k];
}

// Units 2j and 2j+1 as one 16-byte value: one load when aligned and whole.
__device__ __forceinline__ uint4 load_pair(const char *src, u64 j, u64 total) {
    if (aligned16(src) && (j + 1) * 16 <= total) return *(const uint4 *)(src + j * 16);
    uint2 lo = load_unit(src, 2 * j, total), hi = load_unit(src, 2 * j + 1, total);
    return make_uint4(lo.x, lo.y, hi.x, hi.y);
}

__device__ __forceinline__ void store_pair(char *dst, u64 j, u64 total, uint4 w) {
    if (aligned16(dst) && (j + 1) * 16 <= total) {
        *(uint4 *)(dst + j * 16) = w;
        return;
    }
    store_unit(dst, 2 * j, total, make_uint2(w.x, w.y));
    store_unit(dst, 2 * j + 1, total, make_uint2(w.z, w.w));
}

// The call number, on a wait's slow path: the counter still holds the previous call's until
// the last block of this one finishes (finish_call), after every wait. Not passed down to the
// wait, whose loop has no register to spare at four and eight ranks.
__device__ __forceinline__ u64 current_call(const Args &a) {
    // (Read by a block before it counts itself done in finish_call, so before the store.)
    return *(volatile u64 *)(a.counters + STATE_CALL) + 1;
}

// Waits for peer `from`'s line i of this call, starting from `v` (a value already read from
// it), then clears the line. False on mismatch, timeout, abort or another failure.
__device__ bool ll_wait(const Args &a, u32 parity, int from, u64 i, u32 flag, ulonglong2 &v) {
    ulonglong2 *line = ll_line(a, a.rank, parity, from, i);
    u64 deadline = 0;
    u32 spins = 0;
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
    ll_clear(line);
    return true;
}

// Half h (8 bytes: line 2j+h of a pair) of a 16-byte pack: acc = w (first rank) or op(acc, w),
// in f32.
template <typename D, typename Op>
__device__ __forceinline__ void ll_accumulate(Pack<D> &acc, int h, uint2 w, bool first) {
    const int H = Pack<D>::N / 2;
    const char *b = (const char *)&w;
#pragma unroll
    for (int k = 0; k < H; k++) {
        float v = D::load(b + k * D::SIZE);
        acc.v[h * H + k] = first ? v : Op::apply(acc.v[h * H + k], v);
    }
}

__device__ __forceinline__ uint2 ll_data(const ulonglong2 &v) { return make_uint2((u32)v.x, (u32)v.y); }

template <typename D, typename Op, int W> __device__ void one_shot_ll(const Args &a) {
    let_next_kernel_launch(a);
    // Two ranks post the identity after the pushes (see begin_call); more ranks at once, which
    // frees the call number's registers before the reduce loop (invariant 5).
    const u64 call = begin_call(a, W > 2);
    TRACE_PHASE(a, PH_START); // (after the closed-counter check: see CALL_CLOSED)
    const u32 flag = opaque(ll_flag(a.digest, call));
    const u32 parity = (u32)call & 1u;
    const u64 total = a.count * D::SIZE;
    // The empty call (count 0) pushes and waits for one line of no data.
    const u64 lines = total == 0 ? 1 : (total + 7) / 8;
    const u64 pairs = (lines + 1) / 2;
    const u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    // Push: both lines of each pair to every peer (see ll_passes).
    for (int pass = 0; pass < ll_passes(a); pass++) {
        for (u64 j = first; j < pairs; j += stride) {
            const uint4 v = load_pair(a.send, j, total);
            const bool two = 2 * j + 1 < lines;
#pragma unroll
            for (int k = 1; k < W; k++) {
                int r;
                if (!ll_pushes_to(a, pass, k, r)) continue;
                ulonglong2 *line = ll_line(a, r, parity, a.rank, 2 * j);
                ll_put(line, v.x, v.y, flag);
                if (two) ll_put(line + 1, v.z, v.w, flag);
            }
        }
    }
    if (W <= 2) post_identity(a, call);
    // Reduce in rank order from our own memory. The same thread handles pair j in both loops, so
    // in place (send == recv) is safe. Two ranks: the peer's two lines (the only ones held: the
    // peer is 1 - rank, so no line per rank index is kept live) are peeked before either is
    // waited for, and rank 0's data is summed first. More ranks: one line at a time, its line of
    // every peer peeked before any wait (2 * (world - 1) lines held at once would not fit two
    // blocks per SM: 64 registers).
    bool ok = true;
    for (u64 j = first; ok && j < pairs; j += stride) {
        const bool two = 2 * j + 1 < lines;
        Pack<D> acc;
        if (W <= 2) {
            const uint4 mine = load_pair(a.send, j, total);
            uint4 theirs = mine; // world 1: no peer, the sum is our own input
            if (a.world == 2) {
                const ulonglong2 *line = ll_line(a, a.rank, parity, 1 - a.rank, 2 * j);
                ulonglong2 g0 = ll_peek(line);
                ulonglong2 g1 = make_ulonglong2((u64)flag << 32, (u64)flag << 32); // past the end
                if (two) g1 = ll_peek(line + 1);
                if (!ll_wait(a, parity, 1 - a.rank, 2 * j, flag, g0) ||
                    (two && !ll_wait(a, parity, 1 - a.rank, 2 * j + 1, flag, g1))) {
                    ok = false;
                    break;
                }
                theirs = make_uint4((u32)g0.x, (u32)g0.y, (u32)g1.x, (u32)g1.y);
                // Thread 0's first pair is the block's first line from the peer.
                TRACE_PEER(a, threadIdx.x == 0 && j == first, 1 - a.rank);
            }
            const uint4 r0 = a.rank == 0 ? mine : theirs;
            ll_accumulate<D, Op>(acc, 0, make_uint2(r0.x, r0.y), true);
            ll_accumulate<D, Op>(acc, 1, make_uint2(r0.z, r0.w), true);
            if (a.world == 2) {
                const uint4 r1 = a.rank == 0 ? theirs : mine;
                ll_accumulate<D, Op>(acc, 0, make_uint2(r1.x, r1.y), false);
                ll_accumulate<D, Op>(acc, 1, make_uint2(r1.z, r1.w), false);
            }
        } else {
#pragma unroll
            for (int h = 0; h < 2; h++) {
                if (!ok || (h == 1 && !two)) break;
                ulonglong2 got[W];
#pragma unroll
                for (int r = 0; r < W; r++) {
                    got[r] = make_ulonglong2((u64)flag << 32, (u64)flag << 32);
                    if (r < a.world && r != a.rank) got[r] = ll_peek(ll_line(a, a.rank, parity, r, 2 * j + h));
                }
#pragma unroll
                for (int r = 0; r < W; r++) {
                    if (r >= a.world) break;
                    // Our own half, loaded where it is used (registers: invariant 5).
                    uint2 w = r == a.rank ? load_unit(a.send, 2 * j + h, total) : make_uint2(0u, 0u);
                    if (r != a.rank) {
                        if (!ll_wait(a, parity, r, 2 * j + h, flag, got[r])) {
                            ok = false;
                            break;
                        }
                        w = ll_data(got[r]);
                        TRACE_PEER(a, threadIdx.x == 0 && j == first && h == 0, r);
                    }
                    ll_accumulate<D, Op>(acc, h, w, r == 0);
                }
            }
        }
        if (ok) store_pair(a.recv, j, total, repack<D>(acc));
    }
    // Two ranks keep the call number in a register (a re-read of the counter would sit on the
    // kernel's last path); more ranks have none to spare and read it again (see current_call).
    TRACE_BLOCK(a, PH_REDUCE);
    finish_call(a, W <= 2 ? call : current_call(a));
    TRACE_PHASE(a, PH_END);
}

// ---------------------------------------------------------------------------------------------
// LL12: 12 data bytes per 16-byte line {d0, d1, d2, flag}: 1.33x the message on the link instead
// of LL's 2x, with the same flag, clearing and board checks as LL.

// Waits for peer `from`'s line i of this call (its flag word ours), starting from `v`, then
// clears it.
__device__ bool ll12_wait(const Args &a, u32 parity, int from, u64 i, u32 flag, uint4 &v) {
    uint4 *line = (uint4 *)ll_line(a, a.rank, parity, from, i);
    u64 deadline = 0;
    u32 spins = 0;
    while (v.w != flag) {
        if ((++spins & 1023u) == 0u) {
            const u64 call = current_call(a);
            if (v.w != 0u) { // written, but not with our flag
                report(a, ERR_MISMATCH, from, (u32)i, call);
                return false;
            }
            if (wait_must_end(a, from, (u32)i, call, deadline)) return false;
        }
        v = ll12_peek(line);
    }
    ll12_clear(line);
    return true;
}

// 12 bytes of `src` at line i (zero past `total`): three words when 4-byte aligned and whole.
__device__ __forceinline__ uint3 load_tri(const char *src, u64 i, u64 total) {
    const char *p = src + i * 12;
    if ((((u64)src) & 3u) == 0 && (i + 1) * 12 <= total) {
        const u32 *w = (const u32 *)p;
        return make_uint3(w[0], w[1], w[2]);
    }
    uint3 w = make_uint3(0u, 0u, 0u);
    char *b = (char *)&w;
    for (int k = 0; k < 12; k++)
        if (i * 12 + k < total) b[k] = p[k];
    return w;
}

__device__ __forceinline__ void store_tri(char *dst, u64 i, u64 total, uint3 w) {
    char *p = dst + i * 12;
    if ((((u64)dst) & 3u) == 0 && (i + 1) * 12 <= total) {
        u32 *o = (u32 *)p;
        o[0] = w.x;
        o[1] = w.y;
        o[2] = w.z;
        return;
    }
    const char *b = (const char *)&w;
    for (int k = 0; k < 12; k++)
        if (i * 12 + k < total) p[k] = b[k];
}

template <typename D, typename Op, int W> __device__ void one_shot_ll12(const Args &a) {
    let_next_kernel_launch(a);
    const int N = 12 / D::SIZE;
    const u64 call = begin_call(a, false); // posted after the pushes (see begin_call)
    TRACE_PHASE(a, PH_START); // (after the closed-counter check: see CALL_CLOSED)
    const u32 flag = ll_flag(a.digest, call);
    const u32 parity = (u32)call & 1u;
    const u64 total = a.count * D::SIZE;
    const u64 lines = total == 0 ? 1 : (total + 11) / 12;
    const u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    // Push: every line to every peer (see ll_passes).
    for (int pass = 0; pass < ll_passes(a); pass++) {
        for (u64 i = first; i < lines; i += stride) {
            const uint3 v = load_tri(a.send, i, total);
#pragma unroll
            for (int k = 1; k < W; k++) {
                int r;
                if (ll_pushes_to(a, pass, k, r)) ll12_put((uint4 *)ll_line(a, r, parity, a.rank, i), v.x, v.y, v.z, flag);
            }
        }
    }
    post_identity(a, call);
    // Reduce in rank order from our own memory (the same thread pushed line i: in place is safe),
    // every peer's line peeked before any wait.
    bool ok = true;
    for (u64 i = first; ok && i < lines; i += stride) {
        uint4 got[W];
#pragma unroll
        for (int r = 0; r < W; r++) {
            got[r] = make_uint4(0u, 0u, 0u, flag);
            if (r < a.world && r != a.rank) got[r] = ll12_peek((const uint4 *)ll_line(a, a.rank, parity, r, i));
        }
        const uint3 mine = load_tri(a.send, i, total);
        float acc[N];
#pragma unroll
        for (int r = 0; r < W; r++) {
            if (r >= a.world) break;
            uint3 w = mine;
            if (r != a.rank) {
                if (!ll12_wait(a, parity, r, i, flag, got[r])) {
                    ok = false;
                    break;
                }
                w = make_uint3(got[r].x, got[r].y, got[r].z);
                TRACE_PEER(a, threadIdx.x == 0 && i == first, r);
            }
            const char *b = (const char *)&w;
#pragma unroll
            for (int k = 0; k < N; k++) {
                float v = D::load(b + k * D::SIZE);
                acc[k] = r == 0 ? v : Op::apply(acc[k], v); // f32, rank order
            }
        }
        if (ok) {
            uint3 w;
            char *b = (char *)&w;
#pragma unroll
            for (int k = 0; k < N; k++) D::store(b + k * D::SIZE, acc[k]);
            store_tri(a.recv, i, total, w);
        }
    }
    TRACE_BLOCK(a, PH_REDUCE);
    finish_call(a, W <= 2 ? call : current_call(a)); // (see one_shot_ll)
    TRACE_PHASE(a, PH_END);
}

// Entry points: ipcr_oneshotll_<dtype>_<op> (also the empty call's) and ipcr_oneshotll12_*
// (compiled apart: a job uses one of the two line formats).
#define LL_KERNELS(DT, OPN, D, OP)                                                            \
    ENTRY(2, ipcr_oneshotll_##DT##_##OPN, (one_shot_ll<D, OP, IPCR_W>(a)))
#define LL12_KERNELS(DT, OPN, D, OP)                                                          \
    ENTRY(2, ipcr_oneshotll12_##DT##_##OPN, (one_shot_ll12<D, OP, IPCR_W>(a)))
#if !defined(IPCR_ONE_GROUP) || defined(IPCR_GROUP_LL)
FOR_EACH_DTYPE_OP(LL_KERNELS)
#endif
#if !defined(IPCR_ONE_GROUP) || defined(IPCR_GROUP_LL12)
FOR_EACH_DTYPE_OP(LL12_KERNELS)
#endif
