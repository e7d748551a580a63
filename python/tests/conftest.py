"""Shared fixtures. Every rank of `ipcreduce launch -n N -- python -m pytest` runs the same tests
in the same order, so each test's collectives meet their peers'.

IPCREDUCE_REQUIRE_TORCH=1 (CI sets it) makes the torch tests fail where torch is missing
instead of skipping, and fails the run if any of them is skipped all the same."""

import os

import pytest

import ipcreduce
from jobfiles import JobFiles

TORCH_TESTS = ("test_torch_cpu.py", "test_fused_cpu.py")


def launched() -> bool:
    return bool(os.environ.get("IPCREDUCE_RANK") or os.environ.get("RANK"))


def torch_required() -> bool:
    return os.environ.get("IPCREDUCE_REQUIRE_TORCH") == "1"


def rank_and_world():
    if not launched():
        pytest.fail("run these tests as ranks: ipcreduce launch -n 4 -- python -m pytest ...")
    return int(os.environ["IPCREDUCE_RANK"]), int(os.environ["IPCREDUCE_WORLD_SIZE"])


@pytest.fixture(scope="session", autouse=True)
def ranks_collected():
    """Every rank has collected (imported torch and the rest) before the first communicator:
    those imports can take longer on a loaded machine than the rendezvous's timeout."""
    rank, world = rank_and_world()
    JobFiles("session", rank, world).barrier("collected")


@pytest.fixture
def files(request):
    """This test's channel between the ranks that bypasses ipcreduce (jobfiles.JobFiles)."""
    rank, world = rank_and_world()
    return JobFiles(request.node.nodeid.split("/")[-1], rank, world)


@pytest.fixture(autouse=True)
def ranks_aligned(files):
    """Every test starts on every rank at once. The ranks' local work between two collectives
    (torch's first compile, DDP's set-up and teardown) can take longer on a loaded machine than
    the timeout of the next rendezvous; only the calls under test should be timed."""
    files.barrier("start")


@pytest.fixture
def comm(files):
    """A fresh host-backend communicator per test: a test that kills one (mismatch, timeout)
    leaves the next a working one. Every rank closes it at once (see ranks_aligned)."""
    c = ipcreduce.init(backend="host")
    yield c
    files.barrier("close")
    c.close()


_torch_skips = []


def _note_skip(report) -> None:
    if report.skipped and any(name in report.nodeid for name in TORCH_TESTS):
        _torch_skips.append(report.nodeid)


def pytest_collectreport(report):
    _note_skip(report)


def pytest_runtest_logreport(report):
    _note_skip(report)


def pytest_sessionfinish(session, exitstatus):
    if torch_required() and _torch_skips and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    if torch_required() and _torch_skips:
        terminalreporter.write_line(
            f"IPCREDUCE_REQUIRE_TORCH=1 and {len(_torch_skips)} torch test(s) skipped: "
            + ", ".join(_torch_skips), red=True)
