"""Sliced reductions (kernels.sums, kernels.sweep) and the sliced slerp / model_stock / nuslerp /
multislerp / karcher: accurate whole-tensor and row sums, norms in the order of torch's norm kernel,
results equal to the NumPy references and to the unsliced results at any slice size, and no
full-size float32 copy of a tensor."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

import mlx_ssp  # noqa: F401
import mlx.core as mx

from mlx_ssp.merge import interpolate as I
from mlx_ssp.merge import kernels as K
from mlx_ssp.merge import selective as S
from mlx_ssp.merge import slerp as SL
from mlx_ssp.merge import sphere_means as SM

from merge_helpers import R, mxa, npy, ref_karcher, ref_model_stock, ref_multislerp, ref_nuslerp, ref_slerp, tol


def test_sums_whole_tensor_and_rows_match_float64(monkeypatch):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(10_007).astype(np.float32)
    xa = mx.array(x)
    for chunk in (1000, 256, 1 << 18):
        monkeypatch.setattr(K, "CHUNK", chunk)
        s, sq = K.sums(lambda lo, hi: [xa[lo:hi], mx.square(xa[lo:hi])], x.size)
        assert s.shape == (1,) and s.dtype == mx.float32
        np.testing.assert_allclose(s.item(), x.astype(np.float64).sum(), rtol=1e-6, atol=1e-4)
        np.testing.assert_allclose(sq.item(), (x.astype(np.float64) ** 2).sum(), rtol=1e-7)
    # per row: the float64 row sums, whether a slice holds many rows or one
    yn = rng.standard_normal((300, 37)).astype(np.float32)
    y = mx.array(yn).reshape(-1)
    want = yn.astype(np.float64).sum(-1).astype(np.float32)
    for chunk in (10, 100, 1 << 18):
        monkeypatch.setattr(K, "CHUNK", chunk)
        (got,) = K.sums(lambda lo, hi: [y[lo:hi]], y.size, width=37)
        np.testing.assert_array_equal(np.array(got), want)
    (z,) = K.sums(lambda lo, hi: [xa[lo:hi]], 0)  # an empty tensor sums to 0
    assert z.item() == 0.0


def test_round_bf16_equals_the_casts_bit_for_bit():
    """The bf16 rounding on the bits gives what ``astype(bfloat16).astype(float32)`` gives: on 4M
    random bit patterns and on the edge cases (ties to even either way, the largest finite values
    rounding to inf, subnormals, signed zeros, infinities), inside a compiled kernel too; a NaN
    stays a NaN."""
    rng = np.random.default_rng(0)
    edge = [0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x00008000, 0x00018000, 0x3F808000, 0x3F818000,
            0x3F807FFF, 0x7F7FFFFF, 0xFF7F8000, 0x7F7F7FFF, 0x7F800000, 0xFF800000]
    bits = np.concatenate([rng.integers(0, 2 ** 32, 1 << 22, dtype=np.uint64).astype(np.uint32),
                           np.array(edge, dtype=np.uint32)])
    x = mx.array(bits.view(np.float32))
    want = np.array(x.astype(mx.bfloat16).astype(mx.float32)).view(np.uint32)
    for f in (K.round_bf16, mx.compile(K.round_bf16)):
        got = np.array(f(x)).view(np.uint32)
        nan = np.isnan(bits.view(np.float32))
        assert np.array_equal(got[~nan], want[~nan])
        assert np.isnan(got[nan].view(np.float32)).all() and nan.sum() > 1000


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
    for t in (0.0, 0.3, 1.0):
        got = npy(SL.slerp(t, mxa(base, dt), mxa(xs[0], dt)).astype(cd))
        np.testing.assert_allclose(got, R(ref_slerp(t, base, xs[0]).reshape(shape), dt), **tol(dt))
        if t in (0.0, 1.0):
            np.testing.assert_array_equal(got, base if t == 0 else xs[0])
    for fw in (False, True):
        got = npy(I.model_stock(mxa(base, dt), [mxa(x, dt) for x in xs], cd, shape, fw)).reshape(shape)
        np.testing.assert_allclose(got, ref_model_stock(base, xs, dt, fw), **tol(dt))
        if fw:
            np.testing.assert_array_equal(got.ravel(), whole[True])
    # float32 inputs with a bf16 compute dtype are aligned slice by slice: as if cast first (the
    # ``*_parts`` take flat tensors, as the engine hands them over)
    a32 = [mx.array(base + 0.01).reshape(-1), mx.array(xs[0] * 1.001).reshape(-1), mx.array(xs[1] - 0.003).reshape(-1)]
    first = [x.astype(mx.bfloat16) for x in a32]
    np.testing.assert_array_equal(npy(mx.concatenate(I.model_stock_parts(a32[0], a32[1:], mx.bfloat16))),
                                  npy(mx.concatenate(I.model_stock_parts(first[0], first[1:], mx.bfloat16))))
    np.testing.assert_array_equal(npy(mx.concatenate(SL.slerp_parts(0.4, a32[0], a32[1], mx.bfloat16))),
                                  npy(mx.concatenate(SL.slerp_parts(0.4, first[0], first[1], mx.bfloat16))))


#: full-size bf16 arrays a bf16 merge of 3 inputs holds besides its inputs: its output, and what a
#: later pass reads again (multislerp: its 3 unit vectors and its mean, the tangent replacing the
#: unit vectors; karcher: its 3 unit vectors, its mean and its tangent, the output replacing the mean)
HELD_BF16 = {"slerp": 1, "model_stock": 1, "nuslerp": 1, "multislerp": 4, "karcher": 5}


def test_no_full_size_float32_copy(monkeypatch):
    """Beyond its inputs, a bf16 slerp / model_stock / nuslerp / multislerp / karcher holds only the
    bf16 arrays of :data:`HELD_BF16` and one slice's temporaries: no float32 copy of the tensor
    (which would add two bf16 copies; the whole-tensor versions held 2.5-6 float32 copies)."""
    monkeypatch.setattr(K, "CHUNK", 1 << 14)
    n = 1 << 20
    rng = np.random.default_rng(1)
    b = mx.array(rng.standard_normal(n).astype(np.float32)).astype(mx.bfloat16)
    xs = [(b + 0.1).astype(mx.bfloat16), (b * 0.9).astype(mx.bfloat16)]
    mx.eval(b, *xs)
    for name, f in (("slerp", lambda: SL.slerp_parts(0.3, b, xs[0], mx.bfloat16)),
                    ("model_stock", lambda: I.model_stock_parts(b, xs, mx.bfloat16)),
                    ("nuslerp", lambda: SL.nuslerp_parts(0.3, b, xs[0], mx.bfloat16)),
                    ("multislerp", lambda: SM.multislerp_parts([b] + xs, [1, 2, 3], cd=mx.bfloat16)),
                    # karcher holds its mean in bf16, which its output replaces slice by slice
                    ("karcher", lambda: SM.karcher_parts([b] + xs, max_iter=3, cd=mx.bfloat16))):
        f()  # compile first
        mx.clear_cache()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        out = f()
        extra = mx.get_peak_memory() - before
        assert sum(p.nbytes for p in out) == 2 * n
        # the held bf16 arrays plus at most 16 float32 temporaries of one slice (a quarter of a
        # float32 copy)
        assert extra < HELD_BF16[name] * 2 * n + 16 * 4 * K.CHUNK, (name, extra / (2 * n))


def ref_torch_norm_sq(sq: np.ndarray, block: int) -> np.float32:
    """torch's CPU norm order, written out: 8 float32 lanes, each a running sum (np.cumsum is
    sequential) over the prefix of whole ``block``-element vectors, the lanes added in order, then
    the rest one by one."""
    m = sq.size - sq.size % block
    lanes = np.cumsum(sq[:m].reshape(-1, 8), axis=0, dtype=np.float32)[-1] if m else np.zeros(8, np.float32)
    total = np.float32(0)
    for v in list(lanes) + list(sq[m:]):
        total = np.float32(total + v) if total or v else np.float32(0)
    return total


@pytest.mark.slow
def test_big_sums_float64_exact_and_norms_in_torch_order(monkeypatch):
    """Over 2^22 elements a plain float32 sum drifts; the whole-tensor sums stay within an ulp of
    the float64 value, row sums are float64 ones, and the norm sums follow torch's lanes (drift
    included), however the tensor is sliced."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(1 << 22) * 0.02).astype(np.float32)
    sq = x * x
    exact = np.float32(sq.astype(np.float64).sum())
    plain = np.float32(mx.sum(mx.array(sq)).item())
    assert abs(plain - exact) > 4 * np.spacing(exact)  # the drift the sliced sums avoid
    xa = mx.array(x)
    (got,) = K.sums(lambda lo, hi: [mx.square(xa[lo:hi])], x.size)
    assert abs(got.item() - exact) <= np.spacing(exact)
    want = ref_torch_norm_sq(sq, 8)
    assert want != exact  # torch's order drifts too: the test tells the two orders apart
    for chunk in (1 << 18, 4000):
        monkeypatch.setattr(K, "CHUNK", chunk)
        (lanes,) = K.sums(lambda lo, hi: [mx.square(xa[lo:hi])], x.size, block=8)
        assert lanes.item() == want
    # a bf16 vector is 16 elements: an odd length leaves a tail summed one by one
    y = sq[: 10_000 + 13]
    (t16,) = K.sums(lambda lo, hi: [mx.array(y)[lo:hi]], y.size, block=16)
    assert t16.item() == ref_torch_norm_sq(y, 16)
    # per row: torch's order within each row, and float64 sums for the other row statistics
    rows = sq[: 300 * 77].reshape(300, 77)
    monkeypatch.setattr(K, "CHUNK", 1000)
    ya = mx.array(rows.ravel())
    (rn,) = K.sums(lambda lo, hi: [ya[lo:hi]], ya.size, width=77, block=8)
    np.testing.assert_array_equal(np.array(rn), [ref_torch_norm_sq(r, 8) for r in rows])
    (r64,) = K.sums(lambda lo, hi: [ya[lo:hi]], ya.size, width=77)
    np.testing.assert_array_equal(np.array(r64), rows.astype(np.float64).sum(-1).astype(np.float32))


def _sphere_inputs(dt, shape=(24, 40), n=3, seed=5):
    rng = np.random.default_rng(seed)
    b = rng.standard_normal(shape).astype(np.float32)
    return [R(b + 0.3 * rng.standard_normal(shape).astype(np.float32), dt) for _ in range(n)]


@pytest.mark.parametrize("dt", ["float32", "bfloat16"])
def test_sliced_nuslerp_multislerp_karcher_equal_unsliced(monkeypatch, dt):
    """Slices of 64 elements: every mode gives the one-slice result bit for bit, and the NumPy
    references hold (bf16: where terms cancel, a rounding is worth more than its relative size)."""
    xs = _sphere_inputs(dt)
    shape, cd = xs[0].shape, getattr(mx, dt)

    def run():
        a = [mxa(x, dt).reshape(-1) for x in xs]
        got = {f"nuslerp {m}": npy(mx.concatenate(SL.nuslerp_parts(0.35, a[0], a[1], cd, cd, shape, rw, fl)))
               for m, rw, fl in (("flat", False, True), ("rows", False, False), ("cols", True, False))}
        got["multislerp"] = npy(mx.concatenate(SM.multislerp_parts(a, [0.2, 0.5, 0.3], cd=cd)))
        got["karcher"] = npy(mx.concatenate(SM.karcher_parts(a, cd=cd)))
        return got

    whole = run()
    monkeypatch.setattr(K, "CHUNK", 64)
    sliced = run()
    for k in whole:
        np.testing.assert_array_equal(sliced[k], whole[k], err_msg=k)
    tl = tol(dt) if dt == "float32" else dict(rtol=2 ** -7, atol=2 ** -6)
    for m, rw, fl in (("flat", False, True), ("rows", False, False), ("cols", True, False)):
        np.testing.assert_allclose(sliced[f"nuslerp {m}"].reshape(shape), R(ref_nuslerp(0.35, xs[0], xs[1], rw, fl), dt),
                                   **tl)
    np.testing.assert_allclose(sliced["multislerp"], R(ref_multislerp(xs, [0.2, 0.5, 0.3]), dt).ravel(), **tl)
    np.testing.assert_allclose(sliced["karcher"], R(ref_karcher(xs), dt).ravel(), **tl)
    # float32 inputs with a bf16 compute dtype are aligned slice by slice: as if cast first
    a32 = [mx.array(x).reshape(-1) for x in _sphere_inputs("float32")]  # flat, as the ``*_parts`` take them
    first = [x.astype(mx.bfloat16) for x in a32]
    for f in (lambda v: SM.karcher_parts(v, cd=mx.bfloat16), lambda v: SM.multislerp_parts(v, [1, 2, 3], cd=mx.bfloat16),
              lambda v: SL.nuslerp_parts(0.4, v[0], v[1], mx.bfloat16)):
        np.testing.assert_array_equal(npy(mx.concatenate(f(a32))), npy(mx.concatenate(f(first))))


def test_sce_variance_and_weights_as_torch_computes_them():
    """SCE's variance is Welford's in float64 (torch's var), its weights' mean squares are float64
    sums over the tensor (2^21 elements: a float32 sum would drift), divided by the count in float32."""
    rng = np.random.default_rng(6)
    T = (rng.standard_normal((3, 1 << 21)) * 0.002).astype(np.float32)
    mean, m2 = np.zeros(T.shape[1]), np.zeros(T.shape[1])
    for i, row in enumerate(T.astype(np.float64)):
        d = row - mean
        mean = mean + d / (i + 1)
        m2 = m2 + d * (row - mean)
    Ta = mx.array(T)
    rows = [Ta[i] for i in range(3)]
    np.testing.assert_array_equal(np.array(S.variance(rows)), (m2 / 3).astype(np.float32))
    ms = (T.astype(np.float64) ** 2).sum(1).astype(np.float32) / np.float32(T.shape[1])
    want = ms / np.float32(float(ms.sum(dtype=np.float32)))
    np.testing.assert_array_equal(S.sce_weights(rows), want)
    # the top-k mask: a partition, yet the lowest indices among ties, as a stable sort keeps them
    v = np.array([1, 3, 2, 3, 3, 0, 3, 1], dtype=np.float32)
    tv = [mx.zeros(8), mx.array(2 * np.sqrt(v))]  # two task vectors: variance (d / 2)^2 = v
    got = np.array(S.topk_variance_mask(tv, 0.5))  # 7 nonzero * 0.5 -> k = 3
    assert got.tolist() == [False, True, False, True, True, False, False, False]


def test_torch_sum_adds_in_torch_order():
    """Sums whose float32 value depends on the order: the values torch 2.14's CPU ``sum`` gives on
    one thread (small ones checked by hand, not the sequential or exact sums 3.0, 8.0, 9.0; large
    ones recorded from torch: its cascade's levels give neither the float64 nor the sequential
    sum)."""
    assert K.torch_sum([1e8, 1, -1e8, 1, 1]) == 1.0  # 4 interleaved scalars: (x0 + x4) + x1 + ...
    assert K.torch_sum([1e8] + [1.0] * 8 + [-1e8]) == 7.0  # 8-element vectors, then the rest, then lanes
    assert K.torch_sum([3e7, 1, 1, 1, 1, 1, 1, 1, -3e7, 1, 1]) == 7.0
    for n, torch_bits, f64_bits in ((70001, 3227875146, 3227875145), ((1 << 20) + 77, 1103110336, 1103110337)):
        x = (np.random.default_rng(2).standard_normal(n) * 0.02).astype(np.float32)
        assert np.float32(x.sum(dtype=np.float64)).view(np.uint32) == f64_bits  # the data is as recorded
        assert K.torch_sum(x).view(np.uint32) == torch_bits, n


def test_torch_column_sums_and_norms_in_torch_order():
    """Sums and 2-norms across rows (mergekit's nuslerp per column: ``sum`` / ``norm`` over the last
    axis of a transposed view) as torch 2.14 gives them on one thread, recorded as sha256 of its
    results: each shape's sums differ from both the float64 and the sequential sums in 26-49
    columns (the (5, 100) case: 2 from the sequential), so neither order passes."""
    recorded = {(37, 65): ("687ff0b4c4f0", "b5c283092806", "e44738c4b626"),
                (130, 40): ("ca74bc4b794d", "4da6079c7047", "ccc8c42e1d19"),
                (5, 100): ("f0020d2b11aa", "f4b5161a06e1", "fc366cc47515"),
                (20000, 33): ("3944165d5486", "f704dc3d8c32", "422af68351d9")}
    h = lambda a: hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:12]  # noqa: E731
    for shape, (hx, hsum, hnorm) in recorded.items():
        x = (np.random.default_rng(3).standard_normal(shape) * 0.02).astype(np.float32)
        assert h(x) == hx  # the data is as recorded
        assert h(K.torch_column_sums(x)) == hsum, shape
        assert h(K.torch_column_norms(x)) == hnorm, shape
        assert h(np.float32(x.astype(np.float64).sum(0))) != hsum
