"""The expected results of the fused all-reduce + residual add + RMSNorm, computed in torch
from the rounding points the documentation gives (never from the code under test), and the
bounds the results are held to. Every rank computes every rank's input from its seed."""

import torch

# Mantissa bits and smallest normal exponent: one ulp of x is 2^(floor(log2|x|) - bits).
FORMATS = {torch.bfloat16: (7, -126), torch.float16: (10, -14), torch.float32: (23, -126),
           torch.float8_e4m3fn: (3, -6)}
U32 = 2.0**-24  # float32's unit roundoff
E4M3_MAX = 448.0


def rank_input(rank: int, shape, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * seed + rank)
    return torch.randn(shape, generator=g).to(dtype)


def shared_tensors(shape, dtype, seed: int):
    """(residual, weight): the same on every rank, as in a tensor-parallel model."""
    g = torch.Generator().manual_seed(104729 + seed)
    residual = torch.randn(shape, generator=g).to(dtype)
    weight = (1.0 + 0.25 * torch.randn(shape[-1], generator=g)).to(dtype)
    return residual, weight


def ulp(x: torch.Tensor, dtype) -> torch.Tensor:
    """One ulp of `dtype` at each value of float64 `x` (subnormals: the smallest step)."""
    bits, emin = FORMATS[dtype]
    _, e = torch.frexp(x)
    e = torch.clamp(e.to(torch.float64) - 1, min=emin)
    return torch.pow(2.0, e - bits)


def expected_residual_out(inputs, residual: torch.Tensor) -> torch.Tensor:
    """The documented sequence: sum over the ranks in float32 in rank order, rounded to the
    activation dtype, plus the residual in float32, rounded again."""
    s = inputs[0].float()
    for x in inputs[1:]:
        s = s + x.float()
    return (s.to(residual.dtype).float() + residual.float()).to(residual.dtype)


def norm_reference(residual_out: torch.Tensor, weight: torch.Tensor, eps: float):
    """out in float64 from the (bitwise-checked) residual_out: r * rsqrt(mean(r^2) + eps) * w,
    with eps as the float32 the library takes."""
    r = residual_out.double()
    eps32 = float(torch.tensor(eps, dtype=torch.float32))
    rstd = torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps32)
    return r * rstd * weight.double()


def norm_tolerance(ref: torch.Tensor, dtype, hidden: int) -> torch.Tensor:
    """One ulp of `dtype` (the single rounding, with room for the float32 steps before it on
    a value that lies near a rounding boundary), plus the float32 error of those steps in any
    summation order: the sum of `hidden` squares (hidden - 1 roundings, halved by the square
    root), the mean, eps, rsqrt (2 ulp) and two products."""
    return ulp(ref, dtype) + ((hidden + 3) / 2 + 5) * U32 * ref.abs()


def check_out(out: torch.Tensor, ref: torch.Tensor, hidden: int, what: str) -> None:
    tol = norm_tolerance(ref, out.dtype, hidden)
    err = (out.double() - ref).abs()
    bad = torch.nonzero((err > tol).flatten()).flatten()
    assert bad.numel() == 0, (
        f"{what}: {bad.numel()} of {out.numel()} elements off; first at {int(bad[0])}: "
        f"got {out.flatten()[bad[0]].item()}, reference {ref.flatten()[bad[0]].item()}, "
        f"tolerance {tol.flatten()[bad[0]].item()}")


def check_fp8(fp8: torch.Tensor, ref: torch.Tensor, scale: float, hidden: int, what: str):
    """e4m3 of sat(out_f32 / scale): within one e4m3 ulp of the float64 value (plus the
    float32 error of out before it), exactly +-448 where that saturates."""
    assert fp8.dtype == torch.float8_e4m3fn, fp8.dtype
    v = ref / float(torch.tensor(scale, dtype=torch.float32))
    want = v.clamp(-E4M3_MAX, E4M3_MAX)
    got = fp8.double()
    assert not bool(torch.isnan(got).any()), f"{what}: NaN in the fp8 output (satfinite)"
    tol = ulp(want, torch.float8_e4m3fn) + ((hidden + 3) / 2 + 6) * U32 * v.abs()
    err = (got - want).abs()
    bad = torch.nonzero((err > tol).flatten()).flatten()
    assert bad.numel() == 0, (
        f"{what}: {bad.numel()} of {fp8.numel()} fp8 elements off; first at {int(bad[0])}: "
        f"got {got.flatten()[bad[0]].item()}, reference {want.flatten()[bad[0]].item()}")
    sat = v.abs() >= E4M3_MAX + 16  # beyond the rounding boundary above 448
    assert bool((got[sat].abs() == E4M3_MAX).all()), f"{what}: a saturated value is not 448"
