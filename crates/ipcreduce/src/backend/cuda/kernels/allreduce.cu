// ipcreduce all-reduce kernels through peer memory: staged one-shot and two-shot (user buffers
// copied through the shared workspace), zero-copy one-shot and two-shot (registered buffers, read
// and written where they are), and the low-latency one-shot (LL) for small messages.
//
// Compiled at run time by NVRTC (see ../kernels.rs) for the device's compute capability. No CUDA
// headers are needed: half and bfloat16 conversions are single PTX instructions.
//
// Memory layout of one rank's workspace (one cuMemCreate allocation, mapped by every peer):
//
//   [0, FLAG_BYTES)                  flags[MAX_BLOCKS][MAX_RANKS] (u32); peer p's block b writes
//                                    flags[b][p] of this rank to say "I arrived at barrier number
//                                    F"; only this rank reads them.
//   [FLAG_BYTES, SIG_BYTES)          stamps[2][MAX_BLOCKS][MAX_RANKS] (u64): the call's arguments
//                                    (count, dtype, op, path), written by peer p's block b
//                                    before its first flag of each call, so ranks that called with
//                                    different arguments all fail at once instead of hanging or
//                                    reading out of bounds. Indexed by the barrier's parity: a
//                                    peer may run one barrier ahead and stamp its next call.
//   LL area (LL_BYTES(world))        lines[2][world][LL_LINES] of 16 bytes, for the low-latency
//                                    one-shot (see one_shot_ll): peer p pushes its input into
//                                    lines[parity][p] of every other rank, 8 data bytes, the
//                                    call's 32-bit sequence number and a hash of its arguments per
//                                    line, so the receiver polls its own memory and needs no
//                                    barrier at all. Sized by the world (not MAX_RANKS): two ranks
//                                    hold LL_MAX_BYTES of LL data in 8 MiB.
//   data area (2 * slot_bytes)       two slots for the staged kernels (alternating by chunk).
//
// Per-rank private state (device memory, not shared), in u32 words:
//   [2b]                 F of block b: barriers block b has passed (word 2b+1 unused)
//   [2*MAX_BLOCKS]       error word (first failure code, claimed atomically)
//   [2*MAX_BLOCKS+4..6)  LL {sequence number of the last call, blocks done}
//   [2*MAX_BLOCKS+8..10) staged {chunks processed so far (slot parity), blocks done}
// All state lives on the device and is advanced on the device, so calls can be captured in a CUDA
// graph and replayed.
//
// Protocol invariants.
// (1) Barriers. Block b only ever syncs with block b of the peers (flag slot flags[b][p]). The
//     grid may differ from call to call, but every rank computes it the same way from (size,
//     world, path, the communicator's agreed cap), so every rank runs the same sequence of grids
//     and F of block b advances identically on every rank: the flag values block b waits for are
//     the ones block b of the peer writes. A peer whose arguments (and so grid) differ is caught
//     by the stamp check in the first barrier of the call, which every block of both grids takes.
// (2) Zero-copy kernels (registered buffers) touch no workspace data: "inputs ready" barrier, read
//     every rank's send, write, "done" barrier. The done barrier makes the peers' stores into our
//     recv visible before we return and guarantees no peer still reads our send, so the next
//     call (or the caller) may overwrite either. Two-shot touches element i of every buffer only
//     from the thread of the shard's owner that reads it and then writes it, so send == recv is
//     safe; one-shot in place is not (a peer may read our element after we wrote the sum), and
//     the host never sends an in-place call there.
// (3) Staged slots with a variable grid. Within one call the grid is fixed and the bytes of a slot
//     a block touches are fixed too: pieces and shards are cut from the call's chunk frame
//     (min(count, chunk elements)), not from the chunk's actual length, so the short last chunk
//     touches a subset of the same bytes. Block b of every rank cuts the same pieces, so block b
//     only ever reads what block b of a peer wrote. Chunk k lives in slot parity (L0 + k) & 1.
//     Pipelined order of one block, one-shot: copy-in 0; for each chunk k: barrier k, copy-in
//     k+1, reduce k. Two-shot: copy-in 0; for each k: barrier A_k, reduce our shard of k (reads
//     the peers' slots, stores the result back into them), barrier B_k, copy-in k+1, gather k
//     (reads our own slot only). Before block b writes slot parity P for chunk k+1 it has passed
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
// (4) Rank order. Peers are summed in rank order 0..world-1 with f32 accumulation and one final
//     rounding, so all ranks, and every path, produce bitwise the same result.
// (5) Loads in flight. The reduction loads U packs (16 bytes each) from each of W ranks before
//     using any of them. U * W = 8 uint4 registers for the zero-copy kernels (a 512-thread block
//     keeps 64 KiB in flight), compiled for two blocks per SM (<= 64 registers); 16 for their
//     deep variants (oneshotreg16/twoshotreg16: 8 packs per rank at two ranks, 128 KiB in flight
//     per block, the design the stand-alone probe measured), compiled for one block per SM
//     (<= 128 registers); 4 for the staged ones, whose chunk loop holds more state and which run
//     more blocks. The LL kernel peeks its lines from every peer before it waits on any of them.
//     Blocks wait for their peers' blocks, so every CTA of every rank sharing a GPU must be
//     resident at once: the host caps the grid per kernel class (two or one blocks per SM).

#define MAX_RANKS 8
#define MAX_BLOCKS 128
#define LL_MAX_BYTES (1024 * 1024)
#define LL_LINES (LL_MAX_BYTES / 8)
#define LL_BYTES(world) (2 * (world) * LL_LINES * 16)
#define FLAG_BYTES (MAX_BLOCKS * MAX_RANKS * 4)
#define SIG_BYTES (FLAG_BYTES + 2 * MAX_BLOCKS * MAX_RANKS * 8)
#define STATE_LL (2 * MAX_BLOCKS + 4)
#define STATE_STAGED (2 * MAX_BLOCKS + 8)
#define LOADS_IN_FLIGHT 8
#define DEEP_LOADS_IN_FLIGHT(W) ((W) == 4 ? 12 : 16)
#define STAGED_LOADS_IN_FLIGHT 4
#define COPY_UNROLL 4

// u32/u64/u16 and the f16/bf16 conversions come from convert.cuh (prepended at compile).

struct Args {
    const char *send;            // this rank's input (user memory)
    char *recv;                  // this rank's output (user memory; may equal send)
    u64 count;                   // elements
    char *data[MAX_RANKS];       // data area of every rank's workspace (own included), mapped
    char *ll[MAX_RANKS];         // LL area of every rank's workspace, mapped
    u32 *sig[MAX_RANKS];         // signal area of every rank's workspace, mapped
    const char *rsend[MAX_RANKS];// zero-copy: every rank's send buffer as mapped here
    char *rrecv[MAX_RANKS];      // zero-copy: every rank's recv buffer as mapped here
    u32 *counters;               // this rank's private state (see above)
    volatile u32 *abort_flag;    // host-mapped: non-zero = communicator aborted by the host
    u32 *err;                    // device: first failure code (0 = none), claimed atomically
    volatile u32 *host_err;      // host-mapped failure record {code, peer, block, barrier,
                                 // their stamp (2 words), our stamp (2 words), call (2 words)}
    u64 slot_bytes;              // bytes per data slot (multiple of 16 * world * MAX_BLOCKS)
    u64 timeout_ns;              // bound on every wait
    u64 stamp;                   // this call's arguments, compared with every peer's
    u64 seq;                     // this call's number on this rank (named in errors)
    int rank;
    int world;
    int aligned;                 // zero-copy: bit 0 all rsend 16-byte aligned, bit 1 all rrecv
    int lane;                    // copy-engine barrier: the counter and flag slot it syncs on
    int check;                   // copy-engine barrier: compare the call's stamps (first one)
    int mode;                    // staged and LL kernels: MODE_* bits (the same on every rank)
    u64 chunk_bytes;             // staged kernels: bytes per chunk (<= slot_bytes, multiple
                                 // of 256; the same on every rank for a call)
};

// Args::mode bits.
// MODE_PUSH_PASSES (PCIe policy, peer transport): every push into peers' memory is made in
// passes; in pass p this rank writes only to rank (rank + 1 + p) mod world, so each GPU's link
// carries one stream of pushes per direction at a time instead of world - 1 streams that meet
// at the root complex.
#define MODE_PUSH_PASSES 1
// MODE_LET_NEXT_LAUNCH (LL kernels, no GPU shared between ranks): the kernel lets the next
// kernel on its stream launch at once (see let_next_kernel_launch).
#define MODE_LET_NEXT_LAUNCH 2

enum { ERR_NONE = 0, ERR_TIMEOUT = 1, ERR_ABORTED = 2, ERR_MISMATCH = 3 };

// ---------------------------------------------------------------------------------------------
// Element types and conversions


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

// The other half of convert.cuh's wait_for_previous_kernel (MODE_LET_NEXT_LAUNCH, the LL
// kernels only): once every block of ours has run this, the next kernel on the stream may
// launch if it was launched with programmatic stream serialization (the next call's kernel,
// or a PDL-aware kernel of the caller's); it waits on the device for our completion before it
// reads anything, so only its launch overlaps our run.
// Only where no GPU is shared between ranks: a successor resident beside a kernel of ours that
// waits for its peers could keep a peer's kernel off a shared GPU. LL grids are small, so the
// successor finds room; the bandwidth kernels' runtime dwarfs a launch gap.
__device__ __forceinline__ void let_next_kernel_launch(const Args &a) {
#if __CUDA_ARCH__ >= 900
    if ((a.mode & MODE_LET_NEXT_LAUNCH) != 0) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
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
        a.host_err[8] = (u32)a.seq;
        a.host_err[9] = (u32)(a.seq >> 32);
        __threadfence_system();
        a.host_err[0] = code; // written last: the host reads the record once this is non-zero
        __threadfence_system();
    }
}

__device__ __forceinline__ u64 *stamp_slot(const Args &a, int owner, u32 F, int block, int from) {
    return (u64 *)((char *)a.sig[owner] + FLAG_BYTES) + ((F & 1u) * MAX_BLOCKS + block) * MAX_RANKS + from;
}

// Block-wide barrier on slot `b` (the block's index, or a copy-engine lane) with the same slot of
// every peer. Returns false (in every thread of the block) if the wait failed: deadline passed,
// host abort, arguments that differ from a peer's (`check_stamp`, the first barrier of a call),
// or another block failed.
__device__ bool barrier_at(const Args &a, u32 &F, bool check_stamp, int b) {
    F++;
    __syncthreads();
    int t = threadIdx.x;
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

__device__ __forceinline__ bool barrier(const Args &a, u32 &F, bool check_stamp = false) {
    return barrier_at(a, F, check_stamp, blockIdx.x);
}

// ---------------------------------------------------------------------------------------------
// Element-range helpers. Ranges are in elements and start on whole 16-byte packs.

// Loads bypass L1 (.cg) everywhere: peers rewrite slot and registered memory between calls, and
// a line cached in L1 by a neighbouring block before the peer's write would be stale.
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

// Splits [0, n) elements into `parts` pieces aligned to whole 16-byte packs; returns piece `i`
// as [base + b, base + e).
template <typename D>
__device__ __forceinline__ void piece(u64 base, u64 n, int parts, int i, u64 &b, u64 &e) {
    const u64 N = Pack<D>::N;
    u64 packs = (n + N - 1) / N;
    u64 per = (packs + parts - 1) / parts;
    b = base + min(n, (u64)i * per * N);
    e = base + min(n, (u64)(i + 1) * per * N);
}

// Block `blockIdx.x`'s piece of shard `s` of a chunk frame of `frame` elements, clipped to the
// chunk's actual length `n` (<= frame). Cut from the frame so that every chunk of a call touches
// the same bytes per block (invariant 3).
template <typename D>
__device__ __forceinline__ void shard_piece(u64 frame, u64 n, int shards, int s, u64 &b, u64 &e) {
    u64 sb, se;
    piece<D>(0, frame, shards, s, sb, se);
    piece<D>(sb, se - sb, gridDim.x, blockIdx.x, b, e);
    b = min(b, n);
    e = min(e, n);
}

// Copies elements [begin, end) from src to dst, U packs per thread in flight. A non-empty range
// starts on a whole pack; an empty one may not, hence the early return. Whole packs at aligned
// addresses take the unrolled 16-byte path; the rest (unaligned user pointers, the tail pack)
// goes element by element.
template <typename D, int U>
__device__ __forceinline__ void copy_range(char *dst, const char *src, u64 begin, u64 end) {
    const int N = Pack<D>::N;
    if (begin >= end) return;
    const u64 step = blockDim.x;
    u64 p = begin / N + threadIdx.x;
    if (aligned16(src) && aligned16(dst)) {
        const u64 full = end / N;
        for (; p + (U - 1) * step < full; p += step * U) {
            uint4 v[U];
#pragma unroll
            for (int u = 0; u < U; u++) v[u] = ld_cg16(src + (p + u * step) * 16);
#pragma unroll
            for (int u = 0; u < U; u++) *(uint4 *)(dst + (p + u * step) * 16) = v[u];
        }
        for (; p < full; p += step) *(uint4 *)(dst + p * 16) = ld_cg16(src + p * 16);
    }
    for (; p * N < end; p += step)
        store_pack<D>(dst, p, end, false, load_pack<D>(src, p, end, false));
}

// Where a reduction reads rank r's elements (index 0 = the range's origin) and where it writes
// the result. Functors over the rank keep the pointers in the kernel's parameter space.
struct SendSrc {
    const Args &a;
    __device__ const char *operator()(int r) const { return a.rsend[r]; }
};
// One destination (one-shot: our own output).
struct OwnDst {
    char *out;
    bool aligned;
    __device__ bool is_aligned() const { return aligned; }
    template <typename D, int W> __device__ void store(u64 p, u64 end, int, const uint4 &w) const {
        store_pack<D>(out, p, end, false, w);
    }
    template <int W> __device__ void store16(u64 p, int, const uint4 &w) const {
        *(uint4 *)(out + p * 16) = w;
    }
};
// Every rank's registered output (two-shot zero-copy: all-gather by stores).
struct AllRecvDst {
    const Args &a;
    __device__ bool is_aligned() const { return (a.aligned & 2) != 0; }
    template <typename D, int W> __device__ void store(u64 p, u64 end, int world, const uint4 &w) const {
#pragma unroll
        for (int r = 0; r < W; r++)
            if (r < world) store_pack<D>(a.rrecv[r], p, end, false, w);
    }
    template <int W> __device__ void store16(u64 p, int world, const uint4 &w) const {
#pragma unroll
        for (int r = 0; r < W; r++)
            if (r < world) *(uint4 *)(a.rrecv[r] + p * 16) = w;
    }
};

// Reduces one pack from `world` raw packs in rank order (f32 accumulation, one rounding).
template <typename D, typename Op, int W>
__device__ __forceinline__ uint4 reduce_pack(const uint4 (&v)[W], int world) {
    Pack<D> acc, x;
    unpack<D>(v[0], acc);
#pragma unroll
    for (int r = 1; r < W; r++) {
        if (r < world) {
            unpack<D>(v[r], x);
#pragma unroll
            for (int k = 0; k < Pack<D>::N; k++) acc.v[k] = Op::apply(acc.v[k], x.v[k]);
        }
    }
    return repack<D>(acc);
}

// out = op over ranks 0..world-1 (in rank order, f32) of elements [begin, end), for world <= W.
// Whole packs with every pointer aligned take the fast path: each thread issues all its loads (U
// packs from each rank) before it uses any of them. The rest goes pack by pack, element-wise.
template <typename D, typename Op, int W, int LOADS = LOADS_IN_FLIGHT, typename Src, typename Dst>
__device__ __forceinline__ void reduce_range(const Src &src, const Dst &dst, int world, u64 begin,
                                             u64 end, bool src_aligned) {
    const int N = Pack<D>::N;
    const int U = LOADS / W > 0 ? LOADS / W : 1;
    if (begin >= end) return;
    const u64 step = blockDim.x;
    u64 p = begin / N + threadIdx.x;
    if (src_aligned && dst.is_aligned()) {
        const u64 full = end / N;
        for (; p < full; p += step * U) {
            uint4 v[U][W];
#pragma unroll
            for (int u = 0; u < U; u++)
#pragma unroll
                for (int r = 0; r < W; r++)
                    if (r < world && p + u * step < full) v[u][r] = ld_cg16(src(r) + (p + u * step) * 16);
#pragma unroll
            for (int u = 0; u < U; u++)
                if (p + u * step < full) dst.template store16<W>(p + u * step, world, reduce_pack<D, Op, W>(v[u], world));
        }
        // This thread's first pack at or past `full` (p is one of its packs, and p >= full).
        p = full + (p - full) % step;
    }
    for (; p * N < end; p += step) {
        uint4 v[W];
#pragma unroll
        for (int r = 0; r < W; r++)
            if (r < world) v[r] = load_pack<D>(src(r), p, end, false);
        dst.template store<D, W>(p, end, world, reduce_pack<D, Op, W>(v, world));
    }
}

// The last block of the grid to get here stores `value` into st[0] (st[1] counts blocks). Every
// block reads st[0] at its start, before it counts itself here, so no block sees the new value.
__device__ __forceinline__ void publish_when_all_done(u32 *st, u32 value) {
    __syncthreads();
    if (gridDim.x == 1) {
        // The only block: the next kernel on the stream sees the store (small LL calls run one
        // block, and skip the fence and the atomic on their critical path).
        if (threadIdx.x == 0) st[0] = value;
        return;
    }
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(&st[1], 1u) == gridDim.x - 1) {
            st[1] = 0u;
            st[0] = value;
            __threadfence();
        }
    }
}

// ---------------------------------------------------------------------------------------------
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

template <typename D, typename Op, int W> __device__ void one_shot(const Args &a) {
    u32 *ctr = a.counters + 2 * blockIdx.x;
    u32 *st = a.counters + STATE_STAGED;
    u32 F = ctr[0];
    const u32 L0 = *(volatile u32 *)&st[0];
    const u64 chunk = a.chunk_bytes / D::SIZE;
    const u64 frame = min(chunk, a.count);
    const u32 chunks = (u32)((a.count + chunk - 1) / chunk);
    const bool direct = aligned16(a.send);
    one_shot_copy_in<D>(a, L0, 0, chunk, frame);
    for (u32 k = 0; k < chunks; k++) {
        const u64 c0 = (u64)k * chunk;
        const u64 off = slot_offset(a, L0 + k);
        if (!barrier(a, F, k == 0)) break;
        if (k + 1 < chunks) one_shot_copy_in<D>(a, L0 + k + 1, c0 + chunk, chunk, frame);
        u64 b, e;
        shard_piece<D>(frame, min(chunk, a.count - c0), 1, 0, b, e);
        const char *own = direct ? a.send + c0 * D::SIZE : a.data[a.rank] + off;
        char *out = a.recv + c0 * D::SIZE;
        reduce_range<D, Op, W, STAGED_LOADS_IN_FLIGHT>(StagedSrc{a, off, own}, OwnDst{out, aligned16(out)},
                                                        a.world, b, e, true);
    }
    if (threadIdx.x == 0) ctr[0] = F;
    publish_when_all_done(st, L0 + chunks);
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
    u32 *st = a.counters + STATE_STAGED;
    u32 F = ctr[0];
    const u32 L0 = *(volatile u32 *)&st[0];
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
        if (!barrier(a, F, k == 0)) break;
        u64 b, e;
        shard_piece<D>(frame, n, a.world, a.rank, b, e);
        // Reduce our shard's piece into our output (direct) or our slot, and into the peers'.
        char *out = direct ? a.recv + c0 * D::SIZE : mine;
        reduce_range<D, Op, W, STAGED_LOADS_IN_FLIGHT>(StagedSrc{a, off, direct ? a.send + c0 * D::SIZE : mine},
                                                        ShardDst{a, off, out, !passes}, a.world, b, e, true);
        if (passes) // the same thread reads back what it stored above (same pack mapping)
            for (int p = 0; p + 1 < a.world; p++)
                copy_range<D, COPY_UNROLL>(a.data[(a.rank + 1 + p) % a.world] + off, out, b, e);
        if (!barrier(a, F)) break;
        if (k + 1 < chunks) two_shot_copy_in<D>(a, L0 + k + 1, c0 + chunk, chunk, frame, direct);
        // Every peer's reduced shard piece b of chunk k is now in our slot: gather it.
        for (int s = 0; s < a.world; s++) {
            if (direct && s == a.rank) continue;
            shard_piece<D>(frame, n, a.world, s, b, e);
            copy_range<D, COPY_UNROLL>(a.recv + c0 * D::SIZE, mine, b, e);
        }
    }
    if (threadIdx.x == 0) ctr[0] = F;
    publish_when_all_done(st, L0 + chunks);
}

// ---------------------------------------------------------------------------------------------
// Zero-copy kernels (registered buffers, see invariant 2): no workspace data, no chunks.

template <typename D, typename Op, int W, int LOADS> __device__ void one_shot_reg(const Args &a) {
    u32 *ctr = a.counters + 2 * blockIdx.x;
    u32 F = ctr[0];
    if (barrier(a, F, true)) { // inputs ready
        u64 b, e;
        piece<D>(0, a.count, gridDim.x, blockIdx.x, b, e);
        reduce_range<D, Op, W, LOADS>(SendSrc{a}, OwnDst{a.recv, aligned16(a.recv)}, a.world, b, e,
                                      (a.aligned & 1) != 0);
        barrier(a, F); // done reading every send
    }
    if (threadIdx.x == 0) ctr[0] = F;
}

template <typename D, typename Op, int W, int LOADS> __device__ void two_shot_reg(const Args &a) {
    u32 *ctr = a.counters + 2 * blockIdx.x;
    u32 F = ctr[0];
    if (barrier(a, F, true)) { // inputs ready
        u64 b, e;
        shard_piece<D>(a.count, a.count, a.world, a.rank, b, e);
        // Reduce-scatter by loads from every rank, all-gather by stores into every rank's recv.
        reduce_range<D, Op, W, LOADS>(SendSrc{a}, AllRecvDst{a}, a.world, b, e, (a.aligned & 1) != 0);
        barrier(a, F); // every shard stored everywhere, every send read
    }
    if (threadIdx.x == 0) ctr[0] = F;
}

// ---------------------------------------------------------------------------------------------
// Low-latency one-shot (LL) for messages up to LL_MAX_BYTES: every rank pushes each 8-byte unit of
// its input into every peer's LL area as one 16-byte line {data.lo, seq, data.hi, tag}, then
// reduces by polling its OWN LL area, in rank order. No barrier, no remote reads. `seq` is the
// call's full 32-bit sequence number and `tag` a hash of the call's arguments (odd, so never 0):
// both must match, so a line left from any earlier call (even 2^16 calls back) cannot pass, and a
// peer that called with other arguments (same seq, other tag) is seen at once. Buffer parity
// alternates by call; a peer cannot start writing parity p again before this rank has finished
// reading it, since the call in between needs this rank's data.
// Each thread owns 16-byte pairs of units (grid-stride): one 16-byte load of its input, two lines
// to every peer, then the lines of every peer peeked at once before it waits on any (both lines
// at two ranks, one unit at a time at more), so a thread has several polls in flight, not one.

__device__ __forceinline__ u32 ll_tag(u64 stamp) {
    u32 h = (u32)(stamp ^ (stamp >> 32));
    return (h * 0x9E3779B1u) | 1u;
}

__device__ __forceinline__ uint4 *ll_line(const Args &a, int owner, u32 parity, int from, u64 i) {
    return (uint4 *)a.ll[owner] + ((u64)(parity * a.world + from) * LL_LINES + i);
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

__device__ __forceinline__ uint4 ll_peek(const uint4 *line) {
    uint4 v;
    asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(line));
    return v;
}

__device__ __forceinline__ void ll_put(uint4 *line, u32 lo, u32 seq, u32 hi, u32 tag) {
    asm volatile("st.volatile.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(line), "r"(lo), "r"(seq),
                 "r"(hi), "r"(tag)
                 : "memory");
}

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

// The slow part of every LL wait, every 1024 reads: true (reported) when the wait must end:
// host abort, another failure, or the deadline (set at the first call) passed.
__device__ bool ll_give_up(const Args &a, int from, u32 seq, u64 &deadline) {
    u64 now = globaltimer();
    if (deadline == 0) deadline = now + a.timeout_ns;
    if (*a.abort_flag != 0u) {
        report(a, ERR_ABORTED, from, seq);
        return true;
    }
    if (*(volatile u32 *)a.err != 0u) return true;
    if (now > deadline) {
        report(a, ERR_TIMEOUT, from, seq);
        return true;
    }
    return false;
}

// Waits for peer `from`'s line i of this call, starting from `v` (a value already read from
// it); returns its 8 data bytes in v.x, v.z. False on timeout, abort, mismatch or another failure.
__device__ bool ll_wait(const Args &a, u32 parity, int from, u64 i, u32 seq, u32 tag, uint4 &v) {
    const uint4 *line = ll_line(a, a.rank, parity, from, i);
    u64 deadline = 0;
    u32 spins = 0;
    while (!(v.y == seq && v.w == tag)) {
        if ((++spins & 1023u) == 0u) {
            // Our sequence number with another tag, still there 1024 reads later (not a line
            // caught half written): the peer called with other arguments.
            if (v.y == seq) {
                report(a, ERR_MISMATCH, from, seq);
                return false;
            }
            if (ll_give_up(a, from, seq, deadline)) return false;
        }
        v = ll_peek(line);
    }
    return true;
}

// Half h (8 bytes: unit 2j+h of a pair) of a 16-byte pack: acc = w (first rank) or op(acc, w),
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

template <typename D, typename Op, int W> __device__ void one_shot_ll(const Args &a) {
    let_next_kernel_launch(a);
    u32 *ll_state = a.counters + STATE_LL; // {last sequence number, blocks done}
    const u32 seq = *(volatile u32 *)&ll_state[0] + 1;
    const u32 tag = ll_tag(a.stamp);
    const u32 parity = seq & 1u;
    const u64 total = a.count * D::SIZE;
    const u64 units = (total + 7) / 8;
    const u64 pairs = (total + 15) / 16;
    const u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    // Push: both units of each pair to every peer (see ll_passes).
    for (int pass = 0; pass < ll_passes(a); pass++) {
        for (u64 j = first; j < pairs; j += stride) {
            const uint4 v = load_pair(a.send, j, total);
            const bool two = 2 * j + 1 < units;
#pragma unroll
            for (int k = 1; k < W; k++) {
                int r;
                if (!ll_pushes_to(a, pass, k, r)) continue;
                uint4 *line = ll_line(a, r, parity, a.rank, 2 * j);
                ll_put(line, v.x, seq, v.y, tag);
                if (two) ll_put(line + 1, v.z, seq, v.w, tag);
            }
        }
    }
    // Reduce in rank order from our own memory. The same thread handles pair j in both loops, so
    // in place (send == recv) is safe. Two ranks: both lines of the peer are peeked before either
    // is waited for. More ranks: one unit at a time, its line of every peer peeked before any
    // wait (2 * (world - 1) lines held at once would not fit two blocks per SM: 64 registers).
    bool ok = true;
    for (u64 j = first; ok && j < pairs; j += stride) {
        const bool two = 2 * j + 1 < units;
        const uint4 mine = load_pair(a.send, j, total);
        Pack<D> acc;
        if (W <= 2) {
            uint4 got[2][2];
#pragma unroll
            for (int r = 0; r < 2; r++) {
                got[r][0] = got[r][1] = make_uint4(0u, seq, 0u, tag); // unused or past the end
                if (r < a.world && r != a.rank) {
                    const uint4 *line = ll_line(a, a.rank, parity, r, 2 * j);
                    got[r][0] = ll_peek(line);
                    if (two) got[r][1] = ll_peek(line + 1);
                }
            }
#pragma unroll
            for (int r = 0; r < 2; r++) {
                if (r >= a.world) break;
                uint4 w = mine;
                if (r != a.rank) {
                    if (!ll_wait(a, parity, r, 2 * j, seq, tag, got[r][0]) ||
                        (two && !ll_wait(a, parity, r, 2 * j + 1, seq, tag, got[r][1]))) {
                        ok = false;
                        break;
                    }
                    w = make_uint4(got[r][0].x, got[r][0].z, got[r][1].x, got[r][1].z);
                }
                ll_accumulate<D, Op>(acc, 0, make_uint2(w.x, w.y), r == 0);
                ll_accumulate<D, Op>(acc, 1, make_uint2(w.z, w.w), r == 0);
            }
        } else {
#pragma unroll
            for (int h = 0; h < 2; h++) {
                if (!ok || (h == 1 && !two)) break;
                uint4 got[W];
#pragma unroll
                for (int r = 0; r < W; r++) {
                    got[r] = make_uint4(0u, seq, 0u, tag);
                    if (r < a.world && r != a.rank) got[r] = ll_peek(ll_line(a, a.rank, parity, r, 2 * j + h));
                }
#pragma unroll
                for (int r = 0; r < W; r++) {
                    if (r >= a.world) break;
                    uint2 w = h == 0 ? make_uint2(mine.x, mine.y) : make_uint2(mine.z, mine.w);
                    if (r != a.rank) {
                        if (!ll_wait(a, parity, r, 2 * j + h, seq, tag, got[r])) {
                            ok = false;
                            break;
                        }
                        w = make_uint2(got[r].x, got[r].z);
                    }
                    ll_accumulate<D, Op>(acc, h, w, r == 0);
                }
            }
        }
        if (ok) store_pair(a.recv, j, total, repack<D>(acc));
    }
    // The last block to finish publishes the sequence number for the next call.
    publish_when_all_done(ll_state, seq);
}

// ---------------------------------------------------------------------------------------------
// LL12: the low-latency one-shot with 12 data bytes per 16-byte line {d0, d1, d2, seq}
// (IPCREDUCE_LL_DATA=12): 1.33x the message on the link instead of LL's 2x. The full 32-bit
// sequence number in every line keeps stale lines out exactly as in LL; the call's argument hash
// moves to one header line per (parity, sender), {0, seq, 0, tag} at line LL_LINES - 1 (LL12 data
// ends below it: LL_MAX_BYTES / 12 lines). Every thread checks each peer's header before it
// stores anything, and a thread still waiting for data looks at it too, so a peer that called
// with other arguments is a mismatch, never a result. LL and LL12 never share a communicator.

__device__ __forceinline__ uint4 *ll12_header(const Args &a, int owner, u32 parity, int from) {
    return ll_line(a, owner, parity, from, LL_LINES - 1);
}

// Whether the peer's header line `h` of this call shows other arguments (then reported).
__device__ __forceinline__ bool ll12_mismatch(const Args &a, int from, u32 seq, u32 tag, const uint4 &h) {
    if (h.y == seq && h.w != tag) {
        report(a, ERR_MISMATCH, from, seq);
        return true;
    }
    return false;
}

// Waits for peer `from`'s line i of this call (its flag word equal to seq), starting from `v`.
__device__ bool ll12_wait(const Args &a, u32 parity, int from, u64 i, u32 seq, u32 tag, uint4 &v) {
    const uint4 *line = ll_line(a, a.rank, parity, from, i);
    u64 deadline = 0;
    u32 spins = 0;
    while (v.w != seq) {
        if ((++spins & 1023u) == 0u) {
            if (ll12_mismatch(a, from, seq, tag, ll_peek(ll12_header(a, a.rank, parity, from)))) return false;
            if (ll_give_up(a, from, seq, deadline)) return false;
        }
        v = ll_peek(line);
    }
    return true;
}

// Waits for peer `from`'s header of this call; false when its arguments differ or the wait fails.
__device__ bool ll12_header_ok(const Args &a, u32 parity, int from, u32 seq, u32 tag) {
    const uint4 *line = ll12_header(a, a.rank, parity, from);
    u64 deadline = 0;
    u32 spins = 0;
    uint4 h = ll_peek(line);
    while (h.y != seq) {
        if ((++spins & 1023u) == 0u && ll_give_up(a, from, seq, deadline)) return false;
        h = ll_peek(line);
    }
    return !ll12_mismatch(a, from, seq, tag, h);
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
    u32 *ll_state = a.counters + STATE_LL; // {last sequence number, blocks done}
    const u32 seq = *(volatile u32 *)&ll_state[0] + 1;
    const u32 tag = ll_tag(a.stamp);
    const u32 parity = seq & 1u;
    const u64 total = a.count * D::SIZE;
    const u64 lines = (total + 11) / 12;
    const u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    if (first == 0) {
#pragma unroll
        for (int k = 1; k < W; k++) {
            if (k < a.world) {
                int r = a.rank + k;
                if (r >= a.world) r -= a.world;
                ll_put(ll12_header(a, r, parity, a.rank), 0u, seq, 0u, tag);
            }
        }
    }
    // Push: every line to every peer (see ll_passes).
    for (int pass = 0; pass < ll_passes(a); pass++) {
        for (u64 i = first; i < lines; i += stride) {
            const uint3 v = load_tri(a.send, i, total);
#pragma unroll
            for (int k = 1; k < W; k++) {
                int r;
                if (ll_pushes_to(a, pass, k, r)) ll_put(ll_line(a, r, parity, a.rank, i), v.x, v.y, v.z, seq);
            }
        }
    }
    // Reduce in rank order from our own memory (the same thread pushed line i: in place is safe),
    // every peer's line peeked before any wait; every peer's header checked before the first store.
    bool ok = true, checked = false;
    for (u64 i = first; ok && i < lines; i += stride) {
        uint4 got[W];
#pragma unroll
        for (int r = 0; r < W; r++) {
            got[r] = make_uint4(0u, 0u, 0u, seq);
            if (r < a.world && r != a.rank) got[r] = ll_peek(ll_line(a, a.rank, parity, r, i));
        }
        const uint3 mine = load_tri(a.send, i, total);
        float acc[N];
#pragma unroll
        for (int r = 0; r < W; r++) {
            if (r >= a.world) break;
            uint3 w = mine;
            if (r != a.rank) {
                if (!ll12_wait(a, parity, r, i, seq, tag, got[r])) {
                    ok = false;
                    break;
                }
                w = make_uint3(got[r].x, got[r].y, got[r].z);
            }
            const char *b = (const char *)&w;
#pragma unroll
            for (int k = 0; k < N; k++) {
                float v = D::load(b + k * D::SIZE);
                acc[k] = r == 0 ? v : Op::apply(acc[k], v); // f32, rank order
            }
        }
        if (ok && !checked) {
            for (int r = 0; ok && r < a.world; r++)
                if (r != a.rank) ok = ll12_header_ok(a, parity, r, seq, tag);
            checked = true;
        }
        if (ok) {
            uint3 w;
            char *b = (char *)&w;
#pragma unroll
            for (int k = 0; k < N; k++) D::store(b + k * D::SIZE, acc[k]);
            store_tri(a.recv, i, total, w);
        }
    }
    publish_when_all_done(ll_state, seq);
}

// ---------------------------------------------------------------------------------------------
// Copy-engine path (two ranks, registered buffers, out of place; see ../ce.rs). The copies are
// cuMemcpyAsync pushes into the peer's output; these kernels order them across the processes
// and reduce locally.

// One block: a barrier on lane `a.lane`'s counter and flags. Each lane is used by one stream of
// the call, in the same order on both ranks; before and after the call the lanes' slots are
// used only by kernels ordered with it on the caller's stream, so invariant (1) holds.
extern "C" __global__ void __launch_bounds__(32) ipcr_ce_barrier(const Args a) {
    wait_for_previous_kernel();
    u32 *ctr = a.counters + 2 * a.lane;
    u32 F = ctr[0];
    barrier_at(a, F, a.check != 0, a.lane);
    if (threadIdx.x == 0) ctr[0] = F;
}

// Our send holds our input, our recv the peer's input (pushed there): reduced in rank order
// into recv, in place (each element read, then written, by one thread).
struct CeSrc {
    const Args &a;
    __device__ const char *operator()(int r) const { return r == a.rank ? a.send : a.recv; }
};

template <typename D, typename Op> __device__ void ce_reduce(const Args &a) {
    u64 b, e;
    piece<D>(0, a.count, gridDim.x, blockIdx.x, b, e);
    reduce_range<D, Op, 2>(CeSrc{a}, OwnDst{a.recv, aligned16(a.recv)}, 2, b, e,
                           aligned16(a.send) && aligned16(a.recv));
}

// Kernel entry points: ipcr_<path>_w<W>_<dtype>_<op> for the staged and zero-copy paths, and
// ipcr_oneshotll_<dtype>_<op>. W, the compile-time bound on the world size that sets the unroll
// (2, 4 or 8), comes from -DIPCR_W: one module per world-size class keeps NVRTC's time down.
#ifndef IPCR_W
#define IPCR_W 8
#endif
// ENTRY(MIN_BLOCKS, NAME, CALL): an entry point of 512 threads, at least MIN_BLOCKS per SM,
// that waits for the kernel before it (see wait_for_previous_kernel), then runs CALL.
#define ENTRY(MIN_BLOCKS, NAME, CALL)                                                         \
    extern "C" __global__ void __launch_bounds__(512, MIN_BLOCKS) NAME(const Args a) {        \
        wait_for_previous_kernel();                                                           \
        CALL;                                                                                 \
    }
#define SM_KERNELS(DT, OPN, D, OP, W)                                                         \
    ENTRY(2, ipcr_oneshot_w##W##_##DT##_##OPN, (one_shot<D, OP, W>(a)))                       \
    ENTRY(2, ipcr_twoshot_w##W##_##DT##_##OPN, (two_shot<D, OP, W>(a)))                       \
    ENTRY(2, ipcr_oneshotreg_w##W##_##DT##_##OPN, (one_shot_reg<D, OP, W, LOADS_IN_FLIGHT>(a))) \
    ENTRY(2, ipcr_twoshotreg_w##W##_##DT##_##OPN, (two_shot_reg<D, OP, W, LOADS_IN_FLIGHT>(a))) \
    ENTRY(1, ipcr_oneshotreg16_w##W##_##DT##_##OPN,                                           \
          (one_shot_reg<D, OP, W, DEEP_LOADS_IN_FLIGHT(W)>(a)))                               \
    ENTRY(1, ipcr_twoshotreg16_w##W##_##DT##_##OPN,                                           \
          (two_shot_reg<D, OP, W, DEEP_LOADS_IN_FLIGHT(W)>(a)))
#define SM_KERNELS_FOR(DT, OPN, D, OP, W) SM_KERNELS(DT, OPN, D, OP, W)

#define KERNELS(DT, OPN, D, OP)                                                               \
    SM_KERNELS_FOR(DT, OPN, D, OP, IPCR_W)                                                    \
    ENTRY(2, ipcr_cereduce_##DT##_##OPN, (ce_reduce<D, OP>(a)))                               \
    ENTRY(2, ipcr_oneshotll_##DT##_##OPN, (one_shot_ll<D, OP, IPCR_W>(a)))                    \
    ENTRY(2, ipcr_oneshotll12_##DT##_##OPN, (one_shot_ll12<D, OP, IPCR_W>(a)))

KERNELS(f32, sum, F32, OpSum)
KERNELS(f32, max, F32, OpMax)
KERNELS(f32, min, F32, OpMin)
KERNELS(f16, sum, F16, OpSum)
KERNELS(f16, max, F16, OpMax)
KERNELS(f16, min, F16, OpMin)
KERNELS(bf16, sum, BF16, OpSum)
KERNELS(bf16, max, BF16, OpMax)
KERNELS(bf16, min, BF16, OpMin)
