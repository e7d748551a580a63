"""The Python package on the host backend with numpy arrays, run as every rank of a job:
`ipcreduce launch -n 4 -- python -m pytest -q python/tests`."""

import os
import subprocess
import sys
import time

import numpy as np
import pytest

import ipcreduce
from reference import check_close, digest_words, rank_input, reference

SIZES = [1, 1000, (1 << 16) + 7, 3 << 20]  # the last one is chunked through the workspace


def same_on_every_rank(comm, a: np.ndarray) -> bool:
    """Whether every rank holds these exact bytes (max and min of a digest agree)."""
    w = digest_words(a)
    hi, lo = w.copy(), w.copy()
    comm.all_reduce(hi, "max")
    comm.all_reduce(lo, "min")
    return bool(np.array_equal(hi, lo) and np.array_equal(hi, w))


def test_identity(comm):
    assert comm.rank == int(os.environ["IPCREDUCE_RANK"])
    assert comm.world_size == int(os.environ["IPCREDUCE_WORLD_SIZE"])
    assert comm.backend == "host"
    assert f"rank={comm.rank}" in repr(comm)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("n", SIZES)
def test_sum_in_place(comm, n, dtype):
    x = rank_input(comm.rank, n, dtype)
    assert comm.all_reduce(x) is x
    ref, mag = reference("sum", comm.world_size, n, dtype)
    check_close(x, ref, mag, comm.world_size, dtype)
    assert same_on_every_rank(comm, x)


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


# A rank that finds the difference raises MismatchError; a rank that learns it from a peer
# first raises AbortedError with the same cause in its message.
MISMATCH = (ipcreduce.MismatchError, ipcreduce.AbortedError)


def test_mismatch_raises_in_every_rank(comm):
    n = 1000 + (1 if comm.rank == comm.world_size - 1 else 0)
    with pytest.raises(MISMATCH, match="does not match|arguments differ") as e:
        comm.all_reduce(np.ones(n, np.float32))
    assert str(e.value).startswith(f"rank {comm.rank}:"), str(e.value)
    assert "1001" in str(e.value) and "1000" in str(e.value), str(e.value)
    # The communicator is dead afterwards, and says so.
    with pytest.raises(ipcreduce.Error):
        comm.all_reduce(np.ones(4, np.float32))


def test_mismatched_dtype_raises_in_every_rank(comm):
    dtype = np.float16 if comm.rank == 0 else np.float32
    with pytest.raises(MISMATCH, match="float") as e:
        comm.all_reduce(np.ones(256, dtype))
    assert "half" in str(e.value), str(e.value)


def test_absent_rank_times_out_naming_it():
    c = ipcreduce.init(backend="host", timeout=1.0)
    try:
        if c.rank == 0:
            # Never calls: the others must give up within the timeout and name rank 0.
            time.sleep(3.0)
            with pytest.raises(ipcreduce.Error):
                c.all_reduce(np.ones(4, np.float32))
        else:
            t0 = time.monotonic()
            with pytest.raises((ipcreduce.TimeoutError, ipcreduce.AbortedError,
                                ipcreduce.PeerLostError)) as e:
                c.all_reduce(np.ones(4, np.float32))
            assert time.monotonic() - t0 < 2.5
            assert "rank 0" in str(e.value), str(e.value)
    finally:
        c.close()


def test_calls_release_the_gil(comm):
    # Rank 0 comes late, so the others wait inside all_reduce; a Python thread must run
    # meanwhile (it could not if the call held the GIL).
    import threading

    ticks, stop = [0], threading.Event()

    def count():
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    if comm.rank == 0:
        time.sleep(0.5)
    t = threading.Thread(target=count)
    t.start()
    try:
        t0 = time.monotonic()
        comm.all_reduce(np.ones(8, np.float32))
        waited = time.monotonic() - t0
    finally:
        stop.set()
        t.join()
    if comm.rank != 0:
        assert waited > 0.3, waited
        assert ticks[0] > 20, (ticks[0], waited)


def test_abort_from_another_thread_stops_a_waiting_call():
    import threading

    c = ipcreduce.init(backend="host", timeout=5.0)
    try:
        if c.rank == 0:
            # Comes only after the others have aborted; must fail, not hang.
            time.sleep(1.0)
            with pytest.raises(ipcreduce.Error):
                c.all_reduce(np.ones(4, np.float32))
        else:
            timer = threading.Timer(0.3, c.abort, args=("stopped by a watchdog",))
            timer.start()
            t0 = time.monotonic()
            with pytest.raises(ipcreduce.AbortedError, match="stopped by a watchdog"):
                c.all_reduce(np.ones(4, np.float32))
            assert time.monotonic() - t0 < 2.0
            timer.join()
            with pytest.raises(ipcreduce.AbortedError):
                c.check()
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


def test_import_needs_neither_numpy_nor_torch():
    code = ("import sys, ipcreduce; "
            "assert 'numpy' not in sys.modules and 'torch' not in sys.modules, sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_registered_buffers_need_the_cuda_backend(comm):
    with pytest.raises(ipcreduce.InvalidArgumentError, match="cuda backend"):
        comm.alloc(4096)
