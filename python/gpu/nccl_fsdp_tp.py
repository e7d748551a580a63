"""Unchanged PyTorch training with backend="nccl": FSDP2 (fully_shard: all-gather of
parameters, reduce-scatter of gradients) and a tensor-parallel MLP (DTensor,
parallelize_module with ColwiseParallel/RowwiseParallel: all-reduces of activations and
gradients), a few steps each; the TP MLP again through torch.compile, and its forward in a
CUDA graph replayed on new inputs. scripts/device/nccl-dropin.sh runs it plain and with
libipcreduce_nccl.so preloaded and compares the losses; here every rank must agree.
It imports nothing of ipcreduce.
Run: torchrun --standalone --nproc_per_node=2 nccl_fsdp_tp.py   (DROPIN_TAG names the report)"""

import faulthandler
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn

faulthandler.dump_traceback_later(300, exit=True)  # a hang names itself
env = os.environ
rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
local = int(env.get("LOCAL_RANK", rank))
gpus = torch.cuda.device_count()
dev = torch.device("cuda", local % gpus)
torch.cuda.set_device(dev)
if world > gpus:
    # Ranks sharing a GPU (under MPS): NCCL must believe they sit on different hosts.
    env["NCCL_HOSTID"] = f"fsdptp-rank{rank}"
    env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    env.setdefault("NCCL_IB_DISABLE", "1")
dist.init_process_group("nccl", device_id=dev)
tag = env.get("DROPIN_TAG", "run")
out_dir = env.get("DROPIN_OUT", ".")
STEPS = 6
failures: list = []
checks = 0


def expect(ok: bool, what: str) -> None:
    global checks
    checks += 1
    if not ok:
        failures.append(what)
        print(f"rank {rank}: FAIL {what}", flush=True)


def same_on_every_rank(values: list, what: str) -> None:
    """Every rank's list equal to rank 0's, bit for bit (gathered through the same NCCL)."""
    t = torch.tensor(values, device=dev, dtype=torch.float64)
    all_t = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(all_t, t)
    expect(all(torch.equal(all_t[0], u) for u in all_t), f"{what}: every rank the same")


def batch(step: int, n: int, d: int, per_rank: bool) -> torch.Tensor:
    g = torch.Generator(device=dev).manual_seed(1000 * step + (rank if per_rank else 0))
    return torch.randn(n, d, device=dev, generator=g)


def fsdp2_losses() -> list:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256))
                            for _ in range(3)]).to(dev)
    for block in model:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(STEPS):
        x = batch(step, 32, 256, per_rank=True)
        loss = (model(x) - x.flip(1)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        t = loss.detach().clone()
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        losses.append(t.item())
    # The full parameters (all-gathered by DTensor) the same on every rank.
    full = torch.cat([p.full_tensor().flatten() for p in model.parameters()])
    ps = [torch.empty_like(full) for _ in range(world)]
    dist.all_gather(ps, full)
    expect(all(torch.equal(ps[0], q) for q in ps), "FSDP2 parameters identical on every rank")
    return losses


def tp_losses() -> list:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    mesh = init_device_mesh("cuda", (world,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256),
                          nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)).to(dev)
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel(), "3": ColwiseParallel(),
            "5": RowwiseParallel()}
    model = parallelize_module(model, mesh, plan)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(STEPS):
        x = batch(step, 16, 256, per_rank=False)  # TP: the same input on every rank
        loss = (model(x) - x.flip(1)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach().item())
    return losses


def tp_model():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    mesh = init_device_mesh("cuda", (world,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)).to(dev)
    return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def tp_compiled_losses() -> list:
    """The TP MLP's steps through torch.compile: the row-parallel layer's all-reduce becomes
    a functional collective in the compiled graph, launched by ProcessGroupNCCL."""
    model = tp_model()
    step_fn = torch.compile(lambda x: (model(x) - x.flip(1)).pow(2).mean())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(STEPS):
        x = batch(step, 16, 256, per_rank=False)
        loss = step_fn(x)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach().item())
    return losses


def tp_graph_outputs() -> list:
    """The TP MLP's forward (its all-reduce inside) captured in a CUDA graph and replayed on
    new inputs: each replay equal to an eager forward of the same input; the outputs' sums.
    (The row-parallel layer hands back a plain, replicated tensor.)"""
    model = tp_model()
    x = batch(0, 16, 256, per_rank=False)
    sums = []
    with torch.no_grad():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):  # warm-up outside the capture, as CUDA graphs ask
                model(x)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            # DTensor hands back the row-parallel all-reduce's result as a tensor that waits
            # for the collective when first used: used inside the capture (the copy), so the
            # collective's stream joins the capture before it ends.
            y = model(x).clone()
        for step in range(STEPS):
            x.copy_(batch(step + 1, 16, 256, per_rank=False))
            g.replay()
            expect(torch.equal(y, model(x)), f"TP graph replay {step} equal to the eager forward")
            sums.append(y.double().sum().item())
    return sums


results = {}
for name, fn in (("fsdp2", fsdp2_losses), ("tp", tp_losses), ("tp_compiled", tp_compiled_losses),
                 ("tp_graph", tp_graph_outputs)):
    try:
        losses = fn()
        results[name] = losses
        expect(all(v == v and abs(v) < 1e6 for v in losses), f"{name}: finite losses")
        same_on_every_rank(losses, f"{name} losses")
    except Exception:  # noqa: BLE001 - reported as a failure, the other part still runs
        traceback.print_exc()
        expect(False, f"{name}: raised {traceback.format_exc().splitlines()[-1]}")
torch.cuda.synchronize()
report = dict(tag=tag, rank=rank, world=world, failures=failures, checks=checks,
              losses=results, preload=env.get("LD_PRELOAD", ""), torch=torch.__version__,
              date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
with open(os.path.join(out_dir, f"fsdptp-{tag}-rank{rank}.json"), "w") as f:
    json.dump(report, f, indent=1)
shown = {k: [round(v, 6) for v in l] for k, l in results.items()}
print(f"rank {rank} [{tag}]: {checks} checks, {len(failures)} failed; losses {shown}", flush=True)
dist.barrier()
torch.cuda.synchronize()
sys.stdout.flush()
sys.stderr.flush()
os._exit(1 if failures else 0)
