"""Shared fixtures. Every rank of `ipcreduce launch -n N -- python -m pytest` runs the same tests
in the same order, so each test's collectives meet their peers'."""

import os

import pytest

import ipcreduce


def launched() -> bool:
    return bool(os.environ.get("IPCREDUCE_RANK") or os.environ.get("RANK"))


@pytest.fixture
def comm():
    """A fresh host-backend communicator per test: a test that kills one (mismatch, timeout)
    leaves the next a working one."""
    if not launched():
        pytest.fail("run these tests as ranks: ipcreduce launch -n 4 -- python -m pytest ...")
    c = ipcreduce.init(backend="host")
    yield c
    c.close()
