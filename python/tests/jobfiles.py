"""A channel between the ranks of a test job that does not go through ipcreduce: files in a
directory of the job, one per rank and name. Tests use it to order ranks (a rank waits for
the others' marks instead of sleeping) and to compare results independently of the
communicator under test."""

import hashlib
import os
import time
from pathlib import Path

import numpy as np

# Bound on every wait for the other ranks' files: the slowest step between two marks is a
# test of the communicator's own 1-5 s timeouts, on a loaded 2-core machine.
WAIT_S = 60.0


class JobFiles:
    """The files of one test of one job: `<tmp>/ipcreduce-pytest-<job id>/<test>/<name>.<rank>`."""

    def __init__(self, test: str, rank: int, world: int):
        job = os.environ.get("IPCREDUCE_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID")
        if not job:
            raise RuntimeError("no IPCREDUCE_JOB_ID: run the tests as ranks of `ipcreduce launch`")
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in test)
        self.dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"ipcreduce-pytest-{job}" / safe
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank, self.world = rank, world

    def post(self, name: str, data: bytes = b"") -> None:
        """Publishes this rank's `name` (atomically: a reader sees all of it or nothing)."""
        tmp = self.dir / f".{name}.{self.rank}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, self.dir / f"{name}.{self.rank}")

    def wait(self, name: str, ranks=None, timeout: float = WAIT_S) -> dict:
        """The `name` files of `ranks` (default: every rank), once all exist; fails the test
        after `timeout` naming the ranks that never posted."""
        ranks = list(range(self.world)) if ranks is None else list(ranks)
        deadline = time.monotonic() + timeout
        while True:
            missing = [r for r in ranks if not (self.dir / f"{name}.{r}").exists()]
            if not missing:
                return {r: (self.dir / f"{name}.{r}").read_bytes() for r in ranks}
            if time.monotonic() > deadline:
                raise AssertionError(f"rank {self.rank}: ranks {missing} never posted {name!r} "
                                     f"in {self.dir} within {timeout} s")
            time.sleep(0.005)  # polling interval, not an ordering

    def barrier(self, name: str) -> None:
        self.post(name)
        self.wait(name)

    def same_on_every_rank(self, name: str, a: np.ndarray) -> None:
        """Asserts that every rank holds exactly these bytes (sha256 compared through files)."""
        mine = hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest().encode()
        self.post(name, mine)
        digests = self.wait(name)
        differ = [r for r, d in digests.items() if d != mine]
        assert not differ, f"rank {self.rank}: ranks {differ} hold other bytes than this rank"
