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
accumulate in float32 in both). SCE runs slice by slice (:func:`sce_parts`): beyond the task
vectors, it holds the variance (in the compute dtype) and the top-k mask, no float32 copy. SCE's variance is Welford's in float64, as torch's ``var``
computes it, and its weights' mean squares are float64 sums in bf16 / fp16 (torch's float32 cascade
is about as accurate; a plain float32 sum drifts over millions of elements) and, in float32, torch's
own sum order (:func:`.kernels.torch_sum`, which makes the float32 goldens bit-identical): with
MLX's float32 ``var`` and ``mean`` instead, 36% of float32 outputs and up to 1% of the top-k
selection differed. Deviation:
exact ties of the (rounded) variance at SCE's top-k threshold keep the lowest flat indices;
``torch.topk``'s pick among ties is implementation-defined (libstdc++'s ``nth_element`` /
``partial_sort``), and in bf16 ties are common. Measured (4 tensors of 1k-4M elements, bf16,
``select_topk`` 0.5): 0.83% of elements differ from mergekit's, all of them from that pick (with
a stable sort patched into mergekit: 100% identical); with ``select_topk`` 1 bf16 is identical.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

import mlx_ssp  # noqa: F401  (OpenBLAS before mlx.core)
import mlx.core as mx

from mlx_ssp.merge import kernels as K
from mlx_ssp.merge.kernels import F32, F64, f32, kernel, rnd


def variance(tvs: Sequence[mx.array], cd=F32) -> mx.array:
    """The population variance across the flat task vectors, as torch's CPU ``var`` computes it:
    Welford's update in float64, rounded to ``cd`` at the end; computed slice by slice (the float64
    temporaries are one slice's), returned in ``cd``."""
    def part(lo, hi):
        mean = m2 = None
        for i, t in enumerate(tvs):
            x = t[lo:hi].astype(F64)
            d = x if mean is None else x - mean
            mean = d if mean is None else mean + d / (i + 1)
            m2 = mx.zeros_like(x) if m2 is None else m2 + d * (x - mean)
        out = (m2 / len(tvs)).astype(cd)
        mx.eval(out)
        return out
    parts = [part(lo, hi) for lo, hi in K.slices(tvs[0].size)]
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)


def topk_variance_mask(tvs: Sequence[mx.array], density: float, cd=F32) -> mx.array:
    """SCE "select": True at the ``k`` elements with the largest variance across the task vectors
    (:func:`variance`), ``k = int(nonzero * density)`` as torch computes it (the count times the
    density in float32). Of the elements equal to the k-th largest variance, the lowest flat
    indices are kept (what a stable descending sort keeps; found by a partition, not a sort)."""
    v = variance(tvs, cd)
    # a variance is >= 0, and non-negative floats order as their bit patterns: rank those (no
    # float32 copy of a bf16 variance)
    var = np.asarray(v.view(mx.uint16 if v.dtype.size == 2 else mx.uint32)).reshape(-1)
    if density >= 1:
        return mx.ones(var.shape, dtype=mx.bool_)
    k = int(np.float32(np.count_nonzero(var)) * np.float32(density)) if density > 0 else 0
    mask = np.zeros(var.size, dtype=bool)
    if k > 0:
        thr = np.partition(var, var.size - k)[var.size - k]
        mask = var > thr
        ties = np.flatnonzero(var == thr)[: k - int(np.count_nonzero(mask))]
        mask[ties] = True
    return mx.array(mask)


def sce_weights(tvs: Sequence[mx.array], mask=None, cd=F32) -> np.ndarray:
    """SCE "calculate": each (masked) task vector's mean square (its squares rounded to ``cd``; the
    sum over the tensor in float64, as torch's cascade sum is about exact, then divided by the count
    in float32 and rounded to ``cd``), over their sum (rounded to ``cd``); equal weights when that
    sum is below 1e-6."""
    size = tvs[0].size

    def terms(lo, hi):
        m = mask[lo:hi] if mask is not None else None
        return [rnd(mx.square(f32(t[lo:hi]) if m is None else f32(t[lo:hi]) * m), cd) for t in tvs]
    if cd == F32 and size:  # summed as torch sums them (one full-size float32 square at a time)
        sq = [mx.array(K.torch_sum(x)).reshape(1) for x in terms(0, size)]
    else:  # bf16 / fp16 round the last bits away: sliced float64 sums, no full-size copy
        sq = K.sums(terms, size)
    w = np.asarray(rnd(mx.concatenate(sq) / np.float32(max(size, 1)), cd), dtype=np.float32)
    total = float(np.asarray(rnd(mx.array(w.sum(dtype=np.float32)), cd)))
    if abs(total) < 1e-6:
        return np.asarray(rnd(mx.full(w.shape, 1.0 / w.size), cd))
    return np.asarray(rnd(mx.array(w) / total, cd))


def _sce_combine(n: int, masked: bool, cd, out):
    """SCE "erase" and the weighted mean of one slice: the sign elected by the sum of the (masked)
    task vectors, the agreeing ones weighted, over the sum of their weights (at least 1e-6), added
    to the base; each step rounded to ``cd`` as mergekit computes it."""
    def f(base, ts, m, ws):
        T = [f32(t) * m if masked else f32(t) for t in ts]
        total = T[0]
        for x in T[1:]:
            total = total + x
        maj = mx.where(total >= 0, 1.0, -1.0)
        merged = den = None
        for x, w in zip(T, ws):
            ew = w * (mx.sign(x) == maj)
            p = rnd(x * ew, cd)
            merged = p if merged is None else merged + p
            den = ew if den is None else den + ew
        merged, den = rnd(merged, cd), mx.maximum(rnd(den, cd), 1e-6)
        return rnd(f32(base) + rnd(merged / den, cd), cd).astype(out)
    return f


def sce_parts(base: mx.array, tvs: Sequence[mx.array], select_topk: float = 1.0, cd=F32, out=None) -> list[mx.array]:
    """SCE merge of flat task vectors (in ``cd``) onto the flat ``base``, as consecutive evaluated
    slices in ``out`` (default ``cd``): the whole-tensor steps (the top-k mask, the weights) first,
    then the elementwise rest slice by slice; no full-size float32 copy."""
    out = out or cd
    tvs = list(tvs)
    mx.eval(base, *tvs)
    mask = topk_variance_mask(tvs, select_topk, cd) if select_topk < 1 else None
    w = [mx.array(float(x), dtype=F32) for x in sce_weights(tvs, mask, cd)]
    comb = kernel(("sce", len(tvs), mask is not None, str(cd), str(out)),
                  lambda: _sce_combine(len(tvs), mask is not None, cd, out))
    one = mx.array(True)
    parts = []
    for lo, hi in K.slices(base.size):
        part = comb(base[lo:hi], [t[lo:hi] for t in tvs], mask[lo:hi] if mask is not None else one, w)
        mx.eval(part)
        parts.append(part)
    return parts or [base.astype(out)]


def sce(base: mx.array, tvs: Sequence[mx.array], select_topk: float = 1.0, cd=F32) -> mx.array:
    """:func:`sce_parts` as one flat float32 array (holding ``cd`` values)."""
    parts = sce_parts(f32(base).reshape(-1), [t.reshape(-1).astype(cd) for t in tvs], select_topk, cd, F32)
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)


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
