"""An unchanged PyTorch program with backend="nccl", run with and without libipcreduce_nccl.so
preloaded (scripts/device/nccl-dropin.sh): all_reduce (sum/max/min/avg), reduce_scatter_tensor
(sum/max/min/avg) and all_gather_into_tensor (out of place and in place) of several sizes and
dtypes, eager (on the default stream, and on cudaStreamLegacy and cudaStreamPerThread by
handle) and inside a CUDA graph, a broadcast, all-reduces on tensors inside a symmetric NCCL window
(ncclMemAlloc + ncclCommWindowRegister), every result checked against a float64 reference;
a few DDP steps whose
losses the script compares between the two runs; the time of a small all-reduce.
It imports nothing of ipcreduce: what it runs on is the preload's business.
Run: torchrun --standalone --nproc_per_node=2 nccl_dropin.py   (DROPIN_TAG names the report)"""

import faulthandler
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

faulthandler.dump_traceback_later(600, exit=True)  # a hang names itself
env = os.environ
rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
local = int(env.get("LOCAL_RANK", rank))
gpus = torch.cuda.device_count()
dev = torch.device("cuda", local % gpus)
torch.cuda.set_device(dev)
if world > gpus:
    # Ranks sharing a GPU (under MPS): NCCL must believe they sit on different hosts.
    env["NCCL_HOSTID"] = f"dropin-rank{rank}"
    env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    env.setdefault("NCCL_IB_DISABLE", "1")
dist.init_process_group("nccl", device_id=dev)
tag = env.get("DROPIN_TAG", "run")
out_dir = env.get("DROPIN_OUT", ".")
failures: list = []
checks = 0
EPS = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SIZES = [1, 7, 1024, 65536 + 3, 1 << 20]  # elements: 4 B .. 4 MiB of f32
OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
       "avg": dist.ReduceOp.AVG}


def expect(ok: bool, what: str) -> None:
    global checks
    checks += 1
    if not ok:
        failures.append(what)
        print(f"rank {rank}: FAIL {what}", flush=True)


def data(r: int, n: int, dtype, salt: int) -> torch.Tensor:
    """Rank r's input: the same on every rank for the same (r, n, salt), exactly representable
    in dtype, signs mixed, magnitudes spread."""
    g = torch.Generator(device=dev).manual_seed(1000 * salt + 17 * r + n)
    return torch.randn(n, device=dev, generator=g, dtype=torch.float32).to(dtype)


def reference(inputs, op: str) -> torch.Tensor:
    x = torch.stack([t.double() for t in inputs])
    if op == "sum":
        return x.sum(0)
    if op == "avg":
        return x.sum(0) / world
    return x.max(0).values if op == "max" else x.min(0).values


def close(got: torch.Tensor, inputs, op: str, dtype) -> bool:
    ref = reference(inputs, op)
    if op in ("max", "min"):
        return torch.equal(got.double(), ref)
    # Any order of world additions, each rounded in dtype (or one rounding): bounded by
    # world roundings of the running sum's magnitude.
    mag = torch.stack([t.double().abs() for t in inputs]).sum(0)
    tol = EPS[dtype] * (world + 1) * (mag + ref.abs()) + 1e-30
    return bool(((got.double() - ref).abs() <= tol).all())


salt = 0
for dtype in DTYPES:
    for n in SIZES:
        for op, rop in OPS.items():
            salt += 1
            x = data(rank, n, dtype, salt)
            inputs = [data(r, n, dtype, salt) for r in range(world)]
            dist.all_reduce(x, op=rop)
            expect(close(x, inputs, op, dtype), f"all_reduce {op} {dtype} n={n}")
        # reduce_scatter_tensor: rank r gets the reduction of slice r of every rank's input.
        for op in ("sum", "max", "min", "avg"):
            salt += 1
            full = [data(r, n * world, dtype, salt) for r in range(world)]
            y = torch.full((n,), float("nan"), device=dev, dtype=dtype)
            dist.reduce_scatter_tensor(y, full[rank].clone(), op=OPS[op])
            mine = [f[rank * n:(rank + 1) * n] for f in full]
            expect(close(y, mine, op, dtype), f"reduce_scatter {op} {dtype} n={n}")
        # all_gather_into_tensor, out of place and in place (input = this rank's slice).
        salt += 1
        parts = [data(r, n, dtype, salt) for r in range(world)]
        want = torch.cat(parts)
        y = torch.full((n * world,), float("nan"), device=dev, dtype=dtype)
        dist.all_gather_into_tensor(y, parts[rank].clone())
        expect(torch.equal(y, want), f"all_gather {dtype} n={n}")
        y = torch.full((n * world,), float("nan"), device=dev, dtype=dtype)
        y[rank * n:(rank + 1) * n].copy_(parts[rank])
        dist.all_gather_into_tensor(y, y[rank * n:(rank + 1) * n])
        expect(torch.equal(y, want), f"all_gather in place {dtype} n={n}")
torch.cuda.synchronize()


# The default streams by their special handles (cuda_runtime_api.h): cudaStreamLegacy (0x1)
# and cudaStreamPerThread (0x2), current for the calls, which then run on them.
def default_stream_checks(handle: int, name: str) -> None:
    global salt
    es = torch.cuda.ExternalStream(handle, device=dev)
    torch.cuda.synchronize()
    with torch.cuda.stream(es):
        for dtype in DTYPES:
            salt += 1
            x = data(rank, 4099, dtype, salt)
            inputs = [data(r, 4099, dtype, salt) for r in range(world)]
            dist.all_reduce(x, op=dist.ReduceOp.AVG)
            full = [data(r, 1024 * world, dtype, salt + 1) for r in range(world)]
            y = torch.empty(1024, device=dev, dtype=dtype)
            dist.reduce_scatter_tensor(y, full[rank].clone())
            torch.cuda.synchronize()
            expect(close(x, inputs, "avg", dtype), f"all_reduce avg {dtype} on {name}")
            expect(close(y, [f[rank * 1024:(rank + 1) * 1024] for f in full], "sum", dtype),
                   f"reduce_scatter {dtype} on {name}")


# PyTorch may refuse a special handle: then the part is skipped (the driver script fails the
# run only where the preloaded run skipped what the plain one did not).
skipped: list = []
for handle, name in ((0x1, "cudaStreamLegacy"), (0x2, "cudaStreamPerThread")):
    try:
        default_stream_checks(handle, name)
    except Exception as e:  # noqa: BLE001 - said and recorded, see above
        print(f"rank {rank}: {name}: raised {e!r}: not checked", flush=True)
        skipped.append(name)
        torch.cuda.synchronize()
# A broadcast from rank 1 (forwarded to NCCL).
salt += 1
b = data(rank, 3000, torch.float32, salt)
want = data(1, 3000, torch.float32, salt)
dist.broadcast(b, src=1)
expect(torch.equal(b, want), "broadcast from rank 1")
torch.cuda.synchronize()
eager_checks = checks

# CUDA graph: one graph with an all-reduce, a reduce-scatter and an all-gather, replayed with a
# new input each time (copied into the static buffers outside the graph), every replay checked.
N = 4096
src = torch.empty(N * world, device=dev, dtype=torch.bfloat16)
ar_in = torch.empty(N, device=dev, dtype=torch.bfloat16)
rs_out = torch.empty(N, device=dev, dtype=torch.bfloat16)
ag_out = torch.empty(N * world, device=dev, dtype=torch.bfloat16)
f32_in = torch.empty(N, device=dev, dtype=torch.float32)


avg_in = torch.empty(N, device=dev, dtype=torch.float16)


def body():
    dist.all_reduce(ar_in)
    dist.all_reduce(f32_in, op=dist.ReduceOp.MAX)
    dist.all_reduce(avg_in, op=dist.ReduceOp.AVG)
    dist.reduce_scatter_tensor(rs_out, src)
    dist.all_gather_into_tensor(ag_out, ar_in)


s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    for _ in range(3):
        body()
torch.cuda.current_stream().wait_stream(s)
torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    body()
for replay in range(20):
    salt += 1
    full = [data(r, N * world, torch.bfloat16, salt) for r in range(world)]
    a = [data(r, N, torch.bfloat16, salt + 10_000) for r in range(world)]
    b = [data(r, N, torch.float32, salt + 20_000) for r in range(world)]
    c = [data(r, N, torch.float16, salt + 30_000) for r in range(world)]
    avg_in.copy_(c[rank])
    src.copy_(full[rank])
    ar_in.copy_(a[rank])
    f32_in.copy_(b[rank])
    g.replay()
    torch.cuda.synchronize()
    expect(close(ar_in, a, "sum", torch.bfloat16), f"graph replay {replay}: all_reduce sum bf16")
    expect(close(f32_in, b, "max", torch.float32), f"graph replay {replay}: all_reduce max f32")
    expect(close(avg_in, c, "avg", torch.float16), f"graph replay {replay}: all_reduce avg f16")
    expect(close(rs_out, [f[rank * N:(rank + 1) * N] for f in full], "sum", torch.bfloat16),
           f"graph replay {replay}: reduce_scatter bf16")
    # Every rank's all-reduced tensor is the same, so the gather holds world copies of it.
    expect(torch.equal(ag_out, ar_in.repeat(world)), f"graph replay {replay}: all_gather bf16")
graph_checks = checks - eager_checks


# A symmetric window (ncclMemAlloc, ncclCommWindowRegister with NCCL_WIN_COLL_SYMMETRIC):
# all-reduces in place on tensors inside it, at the same offsets on every rank, checked; then
# deregistered. Preloaded, ipcreduce registers the window too and takes these calls zero-copy
# where NCCL made the window (the log names the path: *-reg); where NCCL supports no windows on
# this communicator (ranks on "different hosts" under MPS) it returns none and they are staged.
def window_checks() -> dict:
    import ctypes
    backend = dist.group.WORLD._get_backend(dev)
    # The process's symbols, the preload's first (a handle on libnccl itself would bypass
    # it); without a preload, the NCCL torch loaded, if its symbols are not global.
    lib = ctypes.CDLL(None)
    if not hasattr(lib, "ncclCommWindowRegister") and not env.get("LD_PRELOAD"):
        try:
            lib = ctypes.CDLL("libnccl.so.2")
        except OSError:
            pass
    if not (hasattr(backend, "_comm_ptr") and hasattr(lib, "ncclCommWindowRegister")
            and hasattr(lib, "ncclMemAlloc")):
        skipped.append("window: no communicator pointer or no NCCL windows")
        return dict(window="skipped")
    # ncclMemAlloc straight (torch's NCCL memory pool may be compiled out), seen as a tensor
    # through the CUDA array interface (bf16 as int16: the interface has no bf16).
    n_max = 1 << 20
    nbytes = 2 * n_max * 2
    ptr = ctypes.c_void_p()
    rc = lib.ncclMemAlloc(ctypes.byref(ptr), ctypes.c_size_t(nbytes))
    expect(rc == 0 and bool(ptr.value), f"ncclMemAlloc returned {rc}")
    if rc != 0 or not ptr.value:
        return dict(window="no memory")

    class Raw:
        __cuda_array_interface__ = dict(shape=(2 * n_max,), typestr="<i2", data=(ptr.value, False),
                                        version=3, strides=None)

    buf = torch.as_tensor(Raw(), device=dev).view(torch.bfloat16)
    buf.zero_()
    torch.cuda.synchronize()
    comm = ctypes.c_void_p(backend._comm_ptr())
    win = ctypes.c_void_p()
    rc = lib.ncclCommWindowRegister(comm, ptr, ctypes.c_size_t(nbytes), ctypes.byref(win),
                                    ctypes.c_int(1))
    expect(rc == 0, f"ncclCommWindowRegister returned {rc}")
    global salt
    for n, at in ((4096, 0), (4096, 8192), (65536 + 3, 1000), (n_max, n_max)):
        salt += 1
        x = buf[at:at + n]
        inputs = [data(r, n, torch.bfloat16, salt) for r in range(world)]
        for _ in range(2):  # the second call on the same buffer too (registered once)
            x.copy_(inputs[rank])
            dist.all_reduce(x)
            expect(close(x, inputs, "sum", torch.bfloat16), f"window all_reduce n={n} at={at}")
    torch.cuda.synchronize()
    rc = lib.ncclCommWindowDeregister(comm, win)
    expect(rc == 0, f"ncclCommWindowDeregister returned {rc}")
    made = bool(win.value)
    del x, buf
    torch.cuda.synchronize()
    rc = lib.ncclMemFree(ptr)
    expect(rc == 0, f"ncclMemFree returned {rc}")
    return dict(window="made by NCCL" if made else "none from NCCL (staged)")


try:
    window = window_checks()
except Exception as e:  # a failure of the check, not of the run: recorded, the rest goes on
    expect(False, f"window: raised {e!r}")
    window = dict(window="raised")


# DDP: the same model, data and seed in both runs; losses compared by the driver script.
def ddp_losses(steps: int = 5) -> list:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 512)).to(dev)
    ddp = DDP(model, device_ids=[dev.index], bucket_cap_mb=1)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    losses = []
    for step in range(steps):
        gx = torch.Generator(device=dev).manual_seed(100 * step + rank)
        x = torch.randn(64, 512, device=dev, generator=gx)
        loss = (ddp(x) - x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    # Every rank's parameters must be the same after the steps.
    p = torch.cat([q.detach().flatten() for q in model.parameters()])
    ps = [torch.empty_like(p) for _ in range(world)]
    dist.all_gather(ps, p)
    expect(all(torch.equal(ps[0], q) for q in ps), "DDP parameters identical on every rank")
    return losses


losses = ddp_losses()


def time_us(fn, iters: int) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(iters):
        fn()
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1) * 1000.0 / iters


# A small all-reduce (8 KB bf16): eager, and 50 of them captured in one graph (per call).
small = torch.ones(4096, device=dev, dtype=torch.bfloat16)
eager_us = sorted(time_us(lambda: dist.all_reduce(small), 200) for _ in range(5))[2]
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    for _ in range(3):
        dist.all_reduce(small)
torch.cuda.current_stream().wait_stream(s)
g2 = torch.cuda.CUDAGraph()
with torch.cuda.graph(g2):
    for _ in range(50):
        dist.all_reduce(small)
graph_us = sorted(time_us(g2.replay, 20) / 50 for _ in range(5))[2]

report = dict(tag=tag, rank=rank, world=world, failures=failures, checks=checks, skipped=skipped,
              eager_checks=eager_checks, graph_checks=graph_checks, ddp_losses=losses,
              **window,
              allreduce_8k_bf16_eager_us=eager_us, allreduce_8k_bf16_graph_us=graph_us,
              preload=env.get("LD_PRELOAD", ""), torch=torch.__version__,
              nccl=".".join(map(str, torch.cuda.nccl.version())),
              device=torch.cuda.get_device_name(dev),
              date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
with open(os.path.join(out_dir, f"dropin-{tag}-rank{rank}.json"), "w") as f:
    json.dump(report, f, indent=1)
print(f"rank {rank} [{tag}]: {checks} checks, {len(failures)} failed; DDP losses "
      f"{[round(v, 6) for v in losses]}; 8 KB all-reduce {eager_us:.1f} us eager, "
      f"{graph_us:.1f} us in a graph", flush=True)
dist.barrier()
torch.cuda.synchronize()
# No destroy_process_group: after NCCL calls captured in graphs torch 2.11's teardown can hang
# (see common.py); the reports are written, so the process ends here.
sys.stdout.flush()
sys.stderr.flush()
os._exit(1 if failures else 0)
