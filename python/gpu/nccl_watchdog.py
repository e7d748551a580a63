"""A rank killed inside an accelerated all-reduce, through NCCL's C API (ctypes; PyTorch only
for device memory and streams), with libipcreduce_nccl.so preloaded: the survivor's
ncclCommGetAsyncError must report an error (ncclRemoteError or ncclSystemError) within a
bound, ncclGetLastError must name the dead rank, and ncclCommAbort must return, never hang.

Run (scripts/device/nccl-dropin.sh does): two processes, RANK=0 and RANK=1, the same
WATCHDOG_DIR, each its own NCCL_HOSTID when they share a GPU, LD_PRELOAD=libipcreduce_nccl.so.
Rank 1 enqueues a long sleep kernel and the all-reduce behind it on its stream, then kills
itself (SIGKILL) once rank 0 is inside its own all-reduce. Rank 0 prints one PASS or FAIL line
and writes watchdog.json into WATCHDOG_DIR."""

import ctypes
import faulthandler
import json
import os
import signal
import sys
import threading
import time

import torch  # loads its libnccl.so.2, which the preloaded library forwards to

faulthandler.dump_traceback_later(120, exit=True)  # a hang names itself
rank = int(os.environ["RANK"])
work = os.environ["WATCHDOG_DIR"]
BOUND_S = float(os.environ.get("WATCHDOG_BOUND_S", "10"))
os.makedirs(work, exist_ok=True)
torch.cuda.set_device(0 if torch.cuda.device_count() == 1 else rank)
nccl = ctypes.CDLL(None)  # the process's first definition of each name: the preload's


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


for name, res, args in [
    ("ncclGetUniqueId", ctypes.c_int, [ctypes.POINTER(UniqueId)]),
    ("ncclCommInitRank", ctypes.c_int, [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, UniqueId, ctypes.c_int]),
    ("ncclAllReduce", ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                      ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]),
    ("ncclCommGetAsyncError", ctypes.c_int, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]),
    ("ncclGetLastError", ctypes.c_char_p, [ctypes.c_void_p]),
    ("ncclCommAbort", ctypes.c_int, [ctypes.c_void_p]),
]:
    f = getattr(nccl, name)
    f.restype, f.argtypes = res, args
FLOAT32, SUM = 7, 0  # nccl.h
REMOTE_ERROR, SYSTEM_ERROR = 6, 2


def wait_file(path: str, bound: float) -> bytes:
    t0 = time.monotonic()
    while not os.path.exists(path):
        if time.monotonic() - t0 > bound:
            raise SystemExit(f"rank {rank}: FAIL: {path} not written within {bound} s")
        time.sleep(0.005)
    return open(path, "rb").read()


def put_file(path: str, data: bytes) -> None:
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.rename(path + ".tmp", path)


# The CUDA context (PyTorch's, the device's primary one) and the buffers first, as a framework
# would have them before it makes a communicator.
N = 1 << 16
x = torch.ones(N, device="cuda", dtype=torch.float32)
stream = torch.cuda.Stream()
sp = ctypes.c_void_p(stream.cuda_stream)
torch.cuda.synchronize()

uid = UniqueId()
if rank == 0:
    assert nccl.ncclGetUniqueId(ctypes.byref(uid)) == 0
    # All 128 bytes (uid.internal, a c_char array, would stop at the first NUL).
    put_file(f"{work}/uid", ctypes.string_at(ctypes.byref(uid), 128))
else:
    raw = wait_file(f"{work}/uid", 60)
    if len(raw) != 128:
        raise SystemExit(f"rank 1: FAIL: the unique id file holds {len(raw)} bytes, not 128")
    ctypes.memmove(ctypes.byref(uid), raw, 128)
comm = ctypes.c_void_p()
r = nccl.ncclCommInitRank(ctypes.byref(comm), 2, uid, rank)
if r != 0:
    raise SystemExit(f"rank {rank}: FAIL: ncclCommInitRank returned {r}")

# One call that completes: the communicator works (and, in log mode, says which path).
r = nccl.ncclAllReduce(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(x.data_ptr()), N, FLOAT32, SUM, comm, sp)
stream.synchronize()
if r != 0 or not bool((x == 2).all()):
    raise SystemExit(f"rank {rank}: FAIL: the first all-reduce returned {r}, x[0]={x[0].item()}")

if rank == 1:
    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(30e9))  # far longer than the test: the all-reduce stays pending
    nccl.ncclAllReduce(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(x.data_ptr()), N, FLOAT32, SUM, comm, sp)
    wait_file(f"{work}/inside0", 60)
    put_file(f"{work}/killed", repr(time.time()).encode())
    os.kill(os.getpid(), signal.SIGKILL)

# Rank 0: inside the all-reduce (its kernel waits for rank 1), then the watchdog's poll.
r = nccl.ncclAllReduce(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(x.data_ptr()), N, FLOAT32, SUM, comm, sp)
result = {"rank": 0, "enqueue": r, "bound_s": BOUND_S}
put_file(f"{work}/inside0", b"1")
killed_at = float(wait_file(f"{work}/killed", 60))
err = ctypes.c_int(0)
t0 = time.monotonic()
while True:
    q = nccl.ncclCommGetAsyncError(comm, ctypes.byref(err))
    if q != 0 or err.value not in (0, 7):  # 7: ncclInProgress
        break
    if time.monotonic() - t0 > BOUND_S:
        break
    time.sleep(0.002)
seen_after_kill = time.time() - killed_at
msg = (nccl.ncclGetLastError(comm) or b"").decode(errors="replace")
# NCCL's own side may notice the lost socket first, with its own words: ours (which names the
# rank) must follow within 2 s.
t2 = time.monotonic()
while "rank 1" not in msg and time.monotonic() - t2 < 2:
    time.sleep(0.01)
    nccl.ncclCommGetAsyncError(comm, ctypes.byref(ctypes.c_int(0)))
    msg = (nccl.ncclGetLastError(comm) or b"").decode(errors="replace")
result.update(query=q, async_error=err.value, seconds_after_kill=round(seen_after_kill, 4), last_error=msg)
# The kernel left on this rank's stream must end too (it polls the abort flag).
t1 = time.monotonic()
while not stream.query() and time.monotonic() - t1 < BOUND_S:
    time.sleep(0.005)
result["stream_done"] = stream.query()
# ncclCommAbort must return (bounded here by a thread join).
aborted = {}
th = threading.Thread(target=lambda: aborted.setdefault("r", nccl.ncclCommAbort(comm)), daemon=True)
th.start()
th.join(30)
result["abort"] = aborted.get("r", "hung")
problems = []
if q != 0:
    problems.append(f"ncclCommGetAsyncError itself returned {q}")
if err.value not in (REMOTE_ERROR, SYSTEM_ERROR):
    problems.append(f"async error {err.value} within {BOUND_S} s (want {REMOTE_ERROR} or {SYSTEM_ERROR})")
if seen_after_kill > BOUND_S:
    problems.append(f"seen {seen_after_kill:.2f} s after the kill (bound {BOUND_S} s)")
if "rank 1" not in msg:
    problems.append(f"ncclGetLastError does not name rank 1: {msg!r}")
if not result["stream_done"]:
    problems.append("the survivor's kernel still runs")
if result["abort"] == "hung":
    problems.append("ncclCommAbort did not return within 30 s")
result["problems"] = problems
json.dump(result, open(f"{work}/watchdog.json", "w"), indent=1)
if problems:
    print(f"rank 0: FAIL watchdog: {problems}", flush=True)
else:
    print(f"rank 0: PASS watchdog: error {err.value} {seen_after_kill * 1000:.0f} ms after rank 1 was "
          f"killed inside the all-reduce; ncclGetLastError: {msg}", flush=True)
sys.stdout.flush()
os._exit(1 if problems else 0)
