"""Means of several tensors on the unit sphere: mergekit 0.1.5's ``multislerp`` and ``karcher``,
one tensor at a time (the shared conventions, parity figures and deviations: :mod:`.interpolate`).

- :func:`multislerp` (mergekit ``multislerp``, Goddard's barycentric slerp): project unit vectors
  to the tangent space at their weighted mean, average, map back, rescale by the weighted norm.
- :func:`karcher` (mergekit ``karcher``): the weighted Riemannian (Karcher) mean of the unit
  vectors by fixed-point iteration (``max_iter``, ``tol``), scaled by the weighted mean norm.

Their whole-tensor statistics are passes of sliced sums (:func:`.kernels.sweep`); what a later
pass reads again is held in the compute dtype, as mergekit holds it (every value is rounded to
it, so the copy is exact): the unit vectors, the mean and the tangent of both, each written in
``cd`` by the kernel that makes it where that is faster (MLX otherwise keeps a float32 copy and
casts it in another pass). Their kernels round to bf16 by casts (:func:`.kernels.kernel`'s
``cast_rounding``: measured faster here); a chain of roundings that GCC (which compiles MLX's
fused CPU kernels) leaves unvectorised is cut at a held value. The
inputs stay in their own dtype; no full-size float32 copy exists, except in float32, where the
dots need whole vectors to be summed in torch's order (multislerp: the products with the mean;
karcher: the mean and the unit vectors, copied for BLAS's ``sdot``). ``*_parts`` are the merge
engine's entry points; :func:`multislerp` and :func:`karcher` return the same values as one
float32 array.

bf16 merges of bf16 inputs on a Linux x86_64 CPU run these passes in C instead
(:mod:`.sphere_native`), the whole tensor per pass, with the same bits; the scalars between the
passes are computed by the same helpers on both paths (:mod:`.sphere_scalars`).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

import mlx_ssp  # noqa: F401  (OpenBLAS before mlx.core)
import mlx.core as mx

from mlx_ssp.merge import kernels as K
from mlx_ssp.merge import native as NV
from mlx_ssp.merge import sphere_native as SN
from mlx_ssp.merge import sphere_scalars as SS
from mlx_ssp.merge import torch_math as TM
from mlx_ssp.merge.kernels import F32, aligned, each, f32, item32, kernel, rnd, scalar


def _msl_units(xs, dn, cd):
    """The unit vectors, written in ``cd``."""
    return [(aligned(x, cd) / d).astype(cd) for x, d in zip(xs, dn)]


def _msl_mean(us, W, cd):
    """The weighted sum of the unit vectors (torch's ``sum(0)`` of the rounded products: float32
    in order, one rounding), written in ``cd``."""
    acc = rnd(us[0] * W[0], cd)
    for u, w in zip(us[1:], W[1:]):
        acc = acc + rnd(u * w, cd)
    return acc.astype(cd)


def _msl_tangent(us, m, dots, W, cd):
    acc = None
    for u, d, w in zip(us, dots, W):
        v = rnd(rnd(u - rnd(d * m, cd), cd) * w, cd)
        acc = v if acc is None else acc + v
    return rnd(acc, cd)


def multislerp_parts(xs: Sequence[mx.array], weights: Sequence[float], normalize_weights: bool = True,
                     eps: float = 1e-8, cd=F32, out=None) -> list[mx.array]:
    """mergekit's multislerp of flat tensors, as consecutive evaluated slices in ``out`` (default
    ``cd``): barycentric interpolation on the hypersphere (tangent space at the weighted mean of
    the unit vectors, exponential map back), scaled by the weighted mean norm; each step rounded to
    ``cd`` as mergekit computes it (the weights too). Its four whole-tensor statistics (the norms,
    the mean's norm, the dots with the mean, the tangent's norm) are each one pass of sliced sums
    (:func:`.kernels.sums`, :func:`.kernels.sweep`); the unit vectors, the mean (normalised in the
    dots' pass) and the tangent are held in ``cd`` for the passes after theirs, the tangent
    replacing the unit vectors and the output the mean and the tangent, slice by slice (bf16 inputs
    and ``cd`` on a Linux x86_64 CPU: :func:`.sphere_native.multislerp_native`). Two antipodal inputs whose
    weighted mean vanishes fall back to the linear combination; more than two raise
    ``ValueError``."""
    out = out or cd
    xs = list(xs)
    mx.eval(*xs)
    n, size = len(xs), xs[0].size
    if n == 1 or size == 0:
        return [xs[0].astype(cd).astype(out)]
    r = lambda x: rnd(x, cd)  # noqa: E731
    W = r(mx.array(np.asarray(weights, dtype=np.float32)))
    if normalize_weights:
        W = r(W / r(mx.sum(W)))
    Wl = [W[i] for i in range(n)]
    key = (n, str(cd))
    blk = K.torch_block(cd)
    go_native = cd == mx.bfloat16 and NV.usable(*xs)
    if go_native:
        xb = [K.raw_bits(x) for x in xs]
        nsq = [K.sum_array(NV.lib().mlx_ssp_sumsq_bf16(NV.ptr(b), size, blk)) for b in xb]
    else:
        sq = kernel(("msl_sq",) + key, lambda: (lambda xs: [mx.square(aligned(x, cd)) for x in xs]))
        nsq = K.sums(lambda lo, hi: sq([x[lo:hi] for x in xs]), size, None, blk)
    norms = mx.concatenate([r(mx.sqrt(v)) for v in nsq])
    dn = [r(norms[i] + eps) for i in range(n)]
    if go_native:
        return SN.multislerp_native(xs, xb, norms, dn, W, Wl, eps, out)
    kept, (msq,) = K.sweep(lambda lo, hi: _msl_first([x[lo:hi] for x in xs], dn, Wl, cd), size, blk)
    mean, units = [k[0] for k in kept], [k[1] for k in kept]  # per slice: the mean, the unit vectors
    kept.clear()
    mean_norm = r(mx.sqrt(msq))
    if mean_norm.item() < eps:
        return SS.msl_linear(xs, Wl, cd, out)
    at = {lo: k for k, (lo, _) in enumerate(K.slices(size, K.ALIGN))}  # slice start -> index of the held slice
    mn = mean_norm.reshape(())
    dk = kernel(("msl_dots",) + key, lambda: _msl_dots(cd), cast_rounding=True)
    if cd == F32:  # the dots summed as torch sums them: the products kept whole (float32), then summed
        kept, _ = K.sweep(lambda lo, hi: (dk(mean[at[lo]], units[at[lo]], mn), ()), size)
        mean = [k[0] for k in kept]
        dots = [mx.array(K.torch_sum(np.concatenate([np.asarray(k[1][i]) for k in kept]))) for i in range(n)]
        del kept
    else:
        _, dsums = K.sweep(lambda lo, hi: dk(mean[at[lo]], units[at[lo]], mn), size, into=mean)
        dots = SS.msl_dot_values(dsums, cd)
    tk = kernel(("msl_tan",) + key, lambda: _msl_tan(cd), cast_rounding=True)

    def tangent_step(lo, hi):
        k = at[lo]
        us, units[k] = units[k], None  # freed as the tangent's slice is made
        return tk(mean[k], us, dots, Wl)
    tangent, (tsq,) = K.sweep(tangent_step, size, blk)
    cs, sn, avg = SS.msl_turn(tsq, norms, W, eps, cd)
    fk = kernel(("msl_out", str(cd), str(out)), lambda: _msl_out(cd, out), cast_rounding=True)

    def final(lo, hi):
        k = at[lo]
        m, tg = mean[k], tangent[k]
        mean[k] = tangent[k] = None  # freed as the output's slice is made
        return fk(m, tg, cs, sn, avg)
    return each(size, final, K.ALIGN)


def _msl_first(xs: list, dn: list, W: list, cd) -> tuple:
    """The mean's pass over one slice: ((the weighted mean, the unit vectors), [the mean's
    squares]), each held value written in ``cd`` by the kernel that makes it (a float32 copy and a
    separate cast to ``cd`` cost another pass each: 15% of the pass)."""
    units = kernel(("msl_units", len(xs), str(cd)), lambda: (lambda xs, dn: _msl_units(xs, dn, cd)),
                   cast_rounding=True)(xs, dn)
    m = kernel(("msl_mean", len(xs), str(cd)), lambda: (lambda us, W: _msl_mean([f32(u) for u in us], W, cd)),
               cast_rounding=True)(units, W)
    return (m, units), _held_squares(m)


def _msl_dots(cd):
    """The mean divided by its norm (held in ``cd``) and its rounded products with the unit
    vectors (the dots' terms)."""
    def f(mean, us, mn):
        m = rnd(f32(mean) / mn, cd)
        return m.astype(cd), [rnd(f32(u) * m, cd) for u in us]
    return f


def _msl_tan(cd):
    """The tangent at the (normalised) mean (held in ``cd``) and its squares."""
    def f(m, us, dots, W):
        tg = _msl_tangent([f32(u) for u in us], f32(m), dots, W, cd)
        return tg.astype(cd), [mx.square(tg)]
    return f


def _msl_out(cd, out):
    """The exponential map back, ``m cos(tn) + tangent sin(tn) / tn``, scaled by the weighted norm."""
    def f(m, tg, cs, sn, avg):
        res = rnd(rnd(f32(m) * cs, cd) + rnd(f32(tg) * sn, cd), cd)
        return rnd(res * avg, cd).astype(cd).astype(out)
    return f


def multislerp(xs: Sequence[mx.array], weights: Sequence[float], normalize_weights: bool = True,
               eps: float = 1e-8, cd=F32) -> mx.array:
    """:func:`multislerp_parts` as one flat float32 array (holding ``cd`` values)."""
    parts = multislerp_parts([x.reshape(-1) for x in xs], weights, normalize_weights, eps, cd, F32)
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)




def _kar_units(xs, ns, cd):
    return [rnd(aligned(x, cd) / n, cd) for x, n in zip(xs, ns)]


def _kar_mean_acc(m, a, u, cd):
    """mergekit's ``mean += alpha * u`` with the mean held in ``cd``."""
    return rnd(m + rnd(a * u, cd), cd)


def _kar_mean0(cd):
    """The unit vectors (held in ``cd``: each is rounded to it) and the first mean ``sum alpha_i
    u_i`` accumulated in ``cd`` (mergekit's ``mean += alpha * u``) over the first two of them,
    held in ``cd``; the rest of the sum is :func:`_kar_mean_more`'s and the squares
    :func:`_squares`'. GCC, which compiles MLX's fused CPU kernels, leaves a chain of five bf16
    roundings, or one that ends in a float32 output, unvectorised (the NaN tests of the casts stay
    branches): 2x slower than these kernels cut at held bf16 values."""
    def f(xs, ns, al):
        us = _kar_units(xs, ns, cd)
        m = rnd(al[0] * us[0], cd)
        if len(us) > 1:
            m = _kar_mean_acc(m, al[1], us[1], cd)
        return m.astype(cd), [u.astype(cd) for u in us]
    return f


def _kar_mean_more(cd):
    """One more input's term of the first mean (``m`` held in ``cd``, ``u`` a held unit vector)."""
    def f(m, u, a):
        return _kar_mean_acc(f32(m), a, f32(u), cd).astype(cd)
    return f


def _squares(m):
    """The squares of a held slice (a norm's terms), from the held values."""
    return [mx.square(f32(m))]


def _held_squares(m) -> list:
    """:func:`_squares` as one compiled kernel (any shape)."""
    return kernel(("squares",), lambda: _squares, shapeless=True, cast_rounding=True)(m)


def _kar_first_mean(xs: list, ns: list, al: list, cd):
    """The first pass's step over one slice: ((the mean, the unit vectors), [the mean's squares])."""
    head = kernel(("kar_mean0", len(xs), str(cd)), lambda: _kar_mean0(cd), cast_rounding=True)
    more = kernel(("kar_mean_more", str(cd)), lambda: _kar_mean_more(cd), cast_rounding=True)
    m, us = head(xs, ns, al)
    for j in range(2, len(xs)):
        m = more(m, us[j], al[j])
    return (m, us), _held_squares(m)


def _normalised(cd):
    """A held slice divided by a norm, held in ``cd`` (written in ``cd`` by the kernel itself: a
    float32 output and a separate cast to ``cd`` cost another pass)."""
    def f(m, p):
        return (f32(m) / p).astype(cd)
    return f


def _products(m, us):
    """The held mean's products with each held unit vector (torch.dot's terms), float32."""
    m = f32(m)
    return [m * f32(u) for u in us]


def _kar_dots(m, us, p, cd, pending: bool, products: bool = True) -> tuple:
    """The dots' pass over one slice: (the mean divided by its pending norm, if ``pending``, held
    in ``cd``; its products with each unit vector, or none without ``products``)."""
    if pending:
        m = kernel(("normalised", str(cd)), lambda: _normalised(cd), cast_rounding=True)(m, p)
    if not products:
        return m, []
    return m, kernel(("products", len(us)), lambda: _products, shapeless=True, cast_rounding=True)(m, us)


def _kar_tangent(m, us, dots, coefs, cd):
    tg = None
    for u, d, c in zip(us, dots, coefs):
        step = rnd(c * rnd(f32(u) - rnd(d * m, cd), cd), cd)
        tg = step if tg is None else rnd(tg + step, cd)
    return tg


def _kar_tsq(cd):
    """The tangent (held in ``cd``: every step rounds to it, so the copy is exact) and its squares."""
    def f(m, us, dots, coefs):
        tg = _kar_tangent(f32(m), us, dots, coefs, cd)
        return tg.astype(cd), [mx.square(tg)]
    return f


def _kar_step(cd):
    """The next mean ``cos(tn) m + sin(tn) tangent / tn`` (each step in ``cd``), written in ``cd``
    (its squares: :func:`_squares`, from the held values)."""
    def f(m, tg, tn, cs, sn):
        m = f32(m)
        return (rnd(cs * m, cd) + rnd(sn * rnd(f32(tg) / tn, cd), cd)).astype(cd)
    return f


def _kar_out(cd, out, pending: bool):
    """``scale * mean`` (the mean divided by its pending norm first), in ``cd`` then ``out``."""
    def f(m, p, sc):
        m = rnd(f32(m) / p, cd) if pending else f32(m)
        return rnd(sc * m, cd).astype(out)
    return f


def _whole(parts: list) -> np.ndarray:
    """Float32 slices as one vector, aligned as torch allocates it (:func:`.torch_math.empty64`)."""
    out = TM.empty64(sum(x.size for x in parts))
    lo = 0
    for x in parts:
        out[lo:lo + x.size] = np.asarray(x)
        lo += x.size
    return out


def _kar_iteration(mean: list, units: list, al: list, pending: Optional[float], tol: float, cd, at: dict,
                   size: int) -> tuple[bool, Optional[float]]:
    """One fixed-point step of the mean, updated in place, slice by slice (three passes: the dots,
    normalising the mean on the way; the tangent and its norm; the step, with the new mean's
    squares). ``at``: slice start -> index of the held slice. Returns (go on, the norm the held
    mean is still to be divided by)."""
    p = scalar(pending if pending is not None else 1.0)
    pend = pending is not None
    if cd == F32:  # torch.dot of the whole vectors, in BLAS's order (:func:`.torch_math.dot`)
        K.sweep(lambda lo, hi: (_kar_dots(mean[at[lo]], units[at[lo]], p, cd, pend, False)[0], ()), size, into=mean)
        m = _whole(mean)
        dsums = [mx.array(TM.dot(m, _whole([u[j] for u in units]))) for j in range(len(al))]
    else:
        _, dsums = K.sweep(lambda lo, hi: _kar_dots(mean[at[lo]], units[at[lo]], p, cd, pend), size, into=mean)
    act, dvals, cvals = SS.kar_angles([d.item() for d in dsums], [a.item() for a in al], tol, cd)
    if not act:
        return False, None
    dots, coefs = [scalar(v) for v in dvals], [scalar(v) for v in cvals]
    tk = kernel(("kar_tsq", len(act), str(cd)), lambda: _kar_tsq(cd), cast_rounding=True)
    f32n = K.torch_block(F32)
    tangent, (tsq,) = K.sweep(lambda lo, hi: tk(mean[at[lo]], [units[at[lo]][j] for j in act], dots, coefs),
                              size, f32n)
    tn = np.sqrt(item32(tsq))
    if tn < tol:
        return False, None
    stk = kernel(("kar_step", str(cd)), lambda: _kar_step(cd), cast_rounding=True)
    cs, sn = (scalar(v) for v in SS.kar_turn(tn, cd))
    tn_ = scalar(tn)

    def step(lo, hi):
        k = at[lo]
        tg, tangent[k] = tangent[k], None  # freed as the mean's slice is replaced
        nm = stk(mean[k], tg, tn_, cs, sn)
        return nm, _held_squares(nm)
    _, (usq,) = K.sweep(step, size, f32n, mean)
    un = np.sqrt(item32(usq))
    return True, (un if un > tol else None)


def karcher_parts(xs: Sequence[mx.array], alphas: Optional[Sequence[float]] = None, max_iter: int = 10,
                  tol: float = 1e-5, cd=F32, out=None) -> list[mx.array]:
    """mergekit's weighted Karcher mean of flat tensors on the unit sphere (equal weights by
    default), scaled by ``sum alpha_i |x_i|``, as consecutive evaluated slices in ``out`` (default
    ``cd``); inputs with norm <= tol are left out of the mean. Norms are float32; the unit vectors,
    the mean and the tangent are in ``cd`` (each step rounded), as mergekit holds them in the input
    dtype.

    Every norm and dot is a pass of sliced sums (:func:`.kernels.sweep`): the norms in the order of
    torch's norm kernel (:data:`.kernels.TORCH_LANES`), the dots in float64 across partial sums.
    The unit vectors, the mean and the tangent are held in ``cd`` (exact: each is rounded to it),
    the mean and the tangent updated slice by slice (:func:`_kar_iteration`); the inputs stay in
    their dtype and are read by the first two passes only."""
    out = out or cd
    xs = list(xs)
    mx.eval(*xs)
    size = xs[0].size
    if len(xs) == 1 or size == 0:
        return [xs[0].astype(cd).astype(out)]
    r = lambda x: rnd(x, cd)  # noqa: E731
    alphas = [1.0 / len(xs)] * len(xs) if alphas is None else list(alphas)
    f32n = K.torch_block(F32)  # mergekit's norms: vector_norm of the float32 copy
    go_native = cd == mx.bfloat16 and NV.usable(*xs)
    if go_native:
        xb = [K.raw_bits(x) for x in xs]
        norms = [np.sqrt(np.float32(NV.lib().mlx_ssp_sumsq_bf16(NV.ptr(b), size, f32n))) for b in xb]
    else:
        sq = kernel(("msl_sq", len(xs), str(cd)), lambda: (lambda xs: [mx.square(aligned(x, cd)) for x in xs]))
        norms = [np.sqrt(item32(v)) for v in K.sums(lambda lo, hi: sq([x[lo:hi] for x in xs]), size, None, f32n)]
    # torch casts a 0-d float32 tensor on the left of a bf16 tensor to bf16 (on the right it stays
    # float32): mergekit's ``scale * mean``, ``cos(tn) * mean`` and ``sin(tn) * ...`` round it to cd
    scale = r(scalar(sum(np.float32(a) * n for a, n in zip(alphas, norms))))
    valid = [i for i, n in enumerate(norms) if n > tol]
    if not valid:
        return each(size, lambda lo, hi: mx.zeros(hi - lo, dtype=out))
    a_sum = sum(alphas[i] for i in valid)
    al = [scalar(alphas[i] / a_sum) for i in valid]
    if go_native:
        return SN.karcher_native([xb[i] for i in valid], [norms[i] for i in valid], al, max_iter, tol, scale,
                                 out)
    vx, ns = [xs[i] for i in valid], [scalar(norms[i]) for i in valid]
    kept, (s,) = K.sweep(lambda lo, hi: _kar_first_mean([x[lo:hi] for x in vx], ns, al, cd), size, f32n)
    mean, units = [k[0] for k in kept], [k[1] for k in kept]  # per slice: the mean, the unit vectors
    kept.clear()
    mn = np.sqrt(item32(s))
    pending = None  # the norm the held mean is still to be divided by
    if mn < tol:
        mean = [u[0] for u in units]
    else:
        pending = mn
    at = {lo: k for k, (lo, _) in enumerate(K.slices(size, K.ALIGN))}  # slice start -> index of the held slice
    for _ in range(max_iter):
        go, pending = _kar_iteration(mean, units, al, pending, tol, cd, at, size)
        if not go:
            break
    units.clear()
    fk = kernel(("kar_out", pending is not None, str(cd), str(out)), lambda: _kar_out(cd, out, pending is not None),
                cast_rounding=True)
    p = scalar(pending if pending is not None else 1.0)
    parts = []
    for k in range(len(mean)):
        part = fk(mean[k], p, scale)
        mx.eval(part)
        mean[k] = None  # the mean's slice is not needed any more: output and mean never both full-size
        parts.append(part)
    return parts


def karcher(xs: Sequence[mx.array], alphas: Optional[Sequence[float]] = None, max_iter: int = 10,
            tol: float = 1e-5, cd=F32) -> mx.array:
    """:func:`karcher_parts` as one flat float32 array (holding ``cd`` values)."""
    parts = karcher_parts([x.reshape(-1) for x in xs], alphas, max_iter, tol, cd, F32)
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)
