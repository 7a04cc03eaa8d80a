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

Deviations: arithmetic in float32 from the task vectors rounded to the compute dtype, one rounding
at the end (mergekit rounds each bf16 intermediate); exact ties of the variance at SCE's top-k
threshold keep the lowest flat indices (torch.topk's pick is implementation-defined).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

import mlx_ssp  # noqa: F401  (OpenBLAS before mlx.core)
import mlx.core as mx

from mlx_ssp.merge.kernels import F32, f32


def topk_variance_mask(tvs: mx.array, density: float) -> mx.array:
    """SCE "select": True at the ``int(nonzero * density)`` elements with the largest variance across
    the task vectors (population variance; ties to the lowest index)."""
    var = np.asarray(mx.var(tvs, axis=0))
    if density >= 1:
        return mx.ones(var.shape, dtype=mx.bool_)
    k = int(np.count_nonzero(var) * density) if density > 0 else 0
    mask = np.zeros(var.size, dtype=bool)
    if k > 0:
        mask[np.argsort(-var, kind="stable")[:k]] = True
    return mx.array(mask)


def sce(base: mx.array, tvs: Sequence[mx.array], select_topk: float = 1.0) -> mx.array:
    """SCE merge of task vectors (float32, cd-rounded) onto ``base``; float32 result."""
    T = mx.stack([f32(t).reshape(-1) for t in tvs])
    if select_topk < 1:
        T = T * topk_variance_mask(T, select_topk)
    sign = mx.sign(T)
    majority = mx.where(mx.sum(T, axis=0) >= 0, 1.0, -1.0)
    erase = (sign == majority).astype(F32)
    w = np.asarray(mx.mean(mx.square(T).reshape(T.shape[0], -1), axis=1), dtype=np.float32)
    total = float(w.sum())
    w = np.full(w.shape, 1.0 / w.size, np.float32) if abs(total) < 1e-6 else (w / np.float32(total))
    ew = mx.array(w).reshape(-1, 1) * erase
    merged = mx.sum(T * ew, axis=0) / mx.maximum(mx.sum(ew, axis=0), 1e-6)
    return f32(base).reshape(-1) + merged


def ram(base: mx.array, tvs: Sequence[mx.array], epsilon: float = 1e-5, plus: bool = False, r: float = 0.1,
        alpha: float = 0.2) -> mx.array:
    """RAM (``plus``: RAM+ tensor-local) merge of flat task vectors onto ``base``; float32 result."""
    T = mx.stack([f32(t).reshape(-1) for t in tvs])
    nz = mx.abs(T) > epsilon
    counts = mx.sum(nz, axis=0, keepdims=True)
    overlap, unique = counts > 1, counts == 1
    Tz = T * nz
    uniq_part = Tz * unique
    if plus:
        shared_n = mx.sum(nz & overlap, axis=1).astype(F32)
        unique_n = mx.sum(nz & unique, axis=1).astype(F32)
        lam = 1 + r * mx.clip(shared_n / mx.maximum(unique_n, epsilon), 0.0, alpha)
        uniq_part = uniq_part * lam.reshape(-1, 1)
    merged = mx.sum(uniq_part + Tz * overlap / mx.maximum(counts, 1).astype(F32), axis=0)
    return f32(base).reshape(-1) + merged
