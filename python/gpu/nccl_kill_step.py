"""Unchanged DDP training with backend="nccl" (libipcreduce_nccl.so preloaded): rank 1 is
SIGKILLed in the middle of a step; rank 0 must then end with an error that names rank 1,
through PyTorch's own paths (its NCCL watchdog polling ncclCommGetAsyncError, or the next
collective's error), within a bound, never hang and never finish its steps.

Started without torchrun (whose agent would kill the survivor itself) by
scripts/device/nccl-dropin.sh: two processes with RANK, WORLD_SIZE=2, MASTER_ADDR/PORT, each
its own NCCL_HOSTID when they share a GPU. Rank 0 reaching the end of its steps is the failure:
it prints "FAIL kill-step" and exits 0 so that the driver script tells it apart."""

import faulthandler
import os
import signal
import sys

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
for step in range(STEPS):
    x = torch.randn(64, 512, device=dev)
    loss = (model(x) - x).pow(2).mean()
    opt.zero_grad()
    if rank == 1 and step == KILL_AT:
        print(f"rank 1: killed before the backward of step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    loss.backward()  # the gradient all-reduces (rank 0's wait for rank 1 there)
    opt.step()
    t = loss.detach().clone()
    dist.all_reduce(t)
    t.item()
    if step == KILL_AT - 1:
        print(f"rank {rank}: step {step} done", flush=True)
print(f"rank {rank}: FAIL kill-step: finished {STEPS} steps after rank 1 died", flush=True)
sys.stdout.flush()
os._exit(0)
