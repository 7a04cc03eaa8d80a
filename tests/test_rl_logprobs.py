"""The chunked selective log-softmax op equals naive log_softmax + gather, forward and gradient."""

from __future__ import annotations

import mlx_ssp  # noqa: F401
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_ssp.rl import naive_token_logprobs, selective_log_softmax_reference, token_logprobs
from mlx_ssp.rl.lm_heads import head_of
from mlx_ssp.rl.logprobs import (
    CHUNK_BYTES,
    LIVE_CHUNK_BUFFERS,
    _chunk_impl,
    auto_chunk_size,
    model_token_logprobs,
)


def _close(a, b, atol=2e-5, rtol=1e-4):
    np.testing.assert_allclose(np.array(a), np.array(b), atol=atol, rtol=rtol)


@pytest.mark.parametrize(
    "V,T,chunk",
    [(7, 1.0, 1), (7, 0.6, None), (97, 1.7, 5), (97, 1.0, 64), (1000, 0.6, 5), (1000, 1.7, None), (1000, 1.0, 33)],
)
def test_matches_naive_forward_and_grads_ragged(V, T, chunk):
    mx.random.seed(V + int(T * 10))
    B, L, D = 3, 11, 16
    head = nn.Linear(D, V, bias=True)
    h = mx.random.normal((B, L, D))
    t = mx.random.randint(0, V, (B, L))
    lens = mx.array([11, 4, 7])
    mask = (mx.arange(L)[None] < lens[:, None]).astype(mx.float32)  # ragged sequences
    coef = mx.random.normal((B, L))

    _close(token_logprobs(h, head, t, T, chunk), naive_token_logprobs(h, head, t, T))

    def loss(fn):
        def f(x, w, b):
            head.weight, head.bias = w, b
            return (fn(x) * coef * mask).sum()
        return f

    w0, b0 = head.weight, head.bias
    ga = mx.grad(loss(lambda x: token_logprobs(x, head, t, T, chunk)), argnums=(0, 1, 2))(h, w0, b0)
    gb = mx.grad(loss(lambda x: naive_token_logprobs(x, head, t, T)), argnums=(0, 1, 2))(h, w0, b0)
    head.weight, head.bias = w0, b0
    for a, b in zip(ga, gb):
        _close(a, b, atol=5e-5)
    # masked positions get exactly no gradient
    assert float(mx.abs(ga[0][1, 4:]).max()) == 0.0


def test_frozen_head_grad_only_to_hidden():
    mx.random.seed(0)
    head = nn.Linear(8, 50, bias=False)
    head.freeze()
    h, t = mx.random.normal((20, 8)), mx.random.randint(0, 50, (20,))
    g1 = mx.grad(lambda x: token_logprobs(x, head, t, 0.9, 3).sum())(h)
    g2 = mx.grad(lambda x: naive_token_logprobs(x, head, t, 0.9).sum())(h)
    _close(g1, g2)


@pytest.mark.parametrize("chunk", [3, 64])
def test_saved_grad_mode_matches_naive(chunk):
    mx.random.seed(7)
    head = nn.Linear(8, 300, bias=True)
    head.freeze()
    h, t, c = mx.random.normal((2, 10, 8)), mx.random.randint(0, 300, (2, 10)), mx.random.normal((2, 10))
    lp, ent = token_logprobs(h, head, t, 0.7, chunk, return_entropy=True, save_grad=True)
    _close(lp, naive_token_logprobs(h, head, t, 0.7))
    _close(ent, token_logprobs(h, head, t, 0.7, chunk, return_entropy=True)[1])
    ga = mx.grad(lambda x: (token_logprobs(x, head, t, 0.7, chunk, save_grad=True) * c).sum())(h)
    gb = mx.grad(lambda x: (naive_token_logprobs(x, head, t, 0.7) * c).sum())(h)
    _close(ga, gb)


def test_tied_embedding_head():
    mx.random.seed(1)
    emb = nn.Embedding(64, 12)
    h, t = mx.random.normal((2, 9, 12)), mx.random.randint(0, 64, (2, 9))
    _close(token_logprobs(h, emb, t, 0.7, 4), naive_token_logprobs(h, emb, t, 0.7))

    def f(fn):
        def g(w):
            emb.weight = w
            return fn().sum()
        return g

    w0 = emb.weight
    ga = mx.grad(f(lambda: token_logprobs(h, emb, t, 0.7, 4)))(w0)
    gb = mx.grad(f(lambda: naive_token_logprobs(h, emb, t, 0.7)))(w0)
    emb.weight = w0
    _close(ga, gb)


@pytest.mark.parametrize("cls", ["linear", "embedding"])
def test_quantized_heads(cls):
    mx.random.seed(2)
    base = nn.Linear(64, 96, bias=False) if cls == "linear" else nn.Embedding(96, 64)
    q = nn.QuantizedLinear.from_linear(base, 32, 4) if cls == "linear" else nn.QuantizedEmbedding.from_embedding(base, 32, 4)
    h, t = mx.random.normal((13, 64)), mx.random.randint(0, 96, (13,))
    _close(token_logprobs(h, q, t, 0.8, 4), naive_token_logprobs(h, q, t, 0.8), atol=1e-4)
    ga = mx.grad(lambda x: token_logprobs(x, q, t, 0.8, 4).sum())(h)
    gb = mx.grad(lambda x: naive_token_logprobs(x, q, t, 0.8).sum())(h)
    _close(ga, gb, atol=1e-4)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_reference_op_and_vjp_formula(dtype):
    mx.random.seed(3)
    n, V, T = 9, 33, 0.75
    logits = (mx.random.normal((n, V)) * 3).astype(dtype)
    t = mx.random.randint(0, V, (n,))
    g = mx.random.normal((n,))
    lp = selective_log_softmax_reference(logits, t, T)
    assert lp.dtype == mx.float32
    x = logits.astype(mx.float32) / T
    _close(lp, mx.take_along_axis(x - mx.logsumexp(x, -1, keepdims=True), t[:, None], -1)[:, 0])
    _, (d,) = mx.vjp(lambda z: selective_log_softmax_reference(z, t, T), [logits], [g])
    assert d.dtype == dtype
    onehot = (mx.arange(V)[None] == t[:, None]).astype(mx.float32)
    expect = g[:, None] * (onehot - mx.softmax(x, -1)) / T
    tol = 1e-5 if dtype == mx.float32 else 2e-2
    _close(d.astype(mx.float32), expect, atol=tol, rtol=tol)


def test_entropy_and_empty_and_errors():
    mx.random.seed(4)
    head = nn.Linear(8, 40)
    h, t = mx.random.normal((3, 5, 8)), mx.random.randint(0, 40, (3, 5))
    lp, ent = token_logprobs(h, head, t, 1.3, 4, return_entropy=True)
    p = mx.softmax(head(h) / 1.3, -1)
    _close(ent, -(p * mx.log(p)).sum(-1), atol=1e-4)
    _close(lp, naive_token_logprobs(h, head, t, 1.3))
    assert token_logprobs(mx.zeros((0, 8)), head, mx.zeros((0,), mx.int32)).shape == (0,)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(h, head, t, 0.0)
    with pytest.raises(ValueError, match="disagree"):
        token_logprobs(h, head, t[:, :4])


def test_chunked_memory_is_bounded():
    """Peak memory of forward+backward does not grow with the number of tokens (chunks freed)."""
    mx.random.seed(5)
    V, D = 8000, 32
    head = nn.Linear(D, V, bias=False)
    head.freeze()
    mx.eval(head.parameters())

    def peak(fn, n):
        h, t, g = mx.random.normal((n, D)), mx.random.randint(0, V, (n,)), mx.random.normal((n,))
        mx.eval(h, t, g)
        mx.synchronize()
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        mx.eval(mx.grad(lambda x: (fn(x, t) * g).sum())(h))
        return mx.get_peak_memory() - base

    chunked = lambda x, t: token_logprobs(x, head, t, 0.9, 64)  # noqa: E731
    naive = lambda x, t: naive_token_logprobs(x, head, t, 0.9)  # noqa: E731
    c1, c4 = peak(chunked, 512), peak(chunked, 2048)
    n4 = peak(naive, 2048)
    assert c4 < 1.5 * c1 + 2**20  # flat in the token count
    assert c4 < n4 / 8  # 2048 x 8000 logits never exist


def test_kernel_dispatch_env(monkeypatch):
    monkeypatch.setenv("MLX_SSP_KERNELS", "reference")
    assert _chunk_impl() is selective_log_softmax_reference
    # the default chunk comes from the memory budget: its live [chunk x V] buffers fit in it
    cs = auto_chunk_size(151936)
    assert cs % 16 == 0 and 256 <= cs <= 512
    assert LIVE_CHUNK_BUFFERS * 4 * 151936 * cs <= CHUNK_BYTES
    assert auto_chunk_size(10) > 1000 and auto_chunk_size(10**9) == 16


@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_llama"])
def test_model_logprobs_match_full_logits(fixture, request):
    from mlx_lm import load

    model, _ = load(str(request.getfixturevalue(fixture)))
    mx.random.seed(6)
    V = model.args.vocab_size
    ids = mx.random.randint(0, V, (2, 10))
    inputs, targets = ids[:, :-1], ids[:, 1:]
    ours = model_token_logprobs(model, inputs, targets, 0.8, chunk_size=4)
    logits = model(inputs).astype(mx.float32) / 0.8
    ref = mx.take_along_axis(logits - mx.logsumexp(logits, -1, keepdims=True), targets[..., None], -1)[..., 0]
    _close(ours, ref, atol=1e-4)
    tied = fixture == "tiny_qwen3"
    assert isinstance(head_of(model), nn.Embedding) == tied


@pytest.mark.parametrize("save_grad", [False, True])
def test_extreme_logits_stay_exact(save_grad):
    """Very unlikely targets (log-prob in the hundreds) are exact, not -inf, in both modes."""
    mx.random.seed(8)
    head = nn.Linear(16, 500, bias=False)
    head.freeze()
    h, t, c = mx.random.normal((40, 16)) * 300, mx.random.randint(0, 500, (40,)), mx.random.normal((40,))
    ours = token_logprobs(h, head, t, 0.5, 7, save_grad=save_grad)
    ref = naive_token_logprobs(h, head, t, 0.5)
    assert float(ref.min()) < -200  # the test really reaches far below exp's float32 range
    _close(ours, ref, rtol=1e-5, atol=1e-3)
    ga = mx.grad(lambda x: (token_logprobs(x, head, t, 0.5, 7, save_grad=save_grad) * c).sum())(h)
    gb = mx.grad(lambda x: (naive_token_logprobs(x, head, t, 0.5) * c).sum())(h)
    _close(ga, gb, atol=1e-3)


@pytest.mark.parametrize("save_grad", [False, True])
def test_live_chunk_buffers_within_budget(save_grad):
    """Forward+backward over many chunks keeps at most LIVE_CHUNK_BUFFERS [chunk x V] buffers alive
    (the count auto_chunk_size budgets for), not one per intermediate or per chunk."""
    mx.random.seed(9)
    V, D, chunk, n = 20000, 32, 64, 512
    head = nn.Linear(D, V, bias=False)
    head.freeze()
    h, t, g = mx.random.normal((n, D)), mx.random.randint(0, V, (n,)), mx.random.normal((n,))
    mx.eval(head.parameters(), h, t, g)
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    mx.eval(mx.grad(lambda x: (token_logprobs(x, head, t, 0.9, chunk, save_grad=save_grad) * g).sum())(h))
    buffers = (mx.get_peak_memory() - base) / (chunk * V * 4)
    assert buffers <= LIVE_CHUNK_BUFFERS + 0.5, buffers


def test_under_mx_compile_stays_correct():
    """Inside mx.compile chunks cannot be evaluated eagerly: the op falls back to one lazy graph."""
    mx.random.seed(10)
    head = nn.Linear(8, 60, bias=False)
    head.freeze()
    mx.eval(head.parameters())
    h, t = mx.random.normal((20, 8)), mx.random.randint(0, 60, (20,))
    for save_grad in (False, True):
        f = mx.compile(lambda x: token_logprobs(x, head, t, 0.9, 3, save_grad=save_grad))
        _close(f(h), naive_token_logprobs(h, head, t, 0.9))
        ga = mx.compile(mx.grad(lambda x: token_logprobs(x, head, t, 0.9, 3, save_grad=save_grad).sum()))(h)
        _close(ga, mx.grad(lambda x: naive_token_logprobs(x, head, t, 0.9).sum())(h))


@pytest.mark.parametrize("trained", [False, True])
def test_under_mx_compile_with_the_head_as_compiled_state(trained):
    """mlx-lm's train step compiles value_and_grad with the model's state as traced inputs: the head's
    weights are then tracers (not evaluable), with several chunks; loss and gradients stay exact."""
    from functools import partial

    mx.random.seed(11)
    head = nn.Linear(8, 60, bias=False)
    if not trained:
        head.freeze()
    mx.eval(head.parameters())
    h, t = mx.random.normal((20, 8)), mx.random.randint(0, 60, (20,))

    def loss(m, x, fn):
        return fn(x, m, t, 0.9).sum() if fn is naive_token_logprobs else fn(x, m, t, 0.9, 3, save_grad=not trained).sum()

    def both(x):
        gx = mx.grad(lambda x: loss(head, x, token_logprobs))(x)
        if not trained:  # a frozen head has nothing to differentiate
            return gx, (loss(head, x, token_logprobs), None)
        return gx, nn.value_and_grad(head, lambda m: loss(m, x, token_logprobs))(head)

    step = partial(mx.compile, inputs=[head.state], outputs=[head.state])(both)
    gx, (val, gw) = step(h)
    _close(gx, mx.grad(lambda x: loss(head, x, naive_token_logprobs))(h))
    _close(val, loss(head, h, naive_token_logprobs))
    if trained:
        _close(gw["weight"], nn.value_and_grad(head, lambda m: loss(m, h, naive_token_logprobs))(head)[1]["weight"])
