// Shared by every kernel source (kernels.rs prepends it): integer names, the f16/bf16
// conversions, each a single PTX instruction, so no CUDA header is needed, and the wait of
// programmatic dependent launch.

typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned short u16;

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

// Programmatic dependent launch (`IPCREDUCE_PDL`, and the benchmark's refresh): launched with
// programmatic stream serialization, a kernel's blocks may start while the kernel before it on
// the stream is finishing, so their launch overlaps its tail. Every entry point calls this
// first: it returns once that kernel has completed and its writes are visible, so nothing of
// ours (not even the device protocol state an earlier call of ours left) is read before. A
// no-op when the kernel was launched normally.
__device__ __forceinline__ void wait_for_previous_kernel() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
