"""Per-token log-probs from hidden states and the LM head, chunk by chunk (selective log-softmax).

RL needs ``log pi(y_t | y_<t)`` of the sampled tokens only, at the sampling temperature T:
``log_softmax(h_t W^T / T)[y_t]``. Computing it naively materialises the [tokens x vocab] logits
and their log-softmax (4096 tokens x 151,936 Qwen3 vocab = 2.5 GB each in float32), plus the same
again in the backward pass. This module computes it in chunks of ``chunk_size`` tokens:

- forward: for each chunk, logits = head(h_chunk) (one [chunk x V] buffer), then the selective
  log-softmax ``x[t] - logsumexp(x)`` with ``x = logits / T`` in float32;
- backward (``mx.custom_function`` vjp): each chunk's logits are *recomputed* from h and the head,
  and ``d logits = g[:, None] * (onehot(t) - softmax(x)) / T``; the gradient flows on into the
  hidden states (and into the head's weight when it is trained), chunk by chunk.

This is the cut-cross-entropy idea (Wijmans et al., 2024, "Cut Your Losses in Large-Vocabulary
Language Models"), at chunk rather than tile granularity, in plain MLX. It is the reference that the
custom kernels in :mod:`mlx_ssp.rl.kernels` must equal and the path used where they cannot run.

Kernel dispatch: :func:`_chunk_impl` returns ``mlx_ssp.rl.kernels.selective_log_softmax`` when that
module exists and says a kernel is available, else :func:`selective_log_softmax_reference`.
``MLX_SSP_KERNELS=reference`` forces the reference.

Heads: ``nn.Linear`` (with or without bias), a tied ``nn.Embedding`` (its ``as_linear``),
``nn.QuantizedLinear`` and ``nn.QuantizedEmbedding`` (``mx.quantized_matmul``; no gradient into the
quantized weights, which cannot be trained anyway). Any other head module falls back to the naive,
unchunked computation (correct, not memory-efficient).

Deviations from a fused kernel: the whole chunk's logits exist at once (a kernel tiles the vocab
too); the backward pays one extra head matmul per chunk (the recompute), which is the price of not
keeping [tokens x vocab] alive between forward and backward. ``save_grad=True`` (frozen heads,
callers that will differentiate: the RL loop's training path) avoids that extra matmul by
computing each chunk's d logp / d hidden rows in the forward pass (:func:`_make_saved_op`).
With more than one chunk, each chunk is evaluated eagerly and detached (:func:`_materialize`):
MLX's lazy graph would otherwise hold every chunk's buffers at once.
"""

from __future__ import annotations

import functools
import os
from typing import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

KERNELS_ENV = "MLX_SSP_KERNELS"


# -- the per-chunk op ---------------------------------------------------------------------------


def _scaled(logits: mx.array, temperature: float) -> mx.array:
    x = logits.astype(mx.float32)
    return x if temperature == 1.0 else x * (1.0 / temperature)


@functools.lru_cache(maxsize=64)
def _sls_ref_for(temperature: float):
    """The reference op for one temperature (a closure: T is a constant, not an array input)."""

    @mx.custom_function
    def sls(logits: mx.array, targets: mx.array) -> mx.array:
        x = _scaled(logits, temperature)
        picked = mx.take_along_axis(x, targets[:, None], axis=-1)[:, 0]
        return picked - mx.logsumexp(x, axis=-1)

    @sls.vjp
    def sls_vjp(primals, cotangent, output):
        logits, targets = primals
        x = _scaled(logits, temperature)
        g = cotangent.astype(mx.float32)
        # d lp_i / d x_iv = onehot(t_i) - softmax(x_i); then chain through x = logits / T
        d = mx.exp(x - mx.logsumexp(x, axis=-1, keepdims=True)) * (-g[:, None])
        idx = targets[:, None]
        d = mx.put_along_axis(d, idx, mx.take_along_axis(d, idx, axis=-1) + g[:, None], axis=-1)
        if temperature != 1.0:
            d = d * (1.0 / temperature)
        return d.astype(logits.dtype), mx.zeros_like(targets)

    return sls


def selective_log_softmax_reference(logits: mx.array, targets: mx.array, temperature: float = 1.0) -> mx.array:
    """``log_softmax(logits.astype(float32) / T)[i, targets[i]]`` for each row i -> [n] float32.

    logits [n, V] (any float dtype), targets [n] int. The vjp with respect to logits is
    ``g[:, None] * (onehot(targets) - softmax(logits / T)) / T`` cast to logits' dtype (no
    gradient into targets or T). Plain MLX; the kernels in :mod:`mlx_ssp.rl.kernels` equal it."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return _sls_ref_for(float(temperature))(logits, targets.astype(mx.int32))


def _chunk_impl() -> Callable[[mx.array, mx.array, float], mx.array]:
    """The per-chunk selective log-softmax: a custom kernel where one can run, else the reference."""
    if os.environ.get(KERNELS_ENV, "").strip().lower() == "reference":
        return selective_log_softmax_reference
    try:
        from mlx_ssp.rl import kernels
    except ImportError:
        return selective_log_softmax_reference
    available = getattr(kernels, "kernel_available", None)
    impl = getattr(kernels, "selective_log_softmax", None)
    if impl is None or (callable(available) and not available()):
        return selective_log_softmax_reference
    return impl


def chunk_impl_name() -> str:
    """Which per-chunk implementation :func:`token_logprobs` uses right now (for logs)."""
    impl = _chunk_impl()
    return "reference" if impl is selective_log_softmax_reference else f"{impl.__module__}.{impl.__name__}"


# -- LM heads -----------------------------------------------------------------------------------
# type -> fn(module) -> (params tuple, logits_fn(h, *params)). Params are explicit inputs of the
# chunked op so that a trained head (full fine-tuning, untied or tied) gets its gradient.


def _dense(weight_key: str = "weight"):
    def build(m: nn.Module):
        if "bias" in m:
            return (m[weight_key], m["bias"]), lambda h, w, b: h @ w.T + b
        return (m[weight_key],), lambda h, w: h @ w.T

    return build


def _quantized(m: nn.Module):
    gs, bits, mode = m.group_size, m.bits, getattr(m, "mode", "affine")
    biases = m.get("biases")
    bias = m["bias"] if "bias" in m else None

    def fn(h, w, scales, *rest):
        qb = rest[0] if biases is not None else None
        out = mx.quantized_matmul(h, w, scales=scales, biases=qb, transpose=True, group_size=gs, bits=bits, mode=mode)
        return out + rest[-1] if bias is not None else out

    params = (m["weight"], m["scales"]) + ((biases,) if biases is not None else ()) + ((bias,) if bias is not None else ())
    return params, fn


HEADS: dict[type, Callable] = {
    nn.QuantizedLinear: _quantized,
    nn.QuantizedEmbedding: _quantized,
    nn.Linear: _dense(),
    nn.Embedding: _dense(),  # tied embeddings: logits = h @ E^T (Embedding.as_linear)
}


def head_of(model: nn.Module) -> nn.Module:
    """The LM head of an mlx-lm model: ``lm_head``, or the tied input embedding."""
    if "lm_head" in model:  # mlx-lm creates lm_head only for untied embeddings
        return model["lm_head"]
    inner = getattr(model, "model", None)
    emb = getattr(inner, "embed_tokens", None) if inner is not None else None
    if emb is None:
        raise ValueError(f"cannot find the LM head of {type(model).__name__} (no lm_head, no model.embed_tokens)")
    return emb


def _head_builder(head: nn.Module):
    for cls, build in HEADS.items():  # exact types first so QuantizedLinear is not taken as Linear
        if type(head) is cls:
            return build
    for cls, build in HEADS.items():
        if isinstance(head, cls):
            return build
    return None


def _trainable(head: nn.Module) -> bool:
    return any(mx.issubdtype(v.dtype, mx.floating) for _, v in tree_flatten(head.trainable_parameters()))


def head_vocab(head: nn.Module) -> int:
    """Output size of an LM head (rows of its weight)."""
    return int(head["weight"].shape[0]) if "weight" in head else 0


#: Default chunk: about this many logits per chunk (16M float32 = 64 MB per [chunk x V] buffer).
CHUNK_ELEMENTS = 1 << 24


def auto_chunk_size(vocab: int) -> int:
    """Tokens per chunk so that one [chunk x vocab] float32 buffer is about 64 MB (at least 16)."""
    return max(16, CHUNK_ELEMENTS // max(1, vocab))


# -- the chunked op -----------------------------------------------------------------------------


def _materialize(x: mx.array) -> mx.array:
    """``x`` evaluated now and cut from its graph, so that this chunk's [chunk x V] buffers are
    freed before the next chunk is built.

    Two MLX behaviours force this: the lazy graph allocates every chunk's buffers before computing
    any (measured: peak = all chunks), and inside a gradient transformation evaluated arrays keep
    their inputs alive for the tape (our custom vjp never needs them). A copy through NumPy drops
    the graph; only the small per-token result ([chunk] or [chunk x D]) is copied. Under
    mx.compile / vmap evaluation is not allowed: there ``x`` is returned as is (the result stays
    correct; the memory bound is lost). Detaching also means no higher-order gradients."""
    try:
        mx.eval(x)
    except ValueError:
        return x
    if x.dtype == mx.bfloat16:  # NumPy has no bfloat16: move the bits
        return mx.array(np.asarray(x.view(mx.uint16))).view(mx.bfloat16)
    return mx.array(np.asarray(x))


def _make_op(logits_fn, n_params: int, temperature: float, chunk_size: int, impl, want_entropy: bool):
    """The chunked op as an mx.custom_function of (h, targets, *trained_head_params)."""

    def chunks(n):
        return [(s, min(s + chunk_size, n)) for s in range(0, n, chunk_size)]

    def keep(x, n):
        # one chunk: stay lazy (forcing evaluation inside the gradient trace would materialise the
        # whole model's forward at once: measured 2x the activation memory on a tiny model)
        return _materialize(x) if n > chunk_size else x

    @mx.custom_function
    def op(h, targets, *params):
        lps, ents = [], []
        n = h.shape[0]
        for s, e in chunks(n):
            logits = logits_fn(h[s:e], *params)
            lps.append(keep(impl(logits, targets[s:e], temperature), n))
            if want_entropy:
                ents.append(keep(_entropy(logits, temperature), n))
            del logits
        lp = mx.concatenate(lps) if len(lps) > 1 else lps[0]
        if not want_entropy:
            return lp
        return lp, (mx.concatenate(ents) if len(ents) > 1 else ents[0])

    @op.vjp
    def op_vjp(primals, cotangents, outputs):
        h, targets, *params = primals
        g = cotangents[0] if isinstance(cotangents, (list, tuple)) else cotangents
        dhs, dps = [], [mx.zeros_like(p) for p in params]
        n = h.shape[0]
        for s, e in chunks(n):
            tc = targets[s:e]

            def f(hc, *p):
                return impl(logits_fn(hc, *p), tc, temperature)

            _, grads = mx.vjp(f, [h[s:e], *params], [g[s:e]])  # recomputes this chunk's logits
            dhs.append(keep(grads[0], n))
            dps = [keep(a + b, n) for a, b in zip(dps, grads[1:])]
            del grads
        dh = mx.concatenate(dhs) if len(dhs) > 1 else dhs[0]
        return (dh, mx.zeros_like(targets), *dps)

    return op


def _make_saved_op(logits_fn, temperature: float, chunk_size: int, impl, want_entropy: bool):
    """The chunked op for a frozen head with the backward done in the forward pass.

    Each lp_i depends only on h_i, so d lp_i / d h_i is one D-vector J_i; the vjp of the chunk with
    cotangent 1 gives those rows (J_i = (W[t_i] - softmax_i @ W) / T for a linear head) while the
    chunk's logits are still alive. The backward is then ``dh = g[:, None] * J``: two head matmuls
    per chunk in all (as naive), instead of three with the recompute, for [tokens x D] of memory.
    A forward-only caller pays the second matmul for nothing: use it where a gradient follows."""

    def chunks(n):
        return [(s, min(s + chunk_size, n)) for s in range(0, n, chunk_size)]

    @mx.custom_function
    def op(h, targets):
        lps, js, ents = [], [], []
        n = h.shape[0]
        for s, e in chunks(n):
            tc = targets[s:e]

            def f(hc):
                logits = logits_fn(hc)
                lp = impl(logits, tc, temperature)
                return (lp, _entropy(logits, temperature)) if want_entropy else (lp,)

            cot = [mx.ones((e - s,), mx.float32)] + ([mx.zeros((e - s,), mx.float32)] if want_entropy else [])
            outs, (j,) = mx.vjp(f, [h[s:e]], cot)
            for lst, x in zip((lps, ents), outs):
                lst.append(x if n <= chunk_size else _materialize(x))
            js.append(j if n <= chunk_size else _materialize(j))
        cat = lambda xs: mx.concatenate(xs) if len(xs) > 1 else xs[0]  # noqa: E731
        return (cat(lps), cat(js)) + ((cat(ents),) if want_entropy else ())

    @op.vjp
    def op_vjp(primals, cotangents, outputs):
        h, targets = primals
        g = cotangents[0]
        return (g.astype(mx.float32)[:, None] * outputs[1]).astype(h.dtype), mx.zeros_like(targets)

    return op


def _entropy(logits: mx.array, temperature: float) -> mx.array:
    """Entropy of softmax(logits / T) per row, float32, no gradient (a statistic)."""
    x = mx.stop_gradient(_scaled(logits, temperature))
    lse = mx.logsumexp(x, axis=-1, keepdims=True)
    p = mx.exp(x - lse)
    return lse[:, 0] - (p * x).sum(axis=-1)


def token_logprobs(
    hidden: mx.array,
    head: nn.Module,
    targets: mx.array,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    *,
    return_entropy: bool = False,
    save_grad: bool = False,
):
    """Per-token log-probs ``log_softmax(head(hidden) / T)[targets]`` as float32, shape ``targets.shape``.

    hidden [..., D], targets [...] int; ``head`` is an mlx-lm LM head (``nn.Linear``,
    ``nn.QuantizedLinear``, or the tied ``nn.Embedding`` / ``nn.QuantizedEmbedding``). Computed
    chunk by chunk over tokens; the custom vjp recomputes each chunk, so [tokens x vocab] never
    exists beyond one chunk in either direction. ``chunk_size=None`` picks about 64 MB of
    float32 logits per chunk (:func:`auto_chunk_size`: 110 tokens for Qwen3's 151,936 vocab).
    ``save_grad=True`` (for callers that will take the gradient, with a frozen head) computes
    each chunk's d logp / d hidden rows in the forward instead of recomputing the chunk in the
    backward: two head matmuls in all instead of three (see :func:`_make_saved_op`). Gradients flow into ``hidden`` and into a
    float head's weights. With ``return_entropy`` also returns the per-token entropy of
    softmax(logits / T) (from the same forward logits; no gradient)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    shape = targets.shape
    if hidden.shape[:-1] != shape:
        raise ValueError(f"hidden {hidden.shape} and targets {shape} disagree on the token dimensions")
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1).astype(mx.int32)
    if h.shape[0] == 0:
        z = mx.zeros(shape, dtype=mx.float32)
        return (z, z) if return_entropy else z
    build = _head_builder(head)
    if build is None:  # unknown head type: correct but unchunked
        logits = head.as_linear(h) if hasattr(head, "as_linear") else head(h)
        lp = selective_log_softmax_reference(logits, t, temperature)
        out = (lp, _entropy(logits, temperature)) if return_entropy else lp
    else:
        params, logits_fn = build(head)
        if not _trainable(head):
            # frozen head (LoRA, quantized): weights are constants of the op, so its backward
            # never computes (or keeps buffers for) a head gradient nobody asked for
            frozen, fn = params, logits_fn
            params, logits_fn = (), (lambda hc: fn(hc, *frozen))
        cs = auto_chunk_size(head_vocab(head)) if chunk_size is None else int(chunk_size)
        if save_grad and not params:
            outs = _make_saved_op(logits_fn, float(temperature), cs, _chunk_impl(), return_entropy)(h, t)
            out = (outs[0], outs[2]) if return_entropy else outs[0]
        else:
            op = _make_op(logits_fn, len(params), float(temperature), cs, _chunk_impl(), return_entropy)
            out = op(h, t, *params)
    if return_entropy:
        return out[0].reshape(shape), out[1].reshape(shape)
    return out.reshape(shape)


def naive_token_logprobs(hidden: mx.array, head: nn.Module, targets: mx.array, temperature: float = 1.0) -> mx.array:
    """The unchunked definition (full logits and log-softmax): for tests and benchmarks."""
    logits = head.as_linear(hidden) if isinstance(head, (nn.Embedding, nn.QuantizedEmbedding)) else head(hidden)
    lsm = nn.log_softmax(logits.astype(mx.float32) / temperature, axis=-1)
    return mx.take_along_axis(lsm, targets[..., None].astype(mx.int32), axis=-1)[..., 0]


def sequence_hidden(model: nn.Module, inputs: mx.array) -> mx.array:
    """Final hidden states (after the last norm, before the LM head) of an mlx-lm model."""
    inner = getattr(model, "model", None)
    if inner is None:
        raise ValueError(f"{type(model).__name__} has no .model backbone; not an mlx-lm causal LM")
    return inner(inputs)


def model_token_logprobs(
    model: nn.Module,
    inputs: mx.array,
    targets: mx.array,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    *,
    return_entropy: bool = False,
    compute_dtype: mx.Dtype | None = None,
) -> mx.array | tuple[mx.array, mx.array]:
    """``token_logprobs`` of ``targets`` given ``inputs`` ([B, L] each, targets = inputs shifted
    by one) through an mlx-lm model's backbone and head."""
    h = sequence_hidden(model, inputs)
    if compute_dtype is not None:
        h = h.astype(compute_dtype)
    return token_logprobs(h, head_of(model), targets, temperature, chunk_size, return_entropy=return_entropy)


__all__: Sequence[str] = (
    "selective_log_softmax_reference",
    "token_logprobs",
    "naive_token_logprobs",
    "model_token_logprobs",
    "head_of",
    "chunk_impl_name",
)
