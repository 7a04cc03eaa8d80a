"""The masked token loss of multi-turn SFT (token records: whole conversations with a target mask)."""

from __future__ import annotations


def masked_loss(model, tokens, weights):
    """Mean next-token cross-entropy over the target positions: ``sum_t w_t * CE(logits_t,
    tokens_{t+1}) / sum_t w_t`` with ``logits = model(tokens[:, :-1])`` and ``weights`` the
    ``(B, W - 1)`` target mask of :func:`~mlx_ssp.sft.batches.masked_batch`. Returns ``(loss,
    ntoks)`` like mlx-lm's ``default_loss``, so ``mlx_lm.tuner.trainer.train`` and ``evaluate``
    weigh, accumulate and report it unchanged. On a mask that is one span ``[offset, length)`` this
    is ``default_loss`` (a completions record's answer)."""
    import mlx.core as mx
    import mlx.nn as nn

    logits = model(tokens[:, :-1])
    ce = nn.losses.cross_entropy(logits, tokens[:, 1:]) * weights
    ntoks = weights.sum()
    return ce.astype(mx.float32).sum() / ntoks, ntoks
