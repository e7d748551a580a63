"""Shared set-up of the GPU test programs (run by scripts/device/python.sh under torchrun or
`ipcreduce launch`): the rank's GPU, NCCL beside ipcreduce, reports, CUDA-event timing."""

import faulthandler
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import ipcreduce

EPS = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


class Ctx:
    def __init__(self, nccl: bool = True):
        env = os.environ
        self.rank = int(env.get("RANK") or env["IPCREDUCE_RANK"])
        self.world = int(env.get("WORLD_SIZE") or env["IPCREDUCE_WORLD_SIZE"])
        local = int(env.get("LOCAL_RANK") or env.get("IPCREDUCE_LOCAL_RANK") or self.rank)
        self.gpus = torch.cuda.device_count()
        self.device = torch.device("cuda", local % self.gpus)
        torch.cuda.set_device(self.device)
        torch.zeros(1, device=self.device)  # the primary context, current on this thread
        # Ranks sharing a GPU (MPS dry run): NCCL must believe they sit on different hosts.
        self.shared_gpu = self.world > self.gpus
        if nccl:
            if self.shared_gpu:
                env["NCCL_HOSTID"] = f"ipcreduce-rank{self.rank}"
                env.setdefault("NCCL_SOCKET_IFNAME", "lo")
                env.setdefault("NCCL_IB_DISABLE", "1")
            dist.init_process_group("nccl", device_id=self.device)
        self.comm = ipcreduce.init(backend="cuda")
        assert self.comm.backend == "cuda", self.comm.backend
        assert (self.comm.rank, self.comm.world_size) == (self.rank, self.world)
        # Read now: a report may be written after the CUDA context broke (graph.py's last step).
        self.device_name = torch.cuda.get_device_name(self.device)
        self.out = env.get("IPCREDUCE_PY_OUT", ".")
        self.failures: list = []

    def log(self, *a) -> None:
        if self.rank == 0:
            print(*a, flush=True)

    def expect(self, ok: bool, what: str) -> bool:
        """Records a failed check (the program exits non-zero at the end) and goes on."""
        if not ok:
            self.failures.append(what)
            print(f"rank {self.rank}: FAIL {what}", flush=True)
        return ok

    def report(self, name: str, data: dict) -> None:
        data = dict(data, rank=self.rank, world=self.world, failures=self.failures,
                    device=self.device_name, torch=torch.__version__,
                    shared_gpu=self.shared_gpu, date=time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                    time.gmtime()))
        path = os.path.join(self.out, f"{name}-rank{self.rank}.json")
        with open(path, "w") as f:
            json.dump(data, f, indent=1)
        print(f"rank {self.rank}: {name}: {len(self.failures)} failed checks -> {path}",
              flush=True)

    def finish(self, destroy_nccl: bool = True) -> None:
        """Closes ipcreduce, then NCCL, and exits (non-zero after a failed check).
        `destroy_nccl=False` leaves NCCL's process group to the process's exit: after NCCL calls
        captured in CUDA graphs, torch 2.11's destroy_process_group did not return within 60 s
        (two ranks sharing one H200, NCCL over loopback sockets; stacks in the graph step's log
        of bench/results/2026-12-01-h200-mps-*), while ipcreduce had closed in 0.00 s."""
        # Teardown must not hang: if it is not over in 60 s, every thread's stack goes to the
        # log and the process exits (non-zero), which names the call that hung.
        faulthandler.dump_traceback_later(60, exit=True)
        t0 = time.monotonic()

        def step(what: str) -> None:
            print(f"rank {self.rank}: teardown: {what} after {time.monotonic() - t0:.2f} s",
                  flush=True)

        # ipcreduce first: its close is collective and bounded, and must not depend on NCCL's
        # teardown.
        try:
            self.comm.close()
        except ipcreduce.Error as e:  # a dead communicator cannot free collectively
            print(f"rank {self.rank}: close: {e}", flush=True)
            self.failures.append(f"close: {e}")
        step("ipcreduce closed")
        if dist.is_initialized():
            dist.barrier()
            step("NCCL barrier")
            if not destroy_nccl:
                # Nothing of NCCL's teardown runs: the process ends here, its reports written.
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(1 if self.failures else 0)
            dist.destroy_process_group()
            step("NCCL destroyed")
        faulthandler.cancel_dump_traceback_later()
        sys.exit(1 if self.failures else 0)


def time_us(fn, iters: int, warmup: int = 3) -> float:
    """Mean microseconds of `fn()` on the current stream, by CUDA events after warm-up."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / iters


def median(xs):
    s = sorted(xs)
    return s[len(s) // 2]
