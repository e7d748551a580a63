"""ipcreduce on torch CUDA tensors against torch.distributed's all-reduce (NCCL) on the same
random tensors: within the dtype's rounding of a float64 reference, bitwise identical across
ranks; out of place, max/min, the custom ops, torch.compile, argument errors, and a mismatch
that every rank must report. Run: torchrun --standalone --nproc_per_node=2 correctness.py"""

import os
import re
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

def reference(x: torch.Tensor):
    """(float64 sum of every rank's `x`, the tolerance of a reduction in x's dtype)."""
    xs = gathered(x).double()
    ref = xs.sum(0)
    return ref, EPS[x.dtype] * ref.abs() + world * EPS[torch.float32] * xs.abs().sum(0)


def within(got: torch.Tensor, ref: torch.Tensor, tol: torch.Tensor) -> bool:
    return bool(((got.double() - ref).abs() <= tol).all())


# Registered tensors (ipcreduce.torch.empty): zero-copy in place and into another registered
# tensor, within rounding of the float64 reference (and the same bits as the staged path).
registered = []
for name, dtype in DTYPES.items():
    for n in (4096, 1 << 20, (12 << 20) + 5):
        gen = torch.Generator(device=dev).manual_seed(104729 * rank + n)
        x = torch.randn(n, device=dev, generator=gen).to(dtype)
        ref, tol = reference(x)
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
        ctx.expect(within(b, ref, tol), f"{tag}: out of place beyond rounding of the reference")
        # In place after out of place: the sum of every rank's `a` (= x) again.
        ctx.expect(within(a, ref, tol), f"{tag}: in place beyond rounding of the reference")
        ctx.expect(same_everywhere(a), f"{tag}: results differ between ranks")
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

# The in-place custom op, and both ops under torch.compile (fake implementations traced),
# against the float64 reference.
x = torch.randn(5000, device=dev, generator=torch.Generator(device=dev).manual_seed(rank))
ref, tol = reference(x)
got = x.clone()
itorch.all_reduce_(got, comm)
torch.cuda.synchronize()
ctx.expect(within(got, ref, tol), "ipcreduce::all_reduce_inplace beyond rounding of the reference")
# layer(x) = all_reduce(2 x) + 1: scaling by 2 is exact, the + 1 rounds once more in float32.
layer_ref, layer_tol = 2.0 * ref + 1.0, 2.0 * tol + EPS[torch.float32] * (2.0 * ref.abs() + 1.0)


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
        compiled[fn.__name__] = within(r, layer_ref, layer_tol) or "beyond the reference"
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

# A stream other than the tensors' own: their memory must stay theirs until that stream has
# passed the call (record_stream), even when the caller drops them at once. The side stream
# is kept busy first, so the call is still queued when the tensors are dropped: without the
# record, the allocator would hand their blocks to the next allocation of the same size.
side = torch.cuda.Stream(dev)
side.wait_stream(torch.cuda.current_stream())
src = torch.full((1 << 16,), float(rank + 1), device=dev)
dst = torch.empty_like(src)
freed = {src.data_ptr(), dst.data_ptr()}
torch.cuda._sleep(200_000_000)  # a few hundred ms of the current stream's time...
side.wait_stream(torch.cuda.current_stream())  # ...which the side stream waits for
comm.all_reduce(src, out=dst, stream=side)
del src, dst
reused = [torch.empty(1 << 16, device=dev) for _ in range(4)]
ctx.expect(not freed & {t.data_ptr() for t in reused},
           "record_stream: a tensor still in use on the call's stream was reallocated")
side.synchronize()
comm.check()
del reused

# A mismatch (the last rank passes one element more) must reach every rank as MismatchError
# or AbortedError naming the culprit and the counts, and quickly; then a new communicator works.
dist.barrier()
culprit = world - 1
n = 1000 + (1 if rank == culprit else 0)
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
# The rank that finds it raises MismatchError naming the peer it compared with; one that learns
# it first from a peer raises AbortedError carrying that report ("rank A: ... does not match
# peer rank B", or the host form "differ between ranks A and B"). Either way the pair named
# must be this rank's view of the culprit. The counts: "count 1001 vs 1000" where both ranks'
# arguments were compared, else (the low-latency path sees only a hash of the peer's) the
# reporting rank's own count, "(1001 x float ...)" or "(1000 x float ...)".
pair = (re.search(r"rank (\d+): all_reduce #\d+ does not match peer rank (\d+)", mismatch)
        or re.search(r"differ between ranks (\d+) and (\d+)", mismatch))
named = {int(pair.group(1)), int(pair.group(2))} if pair else set()
kind_ok = mismatch.startswith("MismatchError") or mismatch.startswith("AbortedError")
ctx.expect(kind_ok and culprit in named and len(named) == 2,
           f"mismatch does not name rank {culprit} and a peer: {mismatch}")
if mismatch.startswith("MismatchError") and pair:
    ctx.expect(mismatch.startswith(f"MismatchError: rank {rank}: all_reduce"),
               f"mismatch not reported as this rank's: {mismatch}")
    ctx.expect(culprit != rank or int(pair.group(2)) != rank, f"culprit names itself: {mismatch}")
counts = set(re.findall(r"\b(1000|1001)\b", mismatch))
both = "count 1001 vs 1000" in mismatch or "count 1000 vs 1001" in mismatch
ctx.expect(both or (len(counts) == 1 and re.search(r"\((1000|1001) x ", mismatch)),
           f"mismatch without the counts: {mismatch}")
ctx.expect(waited < 2.0, f"mismatch took {waited:.2f} s to raise")
ctx.log(f"mismatch after {waited * 1000:.0f} ms: {mismatch}")
dist.barrier()
comm.close()
comm = ctx.comm = ipcreduce.init(backend="cuda")
ok = torch.ones(3, device=dev)
comm.all_reduce(ok)
torch.cuda.synchronize()
ctx.expect(bool((ok == world).all()), "a new communicator after the mismatch does not work")
ctx.expect(comm.can_register and comm.fabric in ("peer", "pcie-peer"),
           f"peer-memory communicator: fabric {comm.fabric}, can_register {comm.can_register}")

# The DDP hook where registration is unavailable (host-staged transport): it must not ask for
# registered staging (alloc would refuse), say so once, and still average the bucket, checked
# against the closed form: rank r's bucket is base * (r + 1), its average base * (world + 1) / 2.
dist.barrier()
comm.close()
os.environ["IPCREDUCE_TRANSPORT"] = "host"
try:
    comm = ctx.comm = ipcreduce.init(backend="cuda")
finally:
    del os.environ["IPCREDUCE_TRANSPORT"]
ctx.expect(comm.fabric == "host-staged" and not comm.can_register,
           f"IPCREDUCE_TRANSPORT=host: fabric {comm.fabric}, can_register {comm.can_register}")


class Bucket:
    def __init__(self, t):
        self.t = t

    def index(self):
        return 0

    def buffer(self):
        return self.t


hs = itorch.HookState(comm)
base = torch.arange(1 << 16, device=dev, dtype=torch.float32) - 1000.0
bucket = base * (rank + 1)
try:
    hooked = itorch.hook(hs, Bucket(bucket)).wait()
    torch.cuda.synchronize()
    comm.check()
    want = base.double() * (world + 1) / 2
    hook_err = (hooked.double() - want).abs().max().item()
    ctx.expect(hook_err <= 4 * world * EPS[torch.float32] * want.abs().max().item(),
               f"hook on the host-staged transport: off by {hook_err}")
    hook_staged = hs.unregistered_reason
except ipcreduce.Error as e:
    hook_staged = f"{type(e).__name__}: {e}"
    ctx.expect(False, f"hook on the host-staged transport raised {hook_staged}")
ctx.expect(hs.unregistered_reason is not None and "host-staged" in hs.unregistered_reason,
           f"hook on the host-staged transport: staging reason {hs.unregistered_reason}")
ctx.log(f"hook on the host-staged transport: {hook_staged}")

ctx.report("correctness", dict(cases=cases, registered=registered, compiled=compiled, errors=errors, mismatch=mismatch,
                               mismatch_s=waited, hook_host_staged=hook_staged))
ctx.finish()
