//! Host backend: ranks are processes of one machine sharing memory (memfd arenas).

use crate::backend::{BackendMeta, BackendOps, BufId, Call};
use crate::bootstrap::Bootstrap;
use crate::communicator::Options;
use crate::error::Result;
use crate::types::{Algorithm, BackendKind, DType, ReduceOp};
use std::ffi::c_void;

pub struct HostComm {}

impl HostComm {
    pub fn new(boot: &mut Bootstrap, opts: &Options) -> Result<HostComm> {
        let _ = (boot, opts);
        todo!("host backend")
    }
}

impl BackendOps for HostComm {
    fn kind(&self) -> BackendKind {
        BackendKind::Host
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
    fn time(
        &mut self,
        _call: &Call,
        _warmup: usize,
        _iters: usize,
        _graph: Option<usize>,
    ) -> Result<f64> {
        todo!()
    }
}
