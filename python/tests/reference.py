"""Deterministic inputs of every rank and the float64 reference of their reduction: each rank
computes every rank's input, so it can check its own result without exchanging data."""

import numpy as np

EPS = {np.float32: np.finfo(np.float32).eps, np.float16: np.finfo(np.float16).eps}


def rank_input(rank: int, n: int, dtype, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng([seed, rank, n])
    return rng.standard_normal(n).astype(dtype)


def reference(op: str, world: int, n: int, dtype, seed: int = 0):
    """(reference in float64, sum of magnitudes) of the ranks' inputs."""
    xs = np.stack([rank_input(r, n, dtype, seed).astype(np.float64) for r in range(world)])
    ref = {"sum": xs.sum(0), "max": xs.max(0), "min": xs.min(0)}[op]
    return ref, np.abs(xs).sum(0)


def check_close(got: np.ndarray, ref: np.ndarray, mag: np.ndarray, world: int, dtype) -> None:
    """Within one rounding to `dtype` of the reference plus float32 accumulation error."""
    tol = EPS[dtype] * np.abs(ref) + world * EPS[np.float32] * mag + 1e-30
    err = np.abs(got.astype(np.float64) - ref)
    bad = np.flatnonzero(err > tol)
    assert bad.size == 0, (
        f"{bad.size} of {got.size} elements off; first at {bad[0]}: got {got[bad[0]]}, "
        f"reference {ref[bad[0]]}, tolerance {tol[bad[0]]}")

