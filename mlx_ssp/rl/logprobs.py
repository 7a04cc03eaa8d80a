"""Per-token log-probs from hidden states and the LM head, chunk by chunk (selective log-softmax).

RL needs ``log pi(y_t | y_<t)`` of the sampled tokens only, at the sampling temperature T:
``log_softmax(h_t W^T / T)[y_t]``. Computing it naively materialises the [tokens x vocab] logits
and their log-softmax (4096 tokens x 151,936 Qwen3 vocab = 2.5 GB each in float32), plus the same
again in the backward pass. This module computes it in chunks of ``chunk_size`` tokens:

- forward: for each chunk, logits = head(h_chunk) (one [chunk x V] buffer), the target logit by a
  gather on the flat index, and ``logsumexp(x)`` with ``x = logits / T`` in float32 (one exp
  pass); the per-token logsumexp is kept (a [tokens] vector) for the backward;
- backward (``mx.custom_function`` vjp): each chunk's logits are *recomputed* from h and the head,
  ``d logits = (g / T) * (onehot(t) - exp(x - lse))`` is formed in one exp pass with the one-hot
  part scatter-added at the targets only, and the gradient flows on into the hidden states (and
  into the head's weight when it is trained), chunk by chunk.

The op is split by job: :mod:`mlx_ssp.rl.lm_heads` (which head types it knows, how to find the
head), :mod:`mlx_ssp.rl.chunk_engines` (one chunk's math: the reference written out, or a custom
kernel, with the entropy and its gradient) and :mod:`mlx_ssp.rl.chunked_op` (the custom-vjp
functions and the chunk-by-chunk evaluation on a helper thread that bounds the memory); this
module chooses the chunk size and the per-chunk implementation and is the entry point.

Kernel dispatch: :func:`_chunk_impl` asks the one dispatcher (:mod:`mlx_ssp.rl.kernels`) and returns
its ``selective_log_softmax`` when a kernel runs, else ``selective_log_softmax_reference`` (both live in
:mod:`mlx_ssp.rl.kernels.log_softmax`; the op builds on them and is never imported by them).
``MLX_SSP_KERNELS=reference`` or the ``rl.kernels`` config key forces the reference.

Entropy (``return_entropy``): the per-token entropy of softmax(logits / T) from the same logits, a
statistic without gradient unless ``entropy_grad`` (the RL loss's entropy bonus; its backward is in
:mod:`mlx_ssp.rl.chunk_engines`).

Heads the op does not know fall back to the naive, unchunked computation (correct, not
memory-efficient). Deviations from a fused kernel: the whole chunk's logits exist at once (a kernel
tiles the vocab too); the backward pays one extra head matmul per chunk (the recompute), which is
the price of not keeping [tokens x vocab] alive between forward and backward. ``save_grad=True``
(frozen heads, callers that will differentiate: the RL loop's training path) avoids that extra
matmul by computing each chunk's d logp / d hidden rows in the forward pass
(:func:`mlx_ssp.rl.chunked_op.make_saved_op`): two head matmuls and one exp pass per chunk, as naive.

Memory: the default chunk is the largest whose live [chunk x V] float32 buffers fit a 768 MiB
budget (:func:`auto_chunk_size`; 432 tokens at Qwen3's vocab). With more than one chunk each chunk
is evaluated on its own, on a helper thread (:mod:`mlx_ssp.rl.chunked_op` says why).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn

from mlx_ssp.rl import kernels
from mlx_ssp.rl.chunk_engines import softmax_entropy
from mlx_ssp.rl.chunked_op import evaluable, make_op, make_saved_op
from mlx_ssp.rl.kernels.log_softmax import selective_log_softmax_reference
from mlx_ssp.rl.lm_heads import head_builder, head_of, head_trainable, head_vocab

# -- the per-chunk op ---------------------------------------------------------------------------


def _chunk_impl() -> Callable[[mx.array, mx.array, float], mx.array]:
    """The per-chunk selective log-softmax: a custom kernel where one can run, else the reference."""
    return kernels.selective_log_softmax if kernels.kernel_available() else selective_log_softmax_reference


def chunk_impl_name() -> str:
    """Which per-chunk implementation :func:`token_logprobs` uses right now (for logs)."""
    impl = _chunk_impl()
    return "reference" if impl is selective_log_softmax_reference else f"{impl.__module__}.{impl.__name__}"


#: Default memory budget for one chunk's [chunk x vocab] float32 buffers (see auto_chunk_size).
CHUNK_BYTES = 3 << 28  # 768 MiB
#: [chunk x vocab] float32 buffers alive at once at the peak of a chunk (measured on the CPU path
#: with mx.get_peak_memory: 2 in the recompute backward, 3 in the save_grad forward).
LIVE_CHUNK_BUFFERS = 3


def auto_chunk_size(vocab: int, budget_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk: the largest multiple of 16 whose live [chunk x vocab] float32 buffers
    (:data:`LIVE_CHUNK_BUFFERS` of them) fit in ``budget_bytes`` (at least 16).

    Qwen3's 151,936 vocab gives 432 tokens (3 x 263 MB). Larger chunks cost no time on the CPU
    (every phase scales linearly in the chunk) but memory; smaller ones only add per-chunk
    overhead, so the budget, not speed, sets the default."""
    per_token = LIVE_CHUNK_BUFFERS * 4 * max(1, vocab)
    return max(16, (budget_bytes // per_token) // 16 * 16)


def chunk_tokens(head: nn.Module, chunk_size: int | None = None) -> int:
    """Tokens per chunk of :func:`token_logprobs` for ``head``: ``chunk_size``, or the automatic one."""
    return auto_chunk_size(head_vocab(head)) if chunk_size is None else int(chunk_size)


def token_logprobs(
    hidden: mx.array,
    head: nn.Module,
    targets: mx.array,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    *,
    return_entropy: bool = False,
    entropy_grad: bool = False,
    save_grad: bool = False,
):
    """Per-token log-probs ``log_softmax(head(hidden) / T)[targets]`` as float32, shape ``targets.shape``.

    hidden [..., D], targets [...] int; ``head`` is an mlx-lm LM head (``nn.Linear``,
    ``nn.QuantizedLinear``, or the tied ``nn.Embedding`` / ``nn.QuantizedEmbedding``). Computed
    chunk by chunk over tokens; the custom vjp recomputes each chunk, so [tokens x vocab] never
    exists beyond one chunk in either direction. ``chunk_size=None`` picks the largest chunk whose
    live float32 [chunk x vocab] buffers fit 768 MiB (:func:`auto_chunk_size`: 432 tokens for
    Qwen3's 151,936 vocab, about 0.8 GB at the peak).
    ``save_grad=True`` (for callers that will take the gradient, with a frozen head) computes
    each chunk's d logp / d hidden rows in the forward instead of recomputing the chunk in the
    backward: two head matmuls in all instead of three (see :func:`mlx_ssp.rl.chunked_op.make_saved_op`). Gradients flow
    into ``hidden`` and into a float head's weights. With ``return_entropy`` also returns the per-token entropy of
    softmax(logits / T) (from the same forward logits); it has no gradient unless ``entropy_grad``,
    which gives it its exact one (dH/dlogits = -p (log p + H) / T) on every path, at the price of
    one more exp pass per chunk in the backward, or one more head-gradient matmul per chunk with
    ``save_grad``, and the reference math instead of a custom kernel."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if entropy_grad and not return_entropy:
        raise ValueError("entropy_grad=True needs return_entropy=True (the gradient is of the returned entropy)")
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
    build = head_builder(head)
    if build is None:  # unknown head type: correct but unchunked
        lp, ent = _unchunked(head, h, t, temperature, return_entropy, entropy_grad)
    else:
        lp, ent = _chunked(build(head), head, h, t, temperature, chunk_size, return_entropy, save_grad, entropy_grad)
    return (lp.reshape(shape), ent.reshape(shape)) if return_entropy else lp.reshape(shape)


def _unchunked(head: nn.Module, h, t, temperature: float, want_entropy: bool, entropy_grad: bool = False):
    """(log-probs, entropy or None) through the full logits of a head type HEADS does not know."""
    logits = head.as_linear(h) if hasattr(head, "as_linear") else head(h)
    lp = selective_log_softmax_reference(logits, t, temperature)
    return lp, (softmax_entropy(logits, temperature, grad=entropy_grad) if want_entropy else None)


def _chunked(built, head: nn.Module, h, t, temperature: float, chunk_size, want_entropy: bool, save_grad: bool,
             entropy_grad: bool = False):
    """(log-probs, entropy or None) by the chunked op, for a head with a HEADS builder (``built``)."""
    params, logits_fn = built
    cs = chunk_tokens(head, chunk_size)
    if h.shape[0] > cs:
        # chunks are built on a helper thread: its inputs must be evaluated (not allowed inside
        # mx.compile, where the chunks stay in the caller's graph: see mlx_ssp.rl.chunked_op)
        evaluable(*params)
    if not head_trainable(head):
        # frozen head (LoRA, quantized): weights are constants of the op, so its backward
        # never computes (or keeps buffers for) a head gradient nobody asked for
        frozen, fn = params, logits_fn
        params, logits_fn = (), (lambda hc: fn(hc, *frozen))
    if save_grad and not params:
        outs = make_saved_op(logits_fn, float(temperature), cs, _chunk_impl(), want_entropy, entropy_grad)(h, t)
        return outs[0], (outs[2] if want_entropy else None)
    outs = make_op(logits_fn, len(params), float(temperature), cs, _chunk_impl(), want_entropy,
                    entropy_grad)(h, t, *params)
    return outs[0], (outs[1] if want_entropy else None)


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
    model: nn.Module, inputs: mx.array, targets: mx.array, *args, compute_dtype: mx.Dtype | None = None, **options
) -> mx.array | tuple[mx.array, mx.array]:
    """``token_logprobs`` of ``targets`` given ``inputs`` ([B, L] each, targets = inputs shifted
    by one) through an mlx-lm model's backbone and head. ``args`` / ``options`` are
    :func:`token_logprobs`' (temperature, chunk_size, return_entropy, ...); the hidden states are
    cast to ``compute_dtype`` first when one is given."""
    h = sequence_hidden(model, inputs)
    if compute_dtype is not None:
        h = h.astype(compute_dtype)
    return token_logprobs(h, head_of(model), targets, *args, **options)


__all__: Sequence[str] = (
    "chunk_impl_name",
    "model_token_logprobs",
    "naive_token_logprobs",
    "selective_log_softmax_reference",
    "token_logprobs",
)
