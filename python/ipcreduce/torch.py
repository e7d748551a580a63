"""The PyTorch layer of ipcreduce.

- `all_reduce(x, comm)` / `all_reduce_(x, comm)`: the `torch.library` custom ops
  `ipcreduce::all_reduce` (out of place) and `ipcreduce::all_reduce_inplace`, with fake
  implementations, so that `torch.compile` traces them and CUDA graphs capture them (the kernel
  runs on the current stream and keeps its protocol state on the device).
- `hook`: a DDP communication hook that averages gradient buckets:
  `ddp.register_comm_hook(comm, ipcreduce.torch.hook)`.

CUDA tensors need a communicator on the cuda backend, CPU tensors one on the host backend.
"""

from typing import Any, Optional

import torch
import torch.distributed as dist

from . import _BY_HANDLE, Communicator

__all__ = ["all_reduce", "all_reduce_", "hook", "HookState"]

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


class HookState:
    """State of the DDP hook for one communicator: the stream its all-reduces run on, so that
    they overlap the rest of the backward pass as NCCL's do.

    `side_stream=False` runs them on the backward pass's own stream instead."""

    def __init__(self, comm: Communicator, side_stream: bool = True):
        self.comm = comm
        self.side_stream = side_stream
        self._streams: dict = {}

    def stream(self, device: torch.device) -> Optional[torch.cuda.Stream]:
        if not self.side_stream or device.type != "cuda":
            return None
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device)
        return s


def _hook_state(state: Any) -> HookState:
    if isinstance(state, HookState):
        return state
    if isinstance(state, Communicator):
        # One HookState per communicator, kept with it.
        hs = state._torch_state.get("hook")
        if hs is None:
            hs = state._torch_state["hook"] = HookState(state)
        return hs
    raise TypeError(f"the hook's state must be an ipcreduce Communicator or HookState, "
                    f"not {type(state).__name__}")


# DDP checks these annotations against the real types (so no `from __future__ import annotations`).
def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: averages the bucket over the ranks (divides by the world size,
    then sums, as DDP's own all-reduce does).

        ddp.register_comm_hook(comm, ipcreduce.torch.hook)
    """
    hs = _hook_state(state)
    comm = hs.comm
    t = bucket.buffer()
    side = hs.stream(t.device)
    if side is None:
        t.div_(comm.world_size)
        comm.all_reduce(t)
    else:
        side.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(side):
            t.div_(comm.world_size)
            comm.all_reduce(t)
    if t.device.type == "cuda":
        # A CUDA-aware future: completing it records an event on the current (side) stream,
        # and DDP's wait makes its own stream wait for that event.
        fut = torch.futures.Future(devices=[t.device])
        if side is None:
            fut.set_result(t)
        else:
            with torch.cuda.stream(side):
                fut.set_result(t)
    else:
        fut = torch.futures.Future()
        fut.set_result(t)
    return fut
