"""Task-vector methods that combine by per-element statistics across the models (mergekit 0.1.5).

- :func:`sce` (Wan et al. 2024, FuseChat, section 3.3 "select, calculate, erase"): keep the
  ``select_topk`` fraction of elements with the largest variance across the task vectors (of the
  elements whose variance is nonzero), weight each model by its mean squared task vector (over the
  sum), erase elements that disagree with the elected sign (TIES' ``sum`` vote), and divide by the
  sum of the surviving weights (clamped to 1e-6).
- :func:`ram` / ``ramplus_tl`` (Reinforced Agent Merging, arXiv 2601.13572): elements that only one
  model changes (``|delta| > epsilon``) keep that change; shared ones are averaged over the models
  that change them. ``ramplus_tl`` scales the unique changes of each model by
  ``1 + r * clamp(shared / unique, 0, alpha)`` (its counts of shared and unique elements in this
  tensor).

Each step is rounded to the compute dtype where mergekit holds it in that dtype (sums and means
accumulate in float32 in both). SCE's variance is Welford's in float64, as torch's ``var``
computes it, and its weights' mean squares are float64 sums (torch's float32 cascade is about as
accurate; a plain float32 sum drifts over millions of elements): with MLX's float32 ``var`` and
``mean`` instead, 36% of float32 outputs and up to 1% of the top-k selection differed. Deviation:
exact ties of the (rounded) variance at SCE's top-k threshold keep the lowest flat indices;
``torch.topk``'s pick among ties is implementation-defined (libstdc++'s ``nth_element`` /
``partial_sort``), and in bf16 ties are common. Measured (4 tensors of 1k-4M elements, bf16,
``select_topk`` 0.5): 0.83% of elements differ from mergekit's, all of them from that pick (with
a stable sort patched into mergekit: 100% identical); with ``select_topk`` 1 bf16 is identical and
float32 98.5% identical (the rest: the last bit of torch's cascade sums of the weights).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

import mlx_ssp  # noqa: F401  (OpenBLAS before mlx.core)
import mlx.core as mx

from mlx_ssp.merge import kernels as K
from mlx_ssp.merge.kernels import F32, F64, f32, rnd


def variance(tvs: mx.array, cd=F32) -> mx.array:
    """The population variance across the task vectors (axis 0), as torch's CPU ``var`` computes
    it: Welford's update in float64, rounded to ``cd`` at the end."""
    x = tvs.astype(F64)
    mean = mx.zeros(x.shape[1:], dtype=F64)
    m2 = mx.zeros(x.shape[1:], dtype=F64)
    for i in range(x.shape[0]):
        d = x[i] - mean
        mean = mean + d / (i + 1)
        m2 = m2 + d * (x[i] - mean)
    return (m2 / x.shape[0]).astype(cd)


def topk_variance_mask(tvs: mx.array, density: float, cd=F32) -> mx.array:
    """SCE "select": True at the ``k`` elements with the largest variance across the task vectors
    (:func:`variance`; ties to the lowest index). ``k = int(nonzero * density)`` as torch computes
    it (the count times the density in float32)."""
    var = np.asarray(f32(variance(tvs, cd)))
    if density >= 1:
        return mx.ones(var.shape, dtype=mx.bool_)
    k = int(np.float32(np.count_nonzero(var)) * np.float32(density)) if density > 0 else 0
    mask = np.zeros(var.size, dtype=bool)
    if k > 0:
        mask[np.argsort(-var, kind="stable")[:k]] = True
    return mx.array(mask)


def sce_weights(T: mx.array, cd=F32) -> np.ndarray:
    """SCE "calculate": each task vector's mean square (its squares rounded to ``cd``; the sum over
    the tensor in float64, as torch's cascade sum is about exact, then divided by the count in
    float32 and rounded to ``cd``), over their sum (rounded to ``cd``); equal weights when that sum
    is below 1e-6."""
    n, size = T.shape
    sq = [K.sums(lambda lo, hi, i=i: [rnd(mx.square(T[i, lo:hi]), cd)], size)[0] for i in range(n)]
    w = np.asarray(rnd(mx.concatenate(sq) / np.float32(size), cd), dtype=np.float32)
    total = float(np.asarray(rnd(mx.array(w.sum(dtype=np.float32)), cd)))
    if abs(total) < 1e-6:
        return np.asarray(rnd(mx.full(w.shape, 1.0 / w.size), cd))
    return np.asarray(rnd(mx.array(w) / total, cd))


def sce(base: mx.array, tvs: Sequence[mx.array], select_topk: float = 1.0, cd=F32) -> mx.array:
    """SCE merge of task vectors (cd-rounded) onto ``base``; flat float32 holding ``cd`` values, each
    step rounded to ``cd`` as mergekit computes it."""
    T = mx.stack([f32(t).reshape(-1) for t in tvs])
    if select_topk < 1:
        T = T * topk_variance_mask(T, select_topk, cd)
    majority = mx.where(mx.sum(T, axis=0) >= 0, 1.0, -1.0)
    erase = (mx.sign(T) == majority).astype(F32)
    w = sce_weights(T, cd)
    ew = mx.array(w).reshape(-1, 1) * erase
    merged = rnd(mx.sum(rnd(T * ew, cd), axis=0), cd)
    den = mx.maximum(rnd(mx.sum(ew, axis=0), cd), 1e-6)
    return rnd(f32(base).reshape(-1) + rnd(merged / den, cd), cd)


def ram(base: mx.array, tvs: Sequence[mx.array], epsilon: float = 1e-5, plus: bool = False, r: float = 0.1,
        alpha: float = 0.2, cd=F32) -> mx.array:
    """RAM (``plus``: RAM+ tensor-local) merge of task vectors (cd-rounded) onto ``base``; flat
    float32. Rounded to ``cd`` where mergekit's tensors are in it: RAM throughout, RAM+ only the
    shared part (its ``lambda`` is float32, so torch promotes the rest)."""
    T = mx.stack([f32(t).reshape(-1) for t in tvs])
    nz = mx.abs(T) > epsilon
    counts = mx.sum(nz, axis=0, keepdims=True)
    overlap, unique = counts > 1, counts == 1
    Tz = T * nz
    shared = rnd(Tz * overlap / mx.maximum(counts, 1).astype(F32), cd)
    uniq = Tz * unique
    if plus:
        shared_n = mx.sum(nz & overlap, axis=1).astype(F32)
        unique_n = mx.sum(nz & unique, axis=1).astype(F32)
        lam = 1 + r * mx.clip(shared_n / mx.maximum(unique_n, epsilon), 0.0, alpha)
        return f32(base).reshape(-1) + mx.sum(uniq * lam.reshape(-1, 1) + shared, axis=0)
    merged = rnd(mx.sum(rnd(uniq + shared, cd), axis=0), cd)
    return rnd(f32(base).reshape(-1) + merged, cd)
