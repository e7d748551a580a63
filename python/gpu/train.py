"""The training benchmark: 12 x nn.TransformerEncoderLayer(2048, 16, 8192, batch_first=True,
dropout=0) in bf16, SGD, DDP buckets of 25 MB, sequences of 512 tokens. Step time at 1024 / 4096
/ 16384 tokens per step with DDP over NCCL, with the ipcreduce hook, and with no_sync (no
communication), interleaved in one run; the hook both with its registered staging buffers
(`ipcreduce`) and directly on DDP's buckets (`ipcreduce_direct`); then loss curves of 200 steps
from one seed with NCCL and with the hook. Run: torchrun --standalone --nproc_per_node=2 train.py"""

import os
import time

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ipcreduce.torch as itorch
from common import Ctx, median

ctx = Ctx()
comm, rank, world, dev = ctx.comm, ctx.rank, ctx.world, ctx.device
small = bool(os.environ.get("IPCREDUCE_PY_SMALL"))
LAYERS, D, HEADS, FFN, SEQ = 12, 2048, 16, 8192, 512
TOKENS = [1024, 4096] if small else [1024, 4096, 16384]
STEPS = {1024: 20, 4096: 10, 16384: 5}  # timed steps per variant and round
if small:  # ranks sharing one GPU, NCCL over loopback sockets: a dry run
    STEPS = {1024: 6, 4096: 3}
ROUNDS = 2 if small else 3
WARMUP = 3
LOSS_STEPS = 40 if small else 200
# Per-token squared error of a learnable map (0.5 x): at this rate the loss falls steadily.
LR = 2e-5
bf16 = torch.bfloat16


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[
        nn.TransformerEncoderLayer(D, HEADS, FFN, batch_first=True, dropout=0.0, device=dev,
                                   dtype=bf16) for _ in range(LAYERS)])


def batch(tokens: int, step: int) -> torch.Tensor:
    """This rank's input for a step (deterministic)."""
    g = torch.Generator(device=dev).manual_seed(1_000_003 * rank + step)
    return torch.randn((tokens // SEQ, SEQ, D), device=dev, generator=g, dtype=bf16)


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (model(x).float() - 0.5 * x.float()).pow(2).sum(-1).mean()


t0 = time.time()
base = build()
params = sum(p.numel() for p in base.parameters())
init_state = {k: v.clone() for k, v in base.state_dict().items()}
models = {"nccl": DDP(base, device_ids=[dev.index], bucket_cap_mb=25)}
hooked = build()
models["ipcreduce"] = DDP(hooked, device_ids=[dev.index], bucket_cap_mb=25)
models["ipcreduce"].register_comm_hook(comm, itorch.hook)  # registered staging (the default)
models["ipcreduce_direct"] = DDP(build(), device_ids=[dev.index], bucket_cap_mb=25)
models["ipcreduce_direct"].register_comm_hook(itorch.HookState(comm, registered=False), itorch.hook)
optims = {k: torch.optim.SGD(m.parameters(), lr=LR) for k, m in models.items()}
ctx.log(f"{params / 1e6:.0f}M parameters ({2 * params / 1e9:.2f} GB of bf16 gradients), "
        f"built in {time.time() - t0:.1f} s")


def step(variant: str, x: torch.Tensor) -> torch.Tensor:
    model = models["nccl" if variant == "no_sync" else variant]
    opt = optims["nccl" if variant == "no_sync" else variant]
    opt.zero_grad(set_to_none=True)
    if variant == "no_sync":
        with model.no_sync():
            loss = loss_of(model, x)
            loss.backward()
    else:
        loss = loss_of(model, x)
        loss.backward()
    opt.step()
    return loss.detach()


def timed(variant: str, tokens: int, steps: int, data) -> float:
    """Mean ms per step over `steps` steps after warm-up (CUDA events around the run)."""
    for i in range(WARMUP):
        step(variant, data[i % len(data)])
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(steps):
        step(variant, data[i % len(data)])
    end.record()
    end.synchronize()
    comm.check()
    return start.elapsed_time(end) / steps


VARIANTS = ["nccl", "ipcreduce", "ipcreduce_direct", "no_sync"]
broken: dict = {}  # variant -> the error that stopped it; the other variants go on
times = {}
for tokens in TOKENS:
    data = [batch(tokens, i) for i in range(4)]
    runs = {v: [] for v in VARIANTS}
    for r in range(ROUNDS):
        # Rotate the order so no variant always runs first (clocks, allocator state).
        for v in VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]:
            if v in broken:
                continue
            torch.distributed.barrier()
            try:
                runs[v].append(timed(v, tokens, STEPS[tokens], data))
            except Exception as e:  # ipcreduce errors are bounded on every rank: NCCL goes on
                broken[v] = f"{type(e).__name__}: {e}"
                ctx.expect(False, f"{v} at {tokens} tokens: {broken[v]}")
    row = {v: median(runs[v]) if runs[v] else float("nan") for v in VARIANTS}
    row["runs"] = runs
    row["exposed_nccl_ms"] = row["nccl"] - row["no_sync"]
    row["exposed_ipcreduce_ms"] = row["ipcreduce"] - row["no_sync"]
    row["exposed_ipcreduce_direct_ms"] = row["ipcreduce_direct"] - row["no_sync"]
    row["speedup_vs_nccl"] = row["nccl"] / row["ipcreduce"]
    times[tokens] = row
    ctx.log(f"{tokens:>6} tokens/step: NCCL {row['nccl']:.2f} ms, ipcreduce "
            f"{row['ipcreduce']:.2f} ms (direct {row['ipcreduce_direct']:.2f} ms), no_sync "
            f"{row['no_sync']:.2f} ms; exposed NCCL {row['exposed_nccl_ms']:.2f} ms, ipcreduce "
            f"{row['exposed_ipcreduce_ms']:.2f} ms (direct "
            f"{row['exposed_ipcreduce_direct_ms']:.2f} ms)")
    del data

# Loss curves: both models from the same initial weights, same data (four batches in turn).
curves = {}
loss_data = [batch(1024, 10_000 + i) for i in range(4)]
hooked_variant = next((v for v in ("ipcreduce", "ipcreduce_direct") if v not in broken), None)
if hooked_variant is None:
    ctx.report("train", dict(step_ms=times, broken=broken))
    ctx.finish()
for v in ("nccl", hooked_variant):
    models[v].module.load_state_dict(init_state)
    losses = [step(v, loss_data[i % 4]) for i in range(LOSS_STEPS)]
    curves[v] = torch.stack(losses).tolist()
comm.check()
a, b = torch.tensor(curves["nccl"]), torch.tensor(curves[hooked_variant])
rel = ((a - b).abs() / a.abs()).tolist()
loss = dict(steps=LOSS_STEPS, hook_variant=hooked_variant, first=[a[0].item(), b[0].item()], last=[a[-1].item(), b[-1].item()],
            max_rel_diff=max(rel), mean_rel_diff=sum(rel) / len(rel),
            identical_steps=int((a == b).sum()), curves=curves)
# Training must move the weights, or equal curves would prove nothing.
ctx.expect(a[-4:].mean() < 0.95 * a[:4].mean(),
           f"the loss did not fall with NCCL ({a[:4].mean():.4f} -> {a[-4:].mean():.4f})")
# bf16 noise: a few units of bf16's 2^-8 relative rounding, after many steps of divergence.
ctx.expect(loss["max_rel_diff"] < 0.02 and loss["mean_rel_diff"] < 0.005,
           f"loss curves differ beyond bf16 noise: max {loss['max_rel_diff']:.4f}, "
           f"mean {loss['mean_rel_diff']:.5f}")
ctx.log(f"loss over {LOSS_STEPS} steps: NCCL {loss['first'][0]:.4f} -> {loss['last'][0]:.4f}, "
        f"ipcreduce {loss['first'][1]:.4f} -> {loss['last'][1]:.4f}; relative difference max "
        f"{loss['max_rel_diff']:.2e}, mean {loss['mean_rel_diff']:.2e}; "
        f"{loss['identical_steps']} of {LOSS_STEPS} steps identical")

ctx.report("train", dict(model=dict(layers=LAYERS, d_model=D, heads=HEADS, ffn=FFN, seq=SEQ,
                                    params=params, bucket_mb=25, lr=LR),
                         step_ms=times, loss=loss, broken=broken))
ctx.finish()
