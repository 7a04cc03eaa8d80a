"""Interpolating merge methods, one tensor at a time, with mergekit 0.1.5's semantics and defaults.

Each function is pure: float inputs (already aligned to the compute dtype ``cd`` by the caller) in,
a float32 array out, which the caller rounds to ``cd`` once more (a no-op where the last step
already rounded). Every intermediate that mergekit holds in ``cd`` is rounded to it (:func:`rnd`:
torch computes a bf16 op in float32 and rounds the result), so bf16 outputs equal mergekit's bit for
bit in the parity test (slerp, nuslerp, multislerp, model_stock, nearswap, arcee_fusion); slerp
works in float32 throughout, as mergekit does.

slerp and model_stock run slice by slice (``*_parts``: the merge engine's entry points): their
whole-tensor statistics (norms, dots) are summed over slices (:func:`.kernels.sums`), then the
output is computed slice by slice in the output dtype, the inputs staying in their own dtype (each
slice aligned to ``cd`` where it is used). No full-size float32 copy of a tensor is ever held (peak
memory: the inputs, the output and one slice's temporaries); :func:`slerp` and :func:`model_stock`
return the same values as one float32 array.

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

Deviations from mergekit 0.1.5 (numerical only):

- Reductions (norms, dots) sum in MLX's float32 order, not torch's: float32 results differ in the
  last bits (1e-6 relative in the parity test), and a bf16 result can now and then round the other
  way (slerp: single elements by one ulp). slerp's and model_stock's whole-tensor sums add float32
  partial sums of 256 elements in float64 (:func:`.kernels.sums`), within ~1e-8 of the exact sum;
  a plain float32 sum of 32.8M elements was off by up to 7% (the vocabulary tensors). Per-row
  sums (``filter_wise``) are MLX's float32 row sums, as before. karcher's iterations amplify this: in bf16 about 60% of its
  elements are bit-identical to mergekit's, the rest within two ulps.
- arcee_fusion's quantiles of a tensor over 10^6 elements come from a sample drawn with a PCG64
  stream seeded by (seed, tensor name, model) instead of torch's global generator.
- nuslerp and multislerp take no base model here (see :mod:`.methods`).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

import mlx_ssp  # noqa: F401  (OpenBLAS before mlx.core)
import mlx.core as mx

from mlx_ssp.merge import kernels as K
from mlx_ssp.merge.kernels import F32, f32, kernel, rnd


def _norm(x: mx.array, axis=None, keepdims: bool = False) -> mx.array:
    return mx.sqrt(mx.sum(mx.square(x), axis=axis, keepdims=keepdims))


def _item(x: mx.array) -> np.float32:
    return np.float32(x.item())


def _s(v) -> mx.array:
    """A float32 0-d array (a NumPy scalar on the left of ``*`` would turn an MLX array into NumPy)."""
    return mx.array(float(v), dtype=F32)


def _slerp_sq(cd):
    return lambda a, b: (mx.square(f32(a.astype(cd))), mx.square(f32(b.astype(cd))))


def _slerp_dot(cd):
    return lambda a, b, na, nb: (f32(a.astype(cd)) / na) * (f32(b.astype(cd)) / nb)


def _slerp_mix(cd, out):
    return lambda a, b, ca, cb: (ca * f32(a.astype(cd)) + cb * f32(b.astype(cd))).astype(cd).astype(out)


def slerp_coefficients(t: float, v0: mx.array, v1: mx.array, cd=F32, dot_threshold: float = 0.9995,
                       eps: float = 1e-8) -> tuple[np.float32, np.float32]:
    """``(ca, cb)`` with ``slerp = ca * v0 + cb * v1`` (the flat inputs aligned to ``cd``, then in
    float32): the norms, then the dot of the unit vectors, each summed slice by slice
    (:func:`.kernels.sums`). Zero-norm vectors count as norm 1; when ``|cos| > dot_threshold`` the
    coefficients are the linear ``1 - t`` and ``t`` (mergekit's fallback for nearly parallel
    vectors)."""
    t32, one = np.float32(t), np.float32(1)
    n = v0.size
    sq = kernel(("slerp_sq", str(cd)), lambda: _slerp_sq(cd))
    sa, sb = K.sums(lambda lo, hi: sq(v0[lo:hi], v1[lo:hi]), n)
    na, nb = np.sqrt(_item(sa)), np.sqrt(_item(sb))
    na = na if na > eps else one
    nb = nb if nb > eps else one
    dk = kernel(("slerp_dot", str(cd)), lambda: _slerp_dot(cd))
    (d,) = K.sums(lambda lo, hi: [dk(v0[lo:hi], v1[lo:hi], _s(na), _s(nb))], n)
    dot = np.clip(_item(d), np.float32(-1), one)
    if abs(dot) > dot_threshold:
        return one - t32, t32
    theta = np.arccos(dot)
    s = np.sin(theta)
    return np.sin((one - t32) * theta) / s, np.sin(t32 * theta) / s


def slerp_parts(t: float, v0: mx.array, v1: mx.array, cd=F32, out=None, dot_threshold: float = 0.9995,
                eps: float = 1e-8) -> list[mx.array]:
    """Spherical interpolation from ``v0`` (t = 0) to ``v1`` (t = 1), the tensor as one vector
    (:func:`slerp_coefficients`), as consecutive evaluated slices in ``out`` (default ``cd``): the
    float32 ``ca * v0 + cb * v1`` rounded once to ``cd``. Inputs stay in their dtype; each slice is
    aligned to ``cd`` where it is used, so no full-size float32 copy exists."""
    out = out or cd
    mx.eval(v0, v1)
    if v0.size == 0:
        return [v0.astype(cd).astype(out)]
    ca, cb = slerp_coefficients(t, v0, v1, cd, dot_threshold, eps)
    mix = kernel(("slerp_mix", str(cd), str(out)), lambda: _slerp_mix(cd, out))
    parts = []
    for lo, hi in K.slices(v0.size):
        part = mix(v0[lo:hi], v1[lo:hi], _s(ca), _s(cb))
        mx.eval(part)
        parts.append(part)
    return parts


def slerp(t: float, v0: mx.array, v1: mx.array, dot_threshold: float = 0.9995, eps: float = 1e-8) -> mx.array:
    """:func:`slerp_parts` in float32, as one array of ``v0``'s shape."""
    parts = slerp_parts(t, v0.reshape(-1), v1.reshape(-1), F32, F32, dot_threshold, eps)
    return (parts[0] if len(parts) == 1 else mx.concatenate(parts)).reshape(v0.shape)


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
            flatten: bool = True, eps: float = 1e-8, cd=F32) -> mx.array:
    """mergekit's nuslerp of two flat tensors of shape ``shape``: per vector (see
    :func:`_vectors`), ``(sin((1 - t) th) v0 + sin(t th) v1) / sin th``, linear where
    ``1 - cos^2 <= eps^2``; each step rounded to ``cd`` as mergekit computes it. Returns the flat
    float32 result."""
    r = lambda x: rnd(x, cd)  # noqa: E731
    a = _vectors(f32(v0), shape, row_wise, flatten)
    b = _vectors(f32(v1), shape, row_wise, flatten)
    au = r(a / mx.maximum(r(_norm(a, axis=-1, keepdims=True)), 1e-7))
    bu = r(b / mx.maximum(r(_norm(b, axis=-1, keepdims=True)), 1e-7))
    cos = mx.clip(r(mx.sum(r(au * bu), axis=-1, keepdims=True)), -1.0, 1.0)
    colinear = r(1 - r(mx.square(cos))) <= eps ** 2
    theta = r(mx.arccos(mx.where(colinear, 0.0, cos)))
    s = r(mx.sin(theta))
    num = r(r(r(mx.sin(r((1 - t) * theta))) * a) + r(r(mx.sin(r(t * theta))) * b))
    sph = r(num / mx.where(colinear, 1.0, s))
    res = mx.where(colinear, r(r((1 - t) * a) + r(t * b)), sph)
    return _unvectors(res, shape, row_wise, flatten)


def multislerp(xs: Sequence[mx.array], weights: Sequence[float], normalize_weights: bool = True,
               eps: float = 1e-8, cd=F32) -> mx.array:
    """mergekit's multislerp of flat tensors: barycentric interpolation on the hypersphere (tangent
    space at the weighted mean of the unit vectors, exponential map back), scaled by the weighted
    mean norm; each step rounded to ``cd`` as mergekit computes it (the weights too). Two antipodal
    inputs whose weighted mean vanishes fall back to the linear combination; more than two raise
    ``ValueError``."""
    if len(xs) == 1:
        return f32(xs[0])
    r = lambda x: rnd(x, cd)  # noqa: E731
    W = r(mx.array(np.asarray(weights, dtype=np.float32)))
    if normalize_weights:
        W = r(W / r(mx.sum(W)))
    W = W.reshape(-1, 1)
    X = mx.stack([f32(x) for x in xs])
    norms = r(_norm(X, axis=-1, keepdims=True))
    units = r(X / r(norms + eps))
    mean = r(mx.sum(r(units * W), axis=0))
    mean_norm = r(_norm(mean))
    if _item(mean_norm) < eps:
        if len(xs) == 2:
            return r(r(X[0] * W[0]) + r(X[1] * W[1]))
        raise ValueError("multislerp: the weighted sum of the input tensors is zero (antipodal inputs with "
                         "balancing weights); use different weights")
    mean = r(mean / mean_norm)
    dots = r(mx.sum(r(units * mean), axis=-1, keepdims=True))
    tangent = r(mx.sum(r(r(units - r(dots * mean)) * W), axis=0))
    tn = r(r(_norm(tangent)) + eps)
    res = r(r(mean * r(mx.cos(tn))) + r(tangent * r(r(mx.sin(tn)) / tn)))
    return r(res * r(mx.sum(r(norms.reshape(-1) * W.reshape(-1)))))


def karcher(xs: Sequence[mx.array], alphas: Optional[Sequence[float]] = None, max_iter: int = 10,
            tol: float = 1e-5, cd=F32) -> mx.array:
    """mergekit's weighted Karcher mean of flat tensors on the unit sphere (equal weights by
    default), scaled by ``sum alpha_i |x_i|``; inputs with norm <= tol are left out of the mean.
    Norms are float32; the unit vectors, the mean and the tangent are held in ``cd`` (each step
    rounded), as mergekit holds them in the input dtype."""
    r = lambda x: rnd(x, cd)  # noqa: E731
    X = [f32(x).reshape(-1) for x in xs]
    if len(X) == 1:
        return X[0]
    alphas = [1.0 / len(X)] * len(X) if alphas is None else list(alphas)
    norms = [_item(_norm(x)) for x in X]
    units = [r(x / _s(n)) if n != 0 else mx.zeros_like(x) for x, n in zip(X, norms)]
    valid = [i for i, n in enumerate(norms) if n > tol]
    if not valid:
        return mx.zeros_like(X[0])
    a_sum = sum(alphas[i] for i in valid)
    al = [alphas[i] / a_sum for i in valid]
    us = [units[i] for i in valid]
    mean = r(_s(al[0]) * us[0])
    for a, u in zip(al[1:], us[1:]):
        mean = r(mean + r(_s(a) * u))
    mn = _item(_norm(mean))
    mean = us[0] if mn < tol else r(mean / _s(mn))
    for _ in range(max_iter):
        tangent = None
        for a, u in zip(al, us):
            dot = mx.clip(r(mx.sum(mean * u)), -1.0, 1.0)
            theta = r(mx.arccos(dot))
            if theta.item() < tol:  # already at the mean
                continue
            coef = r(a * r(theta / r(mx.sin(theta))))
            step = r(coef * r(u - r(dot * mean)))
            tangent = step if tangent is None else r(tangent + step)
        if tangent is None:
            break
        tn = _item(_norm(tangent))
        if tn < tol:
            break
        mean = r(r(_s(np.cos(tn)) * mean) + r(_s(np.sin(tn)) * r(tangent / _s(tn))))
        un = _item(_norm(mean))
        if un > tol:
            mean = r(mean / _s(un))
    return r(_s(sum(np.float32(a) * n for a, n in zip(alphas, norms))) * mean)


def _ms_terms(n: int, cd):
    """A slice's terms of model_stock's sums: the squares of each offset ``x_i - base`` (held in
    ``cd``, as mergekit holds them) and the cd-rounded products of each pair of offsets."""
    def f(w0, ws):
        b = f32(w0.astype(cd))
        offs = [rnd(f32(w.astype(cd)) - b, cd) for w in ws]
        pairs = [rnd(offs[i] * offs[j], cd) for i in range(n) for j in range(i + 1, n)]
        return [mx.square(o) for o in offs] + pairs
    return f


def _ms_combine(n: int, cd, out):
    """``t * mean(x) + (1 - t) * base``, each step rounded to ``cd``; the last rounding is the cast
    to ``cd`` itself (measured: a fused cast beats a float32 result cast in another pass, and
    ``1 - t`` computed in the kernel beats passing it in)."""
    def f(ws, w0, t):
        total = f32(ws[0].astype(cd))
        for w in ws[1:]:
            total = rnd(total + f32(w.astype(cd)), cd)
        avg = rnd(total / n, cd)
        return (rnd(t * avg, cd) + rnd(rnd(1 - t, cd) * f32(w0.astype(cd)), cd)).astype(cd).astype(out)
    return f


def _ms_width(shape: Optional[tuple], filter_wise: bool) -> Optional[int]:
    return shape[-1] if (filter_wise and shape and len(shape) >= 2) else None


def model_stock_ratio(base: mx.array, xs: Sequence[mx.array], cd, width: Optional[int] = None) -> mx.array:
    """Model Stock's interpolation ratio ``t = N cos / (1 + (N - 1) cos)`` (0 where the denominator
    is below 1e-6 in magnitude) from the mean pairwise cosine of the offsets ``x_i - base`` over the
    whole flat tensor (shape (1, 1)) or per row of ``width`` elements (shape (rows, 1)); the norms
    and dots are summed slice by slice (:func:`.kernels.sums`), every step rounded to ``cd``."""
    n = len(xs)
    terms = kernel(("ms_terms", n, str(cd)), lambda: _ms_terms(n, cd))
    got = K.sums(lambda lo, hi: terms(base[lo:hi], [x[lo:hi] for x in xs]), base.size, width)
    norms = [rnd(mx.sqrt(s), cd) for s in got[:n]]
    dots = iter(got[n:])
    cos = []
    for i in range(n):
        for j in range(i + 1, n):
            prod = rnd(norms[i] * norms[j], cd)
            dot = rnd(next(dots), cd)
            cos.append(mx.clip(rnd(dot / mx.maximum(prod, 1e-6), cd), -1.0, 1.0))
    c = rnd(mx.mean(mx.stack(cos), axis=0), cd)[..., None]
    den = rnd(1 + rnd((n - 1) * c, cd), cd)
    singular = mx.abs(den) < 1e-6
    return mx.where(singular, 0.0, rnd(rnd(n * c, cd) / mx.where(singular, 1.0, den), cd))


def model_stock_parts(base: mx.array, xs: Sequence[mx.array], cd, out=None, shape: Optional[tuple] = None,
                      filter_wise: bool = False) -> list[mx.array]:
    """Model Stock (Jang et al. 2024) of flat tensors: ``t * mean(x) + (1 - t) * base`` with ``t``
    from :func:`model_stock_ratio` (per row of the last axis with ``filter_wise``), each step
    rounded to ``cd`` as mergekit computes it; consecutive evaluated slices in ``out`` (default
    ``cd``). Inputs stay in their dtype (aligned to ``cd`` slice by slice): no full-size copy."""
    out = out or cd
    mx.eval(base, *xs)
    if base.size == 0:
        return [base.astype(cd).astype(out)]
    width = _ms_width(shape, filter_wise)
    t = model_stock_ratio(base, xs, cd, width)
    mx.eval(t)
    comb = kernel(("ms_combine", len(xs), str(cd), str(out)), lambda: _ms_combine(len(xs), cd, out))
    parts = []
    for lo, hi in K.slices(base.size, width or 1):
        # per row: a column of t against rows of the slice; whole tensor: flat slices and a 0-d t
        # (measured ~1.4x faster than a (1, n) slice broadcast against a (1, 1) t)
        rows = (-1, width) if width else (-1,)
        tt = t[lo // width: hi // width] if width else t.reshape(())
        part = comb([x[lo:hi].reshape(rows) for x in xs], base[lo:hi].reshape(rows), tt).reshape(-1)
        mx.eval(part)
        parts.append(part)
    return parts


def model_stock(base: mx.array, xs: Sequence[mx.array], cd, shape: Optional[tuple] = None,
                filter_wise: bool = False) -> mx.array:
    """:func:`model_stock_parts` as one flat float32 array (holding ``cd`` values)."""
    parts = model_stock_parts(base.reshape(-1), [x.reshape(-1) for x in xs], cd, F32, shape, filter_wise)
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)


def nearswap(t: float, a: mx.array, b: mx.array, cd) -> mx.array:
    """NearSwap: per element, ``w = clamp(t / max(|a - b|, 1e-6), 0, 1)`` and ``w b + (1 - w) a``
    (``a`` the base); rounded to ``cd`` op by op as mergekit computes it."""
    a, b = f32(a), f32(b)
    diff = mx.maximum(mx.abs(rnd(a - b, cd)), rnd(mx.array(1e-6, dtype=F32), cd))
    # torch computes ``scalar / tensor`` as ``reciprocal(tensor) * scalar``: two roundings
    w = mx.clip(rnd(rnd(1 / diff, cd) * t, cd), 0.0, 1.0)
    return rnd(rnd(w * b, cd) + rnd(rnd(1 - w, cd) * a, cd), cd)


def fusion_importance(x: mx.array, base: mx.array, width: int, cd) -> mx.array:
    """arcee_fusion's importance ``|x - b| * KL(softmax(x) || softmax(b))``, softmax and KL over
    rows of ``width`` elements (the tensor's last axis); flat, float32 holding ``cd`` values (each
    step rounded to ``cd`` as mergekit computes it, so the threshold sees the same values)."""
    xr, br = f32(x).reshape(-1, width), f32(base).reshape(-1, width)
    p = rnd(rnd(mx.softmax(xr, axis=-1), cd) + 1e-8, cd)
    q = rnd(rnd(mx.softmax(br, axis=-1), cd) + 1e-8, cd)
    kl = rnd(mx.sum(rnd(p * rnd(mx.log(rnd(p / q, cd)), cd), cd), axis=-1, keepdims=True), cd)
    return rnd(mx.abs(rnd(xr - br, cd)) * kl, cd).reshape(-1)


#: arcee_fusion estimates its quantiles from this many samples (with replacement) of larger tensors
QUANTILE_SAMPLE = 1_000_000


def fusion_threshold(importance: mx.array, seed: int, cd) -> float:
    """``median + 1.5 (q3 - q1)`` of the importance (rounded to ``cd`` step by step), each quantile
    the sorted element at ``floor(q (n - 1))`` (of a seeded sample of QUANTILE_SAMPLE when larger,
    as mergekit does)."""
    v = np.asarray(importance)
    if v.size > QUANTILE_SAMPLE:
        v = v[np.random.Generator(np.random.PCG64(seed)).integers(0, v.size, QUANTILE_SAMPLE)]
    s = np.sort(v)
    q1, med, q3 = (s[int(np.float32(q) * np.float32(s.size - 1))] for q in (0.25, 0.5, 0.75))
    r = lambda y: rnd(mx.array(y, dtype=F32), cd)  # noqa: E731
    return float(r(med + r(1.5 * r(q3 - q1).item()).item()).item())


def arcee_fusion(base: mx.array, x: mx.array, shape: Optional[tuple], seed: int, cd) -> mx.array:
    """Arcee Fusion: ``b + (x - b) * [importance >= threshold]`` (see :func:`fusion_importance`,
    :func:`fusion_threshold`); the change ``x - b`` is rounded to ``cd`` and the sum kept in float32
    (mergekit's mask is float32) until the caller's one rounding."""
    width = shape[-1] if shape else x.size
    b32, x32 = f32(base).reshape(-1), f32(x).reshape(-1)
    imp = fusion_importance(x32, b32, max(1, width), cd)
    keep = imp >= fusion_threshold(imp, seed, cd)
    return b32 + rnd(rnd(x32 - b32, cd) * keep, cd)
