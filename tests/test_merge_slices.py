"""Sliced reductions (kernels.sums) and the sliced slerp / model_stock: accurate whole-tensor sums,
row sums equal to MLX's full-size ones, results equal to the NumPy references at any slice size,
and no full-size float32 copy of a tensor."""

from __future__ import annotations

import numpy as np
import pytest

import mlx_ssp  # noqa: F401
import mlx.core as mx

from mlx_ssp.merge import interpolate as I
from mlx_ssp.merge import kernels as K

from test_merge import R
from test_merge_methods import mxa, npy, ref_model_stock, ref_slerp, tol


def test_sums_whole_tensor_match_float64_and_rows_match_mlx(monkeypatch):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(10_007).astype(np.float32)
    xa = mx.array(x)
    for chunk in (1000, 256, 1 << 18):  # slices with tails inside and across SUM_ROW rows
        monkeypatch.setattr(K, "CHUNK", chunk)
        s, sq = K.sums(lambda lo, hi: [xa[lo:hi], mx.square(xa[lo:hi])], x.size)
        assert s.shape == (1,) and s.dtype == mx.float32
        np.testing.assert_allclose(s.item(), x.astype(np.float64).sum(), rtol=1e-6, atol=1e-4)
        np.testing.assert_allclose(sq.item(), (x.astype(np.float64) ** 2).sum(), rtol=1e-7)
    # per row: bit for bit the full-size row sums, whether a slice holds many rows or one
    y = mx.array(rng.standard_normal((300, 37)).astype(np.float32)).reshape(-1)
    want = np.array(mx.sum(y.reshape(-1, 37), axis=-1))
    for chunk in (10, 100, 1 << 18):
        monkeypatch.setattr(K, "CHUNK", chunk)
        (got,) = K.sums(lambda lo, hi: [y[lo:hi]], y.size, width=37, mlx_rows=True)
        np.testing.assert_array_equal(np.array(got), want)
    (z,) = K.sums(lambda lo, hi: [xa[lo:hi]], 0)  # an empty tensor sums to 0
    assert z.item() == 0.0


def test_slices_cover_in_whole_rows(monkeypatch):
    monkeypatch.setattr(K, "CHUNK", 100)
    for size, align in ((1000, 1), (999, 37), (37 * 3, 37), (50, 200)):
        s = list(K.slices(size, align))
        assert s[0][0] == 0 and s[-1][1] == size
        assert all(a[1] == b[0] for a, b in zip(s, s[1:]))
        assert all((hi - lo) % align == 0 for lo, hi in s[:-1])


@pytest.mark.parametrize("dt", ["float32", "bfloat16"])
def test_sliced_slerp_and_model_stock_match_reference(monkeypatch, dt):
    """Slices of 64 elements, partial sums over 16 (tails everywhere): the NumPy references still
    hold; per-row model_stock and the slerp endpoints equal the unsliced results bit for bit."""
    rng = np.random.default_rng(4)
    shape = (24, 40)
    base = R(rng.standard_normal(shape).astype(np.float32), dt)
    xs = [R(base + 0.3 * rng.standard_normal(shape).astype(np.float32), dt) for _ in range(2)]
    cd = getattr(mx, dt)
    whole = {fw: npy(I.model_stock(mxa(base, dt), [mxa(x, dt) for x in xs], cd, shape, fw)) for fw in (False, True)}
    monkeypatch.setattr(K, "CHUNK", 64)
    monkeypatch.setattr(K, "SUM_ROW", 16)
    for t in (0.0, 0.3, 1.0):
        got = npy(I.slerp(t, mxa(base, dt), mxa(xs[0], dt)).astype(cd))
        np.testing.assert_allclose(got, R(ref_slerp(t, base, xs[0]).reshape(shape), dt), **tol(dt))
        if t in (0.0, 1.0):
            np.testing.assert_array_equal(got, base if t == 0 else xs[0])
    for fw in (False, True):
        got = npy(I.model_stock(mxa(base, dt), [mxa(x, dt) for x in xs], cd, shape, fw)).reshape(shape)
        np.testing.assert_allclose(got, ref_model_stock(base, xs, dt, fw), **tol(dt))
        if fw:
            np.testing.assert_array_equal(got.ravel(), whole[True])
    # float32 inputs with a bf16 compute dtype are aligned slice by slice: as if cast first
    a32 = [mx.array(base + 0.01), mx.array(xs[0] * 1.001), mx.array(xs[1] - 0.003)]
    first = [x.astype(mx.bfloat16) for x in a32]
    np.testing.assert_array_equal(npy(mx.concatenate(I.model_stock_parts(a32[0], a32[1:], mx.bfloat16))),
                                  npy(mx.concatenate(I.model_stock_parts(first[0], first[1:], mx.bfloat16))))
    np.testing.assert_array_equal(npy(mx.concatenate(I.slerp_parts(0.4, a32[0], a32[1], mx.bfloat16))),
                                  npy(mx.concatenate(I.slerp_parts(0.4, first[0], first[1], mx.bfloat16))))


def test_no_full_size_float32_copy(monkeypatch):
    """Beyond its inputs, a bf16 slerp / model_stock holds its bf16 output and one slice's
    temporaries: well under one float32 copy of the tensor (the whole-tensor version held 2.5-6)."""
    monkeypatch.setattr(K, "CHUNK", 1 << 14)
    n = 1 << 20
    rng = np.random.default_rng(1)
    b = mx.array(rng.standard_normal(n).astype(np.float32)).astype(mx.bfloat16)
    xs = [(b + 0.1).astype(mx.bfloat16), (b * 0.9).astype(mx.bfloat16)]
    mx.eval(b, *xs)
    for name, f in (("slerp", lambda: I.slerp_parts(0.3, b, xs[0], mx.bfloat16)),
                    ("model_stock", lambda: I.model_stock_parts(b, xs, mx.bfloat16))):
        f()  # compile first
        mx.clear_cache()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        out = f()
        extra = mx.get_peak_memory() - before
        assert sum(p.nbytes for p in out) == 2 * n
        assert extra < 2 * n + 0.1 * 4 * n, (name, extra / (4 * n))
