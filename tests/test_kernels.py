"""Custom kernels (mlx_ssp.rl.kernels): equality with the plain-MLX reference (the dispatcher,
packaging and sources: test_kernels_dispatch.py).

Where a kernel can run (Metal on a Mac, CUDA with mlx[cuda]) the `*_on_device` tests compare it with
the reference, forward and vjp; elsewhere they are skipped with the reason. What runs everywhere:
the dispatcher, the env override, packaging (importlib.resources, the wheel), build-once caching,
source/interface consistency, and the custom_function plumbing through a plain-MLX emulation of
each kernel's outputs (the "emulate" backend) and a NumPy port of the advantage kernel.
"""

from __future__ import annotations

import numpy as np
import pytest

import mlx_ssp  # noqa: F401
import mlx.core as mx

from mlx_ssp.rl import kernels as K
from mlx_ssp.rl.kernels import advantages as KA, dispatch as KD, log_softmax as KL
from mlx_ssp.rl.logprobs import chunk_impl_name, naive_token_logprobs, selective_log_softmax_reference, token_logprobs

from kernels_helpers import TEMPS, VOCABS, _case, _close, _fwd_vjp
from kernels_helpers import _clean_mode  # noqa: F401  (an autouse fixture: every test starts in auto mode)


# -- the custom_function plumbing, through plain-MLX statements of each kernel --------------------


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_emulated_sls_forward_and_vjp_equal_reference(vocab, dtype):
    logits, targets, g = _case(vocab, dtype)
    for t in TEMPS:
        ref_out, ref_d = _fwd_vjp(selective_log_softmax_reference, logits, targets, g, t)
        out, d = _fwd_vjp(lambda x, y, T: K.selective_log_softmax_on("emulate", x, y, T), logits, targets, g, t)
        assert out.dtype == mx.float32 and d.dtype == dtype and d.shape == logits.shape
        _close(out, ref_out, mx.float32, f"forward V={vocab} T={t}", vocab)
        _close(d, ref_d, dtype, f"vjp V={vocab} T={t}", vocab)
        masked = np.array(g) == 0
        assert np.all(np.array(d.astype(mx.float32))[masked] == 0)


def test_dispatch_to_a_kernel_backend_runs_through_token_logprobs(monkeypatch):
    """With a (pretend) Metal device, token_logprobs goes through our custom_function: equal to naive."""
    import mlx.nn as nn

    monkeypatch.setitem(KD._PROBES, "metal", lambda: True)
    monkeypatch.setitem(KL.SLS_LAUNCHERS, "metal", KL.SLS_LAUNCHERS["emulate"])
    KL._sls_op.cache_clear()
    try:
        mx.random.seed(1)
        head = nn.Linear(16, 1000, bias=False)
        h = mx.random.normal((2, 5, 16))
        tg = mx.random.randint(0, 1000, (2, 5))
        g = mx.random.normal((2, 5))
        lp, (dh,) = mx.vjp(lambda x: token_logprobs(x, head, tg, 0.8, chunk_size=3), [h], [g])[0:2]
        lp_n, (dh_n,) = mx.vjp(lambda x: naive_token_logprobs(x, head, tg, 0.8), [h], [g])[0:2]
        # float32 matmuls of different shapes (3-row chunks vs naive) round differently on a GPU (1.7e-4 on an H200)
        atol = 5e-4 if mx.default_device() == mx.gpu else 1e-5
        np.testing.assert_allclose(np.array(lp), np.array(lp_n), rtol=1e-5, atol=atol)
        np.testing.assert_allclose(np.array(dh), np.array(dh_n), rtol=1e-4, atol=atol)
    finally:
        KL._sls_op.cache_clear()


def test_kernel_path_keeps_a_trained_head_gradient_on_the_device(monkeypatch):
    """Full fine-tuning through a kernel back-end (emulated): the [V x D] head gradient is summed over
    the chunks on the helper thread, never copied through NumPy (_detach) once per chunk, which made
    the chunked op 26-37x slower than the reference on an H200; only the per-token chunk inputs are.
    The gradients into the hidden states and the head equal the reference path's."""
    import mlx.nn as nn

    from mlx_ssp.rl import chunked_op as LP

    monkeypatch.setitem(KD._PROBES, "metal", lambda: True)
    bwd_calls = []

    def bwd(*a):
        bwd_calls.append(1)
        return KL._sls_bwd_emulated(*a)

    monkeypatch.setitem(KL.SLS_LAUNCHERS, "metal", (KL._sls_fwd_emulated, bwd))
    copied = []

    def counting_detach(x):
        copied.append(x.nbytes)
        return detach(x)

    detach = LP._detach
    monkeypatch.setattr(LP, "_detach", counting_detach)
    KL._sls_op.cache_clear()
    try:
        mx.random.seed(4)
        V, D, n = 8000, 64, 16  # 4 chunks of 4 tokens; the head gradient is 2 MiB
        head = nn.Linear(D, V, bias=False)
        w = head.weight
        h, tg, g = mx.random.normal((n, D)), mx.random.randint(0, V, (n,)), mx.random.normal((n,))
        mx.eval(w, h, tg, g)

        def run(mode):
            def f(x, weight):
                head.weight = weight
                return token_logprobs(x, head, tg, 0.8, chunk_size=4)

            with K.use_mode(mode):
                lp, (dh, dw) = mx.vjp(f, [h, w], [g])[0:2]
            mx.eval(lp, dh, dw)
            head.weight = w
            return lp, dh, dw

        copied.clear()
        got = run("auto")
        assert len(bwd_calls) == 4  # the kernel's backward ran, once per chunk
        assert sum(copied) < w.nbytes / 4, f"{sum(copied)} bytes through NumPy for a {w.nbytes}-byte head"
        for a, b in zip(got, run("reference")):
            np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-6)
    finally:
        KL._sls_op.cache_clear()


@pytest.mark.parametrize("chunk", [4, 64])  # several chunks (helper thread), one chunk (lazy)
@pytest.mark.parametrize("entropy", [False, True])
def test_kernel_path_with_save_grad_matches_reference(monkeypatch, chunk, entropy):
    """save_grad (frozen head: the RL training path) through a kernel back-end (emulated) equals the
    reference path; KernelEngine.saved once lacked the entropy_grad argument make_saved_op passes (found on an H200)."""
    import mlx.nn as nn

    monkeypatch.setitem(KD._PROBES, "metal", lambda: True)
    monkeypatch.setitem(KL.SLS_LAUNCHERS, "metal", KL.SLS_LAUNCHERS["emulate"])
    KL._sls_op.cache_clear()
    try:
        mx.random.seed(5)
        head = nn.Linear(16, 300, bias=False)
        head.freeze()
        h, tg, g = mx.random.normal((12, 16)), mx.random.randint(0, 300, (12,)), mx.random.normal((12,))

        def run(mode):
            def f(x):
                out = token_logprobs(x, head, tg, 0.7, chunk, return_entropy=entropy, save_grad=True)
                return out[0] if entropy else out

            with K.use_mode(mode):
                assert (mode == "reference") == (chunk_impl_name() == "reference")
                lp, (dh,) = mx.vjp(f, [h], [g])[0:2]
            return lp[0], dh

        for a, b in zip(run("auto"), run("reference")):
            np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-6)
    finally:
        KL._sls_op.cache_clear()


def test_unsupported_inputs_fall_back_to_reference(monkeypatch):
    monkeypatch.setitem(KD._PROBES, "metal", lambda: True)

    def boom(*a, **k):
        raise AssertionError("kernel launched for an unsupported input")

    monkeypatch.setitem(KL.SLS_LAUNCHERS, "metal", (boom, boom))
    KL._sls_op.cache_clear()
    try:
        logits = mx.zeros((0, 10))
        assert K.selective_log_softmax(logits, mx.zeros((0,), dtype=mx.int32)).shape == (0,)
        with pytest.raises(ValueError):
            K.selective_log_softmax(mx.zeros((2, 10)), mx.zeros((2,), dtype=mx.int32), 0.0)
    finally:
        KL._sls_op.cache_clear()


# -- grouped advantages -------------------------------------------------------------------------

@pytest.fixture
def mgpo():
    return pytest.importorskip("mlx_ssp.rl.mgpo", reason="mlx_ssp.rl.mgpo not present")


def _adv_cases():
    rng = np.random.default_rng(0)
    binary = rng.integers(0, 2, 24).astype(np.float32)
    yield "binary, groups of 4", binary, np.repeat(np.arange(6), 4)
    yield "groups of one", rng.integers(0, 2, 5).astype(np.float32), np.arange(5)
    yield "all equal rewards", np.ones(8, np.float32), np.repeat(np.arange(2), 4)
    yield "all equal non-binary", np.full(6, 0.1, np.float32), np.repeat(np.arange(2), 3)
    ids = np.array([4, 1, 4, 5, 1, 1, 4, 5, 0, 1, 4])  # group 2 and 3 are empty
    yield "unsorted ids, ragged sizes, empty groups", rng.integers(0, 2, 11).astype(np.float32), ids
    yield "continuous rewards", rng.normal(0.4, 0.5, 12).astype(np.float32), np.repeat(np.arange(3), 4)
    yield "one group", rng.integers(0, 2, 16).astype(np.float32), np.zeros(16, np.int64)


def assert_same_advantages(out, ref, what=""):
    assert type(out) is type(ref)
    for name in ref._fields:
        a, b = getattr(out, name), getattr(ref, name)
        assert a.shape == b.shape and a.dtype == mx.float32, f"{what}: {name} {a.shape} {a.dtype} vs {b.shape}"
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=2e-5, atol=2e-5, err_msg=f"{what}: {name}")


def _reference_launcher(mgpo):
    """A launcher with the kernel's interface that computes its 10 outputs with the reference."""

    def launch(backend, rewards, group_ids, params, sizes, scale, num_groups):
        lam, eps = params.tolist()
        o = mgpo.mgpo_advantages(rewards, group_ids, lam=lam, scale_rewards=scale, eps=eps, num_groups=num_groups)
        return (*o, mx.zeros((num_groups,)))

    return launch


def test_advantage_wrapper_plumbing(mgpo, monkeypatch):
    """Dispatch, MGPOAdvantages assembly and the vjp of the kernel wrapper (kernel outputs stated by the reference)."""
    monkeypatch.setitem(KD._PROBES, "cuda", lambda: True)
    monkeypatch.setitem(KA.ADV_LAUNCHERS, "cuda", _reference_launcher(mgpo))
    KA._adv_op.cache_clear()
    try:
        for what, r, gid in _adv_cases():
            for scale in ("group", "batch", "none"):
                ref = mgpo.mgpo_advantages(mx.array(r), mx.array(gid), lam=1.5, scale_rewards=scale)
                out = K.grouped_advantages(mx.array(r), mx.array(gid), lam=1.5, scale_rewards=scale)
                assert_same_advantages(out, ref, f"{what} {scale}")
        r, gid = mx.array([1.0, 0.0, 1.0, 1.0, 0.0, 0.0]), mx.array([0, 0, 0, 1, 1, 1])
        cot = mx.arange(6).astype(mx.float32)

        def vjp_of(fn):
            return mx.vjp(lambda x: fn(x, gid, lam=1.0, scale_rewards="group").advantages, [r], [cot])[1][0]

        np.testing.assert_allclose(
            np.array(vjp_of(K.grouped_advantages)), np.array(vjp_of(mgpo.mgpo_advantages)), rtol=1e-5, atol=1e-6
        )
    finally:
        KA._adv_op.cache_clear()


def test_advantage_dispatch_falls_back_to_reference(mgpo, monkeypatch):
    monkeypatch.setitem(KD._PROBES, "metal", lambda: True)

    def boom(*a, **k):
        raise AssertionError("kernel launched for an input it must not take")

    monkeypatch.setitem(KA.ADV_LAUNCHERS, "metal", boom)
    monkeypatch.setattr(KA, "ADV_KERNEL_MAX_N", 8)
    KA._adv_op.cache_clear()
    try:
        r, gid = mx.zeros((16,)), mx.repeat(mx.arange(4), 4)  # above ADV_KERNEL_MAX_N
        assert_same_advantages(K.grouped_advantages(r, gid, lam=1.0), mgpo.mgpo_advantages(r, gid, lam=1.0))
        r, gid = mx.ones((4,)), mx.array([0, 1, 2, 3])
        out = K.grouped_advantages(r, gid, lam=1.0, num_groups=2)  # ids outside [0, num_groups)
        assert out.advantages.shape == (4,)
        with pytest.raises(ValueError, match="scale_rewards"):
            K.grouped_advantages(r, gid, lam=1.0, scale_rewards="sample")
    finally:
        KA._adv_op.cache_clear()


# -- on the real kernels (Metal on a Mac, CUDA with mlx[cuda]); skipped elsewhere ------------------

_DEVICE_REASON = {
    "metal": "Metal back-end not available here (needs Apple silicon with the GPU as default device)",
    "cuda": "CUDA back-end not available here (needs mlx[cuda] and an NVIDIA GPU)",
}


@pytest.fixture(params=list(K.BACKENDS))
def device_backend(request):
    b = request.param
    if not KD._PROBES[b]():
        pytest.skip(_DEVICE_REASON[b])
    return b


@pytest.mark.parametrize("vocab", VOCABS + [50000, 32000])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_sls_kernel_on_device(device_backend, vocab, dtype):
    n = 64 if vocab < 100_000 else 16
    mx.random.seed(vocab)
    logits = (mx.random.normal((n, vocab)) * 4.0).astype(dtype)
    targets = mx.random.randint(0, vocab, (n,)).astype(mx.int32)
    g = mx.random.normal((n,)) * (mx.arange(n) % 5 != 4)
    for t in TEMPS:
        ref_out, ref_d = _fwd_vjp(selective_log_softmax_reference, logits, targets, g, t)
        out, d = _fwd_vjp(lambda x, y, T: K.selective_log_softmax_on(device_backend, x, y, T), logits, targets, g, t)
        what = f"{device_backend} V={vocab} T={t} {dtype}"
        _close(out, ref_out, mx.float32 if dtype == mx.float32 else dtype, f"forward {what}", vocab)
        _close(d, ref_d, dtype, f"vjp {what}", vocab)


def test_token_logprobs_with_kernel_on_device(device_backend):
    import mlx.nn as nn

    mx.random.seed(3)
    head = nn.Linear(64, 151936, bias=False)
    h = mx.random.normal((300, 64))
    tg = mx.random.randint(0, 151936, (300,))
    g = mx.random.normal((300,))
    with K.use_mode(device_backend):
        lp, (dh,) = mx.vjp(lambda x: token_logprobs(x, head, tg, 0.9, chunk_size=128), [h], [g])[0:2]
    with K.use_mode("reference"):
        lp_r, (dh_r,) = mx.vjp(lambda x: token_logprobs(x, head, tg, 0.9, chunk_size=128), [h], [g])[0:2]
    np.testing.assert_allclose(np.array(lp), np.array(lp_r), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.array(dh), np.array(dh_r), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantage_kernel_on_device(mgpo, device_backend, scale):
    rng = np.random.default_rng(1)
    cases = list(_adv_cases()) + [("large", rng.integers(0, 2, 3000).astype(np.float32), np.repeat(np.arange(375), 8))]
    assert_backend_matches_reference(mgpo, device_backend, cases, scale)


def assert_backend_matches_reference(mgpo, backend, cases, scale):
    """grouped_advantages_on(backend) equals mgpo_advantages on each case, for lambda 0, 1 and 2.5."""
    for lam in (0.0, 1.0, 2.5):
        for what, r, gid in cases:
            ref = mgpo.mgpo_advantages(mx.array(r), mx.array(gid), lam=lam, scale_rewards=scale, eps=1e-6)
            out = K.grouped_advantages_on(backend, mx.array(r), mx.array(gid), lam=lam, scale_rewards=scale, eps=1e-6)
            assert_same_advantages(out, ref, f"{backend} {what} {scale} lam={lam}")
