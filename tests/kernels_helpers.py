"""Shared helpers of the kernel tests: a clean dispatch mode per test, random cases and the tolerance
a kernel must meet against the plain-MLX reference."""

from __future__ import annotations

import numpy as np
import pytest

import mlx_ssp  # noqa: F401
import mlx.core as mx

from mlx_ssp.rl import kernels as K

VOCABS = [7, 1000, 50257, 151936]  # tiny, non-multiples of 32 * 4, GPT-2, Qwen3
TEMPS = [1.0, 0.7, 1.3]


@pytest.fixture(autouse=True)
def _clean_mode(monkeypatch):
    monkeypatch.delenv(K.ENV, raising=False)
    K.set_mode(None)
    yield
    K.set_mode(None)


def _rows_for(vocab: int) -> int:
    return 3 if vocab > 100_000 else 9  # keep [n x V] small on CPU


def _case(vocab, dtype, seed=0):
    mx.random.seed(seed)
    n = _rows_for(vocab)
    logits = (mx.random.normal((n, vocab)) * 3.0).astype(dtype)
    targets = mx.random.randint(0, vocab, (n,)).astype(mx.int32)
    # ragged mask: padded positions carry a valid id and a zero cotangent
    mask = mx.array([1.0 if i % 4 != 3 else 0.0 for i in range(n)])
    g = mx.random.normal((n,)) * mask
    return logits, targets, g


def _fwd_vjp(fn, logits, targets, g, temperature):
    (out,), (d,) = mx.vjp(lambda x: fn(x, targets, temperature), [logits], [g])
    mx.eval(out, d)
    return out, d


def _tol(dtype, vocab):
    # float32: the reference's own logsumexp error grows with V (~5e-5 at V = 50257 on CPU vs float64)
    if dtype == mx.float32:
        return dict(rtol=1e-5 + 2e-9 * vocab, atol=1e-5 + 2e-9 * vocab)
    return dict(rtol=2e-2, atol=2e-2)  # bf16 / fp16 inputs (and gradients), float32 accumulation


def _close(a, b, dtype, what, vocab):
    a = np.array(a.astype(mx.float32))
    b = np.array(b.astype(mx.float32))
    np.testing.assert_allclose(a, b, err_msg=what, **_tol(dtype, vocab))
