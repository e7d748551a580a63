"""The fused all-reduce + residual add + RMSNorm on CPU tensors (host backend): values against
the documented rounding points and a float64 reference, the torch ops with their fake
implementations under torch.compile (fullgraph), the fp8 output, argument errors and
mismatches between ranks, and the tensor-parallel decoder example. Torch tests: see
conftest.py (IPCREDUCE_REQUIRE_TORCH). Every rank runs these in the same order."""

import os
import re
import sys

import pytest

if os.environ.get("IPCREDUCE_REQUIRE_TORCH") == "1":
    import torch
else:
    torch = pytest.importorskip("torch")
import torch._dynamo  # noqa: E402,F401  (imported at collection: see test_torch_cpu.py)

import ipcreduce  # noqa: E402
import ipcreduce.torch as itorch  # noqa: E402
from fused_reference import (  # noqa: E402
    check_fp8, check_out, expected_residual_out, norm_reference, rank_input, shared_tensors)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import tp_decoder  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (tokens, hidden) and one 3-d input: one token, odd and non-multiple-of-16 widths.
SHAPES = [(1, 4096), (5, 1023), (17, 257), (3, 2, 136), (64, 16)]
MISMATCH = (ipcreduce.MismatchError, ipcreduce.AbortedError)


def same_bits_everywhere(files, name: str, t: torch.Tensor) -> None:
    files.same_on_every_rank(name, t.contiguous().view(torch.uint8).numpy())


def case(comm, shape, dtype, seed):
    inputs = [rank_input(r, shape, dtype, seed) for r in range(comm.world_size)]
    residual, weight = shared_tensors(shape, dtype, seed)
    return inputs, residual, weight


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_values_against_the_reference(comm, files, shape, dtype):
    seed = SHAPES.index(shape) * 10 + DTYPES.index(dtype)
    inputs, residual, weight = case(comm, shape, dtype, seed)
    x = inputs[comm.rank]
    x_before, res_before = x.clone(), residual.clone()
    eps = 1e-5
    out, res_out = itorch.all_reduce_add_rms_norm(x, residual, weight, comm, eps)
    assert out.shape == x.shape and out.dtype == dtype and res_out.dtype == dtype
    # Out of place: the inputs are left as they were.
    assert torch.equal(x, x_before) and torch.equal(residual, res_before)
    want_res = expected_residual_out(inputs, residual)
    assert torch.equal(res_out.view(torch.uint8), want_res.view(torch.uint8)), (
        f"residual_out differs from the documented sequence in "
        f"{int((res_out != want_res).sum())} elements")
    check_out(out, norm_reference(want_res, weight, eps), shape[-1], f"{shape} {dtype}")
    same_bits_everywhere(files, "out", out)
    same_bits_everywhere(files, "residual_out", res_out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_output(comm, files, dtype):
    shape, eps, scale = (9, 515), 1e-6, 1.0 / 100  # |out| up to ~5: some values saturate
    inputs, residual, weight = case(comm, shape, dtype, 99)
    s = torch.tensor([scale], dtype=torch.float32)
    out, res_out, fp8 = itorch.all_reduce_add_rms_norm(inputs[comm.rank], residual, weight,
                                                       comm, eps, scale=s)
    assert fp8.shape == out.shape and fp8.dtype == torch.float8_e4m3fn
    want_res = expected_residual_out(inputs, residual)
    assert torch.equal(res_out, want_res)
    ref = norm_reference(want_res, weight, eps)
    check_out(out, ref, shape[-1], "out beside fp8")
    check_fp8(fp8, ref, scale, shape[-1], "fp8_out")
    # The same out as without fp8: the fp8 output changes nothing else.
    out2, res2 = itorch.all_reduce_add_rms_norm(inputs[comm.rank], residual, weight, comm, eps)
    assert torch.equal(out2, out) and torch.equal(res2, res_out)
    same_bits_everywhere(files, "fp8", fp8)


def test_method_in_place_as_vllm_calls_it(comm):
    shape, dtype, eps = (4, 300), torch.bfloat16, 1e-6
    inputs, residual, weight = case(comm, shape, dtype, 5)
    want_res = expected_residual_out(inputs, residual)
    x, r = inputs[comm.rank].clone(), residual.clone()
    got = comm.all_reduce_add_rms_norm(x, r, weight, eps)
    # Defaults: out is the input, residual_out the residual.
    assert got[0] is x and got[1] is r and len(got) == 2
    assert torch.equal(r, want_res)
    check_out(x, norm_reference(want_res, weight, eps), shape[-1], "in place")
    # Out of place through the method, into given tensors.
    out, res_out = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    comm.all_reduce_add_rms_norm(inputs[comm.rank], residual, weight, eps, out=out,
                                 residual_out=res_out)
    assert torch.equal(res_out, want_res) and torch.equal(out, x)


def test_op_with_the_input_as_its_residual(comm):
    # The same tensor as input and residual: the op copies the residual (the library refuses
    # overlapping buffers); the result is as with two tensors of the same values.
    x = rank_input(comm.rank, (3, 100), torch.bfloat16, 8)
    out, res = itorch.all_reduce_add_rms_norm(x, x, torch.ones(100, dtype=torch.bfloat16),
                                              comm, 1e-6)
    out2, res2 = itorch.all_reduce_add_rms_norm(x, x.clone(),
                                                torch.ones(100, dtype=torch.bfloat16), comm, 1e-6)
    assert torch.equal(out, out2) and torch.equal(res, res2)


def test_zero_eps(comm):
    # eps = 0 is allowed (only negative or NaN eps is refused).
    shape, dtype = (3, 64), torch.float32
    inputs, residual, weight = case(comm, shape, dtype, 6)
    out, res_out = itorch.all_reduce_add_rms_norm(inputs[comm.rank], residual, weight, comm, 0.0)
    want_res = expected_residual_out(inputs, residual)
    assert torch.equal(res_out, want_res)
    check_out(out, norm_reference(want_res, weight, 0.0), 64, "eps 0")


def test_ops_schemas_and_fake_tensors(comm):
    from torch._subclasses.fake_tensor import FakeTensorMode

    schema = str(torch.ops.ipcreduce.all_reduce_add_rms_norm.default._schema)
    assert "-> (Tensor, Tensor)" in schema, schema
    schema8 = str(torch.ops.ipcreduce.all_reduce_add_rms_norm_fp8.default._schema)
    assert "-> (Tensor, Tensor, Tensor)" in schema8, schema8
    with FakeTensorMode():
        x = torch.empty(8, 4096, dtype=torch.bfloat16)
        w = torch.empty(4096, dtype=torch.bfloat16)
        out, res = itorch.all_reduce_add_rms_norm(x, x, w, comm, 1e-6)
        assert out.shape == x.shape and res.shape == x.shape and out.dtype == x.dtype
        o8 = itorch.all_reduce_add_rms_norm(x, x, w, comm, 1e-6,
                                            scale=torch.empty(1, dtype=torch.float32))
        assert len(o8) == 3 and o8[2].dtype == torch.float8_e4m3fn and o8[2].shape == x.shape


@pytest.mark.parametrize("fp8", [False, True])
def test_torch_compile_fullgraph(comm, fp8):
    shape, dtype, eps = (6, 200), torch.bfloat16, 1e-5
    inputs, residual, weight = case(comm, shape, dtype, 7)
    scale = torch.tensor([0.05], dtype=torch.float32)

    def f(x, res, w):
        # Work before and after the op: it must trace into the one graph.
        y = x * 2.0
        outs = itorch.all_reduce_add_rms_norm(y, res, w, comm, eps,
                                              scale=scale if fp8 else None)
        return (outs[0] * 0.5, outs[1]) + tuple(outs[2:])

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = compiled(inputs[comm.rank], residual, weight)
    want = f(inputs[comm.rank], residual, weight)
    assert len(got) == len(want) == (3 if fp8 else 2)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g.view(torch.uint8), w.view(torch.uint8))
    # And the values: the doubled inputs (exact) through the documented sequence.
    want_res = expected_residual_out([t * 2.0 for t in inputs], residual)
    assert torch.equal(got[1], want_res)


def _error_of(call):
    with pytest.raises(ipcreduce.Error) as e:
        call()
    return e.value


def _usable_after(comm):
    """A refusal of this layer leaves the communicator usable: the next call meets its peers'."""
    x = torch.full((2, 8), float(comm.rank + 1))
    out, res = itorch.all_reduce_add_rms_norm(x, torch.zeros(2, 8), torch.ones(8), comm, 0.0)
    assert bool((res == sum(r + 1 for r in range(comm.world_size))).all())
    assert torch.allclose(out, torch.ones(2, 8))


def test_tensor_errors_raise_on_every_rank(comm):
    # Refused by the Python layer before anything collective starts, alike on every rank.
    x, w = torch.ones(4, 64, dtype=torch.bfloat16), torch.ones(64, dtype=torch.bfloat16)
    r = comm.rank
    cases = [
        ("residual of another shape",
         lambda: itorch.all_reduce_add_rms_norm(x, x[:3], w, comm, 1e-6),
         r"residual has shape \(3, 64\), expected \(4, 64\)"),
        ("weight of another width",
         lambda: itorch.all_reduce_add_rms_norm(x, x.clone(), w[:63], comm, 1e-6),
         r"weight has shape \(63,\), expected \(64,\)"),
        ("weight of another dtype",
         lambda: itorch.all_reduce_add_rms_norm(x, x.clone(), w.float(), comm, 1e-6),
         r"weight is torch.float32, the input torch.bfloat16"),
        ("float64", lambda: itorch.all_reduce_add_rms_norm(x.double(), x.double(), w.double(),
                                                           comm, 1e-6),
         r"float64 is not reduced"),
        ("scale of two elements",
         lambda: itorch.all_reduce_add_rms_norm(x, x.clone(), w, comm, 1e-6,
                                                scale=torch.ones(2, dtype=torch.float32)),
         r"scale must be a torch float32 tensor of one"),
        ("fp8_out of another dtype",
         lambda: comm.all_reduce_add_rms_norm(x.clone(), x.clone(), w, 1e-6,
                                              scale=torch.ones(1), fp8_out=x.clone()),
         r"fp8_out must be a torch float8_e4m3fn tensor of shape \(4, 64\)"),
        ("not contiguous",
         lambda: comm.all_reduce_add_rms_norm(torch.ones(64, 4, dtype=torch.bfloat16).t(),
                                              x.clone(), w, 1e-6),
         r"input is not contiguous"),
        ("a scalar", lambda: comm.all_reduce_add_rms_norm(x[0, 0], x[0, 0].clone(), w, 1e-6),
         r"input is a scalar"),
        ("a numpy array", lambda: comm.all_reduce_add_rms_norm(x.float().numpy(), x, w, 1e-6),
         r"input is not a torch tensor \(ndarray\)"),
    ]
    for what, call, pattern in cases:
        err = _error_of(call)
        msg = str(err)
        assert isinstance(err, ipcreduce.InvalidArgumentError), f"{what}: {type(err)}: {msg}"
        assert msg.startswith(f"rank {r}: invalid argument to all_reduce_add_rms_norm: "), msg
        assert re.search(pattern, msg), f"{what}: {msg!r} does not say {pattern!r}"
    _usable_after(comm)


# Refused by the library: the calling rank raises InvalidArgumentError and aborts the
# communicator with it (its peers may already wait in the call): every later call, and every
# peer's call, raises AbortedError naming the reason. With the same bad argument on every rank,
# a rank raises either, whichever comes first: its own refusal or a faster peer's abort.
LIBRARY_REFUSALS = {
    "negative eps": (dict(eps=-1e-6), r"eps must be finite and >= 0"),
    "NaN eps": (dict(eps=float("nan")), r"eps must be finite and >= 0"),
    "infinite eps": (dict(eps=float("inf")), r"eps must be finite and >= 0"),
    "fp8_out without scale": (dict(fp8_out=True), r"fp8_out and fp8_scale come together"),
}


def _library_call(comm, eps=1e-6, fp8_out=False):
    x = torch.ones(4, 64, dtype=torch.bfloat16)
    f8 = torch.empty(4, 64, dtype=torch.float8_e4m3fn) if fp8_out else None
    return comm.all_reduce_add_rms_norm(x, x.clone(), torch.ones(64, dtype=torch.bfloat16),
                                        eps, fp8_out=f8)


@pytest.mark.parametrize("what", list(LIBRARY_REFUSALS))
def test_library_refusals_on_every_rank(comm, what):
    kwargs, pattern = LIBRARY_REFUSALS[what]
    err = _error_of(lambda: _library_call(comm, **kwargs))
    msg = str(err)
    if isinstance(err, ipcreduce.InvalidArgumentError):
        assert msg.startswith(
            f"rank {comm.rank}: invalid argument to all_reduce_add_rms_norm: "), msg
    else:
        assert isinstance(err, ipcreduce.AbortedError), f"{type(err).__name__}: {msg}"
        assert msg.startswith(f"rank {comm.rank}: communicator is aborted: "), msg
        assert "invalid argument to all_reduce_add_rms_norm" in msg, msg
    assert re.search(pattern, msg), msg
    after = _error_of(lambda: _library_call(comm))
    assert isinstance(after, ipcreduce.AbortedError) and re.search(pattern, str(after)), after


def test_negative_eps_on_one_rank_stops_every_rank(comm):
    # The culprit raises InvalidArgumentError; the others, in the same call, AbortedError
    # naming the culprit's reason, within the bound (the test's own timeout), never a hang.
    culprit = comm.world_size - 1
    eps = -1.0 if comm.rank == culprit else 1e-6
    err = _error_of(lambda: _library_call(comm, eps=eps))
    msg = str(err)
    if comm.rank == culprit:
        assert isinstance(err, ipcreduce.InvalidArgumentError), msg
    else:
        assert isinstance(err, MISMATCH), f"{type(err).__name__}: {msg}"
    assert msg.startswith(f"rank {comm.rank}:"), msg
    assert "eps" in msg, msg


def _assert_mismatch(comm, err, culprit: int) -> None:
    msg = str(err)
    assert isinstance(err, MISMATCH), f"{type(err).__name__}: {msg}"
    assert msg.startswith(f"rank {comm.rank}:"), msg
    assert "all_reduce_add_rms_norm" in msg, msg
    if isinstance(err, ipcreduce.MismatchError):
        peer = int(re.search(r"does not match peer rank (\d+)", msg).group(1))
        assert peer != comm.rank and (comm.rank == culprit or peer == culprit), msg
    else:
        pair = re.search(r"arguments differ between ranks (\d+) and (\d+)", msg)
        assert pair and culprit in {int(pair.group(1)), int(pair.group(2))}, msg


def test_tokens_differing_between_ranks_raise_on_every_rank(comm):
    culprit = comm.world_size - 1
    tokens = 5 if comm.rank == culprit else 4
    x = torch.ones(tokens, 96)
    _assert_mismatch(comm, _error_of(
        lambda: itorch.all_reduce_add_rms_norm(x, x.clone(), torch.ones(96), comm, 1e-6)),
        culprit)


def test_hidden_differing_between_ranks_raise_on_every_rank(comm):
    # The same element count on every rank (8 x 96 = 12 x 64): only the shape differs.
    culprit = 0
    x = torch.ones(12, 64) if comm.rank == culprit else torch.ones(8, 96)
    _assert_mismatch(comm, _error_of(
        lambda: itorch.all_reduce_add_rms_norm(x, x.clone(), torch.ones(x.shape[1]), comm,
                                               1e-6)),
        culprit)


def test_eps_differing_between_ranks_raise_on_every_rank(comm):
    culprit = 1
    eps = 1e-5 if comm.rank == culprit else 1e-6
    x = torch.ones(2, 32)
    _assert_mismatch(comm, _error_of(
        lambda: itorch.all_reduce_add_rms_norm(x, x.clone(), torch.ones(32), comm, eps)),
        culprit)


def test_fp8_on_one_rank_only_raise_on_every_rank(comm):
    culprit = 0
    x = torch.ones(2, 32, dtype=torch.bfloat16)
    w = torch.ones(32, dtype=torch.bfloat16)
    scale = torch.ones(1) if comm.rank == culprit else None
    _assert_mismatch(comm, _error_of(
        lambda: itorch.all_reduce_add_rms_norm(x, x.clone(), w, comm, 1e-6, scale=scale)),
        culprit)


def test_tp_decoder_example_matches_the_unfused_sequence(comm):
    # The example's own check (python/examples/tp_decoder.py), on CPU tensors: every rank
    # holds the same fused results, within the bound of the unfused torch sequence.
    report = tp_decoder.run(comm, torch.device("cpu"), torch.bfloat16, tokens=6, hidden=256,
                            ffn=512, layers=3)
    assert report["max_diff_of_bound"] <= 1.0, report
    assert report["residual_bitwise"], report
