"""The fused all-reduce + residual add + RMSNorm on CUDA tensors through the torch layer: a sweep
of shapes (1 token, odd and non-multiple-of-16 widths) x bf16/f16/f32, with and without the fp8
output, against the documented rounding points (residual_out bitwise) and the float64 bounds of
python/tests/fused_reference.py; every result the same bits on every rank; the op under
torch.compile (fullgraph, inductor with CUDA graphs: mode "reduce-overhead") against eager;
then shapes that differ between ranks, which must raise on every rank (last: it leaves the
communicator aborted).
Run: torchrun --standalone --nproc_per_node=2 fused_check.py"""

import os
import sys
import time

import torch
import torch.distributed as dist

import ipcreduce
import ipcreduce.torch as itorch
from common import Ctx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from fused_reference import (  # noqa: E402
    check_fp8, check_out, expected_residual_out, norm_reference, rank_input, shared_tensors)

ctx = Ctx()
comm, rank, world, dev = ctx.comm, ctx.rank, ctx.world, ctx.device
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
SHAPES = [(1, 4096), (1, 1), (2, 3), (7, 4095), (3, 1000), (16, 136), (5, 8192), (33, 257),
          (128, 4096), (512, 8192), (1, 16384), (64, 16384), (4, 2, 520)]
checks = 0


def check(ok_fn, what: str) -> None:
    global checks
    checks += 1
    try:
        ok_fn()
    except AssertionError as e:
        ctx.expect(False, f"{what}: {e}")


def bitwise(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    differ = int((got.view(torch.uint8) != want.view(torch.uint8)).sum())
    assert differ == 0, f"{name}: {differ} bytes differ from the documented sequence"


def same_everywhere(t: torch.Tensor, what: str) -> None:
    b = t.contiguous().view(torch.uint8).flatten()
    g = torch.empty(world * b.numel(), device=dev, dtype=torch.uint8)
    dist.all_gather_into_tensor(g, b)
    ctx.expect(all(torch.equal(c, b) for c in g.chunk(world)), f"{what}: ranks differ")


# 1. The sweep, eager.
t0 = time.monotonic()
for name, dtype in DTYPES.items():
    for i, shape in enumerate(SHAPES):
        for fp8 in (False, True):
            if fp8 and dtype == torch.float32 and shape[-1] > 4096:
                continue  # f32 fp8 covered by the smaller shapes
            seed = 100 * i + 10 * list(DTYPES).index(name) + fp8
            inputs = [rank_input(r, shape, dtype, seed) for r in range(world)]
            residual, weight = shared_tensors(shape, dtype, seed)
            scale = torch.tensor([1.0 / 100], dtype=torch.float32)
            eps = 1e-6
            got = itorch.all_reduce_add_rms_norm(
                inputs[rank].to(dev), residual.to(dev), weight.to(dev), comm, eps,
                scale=scale.to(dev) if fp8 else None)
            torch.cuda.synchronize()
            got = [t.cpu() for t in got]
            what = f"{name} {shape}{' fp8' if fp8 else ''}"
            want_res = expected_residual_out(inputs, residual)
            check(lambda: bitwise(got[1], want_res, "residual_out"), what)
            ref = norm_reference(want_res, weight, eps)
            check(lambda: check_out(got[0], ref, shape[-1], what), what)
            if fp8:
                check(lambda: check_fp8(got[2], ref, 1.0 / 100, shape[-1], what), what)
            for j, t in enumerate(got):
                same_everywhere(t.to(dev), f"{what} output {j}")
comm.check()
ctx.log(f"sweep: {checks} checks, {len(ctx.failures)} failed, {time.monotonic() - t0:.1f} s")

# 2. torch.compile: fullgraph with inductor, and with its CUDA graphs ("reduce-overhead").
shape, dtype = (8, 4096), torch.bfloat16
inputs = [rank_input(r, shape, dtype, 7).to(dev) for r in range(world)]
residual, weight = (t.to(dev) for t in shared_tensors(shape, dtype, 7))


def f(x, res, w):
    out, r = itorch.all_reduce_add_rms_norm(x * 2.0, res, w, comm, 1e-5)
    return out * 0.5, r


eager = f(inputs[rank], residual, weight)
compiled = {}
for mode in ("default", "reduce-overhead"):
    torch._dynamo.reset()
    fc = torch.compile(f, fullgraph=True, mode=mode)
    for step in range(3):  # reduce-overhead records its graph after warm-up runs
        got = fc(inputs[rank], residual, weight)
        got = tuple(t.clone() for t in got)
        torch.cuda.synchronize()
        ok = all(torch.equal(a, b) for a, b in zip(got, eager))
        ctx.expect(ok, f"torch.compile mode={mode} step {step}: differs from eager")
    compiled[mode] = ok
comm.check()
ctx.log(f"torch.compile: {compiled}")

# 3. Shapes that differ between ranks: an error on every rank, in bounded time.
culprit = world - 1
tokens = 5 if rank == culprit else 4
x = torch.ones(tokens, 256, device=dev, dtype=torch.bfloat16)
t0 = time.monotonic()
err = None
try:
    itorch.all_reduce_add_rms_norm(x, x.clone(), torch.ones(256, device=dev, dtype=x.dtype),
                                   comm, 1e-6)
    torch.cuda.synchronize()
    comm.synchronize()
except ipcreduce.Error as e:
    err = e
secs = time.monotonic() - t0
ok = isinstance(err, (ipcreduce.MismatchError, ipcreduce.AbortedError)) and str(err).startswith(
    f"rank {rank}:")
ctx.expect(ok, f"tokens 4 vs 5 between ranks: {type(err).__name__}: {err}")
ctx.log(f"mismatch: rank {rank} raised {type(err).__name__} after {secs:.3f} s: {err}")
ctx.report("fused-check", dict(checks=checks, compile=compiled, mismatch=str(err),
                               mismatch_seconds=secs, shapes=[list(s) for s in SHAPES]))
ctx.finish()
