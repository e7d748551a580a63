"""Deterministic inputs of every rank and the float64 reference of their reduction: each rank
computes every rank's input, so it can check its own result without exchanging data."""

import hashlib

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


def digest_words(a: np.ndarray) -> np.ndarray:
    """The array's bytes hashed into 8 float32 integers below 2**24 (exact in float32), so
    that max and min all-reduces of them tell whether every rank holds the same bytes."""
    d = hashlib.sha256(np.ascontiguousarray(a).tobytes()).digest()
    return np.array([int.from_bytes(d[i:i + 3], "little") for i in range(0, 24, 3)],
                    dtype=np.float32)
