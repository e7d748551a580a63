"""The PyTorch layer of ipcreduce.

- `all_reduce(x, comm)` / `all_reduce_(x, comm)`: the `torch.library` custom ops
  `ipcreduce::all_reduce` (out of place) and `ipcreduce::all_reduce_inplace`, with fake
  implementations, so that `torch.compile` traces them and CUDA graphs capture them (the kernel
  runs on the current stream and keeps its protocol state on the device).
- `all_reduce_add_rms_norm(input, residual, weight, comm, eps)`: the custom ops
  `ipcreduce::all_reduce_add_rms_norm` (-> out, residual_out) and
  `ipcreduce::all_reduce_add_rms_norm_fp8` (-> out, residual_out, fp8_out), out of place, with
  fake implementations: the all-reduce, residual add and RMSNorm that end a tensor-parallel
  layer, in one call (`Communicator.all_reduce_add_rms_norm` gives the numerics).
- `empty(shape, dtype, comm)`: a tensor in registered memory (zero-copy all-reduces).
- `hook`: a DDP communication hook that averages gradient buckets:
  `ddp.register_comm_hook(comm, ipcreduce.torch.hook)`. On the cuda backend it divides each
  bucket into a registered staging tensor (the division DDP needs anyway) and all-reduces that
  in place, zero-copy; DDP then copies the result into the gradients as it always does.

CUDA tensors need a communicator on the cuda backend, CPU tensors one on the host backend.
"""

import contextlib
import logging
import math
import weakref
from typing import Any, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from . import _BY_HANDLE, Communicator

_log = logging.getLogger("ipcreduce")

__all__ = ["all_reduce", "all_reduce_", "all_reduce_add_rms_norm", "empty", "free", "hook",
           "HookState"]


def _comm(handle: int) -> Communicator:
    comm = _BY_HANDLE.get(handle)
    if comm is None:
        raise RuntimeError(f"ipcreduce: communicator handle {handle} is gone (closed and freed?)")
    return comm


@torch.library.custom_op("ipcreduce::all_reduce", mutates_args=())
def _all_reduce_op(x: torch.Tensor, handle: int, op: str) -> torch.Tensor:
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _comm(handle).all_reduce(x.contiguous(), op, out=out)
    return out


@_all_reduce_op.register_fake
def _(x: torch.Tensor, handle: int, op: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("ipcreduce::all_reduce_inplace", mutates_args=("x",))
def _all_reduce_inplace_op(x: torch.Tensor, handle: int, op: str) -> None:
    _comm(handle).all_reduce(x, op)


@_all_reduce_inplace_op.register_fake
def _(x: torch.Tensor, handle: int, op: str) -> None:
    return None


def all_reduce(x: torch.Tensor, comm: Communicator, op: str = "sum") -> torch.Tensor:
    """The all-reduce of `x` over `comm`'s ranks as a new tensor (`ipcreduce::all_reduce`)."""
    return _all_reduce_op(x, comm.handle, op)


def all_reduce_(x: torch.Tensor, comm: Communicator, op: str = "sum") -> torch.Tensor:
    """All-reduces contiguous `x` in place (`ipcreduce::all_reduce_inplace`); returns `x`."""
    _all_reduce_inplace_op(x, comm.handle, op)
    return x


def _fused_inputs(input, residual, weight):
    """Contiguous inputs; a residual that is the input itself is copied (the library refuses
    overlapping buffers, and an out-of-place op may be called so)."""
    input, residual = input.contiguous(), residual.contiguous()
    if residual.data_ptr() == input.data_ptr() and input.numel():
        residual = residual.clone()
    return input, residual, weight.contiguous()


def _fused_outputs(input: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty_like(input, memory_format=torch.contiguous_format),
            torch.empty_like(input, memory_format=torch.contiguous_format))


def _fp8_output(input: torch.Tensor) -> torch.Tensor:
    return torch.empty(input.shape, dtype=torch.float8_e4m3fn, device=input.device)


@torch.library.custom_op("ipcreduce::all_reduce_add_rms_norm", mutates_args=())
def _fused_op(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, handle: int,
              eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    out, residual_out = _fused_outputs(input)
    input, residual, weight = _fused_inputs(input, residual, weight)
    _comm(handle).all_reduce_add_rms_norm(input, residual, weight, eps, out=out,
                                          residual_out=residual_out)
    return out, residual_out


@_fused_op.register_fake
def _(input, residual, weight, handle, eps):
    return _fused_outputs(input)


@torch.library.custom_op("ipcreduce::all_reduce_add_rms_norm_fp8", mutates_args=())
def _fused_fp8_op(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  scale: torch.Tensor, handle: int,
                  eps: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out, residual_out = _fused_outputs(input)
    fp8_out = _fp8_output(input)
    input, residual, weight = _fused_inputs(input, residual, weight)
    _comm(handle).all_reduce_add_rms_norm(input, residual, weight, eps, out=out,
                                          residual_out=residual_out, scale=scale.contiguous(),
                                          fp8_out=fp8_out)
    return out, residual_out, fp8_out


@_fused_fp8_op.register_fake
def _(input, residual, weight, scale, handle, eps):
    return _fused_outputs(input) + (_fp8_output(input),)


def all_reduce_add_rms_norm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                            comm: Communicator, eps: float = 1e-6, *,
                            scale: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, ...]:
    """The all-reduce (sum over `comm`'s ranks) of `input`, plus `residual`, RMS-normalised
    over the last dimension and multiplied by `weight`, as new tensors: (out, residual_out),
    where residual_out (the rounded sum plus the residual) is the next layer's residual.
    With `scale` (a float32 tensor of one element on the tensors' device) also fp8_out,
    float8 e4m3 `sat(out / scale)`: (out, residual_out, fp8_out). The ops
    `ipcreduce::all_reduce_add_rms_norm` and `ipcreduce::all_reduce_add_rms_norm_fp8`."""
    if scale is None:
        return _fused_op(input, residual, weight, comm.handle, eps)
    return _fused_fp8_op(input, residual, weight, scale, comm.handle, eps)


def empty(shape: Union[int, Sequence[int]], dtype: torch.dtype, comm: Communicator) -> torch.Tensor:
    """Collective (every rank, same shape and dtype, same order): an uninitialized contiguous
    tensor in memory registered with every rank, on the current CUDA device. All-reduces of
    such tensors (in place, or into another such tensor) are zero-copy. The memory stays
    registered until `free(t, comm)`, or until the tensor (with its views) is gone and the
    communicator closes; `comm.close()` refuses while such tensors are alive."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buf = comm.alloc(max(nbytes, 1))
    raw = torch.as_tensor(buf, device=torch.device("cuda", torch.cuda.current_device()))
    t = raw[:nbytes].view(dtype).view(shape)
    # Weakly: the tensor's storage holds the buffer, and only it decides how long it lives.
    _registered(comm)[t.untyped_storage().data_ptr()] = buf
    return t


def _registered(comm: Communicator) -> "weakref.WeakValueDictionary":
    return comm._torch_state.setdefault("buffers", weakref.WeakValueDictionary())


def free(t: torch.Tensor, comm: Communicator) -> None:
    """Collective: releases the registered memory of a tensor from `empty` (after this rank's
    work on it). The tensor and its views must not be used afterwards."""
    buf = _registered(comm).pop(t.untyped_storage().data_ptr(), None)
    if buf is None:
        raise ValueError("ipcreduce.torch.free: not a tensor from ipcreduce.torch.empty on this "
                         "communicator (or freed already)")
    comm.free(buf)


class HookState:
    """State of the DDP hook for one communicator.

    side_stream: run the all-reduces on a stream of their own, so that they overlap the rest of
    the backward pass as NCCL's do (else on the backward pass's stream).
    registered: stage each bucket in registered memory (zero-copy all-reduce); default: on the
    cuda backend. The staging buffers (one per bucket, as large as the gradients) are allocated
    collectively at the bucket's first call, which every rank makes in the same order. Where the
    communicator cannot register memory (it stages through host memory: IPCREDUCE_TRANSPORT=host,
    or peer access failed at start: `comm.can_register` is False on every rank alike), the
    hook says so once in the log and all-reduces the buckets in place instead, as with
    registered=False.
    """

    def __init__(self, comm: Communicator, side_stream: bool = True,
                 registered: Optional[bool] = None):
        self.comm = comm
        self.side_stream = side_stream
        self.registered = comm.backend == "cuda" if registered is None else registered
        self._streams: dict = {}
        self._staging: dict = {}  # bucket index -> (registered buffer, flat uint8 tensor)
        # Why registered staging is off although asked for (None: not found unavailable).
        self.unregistered_reason: Optional[str] = None
        # Kept with the communicator, whose close() frees the staging buffers.
        comm._torch_state.setdefault("hooks", []).append(self)

    def stream(self, device: torch.device) -> Optional[torch.cuda.Stream]:
        if not self.side_stream or device.type != "cuda":
            return None
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device)
        return s

    def staging(self, index: int, t: torch.Tensor) -> Optional[torch.Tensor]:
        """The registered staging tensor of bucket `index`, shaped like `t`, or None where the
        communicator cannot register memory. A bucket that grew (DDP rebuilds its buckets after
        the first step) gets a new buffer, on every rank alike."""
        if self.unregistered_reason is None and not self.comm.can_register:
            # Decided by the fabric every rank agreed on at init: every rank takes this branch
            # at the same bucket, so no rank waits in an alloc the others skip.
            self.unregistered_reason = (
                f"the communicator's fabric is {self.comm.fabric} on the {self.comm.backend} "
                f"backend")
            _log.warning("ipcreduce DDP hook: registered staging is unavailable (%s): the "
                         "buckets are all-reduced in place", self.unregistered_reason)
        if self.unregistered_reason is not None:
            return None
        nbytes = t.numel() * t.element_size()
        have = self._staging.get(index)
        if have is None or have[0].bytes < nbytes:
            if have is not None:
                # Unmapping is not ordered by any stream: work still reading the old buffer
                # (DDP's copy of the last result) must be done first.
                _synchronize(t.device)
                self.comm.free(have[0])
                del self._staging[index]
            buf = self.comm.alloc(nbytes)
            have = self._staging[index] = (buf, torch.as_tensor(buf, device=t.device))
        return have[1][:nbytes].view(t.dtype).view(t.shape)

    def release(self) -> None:
        """Collective: frees the staging buffers (`Communicator.close` calls it)."""
        if self._staging:
            # As in staging(): nothing may still read or write them once unmapped.
            for device in {tensor.device for _, tensor in self._staging.values()}:
                _synchronize(device)
        for buf, _ in self._staging.values():
            self.comm.free(buf)
        self._staging.clear()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _hook_state(state: Any) -> HookState:
    if isinstance(state, HookState):
        return state
    if isinstance(state, Communicator):
        # One HookState per communicator, kept with it.
        hs = state._torch_state.get("default_hook")
        if hs is None:
            hs = state._torch_state["default_hook"] = HookState(state)
        return hs
    raise TypeError(f"the hook's state must be an ipcreduce Communicator or HookState, "
                    f"not {type(state).__name__}")


# DDP checks these annotations against the real types (so no `from __future__ import annotations`).
def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: averages the bucket over the ranks (divides by the world size,
    then sums, as DDP's own all-reduce does).

        ddp.register_comm_hook(comm, ipcreduce.torch.hook)              # defaults
        ddp.register_comm_hook(HookState(comm, registered=False), ipcreduce.torch.hook)
    """
    hs = _hook_state(state)
    comm = hs.comm
    t = bucket.buffer()
    side = hs.stream(t.device)
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(t.device))
        # The bucket was allocated on DDP's stream and is read (and, in place, written) on
        # ours: its memory must not be reused before our work on it is done, even if DDP
        # drops the bucket first. (The all-reduce records what it touches; the division
        # below reads the bucket before it.)
        t.record_stream(side)
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        staging = hs.staging(bucket.index(), t) if hs.registered and t.is_cuda else None
        if staging is not None:
            # The division DDP needs anyway writes the staging tensor: the all-reduce is then
            # in place in registered memory, with no copy of its own.
            result = torch.div(t, comm.world_size, out=staging)
        else:
            result = t.div_(comm.world_size)
        comm.all_reduce(result)
        if result.is_cuda:
            # A CUDA-aware future: completing it records an event on the current stream, and
            # DDP's wait makes its own stream wait for that event.
            fut = torch.futures.Future(devices=[result.device])
        else:
            fut = torch.futures.Future()
        fut.set_result(result)
    return fut

