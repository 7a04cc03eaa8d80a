"""SFT losses: the next-token cross-entropy over weighted targets, by full logits or by the chunked
log-prob op, on padded or packed batches.

Every loss returns ``(loss, ntoks)`` like mlx-lm's ``default_loss``, so ``mlx_lm.tuner.trainer.train``
and ``evaluate`` weigh, accumulate and report it unchanged.

Two ways to get the per-token cross-entropy (:data:`CE_KINDS`, the ``sft.loss`` key):

- ``logits``: ``nn.losses.cross_entropy(model(inputs), targets)``, mlx-lm's own computation: the
  whole ``(B, T, vocab)`` logits exist, and their gradient too.
- ``chunked``: ``-log_softmax(head(h))[target]`` by the RL stage's chunked op
  (:func:`mlx_ssp.rl.logprobs.token_logprobs`, one implementation for SFT and RL) on the backbone's
  hidden states: the logits exist one chunk of tokens at a time, in the forward and the backward
  (chunks sized for a compiled step: :func:`sft_chunk_size`).
  The same value as ``logits`` up to float32 rounding (tested).

Gathered targets (the ``sft.gather_targets`` key, on by default with ``chunked``): the batch iterator
also yields the flat indices of the weighted targets (:func:`~mlx_ssp.sft.batches.target_index`), and
the loss gathers the hidden states, targets and weights there before the chunked op, so the LM head
(forward and backward) runs only where a target carries weight: the completion tokens, not the
prompt or the padding. The same loss and gradients as the full-width op up to float32 summation
order (tested).

Packed batches (:mod:`mlx_ssp.sft.packing`) run the backbone with a block-diagonal causal mask (a
third batch array: the segment id of every token), so a record attends only to itself.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from mlx_ssp.rl.lm_heads import head_of, head_vocab
from mlx_ssp.rl.logprobs import CHUNK_BYTES, LIVE_CHUNK_BUFFERS, auto_chunk_size, token_logprobs
from mlx_ssp.sft.packing import packed_hidden


def _ce_logits(model, inputs, targets, segments, chunk_size=None):
    if segments is None:
        logits = model(inputs)
    else:
        h = packed_hidden(model, inputs, segments)
        head = head_of(model)
        logits = head.as_linear(h) if isinstance(head, (nn.Embedding, nn.QuantizedEmbedding)) else head(h)
    return nn.losses.cross_entropy(logits, targets)


#: [chunk x vocab] float32 buffers alive at once when the op runs inside mx.compile (mlx-lm's train
#: step), where it cannot evaluate chunk by chunk: measured about 10 (Qwen3's vocabulary, 2k tokens:
#: peak 2.8 GiB with 432-token chunks, 0.97 GiB with 128), against 3 when it runs eagerly
COMPILED_LIVE_BUFFERS = 10


#: at least this many chunks: the compiled step's live chunk buffers then stay a fraction of the
#: whole logits even when those fit the budget (short batches, small vocabularies)
MIN_CHUNKS = 8


def sft_chunk_size(head, n_tokens: int) -> int:
    """Tokens per chunk of the SFT loss over ``n_tokens``: the RL op's memory budget spread over the
    live buffers of a compiled step (128 tokens at Qwen3's 151,936 vocabulary), and at most an
    eighth of the tokens (a multiple of 16, at least 16)."""
    budget = auto_chunk_size(head_vocab(head), CHUNK_BYTES * LIVE_CHUNK_BUFFERS // COMPILED_LIVE_BUFFERS)
    return min(budget, max(16, -(-n_tokens // (16 * MIN_CHUNKS)) * 16))


def _ce_chunked(model, inputs, targets, segments, chunk_size=None):
    h = _hidden(model, inputs, segments)
    head = head_of(model)
    # save_grad: with a frozen head (LoRA) each chunk's d logp / d h is formed in the forward, so the
    # backward does not recompute the chunk's logits (two head matmuls per chunk in all, as `logits`)
    return -token_logprobs(h, head, targets, chunk_size=chunk_size or sft_chunk_size(head, targets.size),
                           save_grad=True)


def _hidden(model, inputs, segments):
    return model.model(inputs) if segments is None else packed_hidden(model, inputs, segments)


def gathered_ce(model, inputs, targets, weights, index, segments=None, chunk_size=None):
    """``(CE, w)`` at the flat target positions ``index`` (``-1`` entries are padding, weight 0):
    the chunked op's per-token CE on the gathered hidden states, and the gathered weights."""
    valid = index >= 0
    at = mx.where(valid, index, 0)
    h = _hidden(model, inputs, segments)
    h = mx.take(h.reshape(-1, h.shape[-1]), at, axis=0)
    head = head_of(model)
    ce = -token_logprobs(h, head, mx.take(targets.reshape(-1), at), save_grad=True,
                         chunk_size=chunk_size or sft_chunk_size(head, index.size))
    return ce, mx.logical_and(mx.take(weights.reshape(-1), at), valid)


def chunked_is_exact(model) -> bool:
    """Whether the model's logits are its LM head applied to its backbone's last hidden states, which
    is what the chunked op computes (a model that scales or soft-caps its logits after the head is
    not: for it the chunked loss would be another loss). Checked on one forward of 4 tokens."""
    x = mx.array([[1, 2, 3, 4]])
    head = head_of(model)
    h = model.model(x)
    got = head.as_linear(h) if isinstance(head, (nn.Embedding, nn.QuantizedEmbedding)) else head(h)
    return bool(mx.allclose(model(x), got, rtol=1e-4, atol=1e-4).item())


#: ``sft.loss`` -> fn(model, inputs, targets, segments or None, chunk_size) -> per-target CE (B, T)
CE_KINDS: dict[str, Callable] = {"chunked": _ce_chunked, "logits": _ce_logits}


def weighted_ce(model, inputs, targets, weights, segments=None, *, kind: str = "chunked", chunk_size=None,
                index=None):
    """``(sum_t w_t * CE_t / sum_t w_t, sum_t w_t)``: the mean next-token cross-entropy over the
    weighted targets, the per-token CE computed the ``kind`` way (:data:`CE_KINDS`; ``chunk_size``:
    tokens per chunk of the chunked op, None = its automatic size). With ``index`` (the batch's
    :func:`~mlx_ssp.sft.batches.target_index`, kind ``chunked`` only) the CE is computed at those
    targets only (:func:`gathered_ce`)."""
    if index is not None:
        if kind != "chunked":
            raise ValueError(f"gathered targets need the chunked loss, not {kind!r}")
        ce, weights = gathered_ce(model, inputs, targets, weights, index, segments, chunk_size)
    else:
        ce = CE_KINDS[kind](model, inputs, targets, segments, chunk_size)
    ce = ce * weights
    ntoks = weights.sum()
    return ce.astype(mx.float32).sum() / ntoks, ntoks


def masked_loss(model, tokens, weights, segments=None, *, kind: str = "chunked", chunk_size=None, index=None):
    """Mean next-token cross-entropy over the target positions: ``sum_t w_t * CE(logits_t,
    tokens_{t+1}) / sum_t w_t`` with ``logits = model(tokens[:, :-1])`` and ``weights`` the
    ``(B, W - 1)`` target mask of :func:`~mlx_ssp.sft.batches.masked_batch` (``segments``: the
    ``(B, W - 1)`` segment ids of a packed batch, :func:`~mlx_ssp.sft.packing.packed_batch`). On a
    mask that is one span ``[offset, length)`` this is ``default_loss`` (a completions record's answer).
    ``index``: compute the CE at the weighted targets only (:func:`weighted_ce`)."""
    return weighted_ce(model, tokens[:, :-1], tokens[:, 1:], weights, segments, kind=kind, chunk_size=chunk_size,
                       index=index)


def default_loss(model, batch, lengths, *, kind: str = "chunked", chunk_size=None, index=None):
    """mlx-lm's ``default_loss`` on its ``(batch, lengths)`` batches (chat, completions and text
    records), with the same target mask (``offset <= t + 1 <= length``, including mlx-lm's one target
    past a record's end when the batch has padding there) and the per-token CE the ``kind`` way
    (``index``: at the weighted targets only, :func:`weighted_ce`)."""
    steps = mx.arange(1, batch.shape[1])
    mask = mx.logical_and(steps >= lengths[:, 0:1], steps <= lengths[:, 1:])
    return weighted_ce(model, batch[:, :-1], batch[:, 1:], mask, kind=kind, chunk_size=chunk_size, index=index)


def make_loss(kind: str, token_batches: bool, gather: bool = False) -> Callable:
    """The ``loss`` of mlx-lm's ``train`` / ``evaluate`` for ``sft.loss = kind``: on our masked
    (or packed) batches when ``token_batches``, else on mlx-lm's ``(batch, lengths)`` batches.
    With ``gather`` every batch ends with its target index (the iterators' ``gather=True``), and
    the CE is computed at those targets only."""
    if kind not in CE_KINDS:
        raise ValueError(f"unknown loss {kind!r}; choose from {', '.join(CE_KINDS)}")
    base = masked_loss if token_batches else default_loss

    if gather:
        def loss(model, *batch):
            return base(model, *batch[:-1], kind=kind, index=batch[-1])
    else:
        def loss(model, *batch):
            return base(model, *batch, kind=kind)

    return loss


__all__ = ["CE_KINDS", "chunked_is_exact", "default_loss", "gathered_ce", "make_loss", "masked_loss", "sft_chunk_size", "weighted_ce"]
