"""The merge's native passes (mlx_ssp/merge/csrc, :mod:`mlx_ssp.merge.native`) give the MLX
path's bits: every method that has them, on sizes around the lane and block edges, with the
special values a bf16 tensor can hold."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import mlx_ssp  # noqa: F401
import mlx.core as mx

from mlx_ssp import native
from mlx_ssp.merge import interpolate as I
from mlx_ssp.merge import kernels as K
from mlx_ssp.merge import native as NV
from mlx_ssp.merge import slerp as SL
from mlx_ssp.merge import sphere_means as SM
from mlx_ssp.merge import sphere_native as SN
from mlx_ssp.merge import sphere_scalars as SS

BF16 = mx.bfloat16

# only where the library cannot be: on Linux x86_64 with a compiler a failed build fails the tests
pytestmark = pytest.mark.skipif(not native.linux_x86_64() or native.compiler() is None
                                or mx.default_device() != mx.cpu,
                                reason="the merge's native passes are built on a Linux x86_64 CPU with a C compiler")


def test_the_library_builds_and_is_used_for_bf16():
    assert NV.usable(mx.zeros(1, dtype=BF16)), NV.status
    assert NV.describe().startswith("on"), NV.describe()


def bf16_inputs(n: int, k: int, seed: int, specials: bool = False) -> list[mx.array]:
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(n).astype(np.float32)
    xs = []
    for _ in range(k):
        x = base + np.float32(0.4) * rng.standard_normal(n).astype(np.float32)
        if specials and n >= 8:
            x[rng.integers(0, n, 3)] = 0.0
            x[rng.integers(0, n, 2)] = np.float32(3e-39)  # a float32 (and bf16) denormal
            x[rng.integers(0, n, 2)] = -np.float32(1e-38)
        xs.append(mx.array(x).astype(BF16))
    mx.eval(xs)
    return xs


def bits_of(parts: list[mx.array]) -> np.ndarray:
    a = parts[0] if len(parts) == 1 else mx.concatenate(parts)
    if a.dtype in (BF16, mx.float16):
        a = a.view(mx.uint16)
    else:
        a = a.view(mx.uint32)
    return np.asarray(a)


def spied(monkeypatch, module, name: str) -> list:
    """Calls of ``module.name`` (the real function still runs): a native path that is not taken
    would make a comparison with the MLX path pass without testing anything."""
    calls, real = [], getattr(module, name)

    def f(*a, **k):
        calls.append(1)
        return real(*a, **k)
    monkeypatch.setattr(module, name, f)
    return calls


def both(f):
    got = f()
    with NV.enabled(False):
        want = f()
    return bits_of(got), bits_of(want)


def test_rounding_equals_mlx_casts_and_round_bf16_on_special_and_strided_bit_patterns():
    pats = np.arange(0, 1 << 32, 4099, dtype=np.uint64).astype(np.uint32)
    edges = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0x18000, 0x007FFFFF, 0x00800000, 0x7F7FFFFF, 0x7F7F8000,
                      0x7F800000, 0x7F800001, 0x7FC00000, 0x7FFFFFFF, 0x80000000, 0xFF800000, 0xFFFFFFFF,
                      0xFFC0FFFF, 0x3F808000, 0x3F818000], dtype=np.uint32)
    x = np.concatenate([pats, edges]).view(np.float32)
    got = np.empty_like(x)
    NV.lib().mlx_ssp_round_bf16(NV.ptr(x), NV.ptr(got), x.size)
    want = np.asarray(mx.array(x).astype(BF16).astype(mx.float32))  # every NaN: the quiet NaN 0x7FC00000
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(np.asarray(K.round_bf16(mx.array(x))).view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(K.rnd_host(x, BF16).view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("n", [1, 7, 13, 16, 100, 1031, 4099, 300007])
def test_karcher_native_equals_the_mlx_path(n, monkeypatch):
    calls = spied(monkeypatch, SN, "karcher_native")
    xs = bf16_inputs(n, 3, seed=n, specials=True)
    for out in (BF16, mx.float32, mx.float16):
        got, want = both(lambda: SM.karcher_parts(xs, cd=BF16, out=out))
        np.testing.assert_array_equal(got, want)
    assert len(calls) == 3


def test_karcher_native_with_zero_inputs_antipodes_and_few_iterations(monkeypatch):
    monkeypatch.setattr(K, "CHUNK", 64)  # the MLX path in many slices
    n = 999
    x = bf16_inputs(n, 4, seed=3)
    zero = mx.zeros(n, dtype=BF16)
    cases = [
        dict(xs=[x[0], zero, x[1]]),  # a zero-norm input is left out of the mean
        dict(xs=[x[0], -x[0]]),  # antipodal: the first mean vanishes
        dict(xs=x, max_iter=1),
        dict(xs=x, max_iter=3, tol=1e-3),
        dict(xs=x[:2], alphas=[0.7, 0.3]),
        dict(xs=[zero, zero]),
    ]
    for c in cases:
        got, want = both(lambda: SM.karcher_parts(cd=BF16, **c))
        np.testing.assert_array_equal(got, want)


def test_native_is_used_only_for_bf16_inputs_on_the_cpu():
    assert NV.usable(mx.zeros(3, dtype=BF16))
    assert not NV.usable(mx.zeros(3, dtype=BF16), mx.zeros(3, dtype=mx.float32))
    with NV.enabled(False):
        assert not NV.usable(mx.zeros(3, dtype=BF16))


def test_an_output_buffer_is_the_mlx_arrays_memory():
    arr, view = NV.empty(5)
    view[:] = np.array([1.0, 2.0, -3.0, 0.5, 0.0], np.float32).view(np.uint32) >> 16
    np.testing.assert_array_equal(np.asarray(arr.astype(mx.float32)), [1.0, 2.0, -3.0, 0.5, 0.0])


def test_lane_sums_are_torch_norm_order():
    """The squares' sum in torch's lane order, against :class:`.kernels._Lanes` via ``sums``."""
    rng = np.random.default_rng(5)
    for n in (5, 8, 17, 1000, 70001):
        x = mx.array(rng.standard_normal(n).astype(np.float32) * 100).astype(BF16)
        mx.eval(x)
        for block in (8, 16):
            (want,) = K.sums(lambda lo, hi: [mx.square(x[lo:hi].astype(mx.float32))], n, None, block)
            got = NV.lib().mlx_ssp_sumsq_bf16(NV.ptr(K.raw_bits(x)), n, block)
            assert np.float32(got) == np.float32(want.item()), (n, block)


def test_the_library_is_keyed_by_the_cpu_it_was_built_for(monkeypatch, tmp_path):
    """``-march=native`` code must not be loaded on another CPU that shares the cache."""
    monkeypatch.setenv("MLX_SSP_CACHE", str(tmp_path))
    cc = native.compiler()
    srcs = NV.sources()
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"sse2", "avx2"}))
    a = native.library_path("merge_kernels", srcs, cc, NV.FLAGS, (), per_cpu=True)
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"sse2", "avx2", "avx512f"}))
    b = native.library_path("merge_kernels", srcs, cc, NV.FLAGS, (), per_cpu=True)
    c = native.library_path("merge_kernels", srcs, cc, NV.FLAGS, (), per_cpu=False)
    assert a != b and c not in (a, b)
    assert a.parent == tmp_path / "native"


def test_without_a_working_compiler_a_merge_takes_the_mlx_path(tmp_path):
    """A compiler that fails: one line of status, a .failed file (no retry), the same merge output."""
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\necho 'cc: no headers here' >&2\nexit 1\n")
    cc.chmod(0o755)
    code = ("import numpy as np, mlx_ssp, mlx.core as mx; from mlx_ssp.merge import native as NV, sphere_means as SM; "
            "xs = [mx.array(np.linspace(-1, 1, 1000) * (i + 1) + i).astype(mx.bfloat16) for i in range(3)]; "
            "print(NV.usable(*xs), NV.status.split(':')[0]); "
            "print(np.asarray(SM.karcher_parts(xs, cd=mx.bfloat16)[0].view(mx.uint16)).tobytes().hex()[:64])")
    env = dict(os.environ, MLX_SSP_CACHE=str(tmp_path / "cache"), CC=str(cc))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    lines = out.stdout.split("\n")
    assert lines[0] == "False not built", out.stdout
    assert len(list((tmp_path / "cache" / "native").glob("merge_kernels-*.so.failed"))) == 1
    xs = [mx.array(np.linspace(-1, 1, 1000) * (i + 1) + i).astype(BF16) for i in range(3)]
    want = np.asarray(SM.karcher_parts(xs, cd=BF16)[0].view(mx.uint16)).tobytes().hex()[:64]
    assert lines[1] == want


MSL_SIZES = [1, 7, 13, 16, 17, 100, 4099, 300007]


@pytest.mark.parametrize("n", MSL_SIZES)
def test_multislerp_native_equals_the_mlx_path(n, monkeypatch):
    calls = spied(monkeypatch, SN, "multislerp_native")
    for k in (2, 4):
        xs = bf16_inputs(n, k, seed=n + k, specials=True)
        w = [0.5, 0.3, 0.15, 0.05][:k]
        for normalize in (True, False):
            for out in (BF16, mx.float32, mx.float16):  # float16: compared as float32 (exact)
                got, want = both(lambda: [p.astype(mx.float32) if out == mx.float16 else p
                                          for p in SM.multislerp_parts(xs, w, normalize, cd=BF16, out=out)])
                np.testing.assert_array_equal(got, want)
    assert len(calls) == 2 * 2 * 3


def test_multislerp_native_with_zero_inputs_antipodes_and_many_slices(monkeypatch):
    monkeypatch.setattr(K, "CHUNK", 64)  # the MLX path in many slices
    calls = spied(monkeypatch, SN, "multislerp_native")
    n = 999
    x = bf16_inputs(n, 3, seed=7, specials=True)
    zero = mx.zeros(n, dtype=BF16)
    cases = [
        dict(xs=[x[0], zero, x[1]], weights=[0.2, 0.5, 0.3]),  # a zero vector: its unit vector is 0
        dict(xs=[x[0], -x[0]], weights=[1.0, 1.0]),  # antipodal, balanced: the linear fallback
        dict(xs=[x[0], -x[0]], weights=[0.7, 0.3]),
        dict(xs=[x[0], x[0]], weights=[0.5, 0.5]),  # equal inputs: the tangent vanishes
        dict(xs=x, weights=[3.0, -1.0, 0.5], normalize_weights=False),
        dict(xs=[zero, zero], weights=[0.5, 0.5]),
    ]
    for c in cases:
        for out in (BF16, mx.float32):
            got, want = both(lambda: SM.multislerp_parts(cd=BF16, out=out, **c))
            np.testing.assert_array_equal(got, want)
    assert len(calls) == 2 * len(cases)


def test_multislerp_native_raises_as_the_mlx_path_on_more_than_two_antipodes():
    x = bf16_inputs(100, 1, seed=2)[0]
    for on in (True, False):
        with NV.enabled(on), pytest.raises(ValueError, match="weighted sum of the input tensors is zero"):
            SM.multislerp_parts([x, -x, x, -x], [1.0] * 4, cd=BF16)


@pytest.mark.parametrize("n", MSL_SIZES)
def test_nuslerp_native_equals_the_mlx_path(n, monkeypatch):
    calls = spied(monkeypatch, SL, "_nuslerp_native")
    a, b = bf16_inputs(n, 2, seed=n, specials=True)
    twice = (a.astype(mx.float32) * 2).astype(BF16)  # colinear: the linear case
    runs = 0
    for v1 in (b, twice, -a):
        for t in (0.0, 0.35, 0.6, 1.0):
            for out in (BF16, mx.float32, mx.float16):  # float16: compared as float32 (exact)
                got, want = both(lambda: [p.astype(mx.float32) if out == mx.float16 else p
                                          for p in SL.nuslerp_parts(t, a, v1, cd=BF16, out=out)])
                np.testing.assert_array_equal(got, want)
                runs += 1
    assert len(calls) == runs


@pytest.mark.parametrize("shape", [(3, 7), (5, 16), (4, 17), (13, 1), (1, 100), (6, 33), (300, 100), (64, 4099),
                                   (2, 3, 40)])
def test_nuslerp_native_per_row_equals_the_mlx_path(shape, monkeypatch):
    """``flatten: false``: each row of the last axis its own vector (norms in torch's lane order
    per row, cosines in float64 per row); rows that are colinear, antipodal or zero among them."""
    monkeypatch.setattr(K, "CHUNK", 256)  # the MLX path in many slices of whole rows
    calls = spied(monkeypatch, SL, "_nuslerp_native")
    size = int(np.prod(shape))
    a, b = (np.asarray(v.astype(mx.float32)).reshape(-1, shape[-1]) for v in bf16_inputs(size, 2, seed=size,
                                                                                         specials=True))
    rows = a.shape[0]
    b[rows // 3] = 2 * a[rows // 3]  # colinear row
    b[rows // 2] = -a[rows // 2]  # antipodal row
    a[rows - 1] = 0  # a zero row (its norm is clamped)
    a, b = (mx.array(v.reshape(-1)).astype(BF16) for v in (a, b))
    for t in (0.3, 0.5):
        for out in (BF16, mx.float32):
            got, want = both(lambda: SL.nuslerp_parts(t, a, b, cd=BF16, out=out, shape=shape, flatten=False))
            np.testing.assert_array_equal(got, want)
    assert len(calls) == 4


@pytest.mark.parametrize("n", [1, 7, 16, 17, 4099, 300007])
def test_model_stock_native_equals_the_mlx_path(n, monkeypatch):
    calls = spied(monkeypatch, NV.lib(), "mlx_ssp_ms_combine")
    base, *xs = bf16_inputs(n, 4, seed=40 + n, specials=True)
    for k in (2, 3):
        for out in (BF16, mx.float32, mx.float16):
            got, want = both(lambda: I.model_stock_parts(base, xs[:k], BF16, out))
            np.testing.assert_array_equal(got, want)
    assert len(calls) == 6


def test_model_stock_native_per_row_and_singular_and_unchanged_models(monkeypatch):
    calls = spied(monkeypatch, NV.lib(), "mlx_ssp_ms_sums")
    base, a, b = bf16_inputs(24 * 40, 3, seed=9)
    cases = [
        (base, [a, b], (24, 40), True),  # filter_wise: a ratio per row
        (base, [a, b], (24, 40), False),
        (base, [a, base + (base - a)], None, False),  # opposite offsets: 1 + (N - 1) cos = 0, t = 0
        (base, [base, base], (24, 40), True),  # zero offsets: zero norms
    ]
    for bs, xs, shape, fw in cases:
        got, want = both(lambda: I.model_stock_parts(bs, xs, BF16, BF16, shape, fw))
        np.testing.assert_array_equal(got, want)
    assert len(calls) == len(cases)


def test_nan_inf_and_strided_inputs_give_the_mlx_paths_bits(monkeypatch):
    """Infinities and NaNs (every NaN rounds to the quiet NaN 0x7FC0, as MLX's and torch's casts
    make it), and inputs that are views with strides (copied for the native passes, the copies
    held through each call)."""
    n = 4099
    base, a, b, c = bf16_inputs(2 * n, 4, seed=77)
    bad = np.asarray(a.astype(mx.float32)).copy()
    bad[[5, 900]] = np.inf
    bad[17] = -np.nan
    bad_a = mx.array(bad).astype(BF16)
    strided = [x[::2] for x in (base, a, b, c)]
    cases = [
        lambda: SM.karcher_parts([bad_a, b, c], cd=BF16),
        lambda: SM.multislerp_parts([bad_a, b, c], [0.5, 0.3, 0.2], cd=BF16),
        lambda: SL.nuslerp_parts(0.4, bad_a, b, cd=BF16),
        lambda: I.model_stock_parts(base, [bad_a, b], BF16, BF16, (2 * n // 2, 2), True),
        lambda: SM.karcher_parts(strided[1:], cd=BF16),
        lambda: SM.multislerp_parts(strided[1:], [0.5, 0.3, 0.2], cd=BF16),
        lambda: SL.nuslerp_parts(0.4, strided[1], strided[2], cd=BF16),
        lambda: I.model_stock_parts(strided[0], strided[1:], BF16, BF16),
    ]
    for f in cases:
        got, want = both(f)
        np.testing.assert_array_equal(got, want)


def test_model_stock_of_more_models_than_the_native_passes_take_uses_mlx(monkeypatch):
    calls = spied(monkeypatch, NV.lib(), "mlx_ssp_ms_sums")
    k = int(NV.lib().mlx_ssp_ms_max_models()) + 1
    base, *xs = bf16_inputs(100, k + 1, seed=5)
    got, want = both(lambda: I.model_stock_parts(base, xs, BF16, BF16))
    np.testing.assert_array_equal(got, want)
    assert not calls


def test_karchers_angles_from_one_array_equal_those_of_single_values():
    """The arc cosines and sines of fewer than 8 inputs come from one MLX array, of more from 0-d
    arrays (the MLX path's own form): the same values."""
    rng = np.random.default_rng(2)
    dots = rng.uniform(-1, 1, 12).astype(np.float32)
    al = np.full(12, 1 / 12, np.float32)
    whole = SS.kar_angles(dots, al, 1e-5, BF16)
    parts = [SS.kar_angles(dots[i:i + 4], al[i:i + 4], 1e-5, BF16) for i in (0, 4, 8)]
    np.testing.assert_array_equal(whole[1], np.concatenate([p[1] for p in parts]))
    np.testing.assert_array_equal(whole[2], np.concatenate([p[2] for p in parts]))
