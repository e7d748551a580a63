// Compute-bound stand-in for a slice of the backward pass, for `ipcreduce overlap`.
//
// The benchmark needs a kernel whose duration scales linearly with one parameter and that
// keeps the SMs busy the way a GEMM would, so that the all-reduce running beside it competes
// for the GPU. Each thread runs `iters` rounds of dependent FMAs on registers and writes one
// value at the end. It touches almost no memory, so it does not compete with the all-reduce
// for memory bandwidth (a real backward pass would, somewhat; this is the optimistic case).
//
// Nothing can be folded away: the multiplier depends on the thread index (a runtime value),
// floating-point FMA chains are not reassociated without fast-math, and the result is stored.

#define COMPUTE_THREADS 256
#define CHAINS 8

extern "C" __global__ void __launch_bounds__(COMPUTE_THREADS)
ipcr_compute_fma(float* __restrict__ out, unsigned int iters)
{
    const unsigned int tid = blockIdx.x * blockDim.x + threadIdx.x;
    // Eight independent chains give each warp enough instruction-level parallelism to hide
    // the FMA latency with a few warps per scheduler; each chain on its own is dependent.
    // a -> a * m + c converges to c / (1 - m) (about 1): no overflow, no denormals, so the
    // time per round does not depend on the values.
    const float m = 0.9999f - 1e-7f * (float)(tid & 1023u);
    const float c = 1e-4f;
    float a[CHAINS];
#pragma unroll
    for (int j = 0; j < CHAINS; ++j) {
        a[j] = (float)((tid + (unsigned int)j) & 255u) * (1.0f / 256.0f);
    }
    for (unsigned int i = 0; i < iters; ++i) {
#pragma unroll
        for (int j = 0; j < CHAINS; ++j) {
            a[j] = fmaf(a[j], m, c);
        }
    }
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < CHAINS; ++j) {
        s += a[j];
    }
    out[tid] = s;
}
