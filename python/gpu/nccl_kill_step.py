"""Unchanged DDP training with backend="nccl" (libipcreduce_nccl.so preloaded): rank 1 is
SIGKILLed in the middle of a step; rank 0 must then end with an error that names rank 1,
through PyTorch's own paths (its NCCL watchdog polling ncclCommGetAsyncError, or the next
collective's error), within a bound, never hang and never finish its steps.

Started without torchrun (whose agent would kill the survivor itself) by
scripts/device/nccl-dropin.sh: two processes with RANK, WORLD_SIZE=2, MASTER_ADDR/PORT,
KILL_FILE (rank 1 writes the time of its death there), each its own NCCL_HOSTID when they share
a GPU. Rank 0 catches PyTorch's error, prints "PASS kill-step" (the error came within
KILL_BOUND_S of the kill and names rank 1) or "FAIL kill-step", and leaves at once: PyTorch's
own teardown after such an error takes a minute (its heartbeat monitor), which is not ours to
time."""

import faulthandler
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

faulthandler.dump_traceback_later(120, exit=True)  # a hang names itself
rank = int(os.environ["RANK"])
gpus = torch.cuda.device_count()
dev = torch.device("cuda", rank % gpus)
torch.cuda.set_device(dev)
dist.init_process_group("nccl", device_id=dev)
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 512)).to(dev),
            device_ids=[dev.index], bucket_cap_mb=1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
KILL_AT, STEPS = 5, 20000
KILL_FILE = os.environ["KILL_FILE"]
BOUND_S = float(os.environ.get("KILL_BOUND_S", "20"))


def train() -> None:
    for step in range(STEPS):
        x = torch.randn(64, 512, device=dev)
        loss = (model(x) - x).pow(2).mean()
        opt.zero_grad()
        if rank == 1 and step == KILL_AT:
            print(f"rank 1: killed before the backward of step {step}", flush=True)
            with open(KILL_FILE + ".tmp", "w") as f:
                f.write(repr(time.time()))
            os.rename(KILL_FILE + ".tmp", KILL_FILE)
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()  # the gradient all-reduces (rank 0's wait for rank 1 there)
        opt.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        t.item()
        if step == KILL_AT - 1:
            print(f"rank {rank}: step {step} done", flush=True)


try:
    train()
    print(f"rank {rank}: FAIL kill-step: finished {STEPS} steps after rank 1 died", flush=True)
    code = 1
except Exception as e:  # noqa: BLE001 - the error under test
    now = time.time()
    text = str(e)
    try:
        after = now - float(open(KILL_FILE).read())
    except (OSError, ValueError):
        after = float("nan")
    first = " | ".join(ln for ln in text.splitlines() if ln.strip())[:600]
    print(f"rank {rank}: {type(e).__name__} {after:.3f} s after rank 1 was killed: {first}", flush=True)
    if not after <= BOUND_S:
        print(f"rank {rank}: FAIL kill-step: the error came {after:.3f} s after the kill "
              f"(bound {BOUND_S} s)", flush=True)
        code = 1
    elif "rank 1" not in text:
        print(f"rank {rank}: FAIL kill-step: the error does not name rank 1", flush=True)
        code = 1
    else:
        print(f"rank {rank}: PASS kill-step: {type(e).__name__} naming rank 1, {after:.3f} s "
              f"after the kill", flush=True)
        code = 0
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
