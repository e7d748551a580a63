"""A killed rank: the victim (VICTIM, default rank 1) SIGKILLs itself between two all-reduces;
every other rank must raise an ipcreduce error naming it within 2 s of the kill.
Run with `ipcreduce launch -n 2 -- python3 kill.py` (torchrun would tear the survivors down
before they report). Writes kill-rank<r>.json into IPCREDUCE_PY_OUT."""

import os
import signal
import time

import torch

import ipcreduce
from common import Ctx

VICTIM = int(os.environ.get("VICTIM", "1"))
ctx = Ctx(nccl=False)
comm, rank, dev = ctx.comm, ctx.rank, ctx.device
stamp = os.path.join(ctx.out, f"kill-{VICTIM}.time")
x = torch.ones(1 << 16, device=dev, dtype=torch.bfloat16)
calls = 0
error, raised_at = None, None
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    if rank == VICTIM and calls == 200:
        with open(stamp + ".tmp", "w") as f:
            f.write(repr(time.time()))
        os.rename(stamp + ".tmp", stamp)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        x.fill_(1.0)
        comm.all_reduce(x)
        torch.cuda.synchronize()
        comm.check()
        if calls < 200 and not bool((x == ctx.world).all()):
            ctx.expect(False, f"call {calls}: wrong sum before the kill")
    except ipcreduce.Error as e:
        raised_at = time.time()
        error = f"{type(e).__name__}: {e}"
        break
    calls += 1

result = dict(victim=VICTIM, calls=calls, error=error)
if ctx.expect(error is not None, "no error within 60 s of calls"):
    for _ in range(100):  # the victim wrote its stamp just before dying
        if os.path.exists(stamp):
            break
        time.sleep(0.01)
    killed_at = float(open(stamp).read())
    result["seconds_after_kill"] = raised_at - killed_at
    ctx.expect(result["seconds_after_kill"] < 2.0,
               f"raised {result['seconds_after_kill']:.2f} s after the kill")
    # The message starts with our own rank; the victim must be named after that.
    ctx.expect(f"rank {VICTIM}" in error.split(f"rank {rank}:", 1)[-1],
               f"the error does not name rank {VICTIM}: {error}")
    print(f"rank {rank}: raised {result['seconds_after_kill'] * 1000:.0f} ms after rank "
          f"{VICTIM} was killed: {error}", flush=True)
ctx.report(f"kill-victim{VICTIM}", result)
# No collective goodbye: the peer is dead. Leave at once.
os._exit(1 if ctx.failures else 0)
