// ipcreduce kernel primitives, shared by every protocol's source (ll.cu, staged.cu, zerocopy.cu,
// ce.cu, scatter_gather.cu; ../kernels.rs concatenates them after this header for NVRTC): the
// memory layout, the arguments, element packs, loads and stores, flags and barriers, the call
// identity board, the LL lines, and the call counter every kernel advances.
//
// Compiled at run time by NVRTC for the device's compute capability. No CUDA headers are
// needed: half and bfloat16 conversions are single PTX instructions (convert.cuh). The path
// codes come from the host's one table of paths (-DIPCR_PATH_*, backend/cuda/paths.rs).
//
// Memory layout of one rank's workspace (one cuMemCreate allocation, mapped by every peer):
//
//   [0, FLAG_BYTES)               flags[MAX_BLOCKS][MAX_RANKS] (u32); peer p's block b writes
//                                 flags[b][p] of this rank to say "I arrived at barrier number
//                                 F"; only this rank reads them.
//   [FLAG_BYTES, +STAMP_BYTES)    stamps[2][MAX_BLOCKS][MAX_RANKS] (u64): the digest of the
//                                 call's identity, written by peer p's block b before its first
//                                 flag of each call; compared in the first barrier. Indexed by
//                                 the barrier's parity: a peer may run one barrier ahead and
//                                 stamp its next call.
//   [.., +BOARD_BYTES)            board[MAX_RANKS][BOARD_WORDS] (u64): peer p's identity of the
//                                 call it runs, posted by its block 0 at the start of every
//                                 kernel of every protocol (post_identity; the LL kernels right
//                                 after their pushes); read by every wait's
//                                 slow path, so a peer that runs another call (even of another
//                                 protocol, which never meets our flags or lines) is named at
//                                 once instead of timing out.
//   [SIG_BYTES, +LL_BYTES(world)) LL lines[2][world][LL_LINES] of 16 bytes (see ll.cu).
//   data area (2 * slot_bytes)    two slots for the staged kernels (see staged.cu).
//
// Per-rank private state (device memory, not shared), in u32 words:
//   [2b]                   F of block b: barriers block b has passed (word 2b+1 unused)
//   [2*MAX_BLOCKS]         error word (first failure code, claimed atomically)
//   [STATE_CALL..+4)       {call number (u64), blocks done, staged chunk counter L}
// All state lives on the device and is advanced on the device, so calls can be captured in a CUDA
// graph and replayed.
//
// Invariants every protocol keeps.
// (1) One call counter. Every kernel that starts a call (every kernel but the copy-engine path's
//     later barriers and its reduce kernels) reads call = state[STATE_CALL] + 1 at its start and
//     its last block stores `call` there at its end (finish_call); the next kernel on the stream
//     starts after that (kernel boundary; with programmatic dependent launch, after
//     wait_for_previous_kernel). Every rank runs every call, count 0 included, through exactly
//     one such kernel, so the ranks' call numbers stay paired across protocols and graph
//     replays: call N on one rank meets call N on every peer.
// (2) One identity. The host encodes the call (operation, path code, dtype, op, count, in place,
//     registered regions and offsets) in IDENT_WORDS words and their 64-bit non-zero digest.
//     Before any peer data is touched: barrier kernels compare the digest in their first
//     barrier (stamps); LL kernels accept only lines whose flag is ll_flag(digest, call). Every
//     wait's slow path (every 1024 spins) also reads the peer's board entry: the same call
//     number with other identity words is a mismatch, reported with both identities.
// (3) Barriers. Block b only ever syncs with block b of the peers (flag slot flags[b][p]). The
//     grid may differ from call to call, but every rank computes it the same way from the
//     identity and the communicator's agreed limits, so F of block b advances identically on
//     every rank. A peer whose identity (and so grid) differs is caught by (2) before any
//     block reads its data.
// (4) Rank order. Peers are summed in rank order 0..world-1 with f32 accumulation and one final
//     rounding, so all ranks, and every path, produce bitwise the same result.
// (5) Loads in flight. The reduction loads U packs (16 bytes each) from each of W ranks before
//     using any of them. U * W = 8 uint4 registers for the zero-copy kernels (two blocks per SM,
//     <= 64 registers); 16 for their deep variants (one block per SM, <= 128 registers); 4 for
//     the staged ones. Blocks wait for their peers' blocks, so every CTA of every rank sharing a
//     GPU must be resident at once: the host caps the grid per kernel class.
//
// The board. Entry word k is {identity word k (low 32 bits), call number mod 2^32 (high 32)},
// each stored and loaded as one aligned 64-bit access, which PTX makes single-copy atomic. A
// reader accepts an entry only when every word carries its own call number: each word then
// holds that call's identity word, with no fence on the writer's side (a torn entry, half of
// one call and half of the next, shows two call numbers and is read again later). Entries are
// rewritten every call and peers are at most a few calls apart, so a 32-bit call number cannot
// alias.

#ifndef IPCR_PATH_ONESHOT_LL
#error "compile with the path codes of backend/cuda/paths.rs (-DIPCR_PATH_*)"
#endif

#define MAX_RANKS 8
#define MAX_BLOCKS 128
#define IDENT_WORDS 10
#define BOARD_WORDS 16
#define LL_MAX_BYTES (1024 * 1024)
#define LL_LINES (LL_MAX_BYTES / 8)
#define LL_BYTES(world) (2 * (world) * LL_LINES * 16)
#define FLAG_BYTES (MAX_BLOCKS * MAX_RANKS * 4)
#define STAMP_BYTES (2 * MAX_BLOCKS * MAX_RANKS * 8)
#define BOARD_BYTES (MAX_RANKS * BOARD_WORDS * 8)
#define SIG_BYTES (FLAG_BYTES + STAMP_BYTES + BOARD_BYTES)
#define STATE_ERR (2 * MAX_BLOCKS)
#define STATE_CALL (2 * MAX_BLOCKS + 4)
#define LOADS_IN_FLIGHT 8
#define DEEP_LOADS_IN_FLIGHT(W) ((W) == 4 ? 12 : 16)
#define STAGED_LOADS_IN_FLIGHT 4
#define COPY_UNROLL 4

// The host-mapped error record (u32 words): {code, peer, block, where (barrier or line), call
// number (2), call of the host (2), theirs known, our identity (IDENT_WORDS), theirs}.
#define REC_CODE 0
#define REC_PEER 1
#define REC_BLOCK 2
#define REC_WHERE 3
#define REC_CALL 4
#define REC_SEQ 6
#define REC_THEIRS_KNOWN 8
#define REC_MINE 9
#define REC_THEIRS (REC_MINE + IDENT_WORDS)
#define REC_WORDS (REC_THEIRS + IDENT_WORDS)

// u32/u64/u16 and the f16/bf16 conversions come from convert.cuh (prepended at compile).

struct Args {
    const char *send;            // this rank's input (user memory; may be null at count 0)
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
    volatile u32 *host_err;      // host-mapped failure record (REC_*)
    u64 slot_bytes;              // bytes per data slot (multiple of 16 * world * MAX_BLOCKS)
    u64 timeout_ns;              // bound on every wait
    u64 digest;                  // this call's identity digest (non-zero), compared with peers'
    u64 seq;                     // this call's number on the host (named in errors)
    u32 ident[IDENT_WORDS];      // this call's identity words (see (2))
    int rank;
    int world;
    int aligned;                 // zero-copy: bit 0 all rsend 16-byte aligned, bit 1 all rrecv
    int lane;                    // copy-engine barrier: the counter and flag slot it syncs on
    int check;                   // copy-engine barrier: CHECK_* bits
    int mode;                    // staged and LL kernels: MODE_* bits (the same on every rank)
    int trace_row;               // traced copy-engine kernels: their row of the phase-stamp
                                 // ring (the others stamp their block's), see "Phase stamps"
    u64 chunk_bytes;             // staged kernels: bytes per chunk (<= slot_bytes, multiple
                                 // of 256; the same on every rank for a call)
    u64 *phases;                 // the phase-stamp ring in device memory (traced kernels only, see
                                 // "Phase stamps"); last, so structs that start with Args keep
                                 // their layout
};

// Args::check bits (copy-engine barrier kernels).
// CHECK_STAMPS: compare the call's stamps (every lane's first barrier).
#define CHECK_STAMPS 1
// CHECK_BEGIN: this barrier starts the call (lane 0's first): it advances the call counter and
// posts the identity (invariant 1).
#define CHECK_BEGIN 2
// CHECK_ROW_REDUCED (traced only): a reduce kernel follows this barrier on its lane and stamps
// the reduce and end of the barrier's row; the barrier clears those two words for it.
#define CHECK_ROW_REDUCED 4

// Args::mode bits.
// MODE_PUSH_PASSES (PCIe policy, peer transport): every push into peers' memory is made in
// passes; in pass p this rank writes only to rank (rank + 1 + p) mod world, so each GPU's link
// carries one stream of pushes per direction at a time instead of world - 1 streams that meet
// at the root complex.
#define MODE_PUSH_PASSES 1
// MODE_LET_NEXT_LAUNCH (LL kernels, no GPU shared between ranks): the kernel lets the next
// kernel on its stream launch at once (see let_next_kernel_launch).
#define MODE_LET_NEXT_LAUNCH 2
// MODE_ROUND (staged kernels, bits 8-15): packs per thread per round when a copy into host
// memory runs beside a read from it (staged.cu, interleave); 0 = one after the other.
#define MODE_ROUND_SHIFT 8
#define MODE_ROUND_MASK 255u

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
// Flags, the identity board, the error record, barriers

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
__device__ __forceinline__ void st_volatile_u64(u64 *p, u64 v) {
    asm volatile("st.volatile.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ u64 ld_volatile_u64(const u64 *p) {
    u64 v;
    asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(p));
    return v;
}

// ---------------------------------------------------------------------------------------------
// Phase stamps (-DIPCR_TRACE: a separate module the host loads only while tracing; without the
// define every TRACE_* below expands to nothing, so the kernels are those of a build without
// tracing). When on, the block's phase boundaries are stamped with %globaltimer into the ring
// a.phases, device memory the host copies out when it writes a trace (phase_ring.rs: stamps
// written across PCIe into host-mapped memory made an eager call end later), on a copy engine,
// so also while a kernel waits for a peer (flight/stamps.rs decodes it).
//
// Layout: u64 words [PH_CALLS][MAX_BLOCKS][PH_SLOTS], indexed by (host call number mod
// PH_CALLS, row, phase); a block's row is its index, but the copy-engine kernels' is a.trace_row
// (the host's choice: a row per barrier and per chunk, ce.cu; a kernel past the rows is
// launched with a.phases = 0). Each word has one writer per call, so no atomics, except the
// copy-engine reduce's two words, which every block raises to its own time
// (`phase_stamp_latest`) after the barrier before it cleared them. A word is
// {call number mod 2^16 (high 16 bits), globaltimer mod 2^48 (low 48 bits, 78 hours)}: one
// 64-bit store, which PTX makes single-copy atomic, so the host never reads half of a stamp and
// tells a stale word (an older call's in the same slot) by its tag. The host restores the high
// bits of the time from its own reading of the clock.
#define PH_START 0  // the block starts (after wait_for_previous_kernel)
#define PH_REDUCE 1 // the block's reduction done
#define PH_GATHER 2 // the block's gather done (two-shot staged)
#define PH_END 3    // the block's last access done (after finish_call)
#define PH_PEER 4   // + p: the block first saw peer p (its first barrier, or LL line from p)
#define PH_SLOTS (PH_PEER + MAX_RANKS)
#define PH_CALLS 1024
#define PH_TIME_MASK ((1ull << 48) - 1)
#ifdef IPCR_TRACE
__device__ __forceinline__ u64 *phase_word(const Args &a, int row, int slot) {
    return a.phases + (((a.seq & (PH_CALLS - 1)) * MAX_BLOCKS + row) * PH_SLOTS + slot);
}
__device__ __forceinline__ u64 phase_now(const Args &a) {
    return (a.seq << 48) | (globaltimer() & PH_TIME_MASK);
}
__device__ __forceinline__ void phase_stamp_at(const Args &a, int row, int slot) {
    if (a.phases == 0) return;
    st_volatile_u64(phase_word(a, row, slot), phase_now(a));
}
__device__ __forceinline__ void phase_stamp(const Args &a, int slot) { phase_stamp_at(a, blockIdx.x, slot); }
// Row a.trace_row's `slot` raised to now by each block that calls it: the word then holds the
// last block's time. Its call's tag must be there already (with time 0, "not reached": the
// barrier before the kernel wrote it): a stale word of an earlier call in the same slot could
// compare larger (its 16-bit tag, once the call numbers pass 2^16).
__device__ __forceinline__ void phase_stamp_latest(const Args &a, int slot) {
    if (a.phases == 0) return;
    atomicMax((unsigned long long *)phase_word(a, a.trace_row, slot), (unsigned long long)phase_now(a));
}
// Row a.trace_row's `slot` set to "not reached" for this call (the tag, time 0).
__device__ __forceinline__ void phase_clear(const Args &a, int slot) {
    if (a.phases == 0) return;
    st_volatile_u64(phase_word(a, a.trace_row, slot), a.seq << 48);
}
// Thread 0 stamps `phase` (what the block's thread 0 has done, without waiting for the others).
#define TRACE_PHASE(a, phase)                                                                 \
    do {                                                                                      \
        if (threadIdx.x == 0) phase_stamp(a, phase);                                          \
    } while (0)
// The whole block is past this point, then thread 0 stamps `phase` (a barrier of its own, in
// the traced kernels only).
#define TRACE_BLOCK(a, phase)                                                                 \
    do {                                                                                      \
        __syncthreads();                                                                      \
        if (threadIdx.x == 0) phase_stamp(a, phase);                                          \
    } while (0)
// The calling thread, which waited for peer p, stamps when it saw it (when `cond`).
#define TRACE_PEER(a, cond, p)                                                                \
    do {                                                                                      \
        if (cond) phase_stamp(a, PH_PEER + (p));                                              \
    } while (0)
// The same in row `row` (a barrier's slot: the block's index, or a copy-engine lane's).
#define TRACE_PEER_AT(a, cond, row, p)                                                        \
    do {                                                                                      \
        if (cond) phase_stamp_at(a, row, PH_PEER + (p));                                      \
    } while (0)
// Thread 0 stamps `phase` in row a.trace_row (the copy-engine kernels).
#define TRACE_ROW(a, phase)                                                                   \
    do {                                                                                      \
        if (threadIdx.x == 0) phase_stamp_at(a, a.trace_row, phase);                          \
    } while (0)
// The whole block is past this point, then thread 0 raises row a.trace_row's `phase` to now
// (every block of the grid: the row ends with the last one).
#define TRACE_ROW_LATEST(a, phase)                                                            \
    do {                                                                                      \
        __syncthreads();                                                                      \
        if (threadIdx.x == 0) phase_stamp_latest(a, phase);                                   \
    } while (0)
// Thread 0 clears row a.trace_row's `phase` for a later kernel's TRACE_ROW_LATEST.
#define TRACE_ROW_CLEAR(a, phase)                                                             \
    do {                                                                                      \
        if (threadIdx.x == 0) phase_clear(a, phase);                                          \
    } while (0)
#else
#define TRACE_PHASE(a, phase)
#define TRACE_BLOCK(a, phase)
#define TRACE_PEER(a, cond, p)
#define TRACE_PEER_AT(a, cond, row, p)
#define TRACE_ROW(a, phase)
#define TRACE_ROW_LATEST(a, phase)
#define TRACE_ROW_CLEAR(a, phase)
#endif

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

// Peer `from`'s board entry in `owner`'s signal area.
__device__ __forceinline__ u64 *board_entry(const Args &a, int owner, int from) {
    return (u64 *)((char *)a.sig[owner] + FLAG_BYTES + STAMP_BYTES) + from * BOARD_WORDS;
}

// Block 0 posts this call's identity on every peer's board (threads 0..world-1, one peer each):
// plain 64-bit stores, no fence (see "The board" above); the peers read it only on a slow path.
__device__ __forceinline__ void post_identity(const Args &a, u64 call) {
    const int t = threadIdx.x;
    if (blockIdx.x != 0 || t >= a.world || t == a.rank) return;
    u64 *e = board_entry(a, t, a.rank);
    const u64 tag = (u64)(u32)call << 32;
#pragma unroll
    for (int k = 0; k < IDENT_WORDS; k++) st_volatile_u64(e + k, tag | a.ident[k]);
}

// Peer `from`'s identity of call `call` into `out`, if its whole entry is that call's.
__device__ __forceinline__ bool read_identity(const Args &a, int from, u64 call, u32 *out) {
    const u64 *e = board_entry(a, a.rank, from);
    bool whole = true;
#pragma unroll
    for (int k = 0; k < IDENT_WORDS; k++) {
        const u64 w = ld_volatile_u64(e + k);
        whole = whole && (u32)(w >> 32) == (u32)call;
        out[k] = (u32)w;
    }
    return whole;
}

// Whether peer `from` posted call `call` with identity words other than ours. call 0: this
// kernel does not know the call number (the copy-engine path's later barriers): no answer.
__device__ bool board_differs(const Args &a, int from, u64 call) {
    if (call == 0) return false;
    u32 theirs[IDENT_WORDS];
    if (!read_identity(a, from, call, theirs)) return false;
    bool same = true;
#pragma unroll
    for (int k = 0; k < IDENT_WORDS; k++) same = same && theirs[k] == a.ident[k];
    return !same;
}

// Records the first failure in the host-visible error record. For a mismatch the peer's
// identity is read from the board (waited for up to a millisecond: its block 0 posts it at the
// start of its kernel, maybe after the block that showed us the difference), so the host names
// both calls.
__device__ void report(const Args &a, u32 code, u32 peer, u32 where, u64 call) {
    if (atomicCAS(a.err, 0u, code) != 0u) return;
    volatile u32 *rec = a.host_err;
    u32 known = 0;
    if (code == ERR_MISMATCH && call != 0) {
        u32 theirs[IDENT_WORDS];
        const u64 until = globaltimer() + 1000000;
        do {
            if (read_identity(a, peer, call, theirs)) {
                known = 1;
                break;
            }
        } while (globaltimer() < until);
        if (known)
            for (int k = 0; k < IDENT_WORDS; k++) rec[REC_THEIRS + k] = theirs[k];
    }
    rec[REC_PEER] = peer;
    rec[REC_BLOCK] = blockIdx.x;
    rec[REC_WHERE] = where;
    rec[REC_CALL] = (u32)call;
    rec[REC_CALL + 1] = (u32)(call >> 32);
    rec[REC_SEQ] = (u32)a.seq;
    rec[REC_SEQ + 1] = (u32)(a.seq >> 32);
    rec[REC_THEIRS_KNOWN] = known;
    for (int k = 0; k < IDENT_WORDS; k++) rec[REC_MINE + k] = a.ident[k];
    __threadfence_system();
    rec[REC_CODE] = code; // written last: the host reads the record once this is non-zero
    __threadfence_system();
}

// The slow part of every wait, every 1024 spins: true (reported) when the wait must end: the
// peer posted this call with another identity, host abort, another failure, or the deadline
// (set at the first call) passed.
__device__ bool wait_must_end(const Args &a, int from, u32 where, u64 call, u64 &deadline) {
    if (board_differs(a, from, call)) {
        report(a, ERR_MISMATCH, from, where, call);
        return true;
    }
    const u64 now = globaltimer();
    if (deadline == 0) deadline = now + a.timeout_ns;
    if (*a.abort_flag != 0u) {
        report(a, ERR_ABORTED, from, where, call);
        return true;
    }
    if (*(volatile u32 *)a.err != 0u) return true; // another block already failed
    if (now > deadline) {
        report(a, ERR_TIMEOUT, from, where, call);
        return true;
    }
    return false;
}

// The call counter of a communicator that was closed after some of its calls were captured
// into CUDA graphs (teardown.rs keeps its private state, and only that, for this): a replay of
// such a graph must not run, since every other address in its arguments may be freed or reused.
#define CALL_CLOSED 0xFFFFFFFFFFFFFFFFull

// The state's call counter, after making sure the communicator is open: a replay of a closed
// one traps before it touches anything but its state, which fails the graph launch
// (CUDA_ERROR_LAUNCH_FAILED; the context is unusable afterwards, as after any trap). A trap and
// nothing else: a message (printf) would make this a function call, whose registers and stack
// frame every kernel carries on its hot path (8 registers in the two-rank LL kernel, twice the
// spills in the staged ones). The host says at close that such graphs were left (teardown.rs).
__device__ __forceinline__ u64 open_call_counter(const Args &a) {
    const u64 done = *(volatile u64 *)(a.counters + STATE_CALL);
    if (done == CALL_CLOSED) asm volatile("trap;");
    return done;
}

// Starts a call (invariant 1): its number, and block 0 posts the identity. The LL kernels at
// two ranks pass post = false and post it themselves after their pushes: the posting threads
// are pushing threads, and ten stores to a peer's board ahead of the first line delay it.
__device__ __forceinline__ u64 begin_call(const Args &a, bool post = true) {
    const u64 call = open_call_counter(a) + 1;
    if (post) post_identity(a, call);
    return call;
}

// Ends a call: the last block of the grid to get here stores `call` (and, for the staged
// kernels, the chunk counter L). What this must ensure, and why no fence is needed for it:
// (a) no block of this grid reads the counter after the store: every thread read it at its
//     start (begin_call; the LL kernels of more than two ranks read it again just before,
//     current_call, and pass that) and below waits for the value passed as `call` (a compare
//     that reads its register stalls the thread until the load has returned) before the
//     block's barrier; the block counts itself after the barrier, and the last block stores
//     only after its atomic saw every block's count. So every read was served before any block counted, let alone
//     stored. (An unused value could still be in flight, but a value never used changes
//     nothing.)
// (b) the next kernel on the stream sees the store and every other write of this grid: kernel
//     completion makes them visible (with programmatic dependent launch, griddepcontrol.wait
//     waits for the whole grid to complete and its memory to be flushed).
// A __threadfence before the count (and one after the store) cost a multi-block call 0.75-1.0
// us, 14-20 % at 16-256 KiB (graph, two ranks under MPS on one H100, 2026-12-05;
// fence.acq_rel before the count alone cost about half of that), and neither was needed for
// (a) or (b).
__device__ __forceinline__ void finish_call(const Args &a, u64 call, bool set_l = false, u32 L = 0) {
    u32 *st = a.counters + STATE_CALL;
    // (a): the counter's value is used before the barrier (call is never 0: begin_call adds 1
    // to a counter that traps at CALL_CLOSED), so its load has returned.
    if (call == 0) asm volatile("trap;");
    __syncthreads();
    if (gridDim.x == 1) {
        // The only block: no count.
        if (threadIdx.x == 0) {
            *(u64 *)st = call;
            if (set_l) st[3] = L;
        }
        return;
    }
    if (threadIdx.x == 0 && atomicAdd(&st[2], 1u) == gridDim.x - 1) {
        st[2] = 0u;
        *(u64 *)st = call;
        if (set_l) st[3] = L;
    }
}

__device__ __forceinline__ u64 *stamp_slot(const Args &a, int owner, u32 F, int block, int from) {
    return (u64 *)((char *)a.sig[owner] + FLAG_BYTES) + ((F & 1u) * MAX_BLOCKS + block) * MAX_RANKS + from;
}

// Block-wide barrier on slot `b` (the block's index, or a copy-engine lane) with the same slot of
// every peer; traced, a first barrier (`check_stamp`) stamps the peers seen in row `b`. Returns
// false (in every thread of the block) if the wait failed: deadline passed, host abort, a call
// that differs from a peer's (`check_stamp`, the first barrier of a call, or the board), or
// another block failed.
__device__ bool barrier_at(const Args &a, u32 &F, u64 call, bool check_stamp, int b) {
    F++;
    __syncthreads();
    int t = threadIdx.x;
    int failed = 0;
    if (t < a.world && t != a.rank) {
        if (check_stamp) *(volatile u64 *)stamp_slot(a, t, F, b, a.rank) = a.digest;
        // Make this block's data writes visible system-wide before announcing arrival.
        __threadfence_system();
        st_release_sys(&a.sig[t][b * MAX_RANKS + a.rank], F);
        const u32 *mine = &a.sig[a.rank][b * MAX_RANKS + t];
        u64 deadline = 0;
        u32 spins = 0;
        while ((int)(ld_acquire_sys(mine) - F) < 0) {
            if ((++spins & 1023u) == 0u && wait_must_end(a, t, F, call, deadline)) {
                failed = 1;
                break;
            }
        }
        TRACE_PEER_AT(a, !failed && check_stamp, b, t);
        if (!failed && check_stamp) {
            u64 theirs = *(volatile u64 *)stamp_slot(a, a.rank, F, b, t);
            if (theirs != a.digest) {
                report(a, ERR_MISMATCH, t, F, call);
                failed = 1;
            }
        }
    }
    return __syncthreads_or(failed) == 0;
}

__device__ __forceinline__ bool barrier(const Args &a, u32 &F, u64 call, bool check_stamp = false) {
    return barrier_at(a, F, call, check_stamp, blockIdx.x);
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

// ---------------------------------------------------------------------------------------------
// LL lines (see ll.cu for the protocol). A line is 16 bytes: two 64-bit halves, each {4 data
// bytes (low word), the call's flag (high word)}, stored and loaded as one .v2.u64 access, whose
// two 64-bit elements PTX makes single-copy atomic each (aligned): a half read is either wholly
// one write or wholly another, so data is accepted only with the flag of its own write.

// The flag of call `call` with identity digest `digest` (identity::ll_flag on the host): never
// 0, which marks a line its reader cleared. One 32-bit multiply-add after the call number is
// read (it sits between that load and the first push): the digest is already a mixed hash, so
// its low word tells identities apart, and an odd multiplier makes consecutive calls' flags
// differ. Stale data never depends on the flag changing (lines hold zero or this call's flag,
// see ll.cu); the call term only keeps a peer one call ahead from looking like this call.
// `x` as the compiler cannot recompute it: kept in one register instead of being rebuilt from
// the values it came from (which would then stay live: registers, invariant 5).
__device__ __forceinline__ u32 opaque(u32 x) {
    u32 y;
    asm volatile("mov.b32 %0, %1;" : "=r"(y) : "r"(x));
    return y;
}

__device__ __forceinline__ u32 ll_flag(u64 digest, u64 call) {
    return ((u32)digest + (u32)call * 0x9E3779B9u) | 1u;
}

__device__ __forceinline__ ulonglong2 *ll_line(const Args &a, int owner, u32 parity, int from, u64 i) {
    return (ulonglong2 *)a.ll[owner] + ((u64)(parity * a.world + from) * LL_LINES + i);
}

__device__ __forceinline__ ulonglong2 ll_peek(const ulonglong2 *line) {
    ulonglong2 v;
    asm volatile("ld.volatile.global.v2.u64 {%0,%1}, [%2];" : "=l"(v.x), "=l"(v.y) : "l"(line));
    return v;
}

__device__ __forceinline__ void ll_put(ulonglong2 *line, u32 lo, u32 hi, u32 flag) {
    const u64 f = (u64)flag << 32;
    asm volatile("st.volatile.global.v2.u64 [%0], {%1,%2};" ::"l"(line), "l"(f | lo), "l"(f | hi)
                 : "memory");
}

// The reader's clear of a line it consumed (its own memory; see ll.cu for why no peer's write
// can be lost to it).
__device__ __forceinline__ void ll_clear(ulonglong2 *line) {
    asm volatile("st.volatile.global.v2.u64 [%0], {%1,%1};" ::"l"(line), "l"(0ull) : "memory");
}

__device__ __forceinline__ bool ll_ready(const ulonglong2 &v, u32 flag) {
    return (u32)(v.x >> 32) == flag && (u32)(v.y >> 32) == flag;
}

// A half written, but not by a call with our identity and number: a mismatch (lines hold only
// zero or the current call's flag, see ll.cu).
__device__ __forceinline__ bool ll_foreign(const ulonglong2 &v, u32 flag) {
    const u32 f0 = (u32)(v.x >> 32), f1 = (u32)(v.y >> 32);
    return (f0 != 0u && f0 != flag) || (f1 != 0u && f1 != flag);
}

// LL12 lines {d0, d1, d2, flag} (one 16-byte access; opt-in, NVLink only: see ll.cu).
__device__ __forceinline__ uint4 ll12_peek(const uint4 *line) {
    uint4 v;
    asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(line));
    return v;
}

__device__ __forceinline__ void ll12_put(uint4 *line, u32 d0, u32 d1, u32 d2, u32 flag) {
    asm volatile("st.volatile.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(line), "r"(d0), "r"(d1),
                 "r"(d2), "r"(flag)
                 : "memory");
}

__device__ __forceinline__ void ll12_clear(uint4 *line) {
    asm volatile("st.volatile.global.v4.u32 [%0], {%1,%1,%1,%1};" ::"l"(line), "r"(0u) : "memory");
}

// ---------------------------------------------------------------------------------------------
// Entry points. W, the compile-time bound on the world size that sets the unroll (2, 4 or 8),
// comes from -DIPCR_W: one module per world-size class keeps NVRTC's time down. Kernel names
// follow the host's table (paths.rs: ipcr_<stem>[_w<W>]_<dtype>[_<op>]).
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
// Which entry points one compilation emits (the host compiles one variant group at a time,
// kernel_variants.rs): without -DIPCR_ONE_GROUP every group, else only the group whose
// -DIPCR_GROUP_<NAME> is set; without -DIPCR_SEL_DT every dtype and op, else only the one of
// -DIPCR_SEL_DT/_OPN/_D/_OP (e.g. f32, sum, F32, OpSum), and the dtype's all-gather kernels
// (which reduce nothing) only with -DIPCR_SEL_GATHER. Guards only: the kernels are the same.
#define IPCR_APPLY(M, ...) M(__VA_ARGS__)
// M(DT, OPN, D, OP) for every dtype and reduction op (or the one selected).
#ifdef IPCR_SEL_DT
#define FOR_EACH_DTYPE_OP(M) IPCR_APPLY(M, IPCR_SEL_DT, IPCR_SEL_OPN, IPCR_SEL_D, IPCR_SEL_OP)
#else
#define FOR_EACH_DTYPE_OP(M)                                                                  \
    M(f32, sum, F32, OpSum)                                                                   \
    M(f32, max, F32, OpMax)                                                                   \
    M(f32, min, F32, OpMin)                                                                   \
    M(f16, sum, F16, OpSum)                                                                   \
    M(f16, max, F16, OpMax)                                                                   \
    M(f16, min, F16, OpMin)                                                                   \
    M(bf16, sum, BF16, OpSum)                                                                 \
    M(bf16, max, BF16, OpMax)                                                                 \
    M(bf16, min, BF16, OpMin)
#endif
