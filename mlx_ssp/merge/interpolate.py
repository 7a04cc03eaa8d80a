"""Interpolating merge methods, one tensor at a time, with mergekit 0.1.5's semantics and defaults.

Each function is pure: float inputs (already aligned to the compute dtype by the caller) in, a
float32 result out; the caller rounds it to the compute dtype once.

- :func:`slerp` (Shoemake 1985; mergekit ``slerp``): spherical interpolation between the base
  ``v0`` and ``v1`` by ``t``, the whole tensor as one vector; norms and dot in float32; linear
  interpolation when ``|cos| > 0.9995`` (nearly parallel or antiparallel vectors).
- :func:`nuslerp` (mergekit ``nuslerp``): slerp of the whole tensor (``flatten``, default), of
  each row (last axis) or of each column (``row_wise``), ``t = w1 / (w0 + w1)``; linear where
  ``1 - cos^2 <= eps^2``.
- :func:`multislerp` (mergekit ``multislerp``, Goddard's barycentric slerp): project unit vectors
  to the tangent space at their weighted mean, average, map back, rescale by the weighted norm.
- :func:`karcher` (mergekit ``karcher``): the weighted Riemannian (Karcher) mean of the unit
  vectors by fixed-point iteration (``max_iter``, ``tol``), scaled by the weighted mean norm.
- :func:`model_stock` (Jang et al. 2024, eq. 3-4): ``t = N cos / (1 + (N - 1) cos)`` from the mean
  pairwise cosine of the fine-tunes' offsets from the base; ``t * mean + (1 - t) * base``, per
  tensor or per row (``filter_wise``); the base where the denominator vanishes.
- :func:`nearswap` (mergekit ``nearswap``): per element, weight ``clamp(t / |a - b|, 0, 1)`` of the
  secondary model.
- :func:`arcee_fusion` (mergekit ``arcee_fusion``): keep the fine-tune's change where its
  importance ``|x - b| * KL(softmax(x) || softmax(b))`` (rows on the last axis) reaches
  ``median + 1.5 IQR``.

Deviations from mergekit 0.1.5 (all numerical, none in the semantics):

- Arithmetic runs in float32 with one rounding to the compute dtype at the end; mergekit rounds
  each bf16 / fp16 intermediate of nuslerp, multislerp, karcher, model_stock and arcee_fusion (slerp
  computes in float32 there too; :func:`nearswap` and :func:`model_stock` round op by op like
  mergekit). In bf16 results can differ by an ulp or two of bf16.
- Reductions (norms, dots) sum in MLX's float32 order, not torch's (last-bit float32 differences).
- arcee_fusion's quantiles of a tensor over 10^6 elements come from a sample drawn with a PCG64
  stream seeded by (seed, tensor name, model) instead of torch's global generator.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

import mlx_ssp  # noqa: F401  (OpenBLAS before mlx.core)
import mlx.core as mx

from mlx_ssp.merge.kernels import F32, f32, rnd


def _norm(x: mx.array, axis=None, keepdims: bool = False) -> mx.array:
    return mx.sqrt(mx.sum(mx.square(x), axis=axis, keepdims=keepdims))


def _item(x: mx.array) -> np.float32:
    return np.float32(x.item())


def _s(v) -> mx.array:
    """A float32 0-d array (a NumPy scalar on the left of ``*`` would turn an MLX array into NumPy)."""
    return mx.array(float(v), dtype=F32)


def slerp(t: float, v0: mx.array, v1: mx.array, dot_threshold: float = 0.9995, eps: float = 1e-8) -> mx.array:
    """Spherical interpolation from ``v0`` (t = 0) to ``v1`` (t = 1), the tensor as one vector.
    Zero-norm vectors count as norm 1; when ``|cos| > dot_threshold`` the coefficients are the
    linear ``1 - t`` and ``t`` (mergekit's fallback for nearly parallel vectors)."""
    a, b = f32(v0), f32(v1)
    t32 = np.float32(t)
    one = np.float32(1)
    if a.size == 0:
        return a
    na, nb = _item(_norm(a)), _item(_norm(b))
    na = na if na > eps else one
    nb = nb if nb > eps else one
    dot = np.clip(_item(mx.sum((a / _s(na)) * (b / _s(nb)))), np.float32(-1), one)
    if abs(dot) > dot_threshold:
        ca, cb = one - t32, t32
    else:
        theta = np.arccos(dot)
        s = np.sin(theta)
        ca, cb = np.sin((one - t32) * theta) / s, np.sin(t32 * theta) / s
    return _s(ca) * a + _s(cb) * b


def _vectors(x: mx.array, shape: Optional[tuple], row_wise: bool, flatten: bool) -> mx.array:
    """``x`` (flat) as the 2-D stack of vectors nuslerp interpolates: one (flatten), the rows of
    the last axis, or the vectors along axis 0 (row_wise)."""
    if flatten or not shape or len(shape) < 2:
        return x.reshape(1, -1)
    x = x.reshape(shape)
    if row_wise:
        x = mx.swapaxes(x, 0, -1)
    return x.reshape(-1, x.shape[-1])


def _unvectors(v: mx.array, shape: Optional[tuple], row_wise: bool, flatten: bool) -> mx.array:
    if flatten or not shape or len(shape) < 2:
        return v.reshape(-1)
    if row_wise:
        s = list(shape)
        s[0], s[-1] = s[-1], s[0]
        return mx.swapaxes(v.reshape(s), 0, -1).reshape(-1)
    return v.reshape(-1)


def nuslerp(t: float, v0: mx.array, v1: mx.array, shape: Optional[tuple] = None, row_wise: bool = False,
            flatten: bool = True, eps: float = 1e-8) -> mx.array:
    """mergekit's nuslerp of two flat tensors of shape ``shape``: per vector (see
    :func:`_vectors`), ``(sin((1 - t) th) v0 + sin(t th) v1) / sin th``, linear where
    ``1 - cos^2 <= eps^2``. Returns the flat float32 result."""
    a = _vectors(f32(v0), shape, row_wise, flatten)
    b = _vectors(f32(v1), shape, row_wise, flatten)
    au = a / mx.maximum(_norm(a, axis=-1, keepdims=True), 1e-7)
    bu = b / mx.maximum(_norm(b, axis=-1, keepdims=True), 1e-7)
    cos = mx.clip(mx.sum(au * bu, axis=-1, keepdims=True), -1.0, 1.0)
    colinear = (1 - mx.square(cos)) <= eps ** 2
    theta = mx.arccos(mx.where(colinear, 0.0, cos))
    s = mx.sin(theta)
    sph = (mx.sin((1 - t) * theta) * a + mx.sin(t * theta) * b) / mx.where(colinear, 1.0, s)
    res = mx.where(colinear, (1 - t) * a + t * b, sph)
    return _unvectors(res, shape, row_wise, flatten)


def multislerp(xs: Sequence[mx.array], weights: Sequence[float], normalize_weights: bool = True,
               eps: float = 1e-8) -> mx.array:
    """mergekit's multislerp of flat tensors: barycentric interpolation on the hypersphere (tangent
    space at the weighted mean of the unit vectors, exponential map back), scaled by the weighted
    mean norm. Two antipodal inputs whose weighted mean vanishes fall back to the linear
    combination; more than two raise ``ValueError``."""
    if len(xs) == 1:
        return f32(xs[0])
    w = np.asarray(weights, dtype=np.float32)
    if normalize_weights:
        w = w / w.sum()
    X = mx.stack([f32(x) for x in xs])
    W = mx.array(w).reshape(-1, 1)
    norms = _norm(X, axis=-1, keepdims=True)
    units = X / (norms + eps)
    mean = mx.sum(units * W, axis=0)
    mean_norm = _item(_norm(mean))
    if mean_norm < eps:
        if len(xs) == 2:
            return X[0] * W[0] + X[1] * W[1]
        raise ValueError("multislerp: the weighted sum of the input tensors is zero (antipodal inputs with "
                         "balancing weights); use different weights")
    mean = mean / _s(mean_norm)
    dots = mx.sum(units * mean, axis=-1, keepdims=True)
    tangent = mx.sum((units - dots * mean) * W, axis=0)
    tn = _norm(tangent) + eps
    res = mean * mx.cos(tn) + tangent * (mx.sin(tn) / tn)
    return res * mx.sum(norms.reshape(-1) * W.reshape(-1))


def karcher(xs: Sequence[mx.array], alphas: Optional[Sequence[float]] = None, max_iter: int = 10,
            tol: float = 1e-5) -> mx.array:
    """mergekit's weighted Karcher mean of flat tensors on the unit sphere (equal weights by
    default), scaled by ``sum alpha_i |x_i|``. Inputs with norm <= tol are left out of the mean.
    Each fixed-point step is two matrix-vector products over the stacked unit vectors: the dots
    with the mean, and the tangent ``sum_i c_i (u_i - dot_i m)`` as ``c^T U - (c . dot) m``."""
    X = [f32(x).reshape(-1) for x in xs]
    if len(X) == 1:
        return X[0]
    alphas = [1.0 / len(X)] * len(X) if alphas is None else list(alphas)
    norms = [_item(_norm(x)) for x in X]
    valid = [i for i, n in enumerate(norms) if n > tol]
    if not valid:
        return mx.zeros_like(X[0])
    a_sum = sum(alphas[i] for i in valid)
    al = np.array([alphas[i] / a_sum for i in valid], dtype=np.float64)
    U = mx.stack([X[i] / _s(norms[i]) for i in valid])
    mean = mx.array(al.astype(np.float32)) @ U
    mn = _item(_norm(mean))
    mean = U[0] if mn < tol else mean / _s(mn)
    for _ in range(max_iter):
        dots = np.clip(np.array(U @ mean, dtype=np.float64), -1.0, 1.0)
        theta = np.arccos(dots)
        moving = theta >= tol  # mergekit skips inputs already at the mean
        c = np.where(moving, al * theta / np.where(moving, np.sin(theta), 1.0), 0.0)
        tangent = mx.array(c.astype(np.float32)) @ U - _s(np.dot(c, dots)) * mean
        tn = _item(_norm(tangent))
        if tn < tol:
            break
        mean = _s(np.cos(tn)) * mean + _s(np.sin(tn)) * (tangent / _s(tn))
        un = _item(_norm(mean))
        if un > tol:
            mean = mean / _s(un)
    return _s(sum(a * n for a, n in zip(alphas, norms))) * mean


def model_stock(base: mx.array, xs: Sequence[mx.array], cd, shape: Optional[tuple] = None,
                filter_wise: bool = False) -> mx.array:
    """Model Stock (Jang et al. 2024): the interpolation ratio ``t = N cos / (1 + (N - 1) cos)``
    from the mean pairwise cosine of the offsets ``x_i - base`` (over the whole tensor, or per row
    of the last axis with ``filter_wise``), then ``t * mean(x) + (1 - t) * base``; where the
    denominator is below 1e-6 in magnitude, the base. Elementwise steps round to ``cd`` as
    mergekit's do; returns the flat float32 (cd-rounded) result."""
    width = shape[-1] if (filter_wise and shape and len(shape) >= 2) else None
    w0 = f32(base).reshape(-1, width) if width else f32(base).reshape(1, -1)
    ws = [f32(x).reshape(w0.shape) for x in xs]
    offsets = [rnd(w - w0, cd) for w in ws]
    norms = [rnd(_norm(o, axis=-1), cd) for o in offsets]
    cos = []
    for i in range(len(offsets)):
        for j in range(i + 1, len(offsets)):
            prod = rnd(norms[i] * norms[j], cd)
            dot = rnd(mx.sum(rnd(offsets[i] * offsets[j], cd), axis=-1), cd)
            cos.append(mx.clip(rnd(dot / mx.maximum(prod, 1e-6), cd), -1.0, 1.0))
    c = rnd(mx.mean(mx.stack(cos), axis=0), cd)[..., None]
    n = len(ws)
    den = rnd(1 + rnd((n - 1) * c, cd), cd)
    singular = mx.abs(den) < 1e-6
    t = mx.where(singular, 0.0, rnd(rnd(n * c, cd) / mx.where(singular, 1.0, den), cd))
    total = ws[0]
    for w in ws[1:]:
        total = rnd(total + w, cd)
    avg = rnd(total / n, cd)
    res = rnd(rnd(t * avg, cd) + rnd(rnd(1 - t, cd) * w0, cd), cd)
    return res.reshape(-1)


def nearswap(t: float, a: mx.array, b: mx.array, cd) -> mx.array:
    """NearSwap: per element, ``w = clamp(t / max(|a - b|, 1e-6), 0, 1)`` and ``w b + (1 - w) a``
    (``a`` the base); rounded to ``cd`` op by op as mergekit computes it."""
    a, b = f32(a), f32(b)
    diff = mx.maximum(mx.abs(rnd(a - b, cd)), 1e-6)
    w = mx.clip(rnd(t / diff, cd), 0.0, 1.0)
    return rnd(rnd(w * b, cd) + rnd(rnd(1 - w, cd) * a, cd), cd)


def fusion_importance(x: mx.array, base: mx.array, width: int) -> mx.array:
    """arcee_fusion's importance ``|x - b| * KL(softmax(x) || softmax(b))``, softmax and KL over
    rows of ``width`` elements (the tensor's last axis); flat, float32."""
    xr, br = f32(x).reshape(-1, width), f32(base).reshape(-1, width)
    p = mx.softmax(xr, axis=-1) + 1e-8
    q = mx.softmax(br, axis=-1) + 1e-8
    kl = mx.sum(p * mx.log(p / q), axis=-1, keepdims=True)
    return (mx.abs(xr - br) * kl).reshape(-1)


#: arcee_fusion estimates its quantiles from this many samples (with replacement) of larger tensors
QUANTILE_SAMPLE = 1_000_000


def fusion_threshold(importance: mx.array, seed: int) -> float:
    """``median + 1.5 (q3 - q1)`` of the importance, each quantile the sorted element at
    ``floor(q (n - 1))`` (of a seeded sample of QUANTILE_SAMPLE when larger, as mergekit does)."""
    v = np.asarray(importance)
    if v.size > QUANTILE_SAMPLE:
        v = v[np.random.Generator(np.random.PCG64(seed)).integers(0, v.size, QUANTILE_SAMPLE)]
    s = np.sort(v)
    q1, med, q3 = (s[int(np.float32(q) * np.float32(s.size - 1))] for q in (0.25, 0.5, 0.75))
    return float(np.float32(med) + np.float32(1.5) * np.float32(q3 - q1))


def arcee_fusion(base: mx.array, x: mx.array, shape: Optional[tuple], seed: int, cd) -> mx.array:
    """Arcee Fusion: ``b + (x - b) * [importance >= threshold]`` (see :func:`fusion_importance`,
    :func:`fusion_threshold`); the change ``x - b`` is rounded to ``cd`` as mergekit computes it."""
    width = shape[-1] if shape else x.size
    b32, x32 = f32(base).reshape(-1), f32(x).reshape(-1)
    imp = fusion_importance(x32, b32, max(1, width))
    keep = imp >= fusion_threshold(imp, seed)
    return b32 + rnd(rnd(x32 - b32, cd) * keep, cd)
