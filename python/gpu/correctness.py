"""ipcreduce on torch CUDA tensors against torch.distributed's all-reduce (NCCL) on the same
random tensors: within the dtype's rounding of a float64 reference, bitwise identical across
ranks; out of place, max/min, the custom ops, torch.compile, argument errors, and a mismatch
that every rank must report. Run: torchrun --standalone --nproc_per_node=2 correctness.py"""

import os
import time

import torch
import torch.distributed as dist

import ipcreduce
import ipcreduce.torch as itorch
from common import DTYPES, EPS, Ctx

ctx = Ctx()
comm, rank, world, dev = ctx.comm, ctx.rank, ctx.world, ctx.device
SIZES = [1, 7, 1000, 4096, 32768 + 3, 1 << 20, (12 << 20) + 5]
if os.environ.get("IPCREDUCE_PY_SMALL"):
    SIZES = SIZES[:-1]


def gathered(t: torch.Tensor) -> torch.Tensor:
    """Every rank's `t`, exactly (NCCL all-gather): shape [world, n]."""
    out = torch.empty((world, t.numel()), dtype=t.dtype, device=dev)
    dist.all_gather_into_tensor(out, t.contiguous())
    return out


def same_everywhere(t: torch.Tensor) -> bool:
    g = gathered(t)
    return all(torch.equal(g[0], g[r]) for r in range(1, world))


cases = []
for name, dtype in DTYPES.items():
    for n in SIZES:
        gen = torch.Generator(device=dev).manual_seed(7919 * rank + n)
        x = torch.randn(n, device=dev, generator=gen).to(dtype)
        x0 = x.clone()
        xs = gathered(x).double()
        ref, mag = xs.sum(0), xs.abs().sum(0)
        tol = EPS[dtype] * ref.abs() + world * EPS[torch.float32] * mag

        y = x.clone()
        comm.all_reduce(y)  # in place, on the current stream
        z = x.clone()
        dist.all_reduce(z)  # NCCL
        o = torch.full_like(x, float("nan"))
        comm.all_reduce(x, out=o)
        c = itorch.all_reduce(x, comm)
        torch.cuda.synchronize()
        comm.check()

        err = (y.double() - ref).abs()
        nccl_err = (z.double() - ref).abs()
        case = dict(dtype=name, n=n, max_err=err.max().item(), nccl_max_err=nccl_err.max().item(),
                    max_tol=tol.max().item(), equal_to_nccl=torch.equal(y, z))
        tag = f"{name} n={n}"
        ctx.expect(bool((err <= tol).all()), f"{tag}: ipcreduce beyond rounding of the reference")
        ctx.expect(bool((nccl_err <= tol).all()), f"{tag}: NCCL beyond rounding (the test's tolerance?)")
        ctx.expect(same_everywhere(y), f"{tag}: results differ between ranks")
        ctx.expect(torch.equal(o, y), f"{tag}: out-of-place differs from in-place")
        ctx.expect(torch.equal(c, y), f"{tag}: ipcreduce::all_reduce op differs from in-place")
        ctx.expect(torch.equal(x, x0), f"{tag}: out-of-place changed its input")
        for op, f in (("max", torch.amax), ("min", torch.amin)):
            m = x.clone()
            comm.all_reduce(m, op=op)
            ctx.expect(torch.equal(m, f(gathered(x), 0)), f"{tag}: {op} is not exact")
        cases.append(case)
        ctx.log(f"{tag:>20}: max err {case['max_err']:.3g} (NCCL {case['nccl_max_err']:.3g}, "
                f"tol {case['max_tol']:.3g}), equal to NCCL: {case['equal_to_nccl']}")

# Registered tensors (ipcreduce.torch.empty): zero-copy in place and into another registered
# tensor, same results as the staged path.
registered = []
for name, dtype in DTYPES.items():
    for n in (4096, 1 << 20, (12 << 20) + 5):
        gen = torch.Generator(device=dev).manual_seed(104729 * rank + n)
        x = torch.randn(n, device=dev, generator=gen).to(dtype)
        want = x.clone()
        comm.all_reduce(want)
        path_staged = comm.last_path()
        a = itorch.empty(n, dtype, comm)
        b = itorch.empty((n,), dtype, comm)
        a.copy_(x)
        comm.all_reduce(a, out=b)
        path_oop = comm.last_path()
        comm.all_reduce(a)
        path_inplace = comm.last_path()
        torch.cuda.synchronize()
        comm.check()
        tag = f"registered {name} n={n}"
        ctx.expect(torch.equal(a, want), f"{tag}: in place differs from the staged path")
        ctx.expect(torch.equal(b, want), f"{tag}: out of place differs from the staged path")
        # Small messages take the low-latency path (data pushed with its flags), registered or
        # not; every other path must read and write the registered tensors directly.
        zero_copy = [p is not None and (p[2] or p[0] == "oneshot-ll")
                     for p in (path_oop, path_inplace)]
        ctx.expect(all(zero_copy), f"{tag}: not zero-copy: {path_oop} / {path_inplace}")
        registered.append(dict(dtype=name, n=n, staged_path=path_staged, inplace_path=path_inplace,
                               oop_path=path_oop))
        itorch.free(b, comm)
        itorch.free(a, comm)
ctx.log(f"registered: {len(registered)} cases, paths e.g. {registered[-1]}")

# The in-place custom op, and both ops under torch.compile (fake implementations traced).
x = torch.randn(5000, device=dev, generator=torch.Generator(device=dev).manual_seed(rank))
want = x.clone()
comm.all_reduce(want)
got = x.clone()
itorch.all_reduce_(got, comm)
ctx.expect(torch.equal(got, want), "ipcreduce::all_reduce_inplace differs")


def layer(a: torch.Tensor) -> torch.Tensor:
    return itorch.all_reduce(a * 2.0, comm) + 1.0


def layer_inplace(a: torch.Tensor) -> torch.Tensor:
    b = a * 2.0
    itorch.all_reduce_(b, comm)
    return b + 1.0


t0 = time.time()
compiled = {}
# Inductor once (Triton compiles take tens of seconds on a bare machine), aot_eager for the
# in-place form (functionalization of the mutating op is what it tests).
for fn, backend in ((layer, "inductor"), (layer_inplace, "aot_eager")):
    try:
        cf = torch.compile(fn, fullgraph=True, backend=backend)
        r = cf(x)
        torch.cuda.synchronize()
        compiled[fn.__name__] = torch.equal(r, layer(x))
    except Exception as e:  # reported as a failure, the other checks still run
        compiled[fn.__name__] = f"{type(e).__name__}: {e}"
    ctx.expect(compiled[fn.__name__] is True, f"torch.compile of {fn.__name__}: {compiled[fn.__name__]}")
ctx.log(f"torch.compile: {compiled} ({time.time() - t0:.1f} s)")

# Argument errors raise on this rank only and leave the communicator usable.
errors = {}
for what, bad in (("float64", lambda: torch.ones(8, device=dev, dtype=torch.float64)),
                  ("cpu tensor", lambda: torch.ones(8)),
                  ("non-contiguous", lambda: torch.ones(8, 8, device=dev)[:, ::2])):
    try:
        comm.all_reduce(bad())
        errors[what] = "no error"
    except ipcreduce.InvalidArgumentError as e:
        errors[what] = str(e)
    ctx.expect(errors[what].startswith(f"rank {rank}: invalid argument"), f"{what}: {errors[what]}")
ok = torch.ones(3, device=dev)
comm.all_reduce(ok)
torch.cuda.synchronize()
ctx.expect(bool((ok == world).all()), "communicator unusable after argument errors")

# A mismatch (the last rank passes one element more) must reach every rank as MismatchError,
# and quickly; then a new communicator works.
dist.barrier()
n = 1000 + (1 if rank == world - 1 else 0)
t0 = time.monotonic()
mismatch = "no error"
try:
    comm.all_reduce(torch.ones(n, device=dev))
    torch.cuda.synchronize()
    comm.check()
    comm.all_reduce(torch.ones(4, device=dev))
except ipcreduce.Error as e:
    mismatch = f"{type(e).__name__}: {e}"
waited = time.monotonic() - t0
# The rank that finds it raises MismatchError; one that learns it from a peer first may raise
# AbortedError naming the same cause.
ctx.expect(mismatch.startswith("MismatchError") or (
    mismatch.startswith("AbortedError") and ("match" in mismatch or "differ" in mismatch)),
    f"mismatch reported as {mismatch}")
ctx.expect(waited < 2.0, f"mismatch took {waited:.2f} s to raise")
ctx.log(f"mismatch after {waited * 1000:.0f} ms: {mismatch}")
dist.barrier()
comm.close()
comm = ctx.comm = ipcreduce.init(backend="cuda")
ok = torch.ones(3, device=dev)
comm.all_reduce(ok)
torch.cuda.synchronize()
ctx.expect(bool((ok == world).all()), "a new communicator after the mismatch does not work")

ctx.report("correctness", dict(cases=cases, registered=registered, compiled=compiled, errors=errors, mismatch=mismatch,
                               mismatch_s=waited))
ctx.finish()
