"""mergekit 0.1.5's other merge methods: each against an independent NumPy reference (float32 and
bfloat16) and their properties. End-to-end merges of tiny models and parameter errors:
test_merge_methods_e2e.py; parity with mergekit itself: test_merge_goldens.py."""

from __future__ import annotations

import numpy as np
import pytest

import mlx_ssp  # noqa: F401
import mlx.core as mx

from mlx_ssp.errors import UserError
from mlx_ssp.merge import interpolate as I
from mlx_ssp.merge import selective as S
from mlx_ssp.merge import slerp as SL
from mlx_ssp.merge import sphere_means as SM
from mlx_ssp.merge.sparsify import magprune_mask, magprune_probabilities

from merge_helpers import (
    DTS, R, mxa, npy, pair, ref_fusion, ref_karcher, ref_magprune_probs, ref_model_stock, ref_multislerp,
    ref_nearswap, ref_nuslerp, ref_ram, ref_sce, ref_slerp, tol,
)

# ------------------------------------------------------------------ pure functions vs the references


@pytest.mark.parametrize("dt", DTS)
@pytest.mark.parametrize("t", [0.0, 0.3, 0.75, 1.0])
def test_slerp_matches_reference_and_endpoints(dt, t):
    a, b = pair(dt)
    got = npy(SL.slerp(t, mxa(a, dt), mxa(b, dt)).astype(getattr(mx, dt)))
    np.testing.assert_allclose(got.ravel(), R(ref_slerp(t, a, b), dt), **tol(dt))
    if t in (0.0, 1.0):  # the endpoints, exactly
        np.testing.assert_array_equal(got, a if t == 0 else b)


def test_slerp_nearly_parallel_falls_back_to_linear():
    a = np.linspace(-1, 1, 64, dtype=np.float32)
    for b in (a * 2.5 + 1e-4, -a):  # cos > 0.9995, and antiparallel
        got = npy(SL.slerp(0.3, mx.array(a), mx.array(b)))
        np.testing.assert_allclose(got, 0.7 * a + 0.3 * b, rtol=1e-6, atol=1e-7)
    # just below the threshold it is spherical: not the linear mix
    rng = np.random.default_rng(3)
    b = a + 0.2 * rng.standard_normal(64).astype(np.float32)
    lin = 0.7 * a + 0.3 * b
    assert np.abs(npy(SL.slerp(0.3, mx.array(a), mx.array(b))) - lin).max() > 1e-4


@pytest.mark.parametrize("dt", DTS)
@pytest.mark.parametrize("row_wise,flatten", [(False, True), (False, False), (True, False)])
def test_nuslerp_matches_reference(dt, row_wise, flatten):
    a, b = pair(dt, scale=1.0)
    got = npy(SL.nuslerp(0.35, mxa(a, dt), mxa(b, dt), a.shape, row_wise, flatten).astype(getattr(mx, dt)))
    np.testing.assert_allclose(got.reshape(a.shape), R(ref_nuslerp(0.35, a, b, row_wise, flatten), dt), **tol(dt))


@pytest.mark.parametrize("dt", DTS)
def test_multislerp_and_karcher_match_reference(dt):
    rng = np.random.default_rng(1)
    xs = [R(rng.standard_normal(50).astype(np.float32) + 1.0, dt) for _ in range(3)]
    w = [0.2, 0.5, 0.3]
    got = npy(SM.multislerp([mxa(x, dt) for x in xs], w).astype(getattr(mx, dt)))
    np.testing.assert_allclose(got, R(ref_multislerp(xs, w), dt), **tol(dt))
    got = npy(SM.karcher([mxa(x, dt) for x in xs]).astype(getattr(mx, dt)))
    np.testing.assert_allclose(got, R(ref_karcher(xs), dt), **tol(dt))


@pytest.mark.parametrize("dt", DTS)
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_karcher_first_mean_is_mergekits_bit_for_bit(dt, n):
    """The first pass of karcher (cut into kernels at held values for GCC's vectoriser): the unit
    vectors, ``mean += alpha * u`` held in the compute dtype, and the mean's squares, equal to
    the same steps in NumPy on every bit."""
    rng = np.random.default_rng(5)
    xs = [R(rng.standard_normal(3000).astype(np.float32) * 0.02, dt) for _ in range(n)]
    norms = [np.float32(np.linalg.norm(x)) for x in xs]
    al = [np.float32(1.0 / n)] * n
    cd = getattr(mx, dt)
    (mean, units), (sq,) = SM._kar_first_mean([mxa(x, dt) for x in xs], [mx.array(v) for v in norms],
                                             [mx.array(a) for a in al], cd)
    ref_units = [R(x / v, dt) for x, v in zip(xs, norms)]
    ref_mean = R(al[0] * ref_units[0], dt)
    for a, u in zip(al[1:], ref_units[1:]):
        ref_mean = R(ref_mean + R(a * u, dt), dt)
    for got, ref in zip([mean, *units], [ref_mean, *ref_units]):
        assert got.dtype == cd
        np.testing.assert_array_equal(npy(got), ref)
    np.testing.assert_array_equal(npy(sq), np.square(ref_mean))


@pytest.mark.parametrize("dt", DTS)
@pytest.mark.parametrize("pending", [False, True])
def test_karcher_dots_step_is_mergekits_bit_for_bit(dt, pending):
    """The dots' pass of one slice: the held mean divided by its pending norm, in the compute
    dtype, and its float32 products with the unit vectors (torch.dot's terms)."""
    rng = np.random.default_rng(6)
    cd = getattr(mx, dt)
    m, *us = (R(rng.standard_normal(2000).astype(np.float32) * 0.02, dt) for _ in range(4))
    p = np.float32(1.0037)
    got_m, terms = SM._kar_dots(mxa(m, dt), [mxa(u, dt) for u in us], mx.array(p), cd, pending)
    ref_m = R(m / p, dt) if pending else m
    assert got_m.dtype == cd
    np.testing.assert_array_equal(npy(got_m), ref_m)
    for got, u in zip(terms, us):
        np.testing.assert_array_equal(npy(got), ref_m * u)
    assert SM._kar_dots(mxa(m, dt), [mxa(u, dt) for u in us], mx.array(p), cd, pending, products=False)[1] == []


@pytest.mark.parametrize("dt", DTS)
def test_multislerp_first_pass_is_mergekits_bit_for_bit(dt):
    """multislerp's mean pass over one slice: the unit vectors and the weighted mean (float32
    sum of the rounded products, one rounding) in the compute dtype, and the mean's squares."""
    rng = np.random.default_rng(8)
    cd = getattr(mx, dt)
    xs = [R(rng.standard_normal(3000).astype(np.float32) * 0.02, dt) for _ in range(3)]
    dn = [R(np.float32(np.linalg.norm(x)) + np.float32(1e-8), dt) for x in xs]
    w = [R(np.float32(v), dt) for v in (0.5, 0.3, 0.2)]
    (mean, units), (sq,) = SM._msl_first([mxa(x, dt) for x in xs], [mx.array(np.float32(d)) for d in dn],
                                         [mx.array(np.float32(v)) for v in w], cd)
    ref_units = [R(x / d, dt) for x, d in zip(xs, dn)]
    acc = R(ref_units[0] * w[0], dt)
    for u, v in zip(ref_units[1:], w[1:]):
        acc = acc + R(u * v, dt)
    ref_mean = R(acc, dt)
    for got, ref in zip([mean, *units], [ref_mean, *ref_units]):
        assert got.dtype == cd
        np.testing.assert_array_equal(npy(got), ref)
    np.testing.assert_array_equal(npy(sq), np.square(ref_mean))


def test_karcher_and_multislerp_of_identical_models_return_it():
    x = np.random.default_rng(2).standard_normal(40).astype(np.float32)
    got = npy(SM.karcher([mx.array(x)] * 3))
    np.testing.assert_allclose(got, x, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(npy(SM.multislerp([mx.array(x)] * 3, [1, 2, 3])), x, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dt", DTS)
@pytest.mark.parametrize("filter_wise", [False, True])
def test_model_stock_matches_reference(dt, filter_wise):
    rng = np.random.default_rng(4)
    base = R(rng.standard_normal((6, 10)).astype(np.float32), dt)
    xs = [R(base + 0.05 * rng.standard_normal(base.shape).astype(np.float32) + 0.03, dt) for _ in range(3)]
    got = npy(I.model_stock(mxa(base, dt), [mxa(x, dt) for x in xs], getattr(mx, dt), base.shape,
                            filter_wise).astype(getattr(mx, dt)))
    np.testing.assert_allclose(got.reshape(base.shape), ref_model_stock(base, xs, dt, filter_wise),
                               rtol=1e-5 if dt == "float32" else 0, atol=1e-6 if dt == "float32" else 0)


@pytest.mark.parametrize("dt", DTS)
def test_nearswap_matches_reference(dt):
    a, b = pair(dt, scale=0.01)
    got = npy(I.nearswap(0.005, mxa(a, dt), mxa(b, dt), getattr(mx, dt)).astype(getattr(mx, dt)))
    np.testing.assert_allclose(got.reshape(a.shape), ref_nearswap(0.005, a, b, dt),
                               rtol=2e-7 if dt == "float32" else 0, atol=0)


@pytest.mark.parametrize("dt", DTS)
def test_arcee_fusion_matches_reference(dt):
    a, b = pair(dt, scale=0.5, n=(10, 16))
    want, imp, thr = ref_fusion(a, b, dt)
    got = npy(I.arcee_fusion(mxa(a, dt), mxa(b, dt), a.shape, 0, getattr(mx, dt)).astype(getattr(mx, dt)))
    close = np.isclose(imp, thr, rtol=1e-4)  # an element at the threshold may fall either way
    np.testing.assert_allclose(got.reshape(a.shape)[~close], R(want, dt)[~close], rtol=0, atol=1e-7)
    assert 0 < (got.reshape(a.shape) != a).mean() < 0.5  # some, not all, changes kept


@pytest.mark.parametrize("dt", DTS)
@pytest.mark.parametrize("topk", [1.0, 0.4])
def test_sce_matches_reference(dt, topk):
    rng = np.random.default_rng(5)
    base = R(rng.standard_normal((8, 8)).astype(np.float32), dt)
    xs = [R(base + 0.1 * rng.standard_normal(base.shape).astype(np.float32), dt) for _ in range(3)]
    tvs = [mx.array(R(x - base, dt)) for x in xs]
    got = npy(S.sce(mx.array(base), tvs, topk).astype(getattr(mx, dt)))
    np.testing.assert_allclose(got.reshape(base.shape), R(ref_sce(base, xs, topk, dt), dt), **tol(dt))


@pytest.mark.parametrize("dt", DTS)
@pytest.mark.parametrize("plus", [False, True])
def test_ram_matches_reference(dt, plus):
    rng = np.random.default_rng(6)
    base = R(rng.standard_normal((8, 8)).astype(np.float32), dt)
    # sparse RL-like task vectors: some elements changed by one model, some by both
    xs = [R(base + 0.1 * rng.standard_normal(base.shape).astype(np.float32) * (rng.random(base.shape) < p), dt)
          for p in (0.3, 0.5)]
    tvs = [mx.array(R(x - base, dt)) for x in xs]
    got = npy(S.ram(mx.array(base), tvs, plus=plus, r=0.3, alpha=0.5).astype(getattr(mx, dt)))
    np.testing.assert_allclose(got.reshape(base.shape), R(ref_ram(base, xs, dt, plus=plus, r=0.3, alpha=0.5), dt),
                               **tol(dt))


@pytest.mark.parametrize("dt", DTS)
def test_magprune_probabilities_and_keep_rates(dt):
    rng = np.random.default_rng(7)
    mag = np.abs(rng.standard_normal((4, 200))).astype(np.float32)
    p = magprune_probabilities(mag, 0.5, 0.2, getattr(mx, dt) if dt == "bfloat16" else mx.float32)
    np.testing.assert_allclose(p, R(ref_magprune_probs(mag, 0.5, 0.2), dt), rtol=0, atol=1e-6 if dt == "float32" else 4e-3)
    # the draw: larger magnitudes survive more often (mean p of the lowest / highest quarter of ranks:
    # 0.3 + 0.4 * 49.5 / 399 and 0.3 + 0.4 * 349.5 / 399), the overall rate is the density
    d = rng.standard_normal((64, 400)).astype(np.float32)
    m = np.array(magprune_mask(mx.array(d.ravel()), 0.5, 0.2, seed=11, shape=d.shape)).reshape(d.shape)
    assert abs(m.mean() - 0.5) < 0.01
    ranks = np.argsort(np.argsort(np.abs(d), axis=1, kind="stable"), axis=1)
    assert abs(m[ranks < 100].mean() - 0.35) < 0.02 and abs(m[ranks >= 300].mean() - 0.65) < 0.02
    again = np.array(magprune_mask(mx.array(d.ravel()), 0.5, 0.2, seed=11, shape=d.shape)).reshape(d.shape)
    np.testing.assert_array_equal(m, again)  # seeded: deterministic
    with pytest.raises(UserError, match="epsilon"):
        magprune_mask(mx.array(d.ravel()), 0.9, 0.15, seed=1, shape=d.shape)


def test_magprune_mask_by_row_blocks_equals_the_whole_tensor_ranked_at_once(monkeypatch):
    """Ranks taken a few rows at a time (blocks that end inside the random stream's chunks, and
    chunks inside blocks) give the mask of the whole tensor's ranks against the same stream."""
    from mlx_ssp.merge import sparsify

    rng = np.random.default_rng(3)
    d = mx.array(rng.standard_normal((37, 53)).astype(np.float32)).astype(mx.bfloat16)
    raw = np.asarray(d.view(mx.uint16)).reshape(-1) & np.uint16(0x7FFF)
    want = np.empty(d.size, bool)
    probs = magprune_probabilities(raw.reshape(37, 53), 0.4, 0.1, mx.bfloat16).reshape(-1)
    monkeypatch.setattr(sparsify, "_RNG_CHUNK", 90)
    for i, j, u in sparsify._uniform_stream(d.size, 5):
        want[i:j] = u < probs[i:j]
    for block in (53, 53 * 3, 100, 1 << 20):
        monkeypatch.setattr(sparsify, "_RANK_BLOCK", block)
        got = np.array(magprune_mask(d.reshape(-1), 0.4, 0.1, seed=5, shape=(37, 53), work=mx.bfloat16))
        np.testing.assert_array_equal(got, want)
    assert magprune_mask(mx.zeros((0,), dtype=mx.float32), 0.4, 0.1, seed=5, shape=(0, 4)).size == 0
