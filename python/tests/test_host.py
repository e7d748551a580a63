"""The Python package on the host backend with numpy arrays, run as every rank of a job:
`ipcreduce launch -n 4 -- python -m pytest -q python/tests`."""

import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

import ipcreduce
from reference import check_close, rank_input, reference

SIZES = [1, 1000, (1 << 16) + 7, 3 << 20]  # the last one is chunked through the workspace


def test_identity(comm):
    assert comm.rank == int(os.environ["IPCREDUCE_RANK"])
    assert comm.world_size == int(os.environ["IPCREDUCE_WORLD_SIZE"])
    assert comm.backend == "host"
    assert f"rank={comm.rank}" in repr(comm)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("n", SIZES)
def test_sum_in_place(comm, files, n, dtype):
    x = rank_input(comm.rank, n, dtype)
    assert comm.all_reduce(x) is x
    ref, mag = reference("sum", comm.world_size, n, dtype)
    check_close(x, ref, mag, comm.world_size, dtype)
    # Bitwise the same everywhere, compared through files rather than through ipcreduce.
    files.same_on_every_rank("result", x)


@pytest.mark.parametrize("op", ["max", "min"])
def test_max_min_exact(comm, op):
    n = 5000
    x = rank_input(comm.rank, n, np.float32)
    comm.all_reduce(x, op=op)
    ref, _ = reference(op, comm.world_size, n, np.float32)
    np.testing.assert_array_equal(x, ref.astype(np.float32))


def test_out_of_place_leaves_the_input(comm):
    n = 4099
    x = rank_input(comm.rank, n, np.float32)
    before = x.copy()
    out = np.full(n, np.nan, np.float32)
    assert comm.all_reduce(x, out=out) is out
    np.testing.assert_array_equal(x, before)
    ref, mag = reference("sum", comm.world_size, n, np.float32)
    check_close(out, ref, mag, comm.world_size, np.float32)


def test_two_dimensional_and_memoryview(comm):
    x = rank_input(comm.rank, 600, np.float32).reshape(20, 30)
    comm.all_reduce(memoryview(x))
    ref, mag = reference("sum", comm.world_size, 600, np.float32)
    check_close(x.ravel(), ref, mag, comm.world_size, np.float32)


def test_many_small_calls_stay_in_step(comm):
    # Every result checked: a stale slot or a skipped handoff would show as a wrong sum.
    for step in range(200):
        x = np.full(17, comm.rank + step, np.float32)
        comm.all_reduce(x)
        want = sum(r + step for r in range(comm.world_size))
        assert (x == want).all(), (step, x[:3], want)


def test_empty_arrays_on_every_rank_keep_the_ranks_in_step(comm):
    # Count 0 on every rank, in place and out of place: nothing to reduce, and the next call
    # still meets the same call of every peer (each rank's value differs, so a call paired
    # with another would show as a wrong sum).
    empty = np.zeros(0, np.float32)
    assert comm.all_reduce(empty) is empty
    out = np.zeros(0, np.float32)
    assert comm.all_reduce(empty, out=out) is out
    for step in range(3):
        x = np.full(5, 10.0 * step + comm.rank, np.float32)
        comm.all_reduce(x)
        want = sum(10.0 * step + r for r in range(comm.world_size))
        assert (x == want).all(), (step, x, want)


@pytest.mark.parametrize("bad, why", [
    (lambda: np.zeros(8, np.float64), "is not reduced"),
    (lambda: np.zeros(8, np.int32), "is not reduced"),
    (lambda: np.zeros((8, 8), np.float32)[:, ::2], "not C-contiguous"),
    (lambda: b"12345678", "is not reduced"),
    (lambda: [1.0, 2.0], "does not export a buffer"),
])
def test_bad_arrays_raise_and_leave_the_communicator_usable(comm, bad, why):
    with pytest.raises(ipcreduce.InvalidArgumentError, match=why) as e:
        comm.all_reduce(bad())
    assert f"rank {comm.rank}" in str(e.value)
    x = np.ones(10, np.float32)
    comm.all_reduce(x)
    assert (x == comm.world_size).all()


def test_bad_op_and_out(comm):
    x = np.ones(4, np.float32)
    with pytest.raises(ipcreduce.InvalidArgumentError, match="unknown reduction"):
        comm.all_reduce(x, op="prod")
    with pytest.raises(ipcreduce.InvalidArgumentError, match="out has 5"):
        comm.all_reduce(x, out=np.ones(5, np.float32))
    ro = np.ones(4, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ipcreduce.InvalidArgumentError, match="read-only"):
        comm.all_reduce(x, out=ro)
    with pytest.raises(ipcreduce.InvalidArgumentError, match="read-only"):
        comm.all_reduce(ro)
    assert isinstance(ipcreduce.InvalidArgumentError("x"), ipcreduce.Error)


# The rank that finds a difference raises MismatchError naming the peer it compared with; a
# rank that learns it from a peer first raises AbortedError naming both ranks of the pair.
MISMATCH = (ipcreduce.MismatchError, ipcreduce.AbortedError)
PAIR = re.compile(r"arguments differ between ranks (\d+) and (\d+)")
PEER = re.compile(r"does not match peer rank (\d+)")


def test_mismatch_raises_in_every_rank(comm):
    culprit = comm.world_size - 1
    n = 1000 + (1 if comm.rank == culprit else 0)
    with pytest.raises(MISMATCH) as e:
        comm.all_reduce(np.ones(n, np.float32))
    msg = str(e.value)
    assert msg.startswith(f"rank {comm.rank}:"), msg
    assert "all_reduce" in msg, msg
    if comm.rank == culprit:
        mine, theirs = 1001, 1000
    else:
        mine, theirs = 1000, 1001
    if isinstance(e.value, ipcreduce.MismatchError):
        peer = int(PEER.search(msg).group(1))
        assert peer != comm.rank and (comm.rank == culprit or peer == culprit), msg
        assert f"count {mine} vs {theirs}" in msg, msg
    else:
        pair = PAIR.search(msg)
        assert pair, msg
        assert culprit in {int(pair.group(1)), int(pair.group(2))}, msg
        assert "count 1001 vs 1000" in msg or "count 1000 vs 1001" in msg, msg
    # The communicator is dead afterwards, and says why: the mismatch, with both counts.
    with pytest.raises(ipcreduce.AbortedError) as after:
        comm.all_reduce(np.ones(4, np.float32))
    msg = str(after.value)
    assert msg.startswith(f"rank {comm.rank}: communicator is aborted"), msg
    assert PAIR.search(msg) and "1001" in msg and "1000" in msg, msg


def test_mismatched_dtype_raises_in_every_rank(comm):
    dtype = np.float16 if comm.rank == 0 else np.float32
    with pytest.raises(MISMATCH) as e:
        comm.all_reduce(np.ones(256, dtype))
    msg = str(e.value)
    assert msg.startswith(f"rank {comm.rank}:"), msg
    assert "dtype half vs float" in msg or "dtype float vs half" in msg, msg
    if isinstance(e.value, ipcreduce.MismatchError):
        # Each rank names the dtype it has first; rank 0 is the one that differs from all.
        want = "dtype half vs float" if comm.rank == 0 else "dtype float vs half"
        assert want in msg, msg
        peer = int(PEER.search(msg).group(1))
        assert (peer != 0) if comm.rank == 0 else (peer == 0), msg
    else:
        pair = PAIR.search(msg)
        assert pair and 0 in {int(pair.group(1)), int(pair.group(2))}, msg


TIMED_OUT = re.compile(r"timed out (after [0-9.]+m?s )?(in all_reduce #\d+ )?waiting for "
                       r"(peer )?rank 0")


def test_absent_rank_times_out_naming_it(files):
    timeout = 1.0
    c = ipcreduce.init(backend="host", timeout=timeout)
    try:
        if c.rank == 0:
            # Calls only once every other rank has given up on it: that call must fail with
            # the others' timeout (learnt from them), or time out itself, never pair up.
            files.wait("timed-out", range(1, c.world_size))
            with pytest.raises((ipcreduce.AbortedError, ipcreduce.TimeoutError)) as e:
                c.all_reduce(np.ones(4, np.float32))
            msg = str(e.value)
            assert msg.startswith("rank 0:") and "timed out" in msg, msg
        else:
            t0 = time.monotonic()
            with pytest.raises((ipcreduce.TimeoutError, ipcreduce.AbortedError)) as e:
                c.all_reduce(np.ones(4, np.float32))
            waited = time.monotonic() - t0
            files.post("timed-out")
            msg = str(e.value)
            assert msg.startswith(f"rank {c.rank}:"), msg
            assert TIMED_OUT.search(msg), msg
            if isinstance(e.value, ipcreduce.TimeoutError):
                # Its own timer: not before the timeout, and not long after it.
                assert timeout * 0.95 <= waited < timeout + 1.5, waited
            else:
                # Another rank's timeout reached this one: it too waited about that long.
                assert waited < timeout + 1.5, waited
    finally:
        c.close()


PEER_DIES = """
import json, os, sys, time
import numpy as np
import ipcreduce
rank, job = int(sys.argv[1]), sys.argv[2]
c = ipcreduce.init(backend="host", rank=rank, world_size=2, job_id=job, timeout=5.0)
x = np.ones(4, np.float32)
c.all_reduce(x)
assert (x == 2).all(), x
if rank == 1:
    os._exit(7)  # dies without leaving: no close, no goodbye
t0 = time.monotonic()
try:
    c.all_reduce(np.ones(4, np.float32))
    out = dict(kind=None)
except ipcreduce.Error as e:
    out = dict(kind=type(e).__name__, msg=str(e))
out["waited"] = time.monotonic() - t0
print(json.dumps(out))
"""


def test_a_dead_peer_is_named_before_the_timeout(comm, tmp_path):
    # A job of two processes of this rank's own (its job id keyed by this rank): rank 1 exits
    # after one call, rank 0's next call must fail naming it, through the closed connection,
    # long before its 5 s timeout.
    script = tmp_path / "peer_dies.py"
    script.write_text(PEER_DIES)
    env = {k: v for k, v in os.environ.items() if not k.startswith("IPCREDUCE_")}
    job = f"{os.environ['IPCREDUCE_JOB_ID']}-dies-{comm.rank}"
    procs = [subprocess.Popen([sys.executable, str(script), str(r), job], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    outs = [p.communicate(timeout=60) for p in procs]
    assert procs[1].returncode == 7, outs[1]
    assert procs[0].returncode == 0, outs[0]
    got = json.loads(outs[0][0].strip().splitlines()[-1])
    assert got["kind"] in ("PeerLostError", "AbortedError"), got
    assert got["msg"].startswith("rank 0:") and "rank 1 died" in got["msg"], got
    assert got["waited"] < 2.5, got


def test_calls_release_the_gil(comm, files):
    # The other ranks wait inside all_reduce until rank 0 comes, and rank 0 comes only once
    # each of them has seen a Python thread run meanwhile (it could not if the call held the
    # GIL: rank 0 would give up waiting and the others time out).
    import threading

    in_call, stop = threading.Event(), threading.Event()

    def count():
        in_call.wait()
        ticks = 0
        while not stop.is_set():
            ticks += 1
            if ticks == 20:
                files.post("ticked")
            time.sleep(0.001)

    if comm.rank == 0:
        files.wait("ticked", range(1, comm.world_size), timeout=5.0)
        x = np.ones(8, np.float32)
        comm.all_reduce(x)
        assert (x == comm.world_size).all()
        return
    t = threading.Thread(target=count)
    t.start()
    try:
        in_call.set()
        x = np.ones(8, np.float32)
        comm.all_reduce(x)
    finally:
        stop.set()
        t.join()
    assert (x == comm.world_size).all()


def test_abort_from_another_thread_stops_a_waiting_call(files):
    import threading

    timeout = 5.0
    c = ipcreduce.init(backend="host", timeout=timeout)
    try:
        if c.rank == 0:
            # Comes only after the others have aborted: must fail, with the watchdog's reason
            # (learnt from them) or its own timeout, not hang and not pair up.
            files.wait("aborted", range(1, c.world_size))
            t0 = time.monotonic()
            with pytest.raises((ipcreduce.AbortedError, ipcreduce.TimeoutError)) as e:
                c.all_reduce(np.ones(4, np.float32))
            msg = str(e.value)
            assert msg.startswith("rank 0:"), msg
            if isinstance(e.value, ipcreduce.AbortedError):
                assert "stopped by a watchdog" in msg, msg
            else:
                assert "timed out" in msg and time.monotonic() - t0 < timeout + 1.5, msg
        else:
            # A watchdog: the abort stops the call whether it comes before or during it.
            timer = threading.Timer(0.3, c.abort, args=("stopped by a watchdog",))
            timer.start()
            t0 = time.monotonic()
            with pytest.raises(ipcreduce.AbortedError, match="stopped by a watchdog"):
                c.all_reduce(np.ones(4, np.float32))
            assert time.monotonic() - t0 < 2.0
            timer.join()
            files.post("aborted")
            with pytest.raises(ipcreduce.AbortedError, match="stopped by a watchdog") as e:
                c.check()
            assert str(e.value).startswith(f"rank {c.rank}:"), str(e.value)
    finally:
        c.close()


def test_explicit_rank_and_world_size():
    rank, world = int(os.environ["IPCREDUCE_RANK"]), int(os.environ["IPCREDUCE_WORLD_SIZE"])
    with ipcreduce.init(backend="host", rank=rank, world_size=world) as c:
        assert (c.rank, c.world_size) == (rank, world)
        x = np.full(3, 2.0, np.float32)
        c.all_reduce(x)
        assert (x == 2.0 * world).all()


def test_bad_configuration_raises():
    with pytest.raises(ipcreduce.InvalidArgumentError, match="unknown backend"):
        ipcreduce.init(backend="tpu")
    with pytest.raises(ipcreduce.ConfigError, match="together"):
        ipcreduce.init(backend="host", rank=0)
    with pytest.raises(ipcreduce.InvalidArgumentError, match="timeout"):
        ipcreduce.init(backend="host", timeout=-1)


def test_import_needs_neither_numpy_nor_torch(tmp_path):
    # Stand-ins that refuse to be imported, ahead of the real ones on the path: importing the
    # package must not even try (whether or not numpy and torch are installed).
    for name in ("numpy", "torch"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(
            f"raise ImportError('ipcreduce imported {name}')\n")
    code = ("import sys, ipcreduce; "
            "assert 'numpy' not in sys.modules and 'torch' not in sys.modules, sys.modules; "
            "print(ipcreduce.__version__)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tmp_path)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == ipcreduce.__version__
    # The stand-ins are what `import torch` finds there.
    probe = subprocess.run([sys.executable, "-c", "import torch"], env=env, capture_output=True,
                           text=True)
    assert "ipcreduce imported torch" in probe.stderr, probe.stderr


def _driver_present() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def test_cuda_backend_unavailable_without_a_driver():
    if _driver_present():
        pytest.skip("a CUDA driver is installed here: this test is for machines without one")
    with pytest.raises(ipcreduce.UnavailableError) as e:
        ipcreduce.init(backend="cuda")
    # The library's reason, as it words it.
    assert str(e.value) == "CUDA backend unavailable: libcuda.so not found (no NVIDIA driver)", \
        str(e.value)
    assert isinstance(e.value, ipcreduce.Error)
    # The job goes on: this rank's host communicator still meets its peers.
    with ipcreduce.init(backend="host") as c:
        x = np.ones(4, np.float32)
        c.all_reduce(x)
        assert (x == c.world_size).all()


def test_fabric_and_registration_of_the_host_backend(comm):
    assert comm.fabric == "peer", comm.fabric  # shared memory: the library's "peer"
    assert comm.can_register is False  # registration is the cuda backend's


def test_registered_buffers_need_the_cuda_backend(comm):
    with pytest.raises(ipcreduce.InvalidArgumentError, match="cuda backend"):
        comm.alloc(4096)


def _traced_counts(path):
    """(header, the counts of the calls) of a trace file."""
    with open(path) as f:
        lines = f.read().splitlines()
    return json.loads(lines[0]), [json.loads(line)["count"] for line in lines[1:]]


def test_trace_writes_the_calls_made_inside_the_block(comm, tmp_path):
    # Counts this test chooses, so each call is known by its count in the file.
    comm.all_reduce(np.ones(10, np.float32))  # before the block: left out
    with ipcreduce.trace(tmp_path / "block", comm) as t:
        for n in (11, 12, 13):
            comm.all_reduce(np.ones(n, np.float32))
    comm.all_reduce(np.ones(14, np.float32))  # after it: left out
    job = os.environ["IPCREDUCE_JOB_ID"]
    want = str(tmp_path / "block" / f"ipcreduce-trace-{job}-rank{comm.rank}.jsonl")
    assert t.files == [want]
    header, counts = _traced_counts(want)
    assert (header["rank"], header["world"], header["written"]) == (comm.rank, comm.world_size,
                                                                    "trace")
    assert counts == [11, 12, 13]

    # A block that ends by an exception is written too; the method form of the same.
    with pytest.raises(ZeroDivisionError):
        with comm.trace(tmp_path / "raised") as t:
            comm.all_reduce(np.ones(15, np.float32))
            1 / 0
    assert _traced_counts(t.files[0])[1] == [15]

    # Without a communicator: every open one (the earlier tests' are closed and left out).
    with ipcreduce.trace(tmp_path / "every") as t:
        comm.all_reduce(np.ones(16, np.float32))
    assert [_traced_counts(f)[1] for f in t.files] == [[16]]

    # Every call the ring holds, through the plain method.
    _, counts = _traced_counts(comm.write_trace(tmp_path / "all"))
    assert counts == [10, 11, 12, 13, 14, 15, 16]
