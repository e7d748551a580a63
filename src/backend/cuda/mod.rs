//! CUDA backend: one process per GPU (or several under MPS), peer memory through CUDA IPC.

use crate::backend::{BackendMeta, BackendOps, BufId, Call};
use crate::bootstrap::Bootstrap;
use crate::communicator::Options;
use crate::error::Result;
use crate::types::{Algorithm, BackendKind, DType, ReduceOp};
use std::ffi::c_void;

pub struct CudaComm {}

impl CudaComm {
    pub fn new(boot: &mut Bootstrap, opts: &Options) -> Result<CudaComm> {
        let _ = (boot, opts);
        todo!("cuda backend")
    }
}

impl BackendOps for CudaComm {
    fn kind(&self) -> BackendKind {
        BackendKind::Cuda
    }
    unsafe fn all_reduce_raw(
        &mut self,
        _send: *const c_void,
        _recv: *mut c_void,
        _count: usize,
        _dtype: DType,
        _op: ReduceOp,
        _algo: Algorithm,
        _stream: *mut c_void,
    ) -> Result<()> {
        todo!()
    }
    fn unavailable(&self, _algo: Algorithm) -> Option<String> {
        todo!()
    }
    fn meta(&self) -> BackendMeta {
        todo!()
    }
    fn alloc(&mut self, _bytes: usize) -> Result<BufId> {
        todo!()
    }
    fn free(&mut self, _id: BufId) {
        todo!()
    }
    fn write(&mut self, _id: BufId, _data: &[u8]) -> Result<()> {
        todo!()
    }
    fn read(&mut self, _id: BufId, _out: &mut [u8]) -> Result<()> {
        todo!()
    }
    fn run(&mut self, _call: &Call) -> Result<()> {
        todo!()
    }
    fn synchronize(&mut self) -> Result<()> {
        todo!()
    }
    fn time(&mut self, _call: &Call, _warmup: usize, _iters: usize, _graph: Option<usize>) -> Result<f64> {
        todo!()
    }
}

/// Whether this process can use the cuda backend (driver, a GPU, NVRTC).
pub fn usable() -> Result<()> {
    Err(crate::error::Error::CudaUnavailable("not implemented".into()))
}
