"""The torch layer on CPU tensors (host backend): the tensor path, the custom ops with their
fake implementations under torch.compile, and the DDP hook against DDP's own all-reduce (gloo).
Skipped where torch is not installed. Every rank runs these in the same order."""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
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
    assert torch.equal(got, f(x))


def _gloo(tag: str):
    path = f"/tmp/ipcreduce-pytest-{os.environ['IPCREDUCE_JOB_ID']}-{tag}"
    rank, world = int(os.environ["IPCREDUCE_RANK"]), int(os.environ["IPCREDUCE_WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)


def test_ddp_hook_averages_like_ddp(comm):
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
        # The gradients are averages: every rank holds the same.
        for q in ours.parameters():
            other = q.grad.clone()
            comm.all_reduce(other, "max")
            assert torch.equal(other, q.grad)
    finally:
        dist.destroy_process_group()
