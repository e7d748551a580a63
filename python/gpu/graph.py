"""CUDA graphs: a tensor-parallel layer (row-sharded matmul -> all-reduce) captured and replayed
1000 times with a new input each time, every result checked against a float32 reference; its
replay latency with ipcreduce, with NCCL in the same graph and with no communication; then
graph-captured all-reduces of 8-64 KB against NCCL's.
Run: torchrun --standalone --nproc_per_node=2 graph.py"""

import faulthandler
import os
import sys

import torch
import torch.distributed as dist

import ipcreduce.torch as itorch
from common import EPS, Ctx, median, time_us

ctx = Ctx()
comm, rank, world, dev = ctx.comm, ctx.rank, ctx.world, ctx.device
small = bool(os.environ.get("IPCREDUCE_PY_SMALL"))
REPLAYS = 1000
T, H = 8, 4096  # tokens, hidden: the all-reduced activation is 8 x 4096 bf16 = 64 KB
K = H // world  # this rank's rows of the weight
bf16 = torch.bfloat16

# Every rank builds the whole input sequence and weight (same seed), then keeps its shard.
gen = torch.Generator(device=dev).manual_seed(1234)
X = torch.randn(REPLAYS, T, H, device=dev, generator=gen).to(bf16)
W = (torch.randn(H, H, device=dev, generator=gen) / H**0.5).to(bf16)
xs = X[:, :, rank * K:(rank + 1) * K].contiguous()
w = W[rank * K:(rank + 1) * K].contiguous()
# Reference: every rank's bf16 partial product in float32, summed.
parts = torch.stack([X[:, :, r * K:(r + 1) * K].float() @ W[r * K:(r + 1) * K].float()
                     for r in range(world)])
ref = parts.sum(0)
# Each partial is rounded to bf16 by the matmul, the sum once more.
tol = EPS[bf16] * (parts.abs().sum(0) + ref.abs()) * 1.01 + 1e-6
del parts


def capture(body, x_static):
    """Warm-up on a side stream (as torch asks), then capture `body(x_static)`."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            body(x_static)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = body(x_static)
    return g, y


def tp_ipcreduce(x):
    y = x @ w
    comm.all_reduce(y)  # the capture stream is the current stream
    return y


def tp_op(x):
    return itorch.all_reduce(x @ w, comm)  # the custom op


y_reg = itorch.empty((T, H), bf16, comm)  # registered: the all-reduce is zero-copy


def tp_registered(x):
    torch.matmul(x, w, out=y_reg)
    comm.all_reduce(y_reg)
    return y_reg


def tp_nccl(x):
    y = x @ w
    dist.all_reduce(y)
    return y


def tp_none(x):
    return x @ w


results = {}
for name, body in (("ipcreduce", tp_ipcreduce), ("ipcreduce_op", tp_op),
                   ("ipcreduce_registered", tp_registered), ("nccl", tp_nccl), ("no_comm", tp_none)):
    x_static = torch.zeros(T, K, device=dev, dtype=bf16)
    g, y_static = capture(body, x_static)
    out = torch.empty(REPLAYS, T, H, device=dev, dtype=bf16)
    torch.cuda.synchronize()
    for i in range(REPLAYS):
        x_static.copy_(xs[i])
        g.replay()
        out[i].copy_(y_static)
    torch.cuda.synchronize()
    comm.check()
    r = dict()
    if name != "no_comm":
        err = (out.float() - ref).abs()
        bad = (err > tol).flatten(1).any(1)
        r["wrong_replays"] = int(bad.sum())
        r["max_err"] = err.max().item()
        ctx.expect(r["wrong_replays"] == 0, f"{name}: {r['wrong_replays']} of {REPLAYS} replays wrong")
        g_all = torch.empty(world, *out.shape, device=dev, dtype=bf16)
        dist.all_gather_into_tensor(g_all, out)
        r["same_on_all_ranks"] = all(torch.equal(g_all[0], g_all[q]) for q in range(1, world))
        ctx.expect(r["same_on_all_ranks"], f"{name}: replays differ between ranks")
        del g_all
    # Latency: replays back to back, median of 5 runs.
    x_static.copy_(xs[0])
    r["replay_us"] = median([time_us(g.replay, 200 if small else 2000) for _ in range(5)])
    results[name] = r
    ctx.log(f"TP layer {name:>12}: {r}")
    del g, out
    dist.barrier()

# Graph-captured all-reduce alone, 8-64 KB bf16: CALLS in-place calls per graph. After the
# first call every rank holds the same values, so each further call multiplies them by the
# world size exactly: the result is checked after every timing run. The first call's result
# is itself checked against the float64 sum of the ranks' inputs (gathered through NCCL).
CALLS = 20
sizes = {}
for kb in (8, 16, 32, 64):
    n = kb * 1024 // 2
    x0 = torch.randn(n, device=dev, generator=torch.Generator(device=dev).manual_seed(rank)).to(bf16)
    x_all = torch.empty(world, n, device=dev, dtype=bf16)
    dist.all_gather_into_tensor(x_all, x0)
    first_ref = x_all.double().sum(0)
    first_tol = EPS[bf16] * first_ref.abs() + world * EPS[torch.float32] * x_all.double().abs().sum(0)
    del x_all
    row = {}
    reg = itorch.empty(n, bf16, comm)
    for name, call in (("ipcreduce", lambda b: comm.all_reduce(b)),
                       ("ipcreduce_registered", lambda b: comm.all_reduce(reg)),
                       ("nccl", lambda b: dist.all_reduce(b))):
        first = (reg if name == "ipcreduce_registered" else x0.clone())
        first.copy_(x0)
        call(first)  # eager: the first call's rounding, then exact doublings
        torch.cuda.synchronize()
        ctx.expect(bool(((first.double() - first_ref).abs() <= first_tol).all()),
                   f"{name} {kb} KB: eager call beyond rounding of the float64 reference")
        want = first.float() * float(world) ** (CALLS - 1)
        buf = reg if name == "ipcreduce_registered" else x0.clone()
        buf.copy_(x0)

        def body(b, call=call):
            for _ in range(CALLS):
                call(b)
            return b

        g, _ = capture(body, buf)

        def run(g=g, buf=buf):
            buf.copy_(x0)
            g.replay()

        times = []
        for _ in range(5):
            times.append(time_us(run, 20 if small else 100) / CALLS)
            torch.cuda.synchronize()
            ctx.expect(torch.equal(buf.float(), want), f"{name} {kb} KB graph: wrong result")
        row[name] = median(times)
        del g
    itorch.free(reg, comm)
    row["speedup"] = row["nccl"] / row["ipcreduce"]
    row["speedup_registered"] = row["nccl"] / row["ipcreduce_registered"]
    sizes[f"{kb}KB"] = row
    ctx.log(f"graph all-reduce {kb:>2} KB: ipcreduce {row['ipcreduce']:.2f} us "
            f"(registered {row['ipcreduce_registered']:.2f} us), NCCL {row['nccl']:.2f} us, "
            f"x{row['speedup']:.2f} (registered x{row['speedup_registered']:.2f})")

itorch.free(y_reg, comm)

# A graph replayed after comm.close(): the captured kernels point at the communicator's
# workspace, which close() unmapped. The outcome must be an error (the replay or the next
# synchronize raises), never a replay that returns as if it had reduced; nor a hang: the
# process dumps its stacks and exits non-zero if it is not over within the bound. This
# leaves the CUDA context unusable, so it comes last, and the process exits right after it.
stale = torch.full((4096,), float(rank + 1), device=dev, dtype=bf16)
g_stale, _ = capture(lambda b: comm.all_reduce(b), stale)
torch.cuda.synchronize()
comm.check()
dist.barrier()
comm.close()
dist.barrier()  # every rank closed before any replays
after_close = "returned without an error"
faulthandler.dump_traceback_later(float(os.environ.get("IPCREDUCE_TIMEOUT_MS", 10000)) / 1000 + 60,
                                  exit=True)
try:
    stale.fill_(float(rank + 1))
    g_stale.replay()
    torch.cuda.synchronize()
except Exception as e:  # the CUDA error torch raises (illegal address, launch failure)
    after_close = f"{type(e).__name__}: {e}".splitlines()[0]
faulthandler.cancel_dump_traceback_later()
ctx.expect(after_close != "returned without an error",
           "a graph replayed after comm.close() returned as if it had run")
ctx.log(f"replay after close: {after_close}")

ctx.report("graph", dict(tp_layer=results, tp_shape=[T, H], replays=REPLAYS,
                         graph_all_reduce_us=sizes, calls_per_graph=CALLS,
                         replay_after_close=after_close))
# The CUDA context is gone (and NCCL was captured in CUDA graphs, see Ctx.finish): nothing of
# the teardown can run, the process ends here with its report written.
sys.stdout.flush()
sys.stderr.flush()
os._exit(1 if ctx.failures else 0)
