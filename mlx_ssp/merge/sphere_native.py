"""multislerp's and karcher's bf16 passes by the native library (:mod:`.native`:
``csrc/multislerp.c``, ``csrc/karcher.c``): the whole tensor per pass, the same values operation
for operation as the MLX kernels of :mod:`.sphere_means`, the scalars between the passes computed
by the same helpers (:mod:`.sphere_scalars`).
"""

from __future__ import annotations

import ctypes

import numpy as np

import mlx_ssp  # noqa: F401  (OpenBLAS before mlx.core)
import mlx.core as mx

from mlx_ssp.merge import kernels as K
from mlx_ssp.merge import native as NV
from mlx_ssp.merge.kernels import F32, rnd
from mlx_ssp.merge.sphere_scalars import kar_angles, kar_turn, msl_dot_values, msl_linear, msl_turn, values


def multislerp_native(xs: list, xb: list[np.ndarray], norms: mx.array, dn: list, W: mx.array, Wl: list,
                      eps: float, out) -> list[mx.array]:
    """:func:`.sphere_means.multislerp_parts`' passes in bf16 by the native library (:mod:`.native`,
    ``csrc/multislerp.c``: the same values operation for operation) on the inputs' bf16 bits ``xb``:
    the whole tensor per pass, the scalars between passes computed as the MLX path computes them
    (:mod:`.sphere_scalars`). The unit vectors are made again from the inputs in each pass (not
    held); the output is the mean's buffer in bf16."""
    lib, cd = NV.lib(), mx.bfloat16
    blk, n, size = K.torch_block(cd), len(xb), xb[0].size
    mean_arr, mean = NV.empty(size)
    xp, dp, w = NV.ptrs(xb), NV.floats(values(dn)), NV.floats(values(Wl))
    msq = lib.mlx_ssp_msl_first(xp, n, size, dp, w, NV.ptr(mean), blk)
    mean_norm = rnd(mx.sqrt(K.sum_array(msq)), cd)
    if mean_norm.item() < eps:
        return msl_linear(xs, Wl, cd, out)
    sums = (ctypes.c_double * n)()
    if lib.mlx_ssp_msl_dots(NV.ptr(mean), xp, n, size, dp, mean_norm.item(), sums):
        raise MemoryError("multislerp: no memory for the dots' sums")
    dots = msl_dot_values([K.sum_array(v) for v in sums], cd)
    tangent = np.empty(size, np.uint16)
    tsq = lib.mlx_ssp_msl_tangent(NV.ptr(mean), xp, n, size, dp, NV.floats(values(dots)), w,
                                  NV.ptr(tangent), blk)
    cs, sn, avg = values(msl_turn(K.sum_array(tsq), norms, W, eps, cd))
    if out == F32:
        res, view = NV.empty(size, F32)
        lib.mlx_ssp_msl_out(NV.ptr(mean), NV.ptr(tangent), size, cs, sn, avg, NV.ptr(view), 1)
        return [res]
    lib.mlx_ssp_msl_out(NV.ptr(mean), NV.ptr(tangent), size, cs, sn, avg, NV.ptr(mean), 0)
    res = mean_arr if out == cd else mean_arr.astype(out)
    mx.eval(res)
    return [res]


def karcher_native(xb: list[np.ndarray], norms: list, al: list, max_iter: int, tol: float, scale: mx.array,
                   out) -> list[mx.array]:
    """:func:`.sphere_means.karcher_parts`' passes in bf16 by the native library (:mod:`.native`,
    ``csrc/karcher.c``: the same values operation for operation) on the valid inputs' bf16 bits
    ``xb``: the whole tensor per pass, the scalars between passes computed as the MLX path computes
    them (:mod:`.sphere_scalars`). The output is the held mean's buffer in bf16."""
    lib, cd, block = NV.lib(), mx.bfloat16, K.torch_block(F32)
    size, k = xb[0].size, len(xb)
    units = [np.empty(size, np.uint16) for _ in xb]
    mean_arr, mean = NV.empty(size)
    alv = np.array([a.item() for a in al], dtype=np.float32)
    s = lib.mlx_ssp_kar_first(NV.ptrs(xb), k, size, NV.floats(norms), NV.floats(alv), NV.ptrs(units),
                              NV.ptr(mean), block)
    del xb
    mn = np.sqrt(np.float32(s))
    pending = None  # the norm the held mean is still to be divided by
    if mn < tol:
        mean[:] = units[0]
    else:
        pending = mn
    tangent = np.empty(size, np.uint16)
    for _ in range(max_iter):
        sums = (ctypes.c_double * k)()
        if lib.mlx_ssp_kar_dots(NV.ptr(mean), NV.ptrs(units), k, size, pending is not None,
                                float(pending if pending is not None else 1.0), sums):
            raise MemoryError("karcher: no memory for the dots' sums")
        pending = None  # the mean is normalised by the dots' pass
        act, dots, coefs = kar_angles(np.array(sums, dtype=np.float32), alv, tol, cd)
        if not act:
            break
        tsq = lib.mlx_ssp_kar_tangent(NV.ptr(mean), NV.ptrs([units[j] for j in act]), len(act), size,
                                      NV.floats(dots), NV.floats(coefs), NV.ptr(tangent), block)
        tn = np.sqrt(np.float32(tsq))
        if tn < tol:
            break
        cs, sn = kar_turn(tn, cd)
        usq = lib.mlx_ssp_kar_step(NV.ptr(mean), NV.ptr(tangent), size, float(tn), float(cs), float(sn), block)
        un = np.sqrt(np.float32(usq))
        pending = un if un > tol else None
    del units, tangent
    p = float(pending if pending is not None else 1.0)
    if out == F32:
        res, view = NV.empty(size, F32)
        lib.mlx_ssp_kar_out(NV.ptr(mean), size, pending is not None, p, scale.item(), NV.ptr(view), 1)
        return [res]
    lib.mlx_ssp_kar_out(NV.ptr(mean), size, pending is not None, p, scale.item(), NV.ptr(mean), 0)
    res = mean_arr if out == cd else mean_arr.astype(out)
    mx.eval(res)
    return [res]
