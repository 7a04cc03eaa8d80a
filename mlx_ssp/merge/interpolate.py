"""Interpolating merge methods, one tensor at a time, with mergekit 0.1.5's semantics and defaults.

Each function is pure: float inputs (already aligned to the compute dtype ``cd`` by the caller) in,
a float32 array out, which the caller rounds to ``cd`` once more (a no-op where the last step
already rounded). Every intermediate that mergekit holds in ``cd`` is rounded to it (:func:`rnd`:
torch computes a bf16 op in float32 and rounds the result), so bf16 outputs equal mergekit's bit for
bit in the parity test (slerp, nuslerp, multislerp, model_stock, nearswap, arcee_fusion); slerp
works in float32 throughout, as mergekit does.

slerp, model_stock, nuslerp, multislerp and karcher run slice by slice (``*_parts``: the merge
engine's entry points): their whole-tensor statistics (norms, dots) are passes of sliced sums
(:func:`.kernels.sums`, :func:`.kernels.sweep`), then the output is computed slice by slice in the
output dtype, the inputs staying in their own dtype (each slice aligned to ``cd`` where it is
used). No full-size float32 copy of a tensor is ever held (peak memory: the inputs, the output
and one slice's temporaries; multislerp and karcher also hold what their later passes read again
in ``cd``, as mergekit holds it: see :mod:`.sphere_means`). :func:`slerp`, :func:`model_stock`, :func:`nuslerp`,
:func:`multislerp` and :func:`karcher` return the same values as one float32 array.

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

- Sums follow torch's where that decides the value. Norms of nuslerp, multislerp, karcher,
  model_stock and slerp (``torch.norm`` / ``vector_norm``) are summed in the order of torch's CPU norm kernel
  (:data:`.kernels.TORCH_LANES`: 8 float32 lanes, which drift by ~1e-4 relative over 4M elements;
  karcher keeps these float32 norms, so an exact norm changed ~2.5% of its bf16 roundings); slerp
  takes them per 2^20-element chunk, as mergekit does. In float32 the dots of slerp, nuslerp
  (flattened or per row) and model_stock, and model_stock's mean of the pairs' cosines, are summed
  in torch's single-thread order (:func:`.kernels.torch_sum`, an exact emulation of its cascade;
  float32 model_stock is then bit-identical on the stored models); other sums (and every dot in
  bf16 / fp16, whose rounding hides the last bits) are float64 sums rounded to float32, which
  equal torch's single-threaded float32 cascade nearly always. A 0-d float32 tensor on the *left*
  of a bf16 tensor is cast to bf16 by torch (on the right it stays float32): karcher's
  ``cos(tn) * mean``, ``sin(tn) * ...`` and ``scale * mean`` round that factor first.
- Measured against mergekit 0.1.5's per-tensor kernels (torch 2.14.1 CPU, one thread; tensors
  4096 x 1024, 1024 x 1024, 1024 and 8000 x 256, base N(0, 0.02), models base + N(0, 0.002)):
  bf16 slerp, nuslerp (all three modes), multislerp, karcher and model_stock (both modes) are
  bit-identical on every element (before: slerp 99.97%, nuslerp 47%, multislerp 51%, karcher
  27%), float32 slerp too (was 0.03%); float32 model_stock 99.7% (was 49%; per row 88%, was
  66%). Whole models (3 small Llama-shaped bf16 models,
  ``mergekit-yaml``): karcher, multislerp and nuslerp bit-identical on every tensor.
- Not bit for bit: mergekit's results depend on torch's thread count. With T threads torch splits a
  whole-tensor ``sum`` into T partial sums, each rounded to the tensor's dtype: nuslerp's bf16
  cosine of a 2^18-element tensor took another bf16 value with 2 threads than with 1 or 4, and
  4 of 39 tensors of a small model then differ (up to 234 ulps). We compute the single-threaded
  value. In float32 the angles, sines and dots are torch's own (:mod:`.torch_math`: oneMKL's
  vector math and ``sdot`` where Intel's runtime is installed, as torch's x86_64 builds compute
  them), the dots of multislerp and of nuslerp per column summed in torch's order: against
  mergekit's kernels run with one torch thread, float32 slerp, nuslerp (all three modes),
  multislerp and karcher are bit-identical on 4 tensors of 1k-4M elements; without oneMKL
  (NumPy's correctly rounded angles) multislerp and slerp still are, nuslerp 96-100% per mode,
  karcher 24%, relative differences ~2e-7.
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
from mlx_ssp.merge import native as NV
from mlx_ssp.merge.kernels import F32, f32, kernel, rnd


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


def _mean_of_pairs(cos: list, width: Optional[int]) -> mx.array:
    """The sum of the pairs' cosines as torch's ``stack(cos).mean(dim=0)`` sums them before it
    divides (MLX's mean multiplies by ``1 / n``, which rounds differently): per tensor an inner
    sum (:func:`.kernels.torch_sum`), per row one running sum per row."""
    if width is None:
        return mx.array(K.torch_sum(np.concatenate([np.asarray(c, dtype=np.float32).reshape(-1) for c in cos])))
    total = cos[0]
    for c in cos[1:]:
        total = total + c
    return total


def model_stock_ratio(base: mx.array, xs: Sequence[mx.array], cd, width: Optional[int] = None) -> mx.array:
    """Model Stock's interpolation ratio ``t = N cos / (1 + (N - 1) cos)`` (0 where the denominator
    is below 1e-6 in magnitude) from the mean pairwise cosine of the offsets ``x_i - base`` over the
    whole flat tensor (shape (1, 1)) or per row of ``width`` elements (shape (rows, 1)); the norms
    and dots are summed slice by slice (:func:`.kernels.sums`; bf16 on a Linux x86_64 CPU: one
    native pass, :func:`_ms_sums_native`), every step rounded to ``cd``."""
    n = len(xs)
    if _ms_native(cd, base, xs):
        sq, got = _ms_sums_native(base, xs, width)
        return _ms_ratio(sq, got, n, cd, width)
    terms = kernel(("ms_terms", n, str(cd)), lambda: _ms_terms(n, cd), cast_rounding=True, shapeless=True)
    # the norms in torch's norm order (``torch.norm``)
    sq = K.sums(lambda lo, hi: terms(base[lo:hi], [x[lo:hi] for x in xs])[:n], base.size, width, K.torch_block(cd))
    if cd == F32 and n > 1:  # the dots as torch sums them (one full-size float32 product per pair)
        got = [mx.array(K.torch_sum(p, width)).reshape(-1) for p in terms(base, xs)[n:]]
    else:  # bf16 / fp16 round the last bits away: sliced float64 sums, no full-size copy
        got = K.sums(lambda lo, hi: terms(base[lo:hi], [x[lo:hi] for x in xs])[n:], base.size, width) if n > 1 else []
    return _ms_ratio(sq, got, n, cd, width)


def _ms_ratio(sq: list, got: list, n: int, cd, width: Optional[int]) -> mx.array:
    """The ratio from the sums: each offset's squares ``sq`` and each pair's dot ``got`` (float32,
    shape (1,) or (rows,), pairs in order)."""
    norms = [rnd(mx.sqrt(s), cd) for s in sq]
    dots = iter(got)
    cos = []
    for i in range(n):
        for j in range(i + 1, n):
            prod = rnd(norms[i] * norms[j], cd)
            dot = rnd(next(dots), cd)
            cos.append(mx.clip(rnd(dot / mx.maximum(prod, 1e-6), cd), -1.0, 1.0))
    c = rnd(_mean_of_pairs(cos, width) / len(cos), cd)[..., None]
    den = rnd(1 + rnd((n - 1) * c, cd), cd)
    singular = mx.abs(den) < 1e-6
    return mx.where(singular, 0.0, rnd(rnd(n * c, cd) / mx.where(singular, 1.0, den), cd))


def _ms_native(cd, base: mx.array, xs: Sequence[mx.array]) -> bool:
    return cd == mx.bfloat16 and len(xs) >= 2 and NV.usable(base, *xs) and len(xs) <= _ms_max_models()


def _ms_max_models() -> int:
    """The most models besides the base the native passes take (``csrc/model_stock.c``)."""
    return int(NV.lib().mlx_ssp_ms_max_models())


def _ms_rows(size: int, width: Optional[int]) -> tuple[int, int]:
    return (size // width, width) if width else (1, size)


def _ms_sums_native(base: mx.array, xs: Sequence[mx.array], width: Optional[int]) -> tuple[list, list]:
    """:func:`model_stock_ratio`'s sums in one native pass (``csrc/model_stock.c``): the same values
    (the dots summed in float64 in another order: equal once rounded to float32, but for a sum
    within float64 rounding of a float32 tie)."""
    k = len(xs)
    rows, w = _ms_rows(base.size, width)
    npairs = k * (k - 1) // 2
    sq, dots = np.empty((rows, k), np.float32), np.empty((rows, npairs), np.float64)
    bb, xb = K.raw_bits(base), [K.raw_bits(x) for x in xs]  # held for the call: a copied input lives as long as these
    if NV.lib().mlx_ssp_ms_sums(NV.ptr(bb), NV.ptrs(xb), k, rows, w, K.torch_block(mx.bfloat16), NV.ptr(sq),
                                NV.ptr(dots)):
        raise RuntimeError(f"model_stock's native sums take 2-{_ms_max_models()} models, not {k}")
    return ([mx.array(sq[:, i]) for i in range(k)],
            [mx.array(dots[:, p].astype(np.float32)) for p in range(npairs)])


def _ms_combine_native(base: mx.array, xs: Sequence[mx.array], t: mx.array, width: Optional[int], out) -> mx.array:
    """:func:`_ms_combine` over the whole tensor by the native library, into an MLX-owned buffer."""
    rows, w = _ms_rows(base.size, width)
    tv = np.ascontiguousarray(np.asarray(t, dtype=np.float32).reshape(-1))
    if tv.size == 1 and rows > 1:
        tv = np.full(rows, tv[0], np.float32)
    f32_out = out == F32
    res, view = NV.empty(base.size, F32 if f32_out else mx.bfloat16)
    bb, xb = K.raw_bits(base), [K.raw_bits(x) for x in xs]  # held for the call
    NV.lib().mlx_ssp_ms_combine(NV.ptr(bb), NV.ptrs(xb), len(xs), rows, w, NV.ptr(tv), NV.ptr(view), int(f32_out))
    if out not in (F32, mx.bfloat16):
        res = res.astype(out)
    mx.eval(res)
    return res


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
    if _ms_native(cd, base, xs):
        return [_ms_combine_native(base, xs, t, width, out)]
    comb = kernel(("ms_combine", len(xs), str(cd), str(out)), lambda: _ms_combine(len(xs), cd, out),
                  cast_rounding=True, shapeless=True)
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
