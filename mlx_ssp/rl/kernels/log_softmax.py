"""Selective log-softmax: ``log_softmax(logits / T)[i, targets[i]]`` per row, its reference and its kernels.

This is the "selective log-softmax" of cut-cross-entropy (Wijmans et al., 2024) at chunk granularity:
only the target's log-prob of each row is kept. Side by side, as in mlx-lm's ``tuner/losses.py``:

- the reference (:func:`selective_log_softmax_reference`): plain MLX, ``logsumexp`` in float32, with an
  explicit vjp ``(g / T) * (onehot(t) - softmax(x))`` whose one-hot part is a scatter-add at the targets;
- the kernels (``selective_log_softmax_fwd`` / ``_bwd``, ``.metal`` and ``.cu`` beside this module): for
  each row of ``logits [n, V]`` one threadgroup walks the vocabulary once with an online (max, sum of exp)
  pair in float32, merges the per-thread pairs with threadgroup reductions and writes
  ``logp = x[t] - lse`` and ``lse`` (``x = logits / T``); the backward kernel reads the saved ``lse`` and
  writes ``(softmax(x) - onehot) * (-g / T)`` in one pass;
- :func:`_sls_op`, the ``mx.custom_function`` joining a back-end's two launchers with that vjp.

A target id outside ``[0, V)`` is clamped inside the kernels (a kernel must not read out of bounds); the
reference's result is undefined there. Kernel results equal the reference to float32 rounding, not bit
for bit (summation order differs). The chunked op of the RL loss, :func:`mlx_ssp.rl.logprobs.token_logprobs`,
calls :func:`selective_log_softmax` per chunk where a kernel runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import mlx.core as mx

from mlx_ssp.rl.kernels.dispatch import backend
from mlx_ssp.rl.kernels.sources import get_kernel, template_args

SLS_M = 4  # contiguous elements per thread per block (vector-friendly loads)
SLS_MAX_TG = 1024  # threads per threadgroup / block (32 SIMD groups or warps)
SLS_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


# -- the reference ------------------------------------------------------------------------------


def scaled(logits: mx.array, temperature: float) -> mx.array:
    """``logits / T`` in float32 (no multiply at T = 1)."""
    x = logits.astype(mx.float32)
    return x if temperature == 1.0 else x * (1.0 / temperature)


def flat_index(targets: mx.array, vocab: int) -> mx.array:
    """Row-major index of (i, targets[i]) in a flattened [n x vocab] array."""
    dtype = mx.int32 if targets.shape[0] * vocab < 2**31 else mx.int64
    return mx.arange(targets.shape[0], dtype=dtype) * vocab + targets.astype(dtype)


@functools.lru_cache(maxsize=64)
def _sls_ref_for(temperature: float):
    """The reference op for one temperature (a closure: T is a constant, not an array input)."""

    @mx.custom_function
    def sls(logits: mx.array, targets: mx.array) -> mx.array:
        x = scaled(logits, temperature)
        picked = mx.take_along_axis(x, targets[:, None], axis=-1)[:, 0]
        return picked - mx.logsumexp(x, axis=-1)

    @sls.vjp
    def sls_vjp(primals, cotangent, output):
        logits, targets = primals
        x = scaled(logits, temperature)
        # d lp_i / d x_iv = onehot(t_i) - softmax(x_i); chained through x = logits / T, the one-hot
        # part is a scatter-add of g / T at the targets only
        gt = cotangent.astype(mx.float32) * (1.0 / temperature)
        d = mx.exp(x - mx.logsumexp(x, axis=-1, keepdims=True)) * (-gt)[:, None]
        d = d.reshape(-1).at[flat_index(targets, x.shape[1])].add(gt).reshape(x.shape)
        return d.astype(logits.dtype), mx.zeros_like(targets)

    return sls


def selective_log_softmax_reference(logits: mx.array, targets: mx.array, temperature: float = 1.0) -> mx.array:
    """``log_softmax(logits.astype(float32) / T)[i, targets[i]]`` for each row i -> [n] float32.

    logits [n, V] (any float dtype), targets [n] int. The vjp with respect to logits is
    ``g[:, None] * (onehot(targets) - softmax(logits / T)) / T`` cast to logits' dtype (no
    gradient into targets or T). Plain MLX; the kernels equal it."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return _sls_ref_for(float(temperature))(logits, targets.astype(mx.int32))


# -- the kernels --------------------------------------------------------------------------------


def sls_threadgroup(vocab: int) -> int:
    """Threads per row: enough for one block of M-element reads to cover V, a multiple of 32, <= 1024."""
    need = -(-vocab // SLS_M)
    tg = 32
    while tg < need and tg < SLS_MAX_TG:
        tg *= 2
    return tg


def _sls_templates(backend: str, dtype, vocab: int) -> dict[str, list]:
    values = {"T": dtype, "V": int(vocab), "TG": sls_threadgroup(vocab), "M": SLS_M}
    return {
        "fwd": template_args("selective_log_softmax_fwd", backend, values),
        "bwd": template_args("selective_log_softmax_bwd", backend, values),
    }


def _sls_fwd_gpu(backend: str, logits: mx.array, targets: mx.array, inv_t: mx.array):
    n, vocab = logits.shape
    tg = sls_threadgroup(vocab)
    out = get_kernel("selective_log_softmax_fwd", backend)(
        inputs=[logits, targets, inv_t],
        template=_sls_templates(backend, logits.dtype, vocab)["fwd"],
        grid=(tg * n, 1, 1),
        threadgroup=(tg, 1, 1),
        output_shapes=[(n,), (n,)],
        output_dtypes=[mx.float32, mx.float32],
    )
    return out[0], out[1]


def _sls_bwd_gpu(backend: str, logits, targets, inv_t, lse, cotan):
    n, vocab = logits.shape
    tg = sls_threadgroup(vocab)
    return get_kernel("selective_log_softmax_bwd", backend)(
        inputs=[logits, targets, inv_t, lse, cotan],
        template=_sls_templates(backend, logits.dtype, vocab)["bwd"],
        grid=(tg * n, 1, 1),
        threadgroup=(tg, 1, 1),
        output_shapes=[logits.shape],
        output_dtypes=[logits.dtype],
    )[0]


def _sls_fwd_emulated(backend, logits, targets, inv_t):
    """Plain-MLX statement of the forward kernel's outputs (logp, lse): exercises the wrapper on CPU."""
    x = logits.astype(mx.float32) * inv_t[0]
    lse = mx.logsumexp(x, axis=-1)
    t = mx.clip(targets, 0, logits.shape[-1] - 1)
    return mx.take_along_axis(x, t[:, None], axis=-1)[:, 0] - lse, lse


def _sls_bwd_emulated(backend, logits, targets, inv_t, lse, cotan):
    """Plain-MLX statement of the backward kernel: (exp(x - lse) - onehot) * (-g / T) from the saved lse."""
    x = logits.astype(mx.float32) * inv_t[0]
    t = mx.clip(targets, 0, logits.shape[-1] - 1)
    onehot = (mx.arange(logits.shape[-1])[None, :] == t[:, None]).astype(mx.float32)
    return ((mx.exp(x - lse[:, None]) - onehot) * (-cotan * inv_t[0])[:, None]).astype(logits.dtype)


# backend -> (forward launcher, backward launcher). "emulate" is for tests of the wrapper on CPU.
SLS_LAUNCHERS: dict[str, tuple[Callable, Callable]] = {
    "metal": (_sls_fwd_gpu, _sls_bwd_gpu),
    "cuda": (_sls_fwd_gpu, _sls_bwd_gpu),
    "emulate": (_sls_fwd_emulated, _sls_bwd_emulated),
}


# -- the custom function (kernel forward, kernel backward as its vjp) ----------------------------


@functools.cache
def _sls_op(backend: str):
    fwd, bwd = SLS_LAUNCHERS[backend]

    @mx.custom_function
    def sls(logits: mx.array, targets: mx.array, inv_t: mx.array):
        logp, lse = fwd(backend, logits, targets, inv_t)
        return logp, mx.stop_gradient(lse)

    @sls.vjp
    def sls_vjp(primals, cotangents, outputs):
        logits, targets, inv_t = primals
        g = cotangents[0].astype(mx.float32)
        d = bwd(backend, logits, targets, inv_t, outputs[1], g)
        return d, mx.zeros_like(targets), mx.zeros_like(inv_t)

    return sls


def _sls_kernel_ok(logits: mx.array) -> bool:
    return logits.ndim == 2 and logits.shape[0] > 0 and logits.shape[1] > 0 and logits.dtype in SLS_DTYPES


def selective_log_softmax_on(
    backend_name: str, logits: mx.array, targets: mx.array, temperature: float = 1.0
) -> mx.array:
    """:func:`selective_log_softmax` on a named backend (``metal``, ``cuda``, ``emulate``, ``reference``)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    targets = targets.astype(mx.int32)
    if logits.ndim == 2 and logits.shape[0] == 0:
        return mx.zeros((0,), dtype=mx.float32)
    if backend_name == "reference" or not _sls_kernel_ok(logits):
        return selective_log_softmax_reference(logits, targets, temperature)
    inv_t = mx.array([1.0 / float(temperature)], dtype=mx.float32)
    return _sls_op(backend_name)(logits, targets, inv_t)[0]


def selective_log_softmax(logits: mx.array, targets: mx.array, temperature: float = 1.0) -> mx.array:
    """``log_softmax(logits.astype(float32) / T)[i, targets[i]]`` -> [n] float32, on the best backend.

    Same signature, result and vjp (``g * (onehot - softmax(logits / T)) / T`` in logits' dtype) as
    :func:`selective_log_softmax_reference`, which runs wherever no kernel can (and for dtypes other
    than float32 / float16 / bfloat16)."""
    return selective_log_softmax_on(backend(), logits, targets, temperature)
