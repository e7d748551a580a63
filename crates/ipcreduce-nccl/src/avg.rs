//! `ncclAvg` on ipcreduce: the sum, then every element of the result divided by the world
//! size by one small kernel on the caller's stream, right behind the sum's kernel (so it is
//! ordered as the sum is and captured into a CUDA graph with it).
//!
//! The division is in f32 and rounded once to the element type: for f32 the result is the
//! correctly rounded quotient of the rounded sum; f16 and bf16 go through f32, as their sums do.

use cudarc::driver::sys;
use ipcreduce::backend::cuda::{driver, kernels};
use ipcreduce::DType;
use std::ffi::{c_void, CString};

/// Its kernels, one per element type; `wait_for_previous_kernel` (convert.cuh) is a no-op
/// for a kernel launched without programmatic dependent launch, as these are.
pub const SOURCE: &str = r#"
template <typename Load, typename Store>
__device__ __forceinline__ void scale(u64 n, float w, Load load, Store store) {
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        store(i, load(i) / w);
    }
}
extern "C" __global__ void ipcr_nccl_avg_f32(float* p, u64 n, float w) {
    scale(n, w, [&](u64 i) { return p[i]; }, [&](u64 i, float v) { p[i] = v; });
}
extern "C" __global__ void ipcr_nccl_avg_f16(u16* p, u64 n, float w) {
    scale(n, w, [&](u64 i) { return h2f(p[i]); }, [&](u64 i, float v) { p[i] = f2h(v); });
}
extern "C" __global__ void ipcr_nccl_avg_bf16(u16* p, u64 n, float w) {
    scale(n, w, [&](u64 i) { return b2f(p[i]); }, [&](u64 i, float v) { p[i] = f2b(v); });
}
"#;

/// The kernel's name for `dt`.
pub fn kernel_name(dt: DType) -> &'static str {
    match dt {
        DType::F16 => "ipcr_nccl_avg_f16",
        DType::Bf16 => "ipcr_nccl_avg_bf16",
        _ => "ipcr_nccl_avg_f32",
    }
}

/// Threads per block, and the most blocks one launch uses (a grid-stride loop covers the rest).
const THREADS: u32 = 256;
const MAX_GRID: u64 = 1024;

/// The blocks for `n` elements.
pub fn grid(n: usize) -> u32 {
    (n as u64).div_ceil(THREADS as u64).clamp(1, MAX_GRID) as u32
}

/// The compiled kernels, loaded in the communicator's context.
pub struct Scaler {
    f32: sys::CUfunction,
    f16: sys::CUfunction,
    bf16: sys::CUfunction,
}

// SAFETY: CUDA function handles may be used from any thread of the process.
unsafe impl Send for Scaler {}
unsafe impl Sync for Scaler {}

fn ck(r: sys::CUresult, rank: usize, what: &str) -> Result<(), String> {
    if r == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    Err(format!(
        "rank {rank}: ncclAvg: {what}: {}",
        driver::describe(r)
    ))
}

impl Scaler {
    /// Compiles and loads the kernels in the calling thread's current context (the
    /// communicator's: its call just bound it). Module loading is not a stream operation, but
    /// a stream capture in global mode refuses it: the thread's capture mode is relaxed around
    /// it, as CUDA documents for such set-up work.
    pub fn load(rank: usize) -> Result<Scaler, String> {
        let mut dev: sys::CUdevice = 0;
        let (mut major, mut minor) = (0, 0);
        // SAFETY: out-parameters of plain values.
        unsafe {
            ck(sys::cuCtxGetDevice(&mut dev), rank, "cuCtxGetDevice")?;
            ck(
                sys::cuDeviceGetAttribute(
                    &mut major,
                    sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                    dev,
                ),
                rank,
                "compute capability",
            )?;
            ck(
                sys::cuDeviceGetAttribute(
                    &mut minor,
                    sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                    dev,
                ),
                rank,
                "compute capability",
            )?;
        }
        let arch = format!("sm_{major}{minor}");
        let ptx = kernels::compile_source("nccl_avg.cu", SOURCE, &arch, &["--fmad=false"])
            .map_err(|e| format!("rank {rank}: ncclAvg: {e}"))?;
        let text = CString::new(ptx.to_src()).map_err(|_| format!("rank {rank}: PTX has a NUL"))?;
        let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: exchanges the thread's capture mode; restored below.
        unsafe {
            ck(
                sys::cuThreadExchangeStreamCaptureMode(&mut mode),
                rank,
                "cuThreadExchangeStreamCaptureMode",
            )?
        };
        let mut module: sys::CUmodule = std::ptr::null_mut();
        // SAFETY: a NUL-terminated PTX image.
        let loaded = unsafe { sys::cuModuleLoadData(&mut module, text.as_ptr().cast()) };
        // SAFETY: puts back the mode exchanged above.
        unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
        ck(loaded, rank, "cuModuleLoadData")?;
        let get = |name: &str| -> Result<sys::CUfunction, String> {
            let c = CString::new(name).expect("no NUL in a kernel name");
            let mut f: sys::CUfunction = std::ptr::null_mut();
            // SAFETY: a loaded module and a C string; the module is kept for the process.
            unsafe {
                ck(
                    sys::cuModuleGetFunction(&mut f, module, c.as_ptr()),
                    rank,
                    name,
                )?
            };
            Ok(f)
        };
        Ok(Scaler {
            f32: get(kernel_name(DType::F32))?,
            f16: get(kernel_name(DType::F16))?,
            bf16: get(kernel_name(DType::Bf16))?,
        })
    }

    /// Enqueues `p[i] /= world` for `n` elements of `dt` on `stream`.
    ///
    /// # Safety
    /// `p` is device memory of the current context holding `n` elements of `dt`.
    pub unsafe fn launch(
        &self,
        p: *mut c_void,
        n: usize,
        dt: DType,
        world: usize,
        stream: *mut c_void,
        rank: usize,
    ) -> Result<(), String> {
        let f = match dt {
            DType::F16 => self.f16,
            DType::Bf16 => self.bf16,
            _ => self.f32,
        };
        let (mut ptr, mut n, mut w) = (p as u64, n as u64, world as f32);
        let mut params: [*mut c_void; 3] = [
            (&mut ptr as *mut u64).cast(),
            (&mut n as *mut u64).cast(),
            (&mut w as *mut f32).cast(),
        ];
        // SAFETY: the parameters match the kernel's (pointer, u64, float); the caller vouches
        // for the memory.
        let r = unsafe {
            driver::launch(
                f,
                grid(n as usize),
                THREADS,
                stream as sys::CUstream,
                params.as_mut_ptr(),
                false,
            )
        };
        ck(r, rank, "launch of the division by the world size")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_grid_covers_small_and_caps_large() {
        assert_eq!(grid(0), 1);
        assert_eq!(grid(1), 1);
        assert_eq!(grid(256), 1);
        assert_eq!(grid(257), 2);
        assert_eq!(grid(1 << 30), 1024);
    }

    #[test]
    fn kernels_compile_for_hopper() {
        if !kernels::nvrtc_for_tests() {
            return;
        }
        let ptx = kernels::compile_source("nccl_avg.cu", SOURCE, "sm_90", &["--fmad=false"])
            .unwrap_or_else(|e| panic!("{e}"));
        let text = ptx.to_src();
        for dt in [DType::F32, DType::F16, DType::Bf16] {
            assert!(
                text.contains(&format!(".entry {}", kernel_name(dt))),
                "{} missing",
                kernel_name(dt)
            );
        }
        // A true division (not a multiply by a reciprocal), rounded to nearest.
        assert!(text.contains("div.rn.f32"), "no div.rn.f32 in the PTX");
        assert!(text.contains("cvt.rn.bf16.f32") && text.contains("cvt.rn.f16.f32"));
    }
}
