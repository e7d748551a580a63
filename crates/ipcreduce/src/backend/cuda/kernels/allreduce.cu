// ipcreduce all-reduce kernels: one-shot and two-shot through peer memory.
//
// Compiled at run time by NVRTC (see ../module.rs) for the device's compute capability. No CUDA
// headers are needed: half and bfloat16 conversions are single PTX instructions.
//
// Memory layout of one rank's workspace (one cuMemCreate allocation, mapped by every peer):
//
//   [0, FLAG_BYTES)                  flags[MAX_BLOCKS][MAX_RANKS] (u32); peer p's block b writes
//                                    flags[b][p] of this rank to say "I arrived at barrier number
//                                    F"; only this rank reads them.
//   [FLAG_BYTES, SIG_BYTES)          stamps[2][MAX_BLOCKS][MAX_RANKS] (u64): the call's arguments
//                                    (count, dtype, op, algorithm), written by peer p's block b
//                                    before its first flag of each call, so ranks that called with
//                                    different arguments all fail at once instead of hanging or
//                                    reading out of bounds. Indexed by the barrier's parity: a
//                                    peer may run one barrier ahead and stamp its next call.
//   LL area (LL_BYTES)               lines[2][MAX_RANKS][LL_LINES] of 16 bytes, for the low-latency
//                                    one-shot (see one_shot_ll): peer p pushes its input into
//                                    lines[parity][p] of every other rank, 8 data bytes and two
//                                    copies of the call's flag per line, so the receiver polls
//                                    its own memory and needs no barrier at all.
//   data area (2 * slot_bytes)       two slots (double buffering by chunk parity).
//
// Per-rank private state (device memory, not shared): counters[MAX_BLOCKS][2] = {F, L} per block,
// then one error word, then {LL sequence number, LL blocks done} at word 2*MAX_BLOCKS+4:
// F = barriers passed, L = chunks processed. All state lives on the device and is advanced on the
// device, so calls can be captured in a CUDA graph and replayed.
//
// Protocol invariants (why no end barrier is needed):
// - Every block of every rank takes part in every barrier; block b only ever syncs with block b
//   of the peers, and the grid size is fixed per communicator, so F and L agree across ranks.
// - Chunk k of the communicator's life uses slot (k & 1). Before a rank writes a slot for chunk k,
//   it has passed a barrier of chunk k-1, which every peer entered only after finishing all its
//   reads of chunk k-2 (the previous use of that slot).
// - Peers are summed in rank order 0..world-1 with f32 accumulation and one final rounding, so all
//   ranks, and one-shot and two-shot, produce bitwise the same result.

#define MAX_RANKS 8
#define MAX_BLOCKS 128
#define LL_MAX_BYTES (256 * 1024)
#define LL_LINES (LL_MAX_BYTES / 8)
#define LL_BYTES (2 * MAX_RANKS * LL_LINES * 16)
#define FLAG_BYTES (MAX_BLOCKS * MAX_RANKS * 4)
#define SIG_BYTES (FLAG_BYTES + 2 * MAX_BLOCKS * MAX_RANKS * 8)

typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned short u16;

struct Args {
    const char *send;            // this rank's input (user memory)
    char *recv;                  // this rank's output (user memory; may equal send)
    u64 count;                   // elements
    char *data[MAX_RANKS];       // data area of every rank's workspace (own included), mapped
    char *ll[MAX_RANKS];         // LL area of every rank's workspace, mapped
    u32 *sig[MAX_RANKS];         // signal area of every rank's workspace, mapped
    u32 *counters;               // this rank's private {F, L} per block
    volatile u32 *abort_flag;    // host-mapped: non-zero = communicator aborted by the host
    u32 *err;                    // device: first failure code (0 = none), claimed atomically
    volatile u32 *host_err;      // host-mapped failure record {code, peer, block, barrier,
                                 // their stamp (2 words), our stamp (2 words)}
    u64 slot_bytes;              // bytes per data slot (multiple of 16 * world * MAX_BLOCKS)
    u64 timeout_ns;              // bound on every wait
    u64 stamp;                   // this call's arguments, compared with every peer's
    int rank;
    int world;
};

enum { ERR_NONE = 0, ERR_TIMEOUT = 1, ERR_ABORTED = 2, ERR_MISMATCH = 3 };

// ---------------------------------------------------------------------------------------------
// Element types and conversions

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float b2f(u16 b) { return __uint_as_float(((u32)b) << 16); }
__device__ __forceinline__ u16 f2b(float f) {
    u16 b;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(f));
    return b;
}

struct F32 {
    static const int SIZE = 4;
    __device__ static float load(const char *p) { return *(const float *)p; }
    __device__ static void store(char *p, float v) { *(float *)p = v; }
};
struct F16 {
    static const int SIZE = 2;
    __device__ static float load(const char *p) { return h2f(*(const u16 *)p); }
    __device__ static void store(char *p, float v) { *(u16 *)p = f2h(v); }
};
struct BF16 {
    static const int SIZE = 2;
    __device__ static float load(const char *p) { return b2f(*(const u16 *)p); }
    __device__ static void store(char *p, float v) { *(u16 *)p = f2b(v); }
};

struct OpSum { __device__ static float apply(float a, float b) { return a + b; } };
struct OpMax { __device__ static float apply(float a, float b) { return fmaxf(a, b); } };
struct OpMin { __device__ static float apply(float a, float b) { return fminf(a, b); } };

// A 16-byte pack of elements unpacked to f32.
template <typename D> struct Pack {
    static const int N = 16 / D::SIZE;
    float v[N];
};

__device__ __forceinline__ uint4 ld_cg16(const char *p) {
    // .cg: cache in L2 only; peers rewrite these addresses every other chunk.
    return __ldcg((const uint4 *)p);
}

template <typename D> __device__ __forceinline__ void unpack(const uint4 &w, Pack<D> &out) {
    const char *b = (const char *)&w;
#pragma unroll
    for (int i = 0; i < Pack<D>::N; i++) out.v[i] = D::load(b + i * D::SIZE);
}

template <typename D> __device__ __forceinline__ uint4 repack(const Pack<D> &in) {
    uint4 w;
    char *b = (char *)&w;
#pragma unroll
    for (int i = 0; i < Pack<D>::N; i++) D::store(b + i * D::SIZE, in.v[i]);
    return w;
}

// ---------------------------------------------------------------------------------------------
// Flags and barriers

__device__ __forceinline__ void st_release_sys(u32 *p, u32 v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ u32 ld_acquire_sys(const u32 *p) {
    u32 v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ u64 globaltimer() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Records the first failure in the host-visible error record.
__device__ void report(const Args &a, u32 code, u32 peer, u32 barrier_no, u64 theirs = 0) {
    if (atomicCAS(a.err, 0u, code) == 0u) {
        a.host_err[1] = peer;
        a.host_err[2] = blockIdx.x;
        a.host_err[3] = barrier_no;
        a.host_err[4] = (u32)theirs;
        a.host_err[5] = (u32)(theirs >> 32);
        a.host_err[6] = (u32)a.stamp;
        a.host_err[7] = (u32)(a.stamp >> 32);
        __threadfence_system();
        a.host_err[0] = code; // written last: the host reads the record once this is non-zero
        __threadfence_system();
    }
}

__device__ __forceinline__ u64 *stamp_slot(const Args &a, int owner, u32 F, int block, int from) {
    return (u64 *)((char *)a.sig[owner] + FLAG_BYTES) + ((F & 1u) * MAX_BLOCKS + block) * MAX_RANKS + from;
}

// Block-wide barrier with block `blockIdx.x` of every peer. Returns false (in every thread of
// the block) if the wait failed: deadline passed, host abort, arguments that differ from a
// peer's (`check_stamp`, the first barrier of a call), or another block failed.
__device__ bool barrier(const Args &a, u32 &F, bool check_stamp = false) {
    F++;
    __syncthreads();
    int t = threadIdx.x;
    int b = blockIdx.x;
    int failed = 0;
    if (t < a.world && t != a.rank) {
        if (check_stamp) *(volatile u64 *)stamp_slot(a, t, F, b, a.rank) = a.stamp;
        // Make this block's data writes visible system-wide before announcing arrival.
        __threadfence_system();
        st_release_sys(&a.sig[t][b * MAX_RANKS + a.rank], F);
        const u32 *mine = &a.sig[a.rank][b * MAX_RANKS + t];
        u64 deadline = 0;
        u32 spins = 0;
        while ((int)(ld_acquire_sys(mine) - F) < 0) {
            if ((++spins & 1023u) == 0u) {
                u64 now = globaltimer();
                if (deadline == 0) deadline = now + a.timeout_ns;
                if (*a.abort_flag != 0u) {
                    report(a, ERR_ABORTED, t, F);
                    failed = 1;
                    break;
                }
                if (*(volatile u32 *)a.err != 0u) { // another block already failed
                    failed = 1;
                    break;
                }
                if (now > deadline) {
                    report(a, ERR_TIMEOUT, t, F);
                    failed = 1;
                    break;
                }
            }
        }
        if (!failed && check_stamp) {
            u64 theirs = *(volatile u64 *)stamp_slot(a, a.rank, F, b, t);
            if (theirs != a.stamp) {
                report(a, ERR_MISMATCH, t, F, theirs);
                failed = 1;
            }
        }
    }
    return __syncthreads_or(failed) == 0;
}

// ---------------------------------------------------------------------------------------------
// Element-range helpers. Ranges are in elements and start on whole 16-byte packs.

// Loads bypass L1 (.cg) everywhere: peers rewrite slot memory every other chunk, and a line
// cached in L1 by a neighbouring block before the peer's write would be stale.
template <typename D> __device__ __forceinline__ void copy_elem_cg(char *dst, const char *src) {
    if (D::SIZE == 4) *(u32 *)dst = __ldcg((const unsigned int *)src);
    else *(u16 *)dst = __ldcg((const unsigned short *)src);
}

// Pack p (elements [p*N, (p+1)*N) ∩ [0, end)) of `base`. A whole pack at a 16-byte aligned
// address is one 16-byte load; otherwise element by element (unaligned user pointers, tails).
template <typename D>
__device__ __forceinline__ uint4 load_pack(const char *base, u64 p, u64 end, bool aligned) {
    const int N = Pack<D>::N;
    if (aligned && (p + 1) * N <= end) return ld_cg16(base + p * 16);
    uint4 w = make_uint4(0u, 0u, 0u, 0u);
    char *b = (char *)&w;
#pragma unroll
    for (int k = 0; k < N; k++)
        if (p * N + k < end) copy_elem_cg<D>(b + k * D::SIZE, base + (p * N + k) * D::SIZE);
    return w;
}

template <typename D>
__device__ __forceinline__ void store_pack(char *base, u64 p, u64 end, bool aligned, const uint4 &w) {
    const int N = Pack<D>::N;
    if (aligned && (p + 1) * N <= end) {
        *(uint4 *)(base + p * 16) = w;
        return;
    }
    const char *b = (const char *)&w;
#pragma unroll
    for (int k = 0; k < N; k++) {
        if (p * N + k < end) {
            char *d = base + (p * N + k) * D::SIZE;
            if (D::SIZE == 4) *(u32 *)d = *(const u32 *)(b + k * 4);
            else *(u16 *)d = *(const u16 *)(b + k * 2);
        }
    }
}

__device__ __forceinline__ bool aligned16(const void *p) { return (((u64)p) & 15u) == 0; }

// Copies elements [begin, end) from src to dst. A non-empty range starts on a whole pack; an
// empty one may not (a piece starting at the message's odd end), hence the early return: its
// pack belongs to another block.
template <typename D>
__device__ __forceinline__ void copy_range(char *dst, const char *src, u64 begin, u64 end) {
    const int N = Pack<D>::N;
    if (begin >= end) return;
    bool sa = aligned16(src), da = aligned16(dst);
    for (u64 p = begin / N + threadIdx.x; p * N < end; p += blockDim.x)
        store_pack<D>(dst, p, end, da, load_pack<D>(src, p, end, sa));
}

// out[i] = op over ranks 0..world-1 of element i, for i in [begin, end) (chunk-relative
// element indices): the peers' from their slots, ours from `own` (this chunk of our input; our
// slot's copy is for the peers, and reading the input saves that traffic, which matters when
// slots live in host memory). Also written to `extra` (if non-null) at the same indices.
// `own` may equal `out` (in place): each pack is read by the thread that writes it, first.
template <typename D, typename Op>
__device__ __forceinline__ void reduce_range(const Args &a, u64 slot_off, const char *own,
                                             char *out, char *extra, u64 begin, u64 end) {
    const int N = Pack<D>::N;
    if (begin >= end) return; // see copy_range
    bool oa = aligned16(out), ia = aligned16(own);
    for (u64 p = begin / N + threadIdx.x; p * N < end; p += blockDim.x) {
        Pack<D> acc, x;
        for (int r = 0; r < a.world; r++) {
            uint4 w = r == a.rank ? load_pack<D>(own, p, end, ia)
                                  : load_pack<D>(a.data[r] + slot_off, p, end, true);
            if (r == 0) {
                unpack<D>(w, acc);
                continue;
            }
            unpack<D>(w, x);
#pragma unroll
            for (int k = 0; k < N; k++) acc.v[k] = Op::apply(acc.v[k], x.v[k]);
        }
        uint4 w = repack<D>(acc);
        store_pack<D>(out, p, end, oa, w);
        if (extra) store_pack<D>(extra, p, end, true, w);
    }
}

// Splits [0, n) elements into `parts` pieces aligned to whole 16-byte packs; returns piece `i`.
template <typename D>
__device__ __forceinline__ void piece(u64 base, u64 n, int parts, int i, u64 &b, u64 &e) {
    const u64 N = Pack<D>::N;
    u64 packs = (n + N - 1) / N;
    u64 per = (packs + parts - 1) / parts;
    b = base + min(n, (u64)i * per * N);
    e = base + min(n, (u64)(i + 1) * per * N);
}

// ---------------------------------------------------------------------------------------------
// Kernels. Grid = the communicator's fixed block count; block b owns "lane" b of every chunk.

template <typename D, typename Op> __device__ void one_shot(const Args &a) {
    u32 *ctr = a.counters + 2 * blockIdx.x;
    u32 F = ctr[0], L = ctr[1];
    const u64 chunk = a.slot_bytes / D::SIZE;
    for (u64 c0 = 0; c0 < a.count; c0 += chunk) {
        u64 n = min(chunk, a.count - c0);
        u64 slot_off = (u64)(L & 1u) * a.slot_bytes;
        L++;
        u64 b, e;
        piece<D>(0, n, gridDim.x, blockIdx.x, b, e);
        copy_range<D>(a.data[a.rank] + slot_off, a.send + c0 * D::SIZE, b, e);
        if (!barrier(a, F, c0 == 0)) return;
        reduce_range<D, Op>(a, slot_off, a.send + c0 * D::SIZE, a.recv + c0 * D::SIZE, nullptr, b, e);
    }
    if (threadIdx.x == 0) { ctr[0] = F; ctr[1] = L; }
}

// Two-shot's last step for one chunk: block b copies sub-range b of every peer's reduced shard
// from the peer's slot into our output.
template <typename D>
__device__ __forceinline__ void gather(const Args &a, u64 c0, u64 n, u64 slot_off) {
    for (int k = 1; k < a.world; k++) {
        int s = (a.rank + k) % a.world; // rotated so peers' links are loaded evenly
        u64 psb, pse, pb, pe;
        piece<D>(0, n, a.world, s, psb, pse);
        piece<D>(psb, pse - psb, gridDim.x, blockIdx.x, pb, pe);
        copy_range<D>(a.recv + c0 * D::SIZE, a.data[s] + slot_off, pb, pe);
    }
}

template <typename D, typename Op> __device__ void two_shot(const Args &a) {
    u32 *ctr = a.counters + 2 * blockIdx.x;
    u32 F = ctr[0], L = ctr[1];
    const u64 chunk = a.slot_bytes / D::SIZE;
    // The chunk whose gather is still due (pend_n == 0: none). A chunk's gather waits until the
    // next chunk's copy-in has been issued, so its reads of the peers' slots overlap those
    // writes (both directions of a link busy at once; with host-staged workspaces, of PCIe).
    // Still before the next chunk's first barrier, so the invariants above hold as stated.
    u64 pend_c0 = 0, pend_n = 0, pend_off = 0;
    for (u64 c0 = 0; c0 < a.count; c0 += chunk) {
        u64 n = min(chunk, a.count - c0);
        u64 slot_off = (u64)(L & 1u) * a.slot_bytes;
        L++;
        // Copy in sub-range b of every peer's shard, so block b of each peer can reduce its
        // shard's sub-range b after one barrier with us. Our own shard is reduced from our input.
        for (int s = 0; s < a.world; s++) {
            if (s == a.rank) continue;
            u64 sb, se, b, e;
            piece<D>(0, n, a.world, s, sb, se);
            piece<D>(sb, se - sb, gridDim.x, blockIdx.x, b, e);
            copy_range<D>(a.data[a.rank] + slot_off, a.send + c0 * D::SIZE, b, e);
        }
        if (pend_n != 0) gather<D>(a, pend_c0, pend_n, pend_off);
        if (!barrier(a, F, c0 == 0)) return;
        u64 sb, se, b, e;
        piece<D>(0, n, a.world, a.rank, sb, se);
        piece<D>(sb, se - sb, gridDim.x, blockIdx.x, b, e);
        // Reduce our shard: into our output and into our slot, where peers gather it from.
        reduce_range<D, Op>(a, slot_off, a.send + c0 * D::SIZE, a.recv + c0 * D::SIZE,
                            a.data[a.rank] + slot_off, b, e);
        if (!barrier(a, F)) return;
        pend_c0 = c0;
        pend_n = n;
        pend_off = slot_off;
    }
    if (pend_n != 0) gather<D>(a, pend_c0, pend_n, pend_off);
    if (threadIdx.x == 0) { ctr[0] = F; ctr[1] = L; }
}

// ---------------------------------------------------------------------------------------------
// Low-latency one-shot (LL) for messages up to LL_MAX_BYTES: every rank pushes each 8-byte unit of
// its input into every peer's LL area as one 16-byte line {data.lo, flag, data.hi, flag}, then
// reduces by polling its OWN LL area, in rank order. No barrier, no remote reads. The flag holds
// the call's sequence number (high 16 bits) and a hash of the call's arguments (low 16 bits, odd
// so a flag is never 0): a line from two calls ago cannot pass, and a peer that called with other
// arguments is seen at once. Buffer parity alternates by call; a peer cannot start writing parity p
// again before this rank has finished reading it, since the call in between needs this rank's data.

__device__ __forceinline__ u32 ll_flag(u32 seq, u64 stamp) {
    u32 h = (u32)(stamp ^ (stamp >> 32));
    h = (h * 0x9E3779B1u) >> 16;
    return ((seq & 0xFFFFu) << 16) | h | 1u;
}

__device__ __forceinline__ uint4 *ll_line(const Args &a, int owner, u32 parity, int from, u64 i) {
    return (uint4 *)a.ll[owner] + ((u64)(parity * MAX_RANKS + from) * LL_LINES + i);
}

// 8 bytes of `src` at unit i (zero past `total` bytes); byte by byte when not 8-byte aligned.
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

// Waits for peer `from`'s line i of this call; false on timeout, abort, mismatch or another failure.
__device__ bool ll_poll(const Args &a, u32 parity, int from, u64 i, u32 flag, uint2 &out) {
    const uint4 *line = ll_line(a, a.rank, parity, from, i);
    u64 deadline = 0;
    u32 spins = 0;
    while (true) {
        uint4 v;
        asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "l"(line));
        if (v.y == flag && v.w == flag) {
            out = make_uint2(v.x, v.z);
            return true;
        }
        if ((v.y >> 16) == (flag >> 16) && v.y != flag) {
            report(a, ERR_MISMATCH, from, flag);
            return false;
        }
        if ((++spins & 1023u) == 0u) {
            u64 now = globaltimer();
            if (deadline == 0) deadline = now + a.timeout_ns;
            if (*a.abort_flag != 0u) {
                report(a, ERR_ABORTED, from, flag);
                return false;
            }
            if (*(volatile u32 *)a.err != 0u) return false;
            if (now > deadline) {
                report(a, ERR_TIMEOUT, from, flag);
                return false;
            }
        }
    }
}

template <typename D, typename Op> __device__ void one_shot_ll(const Args &a) {
    u32 *ll_state = a.counters + 2 * MAX_BLOCKS + 4; // {last sequence number, blocks done}
    const u32 seq = *(volatile u32 *)&ll_state[0] + 1;
    const u32 flag = ll_flag(seq, a.stamp);
    const u32 parity = seq & 1u;
    const u64 total = a.count * D::SIZE;
    const u64 units = (total + 7) / 8;
    const u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    // Push: each unit to every peer, peers in rotated order so links load evenly.
    for (u64 i = first; i < units; i += stride) {
        uint2 v = load_unit(a.send, i, total);
        for (int k = 1; k < a.world; k++) {
            int r = (a.rank + k) % a.world;
            asm volatile("st.volatile.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(ll_line(a, r, parity, a.rank, i)),
                         "r"(v.x), "r"(flag), "r"(v.y), "r"(flag)
                         : "memory");
        }
    }
    // Reduce in rank order from our own memory. The same thread handles unit i in both loops, so
    // in place (send == recv) is safe.
    bool ok = true;
    for (u64 i = first; ok && i < units; i += stride) {
        const int N = 8 / D::SIZE;
        float acc[N];
        for (int r = 0; r < a.world; r++) {
            uint2 x;
            if (r == a.rank) x = load_unit(a.send, i, total);
            else if (!ll_poll(a, parity, r, i, flag, x)) { ok = false; break; }
            const char *xb = (const char *)&x;
#pragma unroll
            for (int k = 0; k < N; k++) {
                float v = D::load(xb + k * D::SIZE);
                acc[k] = r == 0 ? v : Op::apply(acc[k], v); // f32 accumulation, rank order
            }
        }
        if (ok) {
            uint2 w;
            char *wb = (char *)&w;
#pragma unroll
            for (int k = 0; k < N; k++) D::store(wb + k * D::SIZE, acc[k]);
            store_unit(a.recv, i, total, w);
        }
    }
    // The last block to finish publishes the sequence number for the next call.
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(&ll_state[1], 1u) == gridDim.x - 1) {
            ll_state[1] = 0u;
            ll_state[0] = seq;
            __threadfence();
        }
    }
}

#define KERNELS(DT, OPN, D, OP)                                                               \
    extern "C" __global__ void __launch_bounds__(512)                                         \
        ipcr_oneshot_##DT##_##OPN(const Args a) { one_shot<D, OP>(a); }                       \
    extern "C" __global__ void __launch_bounds__(512)                                         \
        ipcr_twoshot_##DT##_##OPN(const Args a) { two_shot<D, OP>(a); }                       \
    extern "C" __global__ void __launch_bounds__(512)                                         \
        ipcr_oneshotll_##DT##_##OPN(const Args a) { one_shot_ll<D, OP>(a); }

KERNELS(f32, sum, F32, OpSum)
KERNELS(f32, max, F32, OpMax)
KERNELS(f32, min, F32, OpMin)
KERNELS(f16, sum, F16, OpSum)
KERNELS(f16, max, F16, OpMax)
KERNELS(f16, min, F16, OpMin)
KERNELS(bf16, sum, BF16, OpSum)
KERNELS(bf16, max, BF16, OpMax)
KERNELS(bf16, min, BF16, OpMin)
