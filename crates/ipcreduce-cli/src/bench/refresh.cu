// The benchmark's input refresh, run after every timed all-reduce: x <- f(x).
//
// A benchmark whose input never changes cannot see a stale read (the old value is the right
// one) and flatters zero-copy paths (peers read the input from their cache). So after every
// call this kernel
//   1. checks the call's output element by element against the exact expected value,
//      computed here from every rank's input pattern (counted in state->wrong);
//   2. writes the next call's input: the pattern of the next iteration where the output was
//      right, a poison (+inf, or -inf for min) where it was wrong, so an error also reaches
//      the final output that the host checks;
//   3. advances the iteration counter kept on the device (so graph replays see new values).
//
// Inputs are small integers (-16..15): every sum of up to 8 ranks is exact in f32, f16 and
// bf16 and in any order, so the check is an equality. Consecutive iterations of one element
// differ, so a sum that reads last call's data of any rank is wrong.
// pattern() must equal bench::pattern::value in Rust: the host writes nothing but checks the
// final output with the Rust version, so a difference fails every row.

// u32/u64/u16, h2f/f2h/f2b and wait_for_previous_kernel come from the library's convert.cuh
// (prepended at compile).

#define REFRESH_THREADS 512
#define MAX_RANKS 8

struct State {
    u32 iter;        // the iteration whose output the next refresh checks
    u32 blocks_done; // blocks finished in this launch (the last one advances iter)
    u64 wrong;       // wrong output elements seen so far
};

struct RefreshArgs {
    u64 send;   // next input (written)
    u64 recv;   // this call's output (read when check != 0)
    u64 count;
    u64 seed;
    u64 state;  // struct State *
    int rank;
    int world;
    int op;     // 0 sum, 1 max, 2 min
    int check;  // 0: only write the next input (the first fill, and the timing of f alone)
    int early;  // 1: let the next kernel launch now (bench --pdl-producer)
};

// Launched with programmatic stream serialization (bench --pdl-consumer), the refresh may start
// while the all-reduce before it runs: it first waits on the device for that kernel's completion
// and writes (convert.cuh's wait_for_previous_kernel) before it reads the output.

__device__ __forceinline__ u32 lowbias32(u32 x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

// Per-rank salt: depends on the seed and the rank only.
__device__ __forceinline__ u32 salt_of(u64 seed, int rank) {
    return lowbias32((u32)seed ^ lowbias32((u32)(seed >> 32) + 0x9e3779b9u * (u32)(rank + 1)));
}

// Rank 0 steps by an odd amount, the others by an even non-zero one (modulo 32): a call that
// reads one rank's previous input, or every rank's, gets a different sum.
__device__ __forceinline__ int pattern(u32 salt, u32 iter, u64 i, int rank) {
    u32 h = lowbias32((u32)i ^ lowbias32((u32)(i >> 32) ^ salt));
    u32 step = rank == 0 ? 2u * (h & 15u) + 1u : 2u * (h % 15u) + 2u;
    return (int)(((h >> 4) + iter * step) & 31u) - 16;
}


struct F32 {
    __device__ static float load(const void *p, u64 i) { return ((const float *)p)[i]; }
    __device__ static void store(void *p, u64 i, float v) { ((float *)p)[i] = v; }
};
struct F16 {
    __device__ static float load(const void *p, u64 i) { return h2f(((const u16 *)p)[i]); }
    __device__ static void store(void *p, u64 i, float v) { ((u16 *)p)[i] = f2h(v); }
};
struct BF16 {
    __device__ static float load(const void *p, u64 i) {
        return __uint_as_float(((u32)((const u16 *)p)[i]) << 16);
    }
    __device__ static void store(void *p, u64 i, float v) { ((u16 *)p)[i] = f2b(v); }
};

template <typename T>
__device__ void refresh(const RefreshArgs &a) {
    State *st = (State *)a.state;
    const u32 iter = *(volatile u32 *)&st->iter;
    u32 salts[MAX_RANKS];
#pragma unroll
    for (int r = 0; r < MAX_RANKS; ++r) {
        salts[r] = r < a.world ? salt_of(a.seed, r) : 0u;
    }
    const u32 mine = salt_of(a.seed, a.rank);
    const float poison = a.op == 2 ? -__int_as_float(0x7f800000) : __int_as_float(0x7f800000);
    u64 wrong = 0;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < a.count; i += stride) {
        bool ok = true;
        if (a.check) {
            float want = (float)pattern(salts[0], iter, i, 0);
            for (int r = 1; r < a.world && r < MAX_RANKS; ++r) {
                float v = (float)pattern(salts[r], iter, i, r);
                want = a.op == 0 ? want + v : (a.op == 1 ? fmaxf(want, v) : fminf(want, v));
            }
            ok = T::load((const void *)a.recv, i) == want;
            wrong += ok ? 0 : 1;
        }
        T::store((void *)a.send, i, ok ? (float)pattern(mine, iter + 1u, i, a.rank) : poison);
    }
    // Block sum of the wrong count, then one atomic per block.
    __shared__ u64 partial[REFRESH_THREADS / 32];
    for (int off = 16; off > 0; off >>= 1) {
        wrong += __shfl_down_sync(0xffffffffu, wrong, off);
    }
    if ((threadIdx.x & 31) == 0) {
        partial[threadIdx.x >> 5] = wrong;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        u64 sum = 0;
        for (int w = 0; w < (int)(blockDim.x >> 5); ++w) {
            sum += partial[w];
        }
        if (sum) {
            atomicAdd(&st->wrong, sum);
        }
        // The last block to finish advances the iteration for the next launch; every block
        // read `iter` before any block got here, and the next launch starts after this one.
        __threadfence();
        if (atomicAdd(&st->blocks_done, 1u) == gridDim.x - 1) {
            st->blocks_done = 0;
            st->iter = iter + 1u;
            __threadfence();
        }
    }
}

// With `early`, the refresh behaves as a producer written for programmatic dependent launch
// (as e.g. GEMM libraries on Hopper are): it lets the kernel after it launch at once. That
// kernel, if launched with programmatic stream serialization, waits on the device for the
// refresh's completion and its writes (griddepcontrol.wait); one launched normally waits anyway.
__device__ __forceinline__ void let_next_kernel_launch(const RefreshArgs &a) {
#if __CUDA_ARCH__ >= 900
    if (a.early) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

extern "C" __global__ void __launch_bounds__(REFRESH_THREADS)
ipcr_refresh_f32(RefreshArgs a) { wait_for_previous_kernel(); let_next_kernel_launch(a); refresh<F32>(a); }
extern "C" __global__ void __launch_bounds__(REFRESH_THREADS)
ipcr_refresh_f16(RefreshArgs a) { wait_for_previous_kernel(); let_next_kernel_launch(a); refresh<F16>(a); }
extern "C" __global__ void __launch_bounds__(REFRESH_THREADS)
ipcr_refresh_bf16(RefreshArgs a) { wait_for_previous_kernel(); let_next_kernel_launch(a); refresh<BF16>(a); }
