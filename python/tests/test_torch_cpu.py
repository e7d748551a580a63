"""The torch layer on CPU tensors (host backend): the tensor path, the custom ops with their
fake implementations under torch.compile, the DDP hook against DDP's own all-reduce (gloo) and
called directly, and HookState. Skipped where torch is not installed, unless
IPCREDUCE_REQUIRE_TORCH=1 (CI): then a missing torch fails. Every rank runs these in the same
order."""

import datetime
import logging
import os

import numpy as np
import pytest

if os.environ.get("IPCREDUCE_REQUIRE_TORCH") == "1":
    import torch
else:
    torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
# Imported now, at collection, rather than lazily inside a test (the first custom-op call
# imports dynamo, DDP the distributed tensors): on a loaded machine these imports can outlast
# the timeout that the other ranks wait for this one with.
import torch._dynamo  # noqa: E402,F401
import torch.distributed.tensor  # noqa: E402,F401
import torch.nn as nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import ipcreduce  # noqa: E402
import ipcreduce.torch as itorch  # noqa: E402
from reference import check_close, rank_input, reference  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cpu_tensors(comm, dtype):
    n = 10_001
    x = torch.from_numpy(rank_input(comm.rank, n, np.float32)).to(dtype)
    xs = [torch.from_numpy(rank_input(r, n, np.float32)).to(dtype).double()
          for r in range(comm.world_size)]
    ref = sum(xs)
    mag = sum(t.abs() for t in xs)
    out = torch.empty_like(x)
    comm.all_reduce(x, out=out)
    eps = torch.finfo(dtype).eps
    tol = eps * ref.abs() + comm.world_size * torch.finfo(torch.float32).eps * mag
    assert bool(((out.double() - ref).abs() <= tol).all())
    y = x.clone()
    assert comm.all_reduce(y) is y
    assert torch.equal(y, out)


def test_float32_matches_numpy_path(comm):
    n = 3000
    ref, mag = reference("sum", comm.world_size, n, np.float32)
    t = torch.from_numpy(rank_input(comm.rank, n, np.float32))
    comm.all_reduce(t)
    check_close(t.numpy(), ref, mag, comm.world_size, np.float32)


def test_bad_tensors(comm):
    with pytest.raises(ipcreduce.InvalidArgumentError, match="float64 is not reduced"):
        comm.all_reduce(torch.ones(4, dtype=torch.float64))
    with pytest.raises(ipcreduce.InvalidArgumentError, match="contiguous"):
        comm.all_reduce(torch.ones(4, 4)[:, ::2])
    with pytest.raises(ipcreduce.InvalidArgumentError, match="out is not"):
        comm.all_reduce(torch.ones(4), out=np.ones(4, np.float32))
    x = torch.ones(4)
    comm.all_reduce(x)
    assert bool((x == comm.world_size).all())


def test_custom_ops(comm):
    x = torch.full((64,), float(comm.rank + 1))
    want = float(sum(r + 1 for r in range(comm.world_size)))
    y = itorch.all_reduce(x, comm)
    assert bool((y == want).all()) and bool((x == comm.rank + 1).all())
    assert itorch.all_reduce_(x, comm) is x
    assert bool((x == want).all())
    # The schemas torch.compile and CUDA graphs see.
    assert "ipcreduce::all_reduce" in str(torch.ops.ipcreduce.all_reduce.default._schema)
    assert "!) x" in str(torch.ops.ipcreduce.all_reduce_inplace.default._schema)


def test_custom_ops_fake_tensors(comm):
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x = torch.empty(8, 16, dtype=torch.bfloat16)
        y = itorch.all_reduce(x, comm)
        assert y.shape == x.shape and y.dtype == x.dtype
        itorch.all_reduce_(x, comm)


@pytest.mark.parametrize("inplace", [False, True])
def test_torch_compile_fullgraph(comm, inplace):
    def f(a):
        b = a * 2.0
        if inplace:
            itorch.all_reduce_(b, comm)
            return b + 1.0
        return itorch.all_reduce(b, comm) + 1.0

    x = torch.arange(32, dtype=torch.float32) + comm.rank
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = compiled(x)
    # The closed form 2 * sum_r (arange(32) + r) + 1, exact in float32 (small integers).
    w = comm.world_size
    want = 2.0 * (w * torch.arange(32, dtype=torch.float64) + w * (w - 1) / 2) + 1.0
    assert got.dtype == torch.float32 and torch.equal(got.double(), want), (got, want)
    if inplace:
        assert torch.equal(x, torch.arange(32, dtype=torch.float32) + comm.rank)


def _gloo(tag: str):
    path = f"/tmp/ipcreduce-pytest-{os.environ['IPCREDUCE_JOB_ID']}-{tag}"
    rank, world = int(os.environ["IPCREDUCE_RANK"]), int(os.environ["IPCREDUCE_WORLD_SIZE"])
    # Bounded like every other wait of these tests (gloo's default is 30 minutes).
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))


def test_ddp_hook_averages_like_ddp(comm, files):
    _gloo("ddp")
    try:
        def model():
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))

        ref_ddp = DDP(model(), bucket_cap_mb=0.01)  # several buckets
        ours = DDP(model(), bucket_cap_mb=0.01)
        ours.register_comm_hook(comm, itorch.hook)
        g = torch.Generator().manual_seed(comm.rank)
        x = torch.randn(32, 64, generator=g)
        for m in (ref_ddp, ours):
            m(x).pow(2).sum().backward()
        for (name, p), q in zip(ref_ddp.named_parameters(), ours.parameters()):
            assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6), name
        # The gradients are averages: every rank holds the same bits (compared through files,
        # not through the communicator under test; nor through gloo: a gloo collective on
        # Python-owned tensors can leave its work object to a worker thread that then needs
        # the GIL while DDP's teardown, holding it, joins that thread).
        for name, q in ours.named_parameters():
            files.same_on_every_rank(f"grad-{name}", q.grad.numpy())
    finally:
        dist.destroy_process_group()


class FakeBucket:
    """The part of dist.GradBucket the hook uses."""

    def __init__(self, index: int, t: torch.Tensor):
        self._index, self._t = index, t

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._t


@pytest.mark.parametrize("state", ["comm", "hookstate"])
def test_hook_called_directly_averages(comm, state):
    w = comm.world_size
    n = 1000
    base = torch.arange(n, dtype=torch.float32) - 300.0
    # Bucket of rank r: base * (r + 1) + r. Its average: base * (w + 1) / 2 + (w - 1) / 2.
    grads = base * (comm.rank + 1) + comm.rank
    hs = comm if state == "comm" else itorch.HookState(comm)
    fut = itorch.hook(hs, FakeBucket(0, grads))
    got = fut.wait()
    want = base.double() * (w + 1) / 2 + (w - 1) / 2
    mag = (base.double().abs() * sum(r + 1 for r in range(w)) + w * w) / w
    tol = w * torch.finfo(torch.float32).eps * mag + torch.finfo(torch.float32).eps * want.abs()
    assert got.dtype == torch.float32 and got.shape == (n,)
    assert bool(((got.double() - want).abs() <= tol).all()), (got[:4], want[:4])
    # On CPU the bucket itself is divided and all-reduced in place: DDP copies from it.
    assert got.data_ptr() == grads.data_ptr()
    # Several buckets in a row, each with its own index.
    for index in range(1, 4):
        g = torch.full((17,), float(comm.rank * index))
        assert bool((itorch.hook(hs, FakeBucket(index, g)).wait()
                     == index * (w - 1) / 2).all())


def test_hook_state_defaults_and_refusals(comm):
    a = itorch._hook_state(comm)
    assert a is itorch._hook_state(comm), "one HookState per communicator"
    assert not a.registered and a.side_stream
    assert a.stream(torch.device("cpu")) is None  # no side stream for CPU buckets
    assert a in comm._torch_state["hooks"]  # close() releases it
    explicit = itorch.HookState(comm, side_stream=False, registered=False)
    assert itorch._hook_state(explicit) is explicit
    with pytest.raises(TypeError, match="Communicator or HookState, not int"):
        itorch._hook_state(3)


class HostStagedComm:
    """A cuda-backend communicator whose transport stages through host memory; `alloc` must not
    be called (the library would refuse)."""

    def __init__(self, fabric: str = "host-staged"):
        self.backend, self.fabric, self.world_size, self.rank = "cuda", fabric, 2, 0
        self.can_register = fabric != "host-staged"
        self._torch_state: dict = {}
        self.allocs = 0

    def alloc(self, nbytes):
        self.allocs += 1
        raise ipcreduce.InvalidArgumentError(
            "rank 0: invalid argument to alloc: registered buffers need peer memory, and this "
            "communicator stages through host memory")


def test_hook_stages_in_place_where_registration_is_unavailable(caplog):
    fake = HostStagedComm()
    hs = itorch.HookState(fake)
    assert hs.registered, "registered staging is the cuda backend's default"
    t = torch.ones(64)
    with caplog.at_level(logging.WARNING, logger="ipcreduce"):
        for index in range(3):
            assert hs.staging(index, t) is None
    assert fake.allocs == 0, "no alloc where the fabric cannot register"
    warned = [r for r in caplog.records if "registered staging is unavailable" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
    assert "host-staged" in warned[0].getMessage()
    # Over peer memory the hook does ask for its staging buffer (here refused, and raised).
    peer = itorch.HookState(HostStagedComm("peer"))
    with pytest.raises(ipcreduce.InvalidArgumentError, match="need peer memory"):
        peer.staging(0, t)
    assert peer.unregistered_reason is None

