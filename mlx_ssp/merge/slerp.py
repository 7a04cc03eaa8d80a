"""Spherical interpolation of two tensors: mergekit 0.1.5's ``slerp`` and ``nuslerp``, one tensor
at a time (the shared conventions, parity figures and deviations: :mod:`.interpolate`).

- :func:`slerp` (Shoemake 1985; mergekit ``slerp``): spherical interpolation between the base
  ``v0`` and ``v1`` by ``t``, the whole tensor as one vector; norms and dot in float32, per chunk
  of :data:`SLERP_CHUNK` elements as mergekit takes them; linear interpolation when
  ``|cos| > 0.9995`` (nearly parallel or antiparallel vectors).
- :func:`nuslerp` (mergekit ``nuslerp``): slerp of the whole tensor (``flatten``, default), of
  each row (last axis) or of each column (``row_wise``), ``t = w1 / (w0 + w1)``; linear where
  ``1 - cos^2 <= eps^2``.

``*_parts`` are the merge engine's entry points: statistics as passes of sliced sums, the output
as consecutive evaluated slices; :func:`slerp` and :func:`nuslerp` return the same values as one
float32 array. bf16 nuslerp of bf16 inputs on a Linux x86_64 CPU (whole tensor or per row) runs
its passes in C instead (:mod:`.native`, ``csrc/slerp.c``), with the same bits.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

import mlx_ssp  # noqa: F401  (OpenBLAS before mlx.core)
import mlx.core as mx

from mlx_ssp.merge import kernels as K
from mlx_ssp.merge import native as NV
from mlx_ssp.merge import torch_math as TM
from mlx_ssp.merge.kernels import F32, aligned, f32, item32, kernel, rnd, scalar


def _norm(x: mx.array, axis=None, keepdims: bool = False) -> mx.array:
    return mx.sqrt(mx.sum(mx.square(x), axis=axis, keepdims=keepdims))



def _slerp_sq(cd):
    return lambda a, b: (mx.square(f32(a.astype(cd))), mx.square(f32(b.astype(cd))))


def _slerp_dot(cd):
    return lambda a, b, na, nb: (f32(a.astype(cd)) / na) * (f32(b.astype(cd)) / nb)


def _slerp_mix(cd, out):
    return lambda a, b, ca, cb: (ca * f32(a.astype(cd)) + cb * f32(b.astype(cd))).astype(cd).astype(out)


#: mergekit's slerp takes its norms and dot per chunk of this many elements, then combines them
SLERP_CHUNK = 1 << 20


def _norm_of_parts(parts: list) -> np.float32:
    """``vector_norm`` of the chunks' float32 norms (torch's norm order over their squares)."""
    sq = mx.array(np.square(np.asarray(parts, dtype=np.float32)))
    (v,) = K.sums(lambda lo, hi: [sq[lo:hi]], sq.size, None, K.torch_block(F32))
    return np.sqrt(item32(v))


def slerp_coefficients(t: float, v0: mx.array, v1: mx.array, cd=F32, dot_threshold: float = 0.9995,
                       eps: float = 1e-8) -> tuple[np.float32, np.float32]:
    """``(ca, cb)`` with ``slerp = ca * v0 + cb * v1`` (the flat inputs aligned to ``cd``, then in
    float32), as mergekit computes them: per chunk of :data:`SLERP_CHUNK` elements the norms
    (torch's norm order) and the dot of the unit vectors (float64), each summed slice by slice
    (:func:`.kernels.sums`); the tensor's norm is the norm of the chunks' norms, its dot the sum of
    theirs (torch's order: :func:`.kernels.torch_sum`). Zero-norm vectors count as norm 1;
    when ``|cos| > dot_threshold`` the coefficients are the linear ``1 - t`` and ``t`` (mergekit's
    fallback for nearly parallel vectors)."""
    t32, one = np.float32(t), np.float32(1)
    n = v0.size
    chunks = [(c, min(n, c + SLERP_CHUNK)) for c in range(0, n, SLERP_CHUNK)]
    sq = kernel(("slerp_sq", str(cd)), lambda: _slerp_sq(cd))
    na, nb = [], []
    for c0, c1 in chunks:
        sa, sb = K.sums(lambda lo, hi: sq(v0[c0 + lo:c0 + hi], v1[c0 + lo:c0 + hi]), c1 - c0, None,
                        K.torch_block(F32))
        na.append(np.sqrt(item32(sa)))
        nb.append(np.sqrt(item32(sb)))
    na, nb = _norm_of_parts(na), _norm_of_parts(nb)
    na = na if na > eps else one
    nb = nb if nb > eps else one
    dk = kernel(("slerp_dot", str(cd)), lambda: _slerp_dot(cd))
    una, unb = scalar(na), scalar(nb)
    if cd == F32:  # the chunk's products summed as torch sums them (a float32 chunk: 4 MiB at most)
        dots = [K.torch_sum(dk(v0[c0:c1], v1[c0:c1], una, unb)) for c0, c1 in chunks]
    else:  # bf16 / fp16 outputs round the last bits away: the sliced float64 sum, no chunk-sized copy
        dots = [item32(K.sums(lambda lo, hi: [dk(v0[c0 + lo:c0 + hi], v1[c0 + lo:c0 + hi], una, unb)], c1 - c0)[0])
                for c0, c1 in chunks]
    dot = np.clip(K.torch_sum(dots), np.float32(-1), one)
    if abs(dot) > dot_threshold:
        return one - t32, t32
    # float32 outputs: torch's own acos / sin (bf16 ones keep NumPy's, whose last bit they round away)
    acos, sin = (TM.acos, TM.sin) if cd == F32 else (np.arccos, np.sin)
    theta = acos(dot)
    s = sin(theta)
    return sin((one - t32) * theta) / s, sin(t32 * theta) / s


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
        part = mix(v0[lo:hi], v1[lo:hi], scalar(ca), scalar(cb))
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


def _sines(cos: mx.array, t: float, eps: float, cd) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """From the (clipped) cosines of the vectors' angles theta: ``sin((1 - t) theta)``,
    ``sin(t theta)``, ``sin(theta)`` (1 where linear) and where nuslerp is linear
    (``1 - cos^2 <= eps^2``), each rounded to ``cd``. float32: the angle and sines from torch's
    own float32 ``acos`` / ``sin`` (:mod:`.torch_math`); bf16 / fp16 round their last bit away."""
    r = lambda x: rnd(x, cd)  # noqa: E731
    lin = r(1 - r(mx.square(cos))) <= eps ** 2
    if cd == F32:
        theta = TM.acos(np.asarray(mx.where(lin, 0.0, cos)))
        ca, cb = TM.sin(np.float32(1 - t) * theta), TM.sin(np.float32(t) * theta)
        return mx.array(ca), mx.array(cb), mx.where(lin, 1.0, mx.array(TM.sin(theta))), lin
    theta = r(mx.arccos(mx.where(lin, 0.0, cos)))
    return r(mx.sin(r((1 - t) * theta))), r(mx.sin(r(t * theta))), mx.where(lin, 1.0, r(mx.sin(theta))), lin


def _nuslerp_whole(t: float, v0: mx.array, v1: mx.array, shape: Optional[tuple], row_wise: bool, flatten: bool,
                   eps: float, cd) -> mx.array:
    """nuslerp as one float32 array, every statistic an MLX float32 sum along the vectors (used for
    ``row_wise`` columns, which a slice of whole rows does not hold)."""
    r = lambda x: rnd(x, cd)  # noqa: E731
    a = _vectors(f32(v0), shape, row_wise, flatten)
    b = _vectors(f32(v1), shape, row_wise, flatten)
    au = r(a / r(mx.maximum(r(_norm(a, axis=-1, keepdims=True)), 1e-7)))
    bu = r(b / r(mx.maximum(r(_norm(b, axis=-1, keepdims=True)), 1e-7)))
    cos = mx.clip(r(mx.sum(r(au * bu), axis=-1, keepdims=True)), -1.0, 1.0)
    ca, cb, s, colinear = _sines(cos, t, eps, cd)
    sph = r(r(r(ca * a) + r(cb * b)) / s)
    res = mx.where(colinear, r(r((1 - t) * a) + r(t * b)), sph)
    return _unvectors(res, shape, row_wise, flatten)


def _nuslerp_columns(t: float, v0: mx.array, v1: mx.array, shape: tuple, eps: float) -> mx.array:
    """float32 nuslerp of the vectors along axis 0 (``row_wise``) as one flat array, in torch's
    order: mergekit transposes them to the last axis, so its norms and dots are reductions across
    rows (:func:`.kernels.torch_column_norms`, :func:`.kernels.torch_column_sums`)."""
    a, b = (np.asarray(f32(v)).reshape(shape[0], -1) for v in (v0, v1))
    au, bu = (x / np.maximum(K.torch_column_norms(x), np.float32(1e-7)) for x in (a, b))
    cos = np.clip(K.torch_column_sums(au * bu), np.float32(-1), np.float32(1))
    ca, cb, s, lin = _sines(mx.array(cos), t, eps, F32)
    A, B = mx.array(a), mx.array(b)
    return mx.where(lin, (1 - t) * A + t * B, (ca * A + cb * B) / s).reshape(-1)


def _nus_cos(cd):
    return lambda a, b, na, nb: rnd(rnd(aligned(a, cd) / na, cd) * rnd(aligned(b, cd) / nb, cd), cd)


def _nus_mix(cd, out):
    def f(a, b, ca, cb, s, lin, u, t):
        A, B = aligned(a, cd), aligned(b, cd)
        sph = rnd(rnd(rnd(ca * A, cd) + rnd(cb * B, cd), cd) / s, cd)
        return mx.where(lin, rnd(rnd(u * A, cd) + rnd(t * B, cd), cd), sph).astype(cd).astype(out)
    return f


def nuslerp_parts(t: float, v0: mx.array, v1: mx.array, cd=F32, out=None, shape: Optional[tuple] = None,
                  row_wise: bool = False, flatten: bool = True, eps: float = 1e-8) -> list[mx.array]:
    """mergekit's nuslerp of two flat tensors of shape ``shape``, as consecutive evaluated slices in
    ``out`` (default ``cd``): per vector (the whole tensor with ``flatten``, else each row of the
    last axis, or with ``row_wise`` each column), ``(sin((1 - t) th) v0 + sin(t th) v1) / sin th``,
    linear where ``1 - cos^2 <= eps^2``; each step rounded to ``cd`` as mergekit computes it.

    The whole tensor's norms and dot are summed slice by slice (:func:`.kernels.sums`, float64
    across partial sums), a row's as MLX's float32 row sum; inputs stay in their dtype (aligned to
    ``cd`` slice by slice; bf16 on a Linux x86_64 CPU: :func:`_nuslerp_native`). Columns
    (``row_wise``) are not whole in a slice of rows: that mode computes the tensor at once."""
    out = out or cd
    mx.eval(v0, v1)
    rows = not flatten and shape is not None and len(shape) >= 2
    if v0.size and rows and row_wise and cd == F32:
        res = _nuslerp_columns(t, v0, v1, shape, eps).astype(out)
        mx.eval(res)
        return [res]
    if v0.size == 0 or (rows and row_wise):
        res = _nuslerp_whole(t, v0, v1, shape, row_wise, flatten, eps, cd).astype(cd).astype(out)
        mx.eval(res)
        return [res]
    width = shape[-1] if rows else None
    if cd == mx.bfloat16 and NV.usable(v0, v1):
        return _nuslerp_native(t, v0, v1, out, width, eps)
    sq = kernel(("slerp_sq", str(cd)), lambda: _slerp_sq(cd))
    sa, sb = K.sums(lambda lo, hi: sq(v0[lo:hi], v1[lo:hi]), v0.size, width, K.torch_block(cd))
    na, nb = _nus_norms(sa, sb, cd)
    # per row: a column of statistics against the rows of a slice; whole tensor: flat slices, 0-d
    shaped = (lambda x, lo, hi: x.reshape(-1, width)) if width else (lambda x, lo, hi: x)
    stat = ((lambda v, lo, hi: v[lo // width: hi // width].reshape(-1, 1)) if width
            else (lambda v, lo, hi: v.reshape(())))
    ck = kernel(("nus_cos", str(cd)), lambda: _nus_cos(cd))
    if cd == F32:  # summed as torch sums them (one full-size float32 product)
        c = mx.array(K.torch_sum(ck(shaped(v0, 0, v0.size), shaped(v1, 0, v0.size), stat(na, 0, v0.size),
                                    stat(nb, 0, v0.size)), width)).reshape(-1)
    else:  # bf16 / fp16 round the last bits away: sliced float64 sums, no full-size copy
        (c,) = K.sums(lambda lo, hi: [ck(shaped(v0[lo:hi], lo, hi), shaped(v1[lo:hi], lo, hi), stat(na, lo, hi),
                                         stat(nb, lo, hi)).reshape(-1)], v0.size, width)
    ca, cb, s, lin = _nus_angles(c, t, eps, cd)
    mix = kernel(("nus_mix", str(cd), str(out)), lambda: _nus_mix(cd, out))
    u, tt = (scalar(v) for v in _nus_weights(t))
    parts = []
    for lo, hi in K.slices(v0.size, width or 1):
        part = mix(shaped(v0[lo:hi], lo, hi), shaped(v1[lo:hi], lo, hi), stat(ca, lo, hi), stat(cb, lo, hi),
                   stat(s, lo, hi), stat(lin, lo, hi), u, tt).reshape(-1)
        mx.eval(part)
        parts.append(part)
    return parts


def _nus_norms(sa: mx.array, sb: mx.array, cd) -> tuple[mx.array, mx.array]:
    """The vectors' norms (at least 1e-7, in ``cd``) from the sums of their squares."""
    return tuple(rnd(mx.maximum(rnd(mx.sqrt(x), cd), 1e-7), cd) for x in (sa, sb))


def _nus_angles(c: mx.array, t: float, eps: float, cd) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """:func:`_sines` of the cosines' sums ``c`` (rounded to ``cd``, clipped), evaluated."""
    got = _sines(mx.clip(rnd(c, cd), -1.0, 1.0), t, eps, cd)
    mx.eval(*got)
    return got


def _nus_weights(t: float) -> tuple[np.float32, np.float32]:
    """The linear fallback's weights ``1 - t`` and ``t``."""
    return np.float32(1 - t), np.float32(t)


def _nuslerp_native(t: float, v0: mx.array, v1: mx.array, out, width: Optional[int], eps: float) -> list[mx.array]:
    """:func:`nuslerp_parts` in bf16 by the native library (:mod:`.native`, ``csrc/slerp.c``: the
    same values operation for operation) on the inputs' bf16 bits, the whole tensor (``width``
    None) or each row of ``width`` elements in one pass each; the scalars between the passes
    computed as the MLX path computes them (:func:`_nus_norms`, :func:`_nus_angles`). One output
    buffer, MLX's."""
    lib, cd = NV.lib(), mx.bfloat16
    size = v0.size
    width = width or size
    rows = size // width
    a, b = K.raw_bits(v0), K.raw_bits(v1)
    sq = [np.empty(rows, np.float32) for _ in range(2)]
    for x, q in zip((a, b), sq):
        lib.mlx_ssp_sumsq_rows_bf16(NV.ptr(x), rows, width, K.torch_block(cd), NV.ptr(q))
    na, nb = (np.ascontiguousarray(np.asarray(v, dtype=np.float32)) for v in _nus_norms(*map(mx.array, sq), cd))
    sums = np.empty(rows, np.float64)
    lib.mlx_ssp_nus_cos(NV.ptr(a), NV.ptr(b), rows, width, NV.ptr(na), NV.ptr(nb), NV.ptr(sums))
    ca, cb, s, lin = (np.ascontiguousarray(np.asarray(v, dtype=dt)).reshape(-1) for v, dt in zip(
        _nus_angles(mx.array(sums.astype(np.float32)), t, eps, cd), (np.float32,) * 3 + (np.uint8,)))
    u, tt = _nus_weights(t)
    res, view = NV.empty(size, F32 if out == F32 else cd)
    lib.mlx_ssp_nus_mix(NV.ptr(a), NV.ptr(b), rows, width, NV.ptr(ca), NV.ptr(cb), NV.ptr(s), NV.ptr(lin),
                        float(u), float(tt), NV.ptr(view), out == F32)
    if out not in (F32, cd):
        res = res.astype(out)
        mx.eval(res)
    return [res]


def nuslerp(t: float, v0: mx.array, v1: mx.array, shape: Optional[tuple] = None, row_wise: bool = False,
            flatten: bool = True, eps: float = 1e-8, cd=F32) -> mx.array:
    """:func:`nuslerp_parts` as one flat float32 array (holding ``cd`` values)."""
    parts = nuslerp_parts(t, v0.reshape(-1), v1.reshape(-1), cd, F32, shape, row_wise, flatten, eps)
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)
