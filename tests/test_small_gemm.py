"""The few-row float32 kernel that MLX's cblas_sgemm calls reach first on Linux x86_64
(mlx_ssp/small_gemm.c): its fixed order of arithmetic, invariance to batching and threads, and
what it leaves to OpenBLAS."""

import os
import platform
import sys
import time

import numpy as np
import pytest

import mlx_ssp  # noqa: F401  (OpenBLAS and the kernel before mlx.core)
import mlx.core as mx
from mlx_ssp import _blas, _small_gemm

LINUX_X86 = sys.platform.startswith("linux") and platform.machine() == "x86_64"

pytestmark = pytest.mark.skipif(not LINUX_X86 or _blas.loaded_path is None,
                                reason="the kernel is for MLX on Linux x86_64 with OpenBLAS")


def reference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b.T in the kernel's stated order: eight lanes of fused multiply-adds over k, the lanes
    summed as ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), then the tail k in order.
    A float32 fused multiply-add is emulated in float64 (the product is exact there; the sum's two
    roundings differ from one only at ties of probability ~2^-29, which these seeded inputs avoid)."""
    f32, f64 = np.float32, np.float64

    def fma(x, y, z):
        return (x.astype(f64) * y.astype(f64) + z.astype(f64)).astype(f32)

    K = a.shape[1]
    K8 = K - K % 8
    lanes = np.zeros((a.shape[0], b.shape[0], 8), f32)
    for k0 in range(0, K8, 8):
        lanes = fma(a[:, None, k0:k0 + 8], b[None, :, k0:k0 + 8], lanes)
    l = [lanes[..., j] for j in range(8)]
    s = ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))
    for k in range(K8, K):
        s = fma(a[:, None, k], b[None, :, k], s)
    return s


def test_the_kernel_is_loaded_here():
    # CI's machine is Linux x86_64 with a C compiler: the kernel must be on, not silently off
    assert _small_gemm.active(), _small_gemm.status


@pytest.mark.parametrize("m,n,k", [(1, 67, 8), (2, 33, 45), (3, 130, 576), (4, 9, 17), (5, 70, 64), (8, 41, 100)])
def test_kernel_equals_its_stated_order_bit_for_bit(m, n, k):
    rng = np.random.default_rng(m * 1000 + k)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((n, k)).astype(np.float32)
    before = _small_gemm.calls()
    out = mx.array(a) @ mx.array(b).T
    mx.eval(out)
    assert _small_gemm.calls() == before + 1
    np.testing.assert_array_equal(np.array(out), reference(a, b))


def test_addmm_alpha_and_beta():
    rng = np.random.default_rng(3)
    a, b, c = (rng.standard_normal(s).astype(np.float32) for s in ((2, 40), (50, 40), (2, 50)))
    out = mx.addmm(mx.array(c), mx.array(a), mx.array(b).T, alpha=0.5, beta=2.0)
    mx.eval(out)
    want = (np.float32(0.5) * reference(a, b)) + np.float32(2.0) * c
    np.testing.assert_array_equal(np.array(out), want.astype(np.float32))


def test_a_row_alone_equals_the_row_in_a_batch_and_threads_do_not_matter():
    rng = np.random.default_rng(5)
    a = mx.array(rng.standard_normal((8, 576)).astype(np.float32))
    w = mx.array(rng.standard_normal((3000, 576)).astype(np.float32))  # large enough to split
    with _small_gemm.threads(2):  # split between the caller and the helper thread
        batch = a @ w.T
        mx.eval(batch)
    with _small_gemm.threads(1):
        one_thread = a @ w.T
        mx.eval(one_thread)
    alone = [a[i:i + 1] @ w.T for i in range(8)]
    mx.eval(*alone)
    np.testing.assert_array_equal(np.array(batch), np.array(one_thread))
    for i in range(8):
        np.testing.assert_array_equal(np.array(batch)[i:i + 1], np.array(alone[i]))


def test_other_products_go_to_openblas_unchanged():
    rng = np.random.default_rng(7)
    cases = [((9, 64), (64, 100), True),    # nine rows: more than the kernel takes
             ((3, 64), (64, 100), False),   # B not transposed
             ((3, 4), (4, 10), True)]       # K below one lane group
    for (sa, sb, trans) in cases:
        a = mx.array(rng.standard_normal(sa).astype(np.float32))
        b = rng.standard_normal(sb).astype(np.float32)
        bm = mx.array(np.ascontiguousarray(b.T)).T if trans else mx.array(b)
        before = _small_gemm.calls()
        out = a @ bm
        mx.eval(out)
        assert _small_gemm.calls() == before
        # forwarded unchanged: the same bits as OpenBLAS's own cblas_sgemm called directly
        ob = openblas_sgemm(np.array(a), b, trans)
        np.testing.assert_array_equal(np.array(out), ob)


def test_kernel_off_is_openblas_and_close_to_it():
    rng = np.random.default_rng(11)
    a = mx.array(rng.standard_normal((4, 576)).astype(np.float32))
    w = mx.array(rng.standard_normal((700, 576)).astype(np.float32))
    on = a @ w.T
    mx.eval(on)
    with _small_gemm.enabled(False) as was:
        assert was and not _small_gemm.active()
        before = _small_gemm.calls()
        off = a @ w.T
        mx.eval(off)
        assert _small_gemm.calls() == before
    assert _small_gemm.active()
    np.testing.assert_allclose(np.array(on), np.array(off), rtol=1e-5, atol=1e-4)


def openblas_sgemm(a: np.ndarray, b: np.ndarray, trans: bool) -> np.ndarray:
    """a @ b (b given as (K, N)) through OpenBLAS's own cblas_sgemm, B transposed in memory if ``trans``."""
    import ctypes

    lib = ctypes.CDLL(_blas.loaded_path)
    m, k = a.shape
    n = b.shape[1]
    bb = np.ascontiguousarray(b.T if trans else b, np.float32)
    a = np.ascontiguousarray(a, np.float32)
    c = np.zeros((m, n), np.float32)
    p = lambda x: x.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    lib.cblas_sgemm.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                                     ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    lib.cblas_sgemm(101, 111, 112 if trans else 111, m, n, k, 1.0, p(a), k, p(bb), k if trans else n, 0.0, p(c), n)
    return c


def sgemm(a: np.ndarray, b: np.ndarray, c=None, lda=None, ldb=None, ldc=None, beta=0.0, k=None) -> np.ndarray:
    """a @ b.T through the kernel's cblas_sgemm directly (no MLX: its stream threads do not survive fork)."""
    import ctypes

    m, n = a.shape[0], b.shape[0]
    k = a.shape[1] if k is None else k
    c = np.zeros((m, n), np.float32) if c is None else c
    ptr = lambda x: x.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    f = _small_gemm.lib.cblas_sgemm
    f.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                       ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    f(101, 111, 112, m, n, k, 1.0, ptr(a), lda or a.shape[1], ptr(b), ldb or b.shape[1], beta,
      ptr(c), ldc or c.shape[1])
    return c


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_can_split_a_product():
    """The helper thread does not survive fork: the child must start its own, not wait forever."""
    import time

    rng = np.random.default_rng(13)
    a = rng.standard_normal((2, 576)).astype(np.float32)
    w = rng.standard_normal((4000, 576)).astype(np.float32)
    before = _small_gemm.calls()
    want = sgemm(a, w)  # split: the parent's helper thread is running now
    assert _small_gemm.calls() == before + 1
    np.testing.assert_array_equal(want, reference(a, w))
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit status
        code = 1
        try:
            code = 0 if np.array_equal(sgemm(a, w), want) else 3
        finally:
            os._exit(code)
    for _ in range(300):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung on a split product")
    assert os.waitstatus_to_exitcode(status) == 0


def test_disabled_by_the_environment(tmp_path):
    import subprocess

    code = ("import mlx_ssp; from mlx_ssp import _small_gemm; import mlx.core as mx; "
            "x = mx.ones((2, 64)) @ mx.ones((32, 64)).T; mx.eval(x); "
            "print(_small_gemm.active(), _small_gemm.calls(), float(x[0, 0]), _small_gemm.status)")
    env = dict(os.environ, MLX_SSP_SMALL_GEMM="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    active, calls, value, *why = out.stdout.split()
    assert (active, calls, value) == ("False", "0", "64.0")
    assert "MLX_SSP_SMALL_GEMM=0" in " ".join(why)


def test_a_fresh_cache_builds_and_loads_the_kernel(tmp_path):
    import subprocess

    code = ("import mlx_ssp; from mlx_ssp import _small_gemm; import mlx.core as mx; "
            "x = mx.ones((2, 64)) @ mx.ones((32, 64)).T; mx.eval(x); "
            "print(_small_gemm.active(), _small_gemm.calls(), float(x[0, 0]))")
    native = tmp_path / "native"
    native.mkdir()
    stale, recent = native / "small_gemm-0000000000000000.so", native / "small_gemm-1111111111111111.so"
    stale.write_bytes(b"a build unused for 8 days")
    recent.write_bytes(b"another checkout's build, in use")
    os.utime(stale, (time.time() - 8 * 86400,) * 2)
    env = dict(os.environ, MLX_SSP_CACHE=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "1", "64.0"]
    assert not stale.exists() and recent.exists()
    assert len(list(native.glob("small_gemm-*.so"))) == 2


def test_a_user_fixed_single_thread_is_kept():
    import subprocess

    code = "import mlx_ssp; from mlx_ssp import _small_gemm; print(_small_gemm.status)"
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.startswith("on, 1 thread "), out.stdout


def test_leading_dimensions_and_an_unread_c():
    """Rows wider than K (lda, ldb > K), a wider C (ldc > N), and C full of NaN with beta 0: not read."""
    rng = np.random.default_rng(17)
    k, n = 40, 70
    a = rng.standard_normal((3, k + 5)).astype(np.float32)
    b = rng.standard_normal((n, k + 9)).astype(np.float32)
    c = np.full((3, n + 4), np.nan, np.float32)
    out = sgemm(a, b, c=c, lda=k + 5, ldb=k + 9, ldc=n + 4, k=k)
    np.testing.assert_array_equal(out[:, :n], reference(a[:, :k], b[:, :k]))
    assert np.isnan(out[:, n:]).all()


def test_two_threads_calling_at_once_get_the_reference():
    import threading

    rng = np.random.default_rng(19)
    a = rng.standard_normal((4, 576)).astype(np.float32)
    w = rng.standard_normal((4000, 576)).astype(np.float32)
    want = reference(a, w)
    bad = []

    def run():
        for _ in range(20):
            if not np.array_equal(sgemm(a, w), want):
                bad.append(1)

    threads = [threading.Thread(target=run) for _ in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not bad


def test_a_blas_loaded_before_mlx_ssp_shadows_the_kernel_and_is_reported():
    import subprocess

    code = ("import mlx_ssp; from mlx_ssp import _small_gemm; import mlx.core as mx; "
            "x = mx.ones((2, 64)) @ mx.ones((32, 64)).T; mx.eval(x); "
            "print(_small_gemm.active(), _small_gemm.calls()); print(_small_gemm.status)")
    env = dict(os.environ, LD_PRELOAD=_blas.loaded_path)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    first, status = out.stdout.splitlines()
    assert first == "False 0"
    assert status.startswith("off: MLX's cblas_sgemm comes from") and _blas.loaded_path in status
