"""The steps of multislerp and karcher between their passes (:mod:`.sphere_means`): the scalars
each pass hands the next, and multislerp's linear fallback. One implementation for both paths, the
MLX kernels' and the native passes' (:mod:`.sphere_native`), so both compute the same values.
"""

from __future__ import annotations

import numpy as np

import mlx_ssp  # noqa: F401  (OpenBLAS before mlx.core)
import mlx.core as mx

from mlx_ssp.merge import kernels as K
from mlx_ssp.merge import torch_math as TM
from mlx_ssp.merge.kernels import F32, aligned, each, item32, kernel, rnd, scalar


def values(xs) -> list[float]:
    """One-element arrays' values, evaluated together (one wait for MLX, not one per value)."""
    mx.eval(*xs)
    return [x.item() for x in xs]


def msl_linear(xs: list, Wl: list, cd, out) -> list[mx.array]:
    """The fallback where the weighted mean of the unit vectors vanishes: the linear combination of
    two (antipodal) inputs; more than two raise ``ValueError``."""
    if len(xs) != 2:
        raise ValueError("multislerp: the weighted sum of the input tensors is zero (antipodal inputs with "
                         "balancing weights); use different weights")
    lk = kernel(("msl_lin", str(cd), str(out)), lambda: (lambda a, b, wa, wb: rnd(
        rnd(aligned(a, cd) * wa, cd) + rnd(aligned(b, cd) * wb, cd), cd).astype(cd).astype(out)))
    return each(xs[0].size, lambda lo, hi: lk(xs[0][lo:hi], xs[1][lo:hi], Wl[0], Wl[1]))


def msl_dot_values(dsums: list, cd) -> list[mx.array]:
    """The dots (0-d, in ``cd``) from their float32 sums."""
    return [rnd(d, cd).reshape(()) for d in dsums]


def msl_turn(tsq: mx.array, norms: mx.array, W: mx.array, eps: float, cd) -> tuple:
    """From the tangent's squares' sum: ``cos(tn)``, ``sin(tn) / tn`` and the weighted mean norm,
    each in ``cd`` (float32: torch's own cos / sin and its order for the norms' sum)."""
    r = lambda x: rnd(x, cd)  # noqa: E731
    tn = r(r(mx.sqrt(tsq)) + eps).reshape(())
    if cd == F32:
        tn32 = item32(tn)
        return scalar(TM.cos(tn32)), scalar(TM.sin(tn32) / tn32), scalar(K.torch_sum(np.asarray(norms * W)))
    return r(mx.cos(tn)), r(r(mx.sin(tn)) / tn), r(mx.sum(r(norms * W)))


#: float32 elements of the widest SIMD vector MLX's CPU code uses (its macOS build: 8)
_MLX_SIMD_FLOATS = 8


def kar_angles(dsums, al, tol: float, cd) -> tuple[list[int], np.ndarray, np.ndarray]:
    """From the dots' sums and the weights (float32 values): the inputs not yet at the mean, their
    dots (clipped, in ``cd``) and their tangent coefficients ``alpha theta / sin(theta)`` (each step
    in ``cd``), as float32 values. The arithmetic is NumPy's float32 (the same IEEE operations as
    MLX's), the angles and sines MLX's own (bf16 / fp16: one evaluation for all inputs) or torch's
    (float32)."""
    dots = np.clip(K.rnd_host(np.asarray(dsums, dtype=np.float32), cd), np.float32(-1), np.float32(1))
    if cd == F32:  # torch's own float32 acos / sin
        thetas = np.array([TM.acos(d) for d in dots], dtype=np.float32)
        sins = np.array([TM.sin(t) for t in thetas], dtype=np.float32)
    else:  # MLX's own functions, rounded by casts, in one evaluation (each waits on the stream's
        # thread), of all values as one array: MLX's CPU code takes each element as it takes a 0-d
        # array, but for the SIMD code of its macOS build from 8 elements on, hence 0-d arrays there
        if len(dots) < _MLX_SIMD_FLOATS:
            th = mx.arccos(mx.array(dots)).astype(cd).astype(F32)
            sn = mx.sin(th).astype(cd).astype(F32)
            mx.eval(th, sn)
            thetas, sins = np.array(th), np.array(sn)
        else:
            th = [mx.arccos(mx.array(d)).astype(cd).astype(F32) for d in dots]
            sn = [mx.sin(t).astype(cd).astype(F32) for t in th]
            mx.eval(th, sn)
            thetas = np.array([t.item() for t in th], dtype=np.float32)
            sins = np.array([t.item() for t in sn], dtype=np.float32)
    act = [j for j, theta in enumerate(thetas) if not theta < tol]  # the rest are at the mean already
    with np.errstate(divide="ignore", invalid="ignore"):  # sin 0 only where theta is 0: not active
        coefs = K.rnd_host(np.asarray(al, dtype=np.float32) * K.rnd_host(thetas / sins, cd), cd)
    return act, dots[act], coefs[act]


def kar_turn(tn: np.float32, cd) -> tuple[np.float32, np.float32]:
    """``cos(tn)`` and ``sin(tn)`` of the tangent's norm, in ``cd`` (float32: torch's own)."""
    cos, sin = (TM.cos, TM.sin) if cd == F32 else (np.cos, np.sin)
    return K.rnd_host(cos(tn), cd)[()], K.rnd_host(sin(tn), cd)[()]
