"""Errors carry, beside their message, the rank that raised them, their kind and the path of the
flight record that rank wrote (docs/tracing.md), so a handler need not parse the message."""

import json
import os

import numpy as np
import pytest

import ipcreduce


def test_a_mismatch_names_rank_kind_and_flight_record(comm):
    culprit = comm.world_size - 1
    n = 500 + (1 if comm.rank == culprit else 0)
    with pytest.raises((ipcreduce.MismatchError, ipcreduce.AbortedError)) as e:
        comm.all_reduce(np.ones(n, np.float32))
    err = e.value
    assert err.rank == comm.rank, str(err)
    want = "mismatch" if isinstance(err, ipcreduce.MismatchError) else "aborted"
    assert err.kind == want, (err.kind, str(err))
    path = err.flight_record
    assert path and f"(flight record: {path})" in str(err), str(err)
    assert os.path.basename(path).endswith(f"-rank{comm.rank}.jsonl"), path
    with open(path) as f:
        header = json.loads(f.readline())
        calls = [json.loads(line) for line in f if line.strip()]
    assert header["rank"] == comm.rank and header["world"] == comm.world_size, header
    assert calls[-1]["count"] == n and calls[-1]["state"] != "ok", calls[-1]
    # The next call is refused with the same file.
    with pytest.raises(ipcreduce.AbortedError) as later:
        comm.all_reduce(np.ones(4, np.float32))
    assert later.value.kind == "aborted" and later.value.rank == comm.rank
    assert later.value.flight_record == path


def test_a_local_argument_error_has_its_rank_and_kind(comm):
    with pytest.raises(ipcreduce.InvalidArgumentError) as e:
        comm.all_reduce(np.ones((2, 3), np.float32)[:, ::2])
    assert e.value.rank == comm.rank and e.value.kind == "invalid_argument", str(e.value)
    # Refused before any peer took part: no record was written.
    assert e.value.flight_record is None, str(e.value)
