"""ipcreduce: all-reduce between the GPUs (CUDA IPC / peer memory) or the processes (shared
memory) of one machine.

    import ipcreduce
    comm = ipcreduce.init()          # ranks from `ipcreduce launch` or torchrun
    comm.all_reduce(x)               # in place: numpy array, torch CPU or CUDA tensor
    comm.all_reduce(x, out=y)        # out of place

numpy arrays (C-contiguous float32 / float16) and torch CPU tensors go through the host
backend, torch CUDA tensors through the cuda backend on the current CUDA stream. bfloat16 has
no numpy dtype: use torch tensors for it. Neither numpy nor torch is needed to import this
package; the PyTorch layer is `ipcreduce.torch`.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Optional

from . import _native
from ._native import (
    AbortedError,
    ConfigError,
    Error,
    InvalidArgumentError,
    MismatchError,
    PeerLostError,
    TimeoutError,
    UnavailableError,
)

__version__ = _native.__version__

__all__ = [
    "init",
    "Communicator",
    "Error",
    "TimeoutError",
    "PeerLostError",
    "AbortedError",
    "MismatchError",
    "InvalidArgumentError",
    "UnavailableError",
    "ConfigError",
    "RegisteredBuffer",
    "nccl_library",
    "trace",
]

RegisteredBuffer = _native.RegisteredBuffer

# torch dtypes by name, so that this module never imports torch itself.
_TORCH_DTYPES = {"torch.float32": "f32", "torch.float16": "f16", "torch.bfloat16": "bf16"}

# Communicators by handle: torch custom ops take ints, not Python objects (ipcreduce.torch).
_BY_HANDLE: "weakref.WeakValueDictionary[int, Communicator]" = weakref.WeakValueDictionary()


class Communicator:
    """One rank's membership in a job; see `init`."""

    def __init__(self, native: _native.Communicator):
        self._native = native
        # Per-communicator state of the torch layer (side streams, staging buffers).
        self._torch_state: dict = {}
        # A plain int attribute, so torch.compile reads it as a constant.
        self.handle = id(self)
        _BY_HANDLE[self.handle] = self

    @property
    def rank(self) -> int:
        return self._native.rank

    @property
    def world_size(self) -> int:
        return self._native.world_size

    @property
    def backend(self) -> str:
        """"cuda" or "host"."""
        return self._native.backend

    @property
    def fabric(self) -> str:
        """What the data crosses, as every rank agreed at init: "peer" (peer memory; also the
        host backend's shared memory), "pcie-peer" (peer memory under the PCIe policy) or
        "host-staged" (cuda workspaces in host memory: IPCREDUCE_TRANSPORT=host, or peer
        access failed at start)."""
        return self._native.fabric

    @property
    def can_register(self) -> bool:
        """Whether `alloc` can register memory: the cuda backend over peer memory. The same on
        every rank."""
        return self.backend == "cuda" and self.fabric != "host-staged"

    def all_reduce(self, x: Any, op: str = "sum", *, out: Any = None, stream: Any = None,
                   algo: str = "auto") -> Any:
        """All-reduces `x` into `out` (default: `x` itself, in place) and returns the result.

        `x`: a numpy array or another buffer-protocol object (float32/float16, C-contiguous;
        host backend), a torch CPU tensor (host backend) or a torch CUDA tensor (cuda backend:
        enqueued on `stream`, default `torch.cuda.current_stream()`, so the call returns before
        the result is there, as NCCL's does). `op`: "sum", "max" or "min".
        """
        if _is_torch_tensor(x):
            self._all_reduce_tensor(x, out, op, algo, stream)
        else:
            if out is not None and _is_torch_tensor(out):
                raise self._invalid("out is a torch tensor but the input is not")
            self._native.all_reduce_buffer(x, out, op, algo)
        return x if out is None else out

    def _all_reduce_tensor(self, x, out, op, algo, stream) -> None:
        if out is None:
            out = x
        elif not _is_torch_tensor(out):
            raise self._invalid("the input is a torch tensor but out is not")
        dtype = _TORCH_DTYPES.get(str(x.dtype))
        if dtype is None:
            raise self._invalid(f"dtype {x.dtype} is not reduced (float32, float16, bfloat16)")
        if out.dtype != x.dtype or out.numel() != x.numel():
            raise self._invalid(
                f"out has {out.numel()} x {out.dtype}, the input {x.numel()} x {x.dtype}")
        if out.device != x.device:
            raise self._invalid(f"out is on {out.device}, the input on {x.device}")
        if not (x.is_contiguous() and out.is_contiguous()):
            raise self._invalid("tensors must be contiguous (call .contiguous())")
        on_device = x.device.type == "cuda"
        if not on_device and x.device.type != "cpu":
            raise self._invalid(f"tensors on {x.device} are not supported (cpu or cuda)")
        handle = 0
        if on_device:
            stream = self._stream(x.device, stream)
            handle = stream.cuda_stream
        self._native.all_reduce_ptr(x.data_ptr(), out.data_ptr(), x.numel(), dtype, on_device,
                                    op, algo, handle)
        if on_device:
            # The call is enqueued, not done: the caching allocator must not hand this memory
            # to another tensor until `stream` has passed it, even where the caller drops the
            # tensors at once or they were allocated on another stream (as torch.distributed
            # does). On the tensors' own allocation stream, and for memory the allocator does
            # not own (registered buffers), this records nothing.
            _record_stream((x, out), stream)

    def all_reduce_add_rms_norm(self, input: Any, residual: Any, weight: Any,
                                eps: float = 1e-6, *, out: Any = None, residual_out: Any = None,
                                scale: Any = None, fp8_out: Any = None, stream: Any = None,
                                algo: str = "auto") -> tuple:
        """All-reduce (sum) of `input`, residual add and RMSNorm in one call, as a
        tensor-parallel layer ends:

            residual_out = round(round(sum over ranks of input) + residual)
            out = round(residual_out * rsqrt(mean(residual_out ** 2, -1) + eps) * weight)

        (sums in float32 in rank order; docs/fused.md gives every rounding point). Torch tensors
        of one dtype (bfloat16, float16, float32), contiguous: `input` and `residual` of one
        shape [..., hidden], `weight` [hidden]; CPU tensors on the host backend, CUDA tensors
        on the cuda backend (enqueued on `stream`, default the current stream).

        In place by default, as vLLM's fused_add_rms_norm: `out` defaults to `input` and
        `residual_out` to `residual`. With `scale` (one float32, on the tensors' device) the
        normalised rows are also written as float8 e4m3 `sat(out / scale)` into `fp8_out`
        (allocated when not given). Returns (out, residual_out), or (out, residual_out,
        fp8_out) with `scale`. `ipcreduce.torch.all_reduce_add_rms_norm` is the out-of-place
        torch op of it (torch.compile, CUDA graphs).
        """
        op = "all_reduce_add_rms_norm"
        if out is None:
            out = input
        if residual_out is None:
            residual_out = residual
        tensors = {"input": input, "residual": residual, "weight": weight, "out": out,
                   "residual_out": residual_out}
        for name, t in tensors.items():
            if not _is_torch_tensor(t):
                raise self._invalid(f"{name} is not a torch tensor ({type(t).__name__})", op)
        dtype = _TORCH_DTYPES.get(str(input.dtype))
        if dtype is None:
            raise self._invalid(
                f"dtype {input.dtype} is not reduced (float32, float16, bfloat16)", op)
        if input.dim() == 0:
            raise self._invalid("input is a scalar: it needs a last dimension (hidden)", op)
        hidden = input.shape[-1]
        for name, t in tensors.items():
            if t.dtype != input.dtype:
                raise self._invalid(f"{name} is {t.dtype}, the input {input.dtype}", op)
            want = (hidden,) if name == "weight" else tuple(input.shape)
            if tuple(t.shape) != want:
                raise self._invalid(f"{name} has shape {tuple(t.shape)}, expected {want} "
                                    f"(input {tuple(input.shape)})", op)
        if scale is not None:
            if not _is_torch_tensor(scale) or str(scale.dtype) != "torch.float32" \
                    or scale.numel() != 1:
                raise self._invalid("scale must be a torch float32 tensor of one element", op)
            if fp8_out is None:
                import torch

                fp8_out = torch.empty(input.shape, dtype=torch.float8_e4m3fn,
                                      device=input.device)
            tensors["scale"] = scale
        if fp8_out is not None:
            if not _is_torch_tensor(fp8_out) or str(fp8_out.dtype) != "torch.float8_e4m3fn" \
                    or tuple(fp8_out.shape) != tuple(input.shape):
                raise self._invalid(f"fp8_out must be a torch float8_e4m3fn tensor of shape "
                                    f"{tuple(input.shape)}", op)
            tensors["fp8_out"] = fp8_out
        for name, t in tensors.items():
            if t.device != input.device:
                raise self._invalid(f"{name} is on {t.device}, the input on {input.device}", op)
            if not t.is_contiguous():
                raise self._invalid(f"{name} is not contiguous (call .contiguous())", op)
        on_device = input.device.type == "cuda"
        if not on_device and input.device.type != "cpu":
            raise self._invalid(f"tensors on {input.device} are not supported (cpu or cuda)", op)
        stream = self._stream(input.device, stream) if on_device else None
        handle = 0 if stream is None else stream.cuda_stream
        tokens = input.numel() // hidden if hidden else 0
        # fp8_out without scale goes to the library as it is: its refusal is the one message.
        self._native.all_reduce_add_rms_norm(
            input.data_ptr(), residual.data_ptr(), weight.data_ptr(), float(eps),
            out.data_ptr(), residual_out.data_ptr(), tokens, hidden, dtype, on_device,
            fp8_out=0 if fp8_out is None else fp8_out.data_ptr(),
            scale=0 if scale is None else scale.data_ptr(), algo=algo, stream=handle)
        if on_device:
            # As in all_reduce: enqueued, not done.
            _record_stream(tensors.values(), stream)
        return (out, residual_out) if fp8_out is None else (out, residual_out, fp8_out)

    @staticmethod
    def _stream(device, stream):
        """The torch stream of a call: `stream`, or an int CUstream wrapped, or (None) the
        current stream of `device`."""
        import torch

        if stream is None:
            return torch.cuda.current_stream(device)
        if isinstance(stream, int):
            return torch.cuda.ExternalStream(stream, device=device)
        return stream

    def synchronize(self) -> None:
        """Waits for the work enqueued on the communicator's own stream; raises an error a
        kernel recorded (timeout, mismatch, peer lost)."""
        self._native.synchronize()

    def check(self) -> None:
        """Raises the error that made the communicator unusable, if there is one (no wait)."""
        self._native.check()

    def abort(self, reason: str = "aborted by the program") -> None:
        """Makes the communicator unusable now: calls in flight stop, later calls raise."""
        self._native.abort(reason)

    def alloc(self, nbytes: int) -> "_native.RegisteredBuffer":
        """Collective (every rank, same size, same order): `nbytes` of device memory that every
        rank maps (cuda backend). All-reduces whose input and output lie in such buffers, at
        the same offsets on every rank, read and write them directly (no staging copy), eagerly
        and inside CUDA graphs. Exposes `ptr`, `bytes` and `__cuda_array_interface__`;
        `ipcreduce.torch.empty` makes tensors over it."""
        return self._native.alloc(nbytes)

    def free(self, buf: "_native.RegisteredBuffer") -> None:
        """Collective: releases a buffer from `alloc` (after this rank's work on it is done).
        Tensors over it must not be used afterwards."""
        self._native.free(buf)

    def last_path(self):
        """(path, CTAs, zero-copy) of the last all-reduce this rank issued (cuda), or None."""
        return self._native.last_path()

    def close(self) -> None:
        """Leaves the job (every rank calls it; bounded by the timeout). The DDP hook's
        registered staging buffers are freed first; other registered buffers (and tensors from
        `ipcreduce.torch.empty`) must be freed or gone, else this raises."""
        for hook_state in self._torch_state.pop("hooks", []):
            hook_state.release()
        self._native.close()

    def meta(self) -> dict:
        """Devices, driver and NCCL versions, for reports."""
        return self._native.meta()

    @property
    def traced_calls(self) -> int:
        """Calls this rank's flight recorder has seen: a mark for `write_trace`."""
        return self._native.traced_calls

    def write_trace(self, dir: str, since: int = 0) -> str:
        """Writes this rank's calls after `since` (a `traced_calls` mark; 0: every call the
        flight recorder still holds, the last IPCREDUCE_FLIGHT) into `dir` as
        ipcreduce-trace-<job>-rank<r>.jsonl, replacing one there, and returns its path. For
        `ipcreduce trace export` / `summarize` (docs/tracing.md). Not collective."""
        return self._native.write_trace(str(dir), since)

    def trace(self, dir: str) -> "_Trace":
        """`with comm.trace(dir): ...` writes the calls made inside the block into `dir` when
        it ends (see `write_trace`), also when it ends by an exception."""
        return _Trace(dir, [self])

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return repr(self._native)

    def _invalid(self, detail: str, op: str = "all_reduce") -> InvalidArgumentError:
        # Worded as the library's own argument errors.
        return InvalidArgumentError(f"rank {self.rank}: invalid argument to {op}: {detail}")


class _Trace:
    """The context of `ipcreduce.trace` and `Communicator.trace`."""

    def __init__(self, dir: str, comms, every_open: bool = False) -> None:
        self.dir = str(dir)
        self._comms = list(comms)
        # Every open communicator of the process: those closed already are left out.
        self._every_open = every_open
        self._marks: list = []
        self.files: list = []

    def __enter__(self) -> "_Trace":
        self._marks = []
        for c in self._comms:
            try:
                self._marks.append((c, c.traced_calls))
            except InvalidArgumentError:
                if not self._every_open:
                    raise
        return self

    def __exit__(self, *exc) -> None:
        self.files = [c.write_trace(self.dir, since) for c, since in self._marks]


def trace(dir: str, comm: Optional[Communicator] = None) -> _Trace:
    """Traces the calls made inside a `with` block:

        with ipcreduce.trace("traces/step-10"):
            ...                     # calls of comm (and any other open communicator)

    When the block ends (an exception included), every rank writes its calls made inside it
    into `dir` (ipcreduce-trace-<job>-rank<r>.jsonl, replacing one there), which
    `ipcreduce trace export DIR` turns into one Perfetto / chrome://tracing timeline and
    `ipcreduce trace summarize DIR` into the straggler report (docs/tracing.md). `comm`: the
    communicator to trace, default every open one of this process. The context's `files` are
    the paths written. Costs nothing inside the block: the calls are recorded anyway (the
    flight recorder); `IPCREDUCE_TIMELINE=1` adds when each ran on its stream (cuda)."""
    if comm is not None:
        return _Trace(dir, [comm])
    return _Trace(dir, list(_BY_HANDLE.values()), every_open=True)


def nccl_library() -> str:
    """The path of libipcreduce_nccl.so, the NCCL stand-in (README, "Use with PyTorch / any NCCL
    program"), for `LD_PRELOAD`:

        LD_PRELOAD=$(python3 -c 'import ipcreduce; print(ipcreduce.nccl_library())') torchrun ...

    Looked for beside this package, then in every folder of `LD_LIBRARY_PATH`; FileNotFoundError
    (saying how to build it) when it is in neither."""
    import os

    name = "libipcreduce_nccl.so"
    dirs = [os.path.dirname(os.path.abspath(__file__))]
    dirs += [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    for d in dirs:
        path = os.path.join(d, name)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"{name} is in none of {dirs}: build it with `cargo build --release -p ipcreduce-nccl` "
        "(target/release/) and put its folder on LD_LIBRARY_PATH or the file beside this package")


def _record_stream(tensors, stream) -> None:
    """Marks each tensor's memory as in use on `stream` until the work enqueued there so far
    is done (`Tensor.record_stream`); a tensor given twice is marked once."""
    seen = set()
    for t in tensors:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            t.record_stream(stream)


def _is_torch_tensor(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def init(backend: str = "auto", timeout: Optional[float] = None, *, rank: Optional[int] = None,
         world_size: Optional[int] = None, local_rank: Optional[int] = None,
         job_id: Optional[str] = None, device: Optional[int] = None, algo: Optional[str] = None,
         workspace_bytes: Optional[int] = None, with_nccl: bool = False) -> Communicator:
    """Joins the job this process belongs to; collective: every rank calls it.

    Rank and world size come from `ipcreduce launch` (IPCREDUCE_RANK, ...) or torchrun (RANK,
    WORLD_SIZE, LOCAL_RANK, with TORCHELASTIC_RUN_ID or MASTER_PORT as the job id), or are
    given (`rank=`, `world_size=`, and a `job_id=` shared by the job's ranks).

    backend: "auto" (cuda when every rank can use a GPU, else host), "cuda" or "host".
    timeout: seconds, the bound on every wait (default IPCREDUCE_TIMEOUT_MS, else 30 s).
    device: the GPU ordinal (default: torch's current device when torch has initialized
    CUDA, else the current CUDA context's, else local_rank % GPUs).
    """
    if device is None and backend != "host":
        device = _torch_current_device()
    return Communicator(_native.Communicator(
        backend, timeout, rank=rank, world_size=world_size, local_rank=local_rank,
        job_id=job_id, device=device, algo=algo, workspace_bytes=workspace_bytes,
        with_nccl=with_nccl))


def _torch_current_device() -> Optional[int]:
    """torch's current GPU, when the program already uses torch with CUDA."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda.current_device()
