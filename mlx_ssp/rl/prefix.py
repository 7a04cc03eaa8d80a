"""Shared prompt prefixes in the trainer's forward passes.

The G samples of one prompt are G rows that start with the same prompt tokens. The update's
forward + backward, the reference forward and the entropy pass used to run the prompt once per row;
at the demo shape (256-token prompt, G = 8, 128 completion tokens) that is 8 x 384 = 3,072 body
tokens where 256 + 8 x 128 = 1,280 carry information. Here the rows are cut into blocks of
consecutive rows that share a prefix with no loss token in it (:func:`blocks`: a group's prompt);
a block's prefix runs once at batch 1 (:func:`prefix_kv`, its per-layer keys and values), and the
block's rows, in pieces, run only their suffixes attending to that cache broadcast to their rows
(:func:`hidden_after`). The gradient flows back through the broadcast (a sum over rows) into the
cache; the trainer sums it over a block's pieces and runs the prefix's backward once
(:func:`mlx_ssp.rl.pieces.prefix_grads`), so LoRA weights on the prompt's path get the gradient of
the unshared forward (the chain rule).

Identity: log-probs, and gradients, equal the unshared forward's up to float reassociation
(different matmul shapes); on the prefix positions they are 0, which every use masks out (the
prefix ends at or before the first loss token of any row). Where the model's cache is not the plain
mlx-lm ``KVCache`` (sliding windows, SSM layers), or the rows share fewer than
:data:`MIN_PREFIX` tokens, the forward is the plain one.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache

#: Shorter common prefixes are not worth a second, batch-1 forward.
MIN_PREFIX = 8


class _TracedCache(KVCache):
    """A KVCache whose update is a concatenation: differentiable, with no preallocated buffer
    written in place (mlx-lm's slice update), so the backward sees the prefix's keys and values."""

    def update_and_fetch(self, keys, values):
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = mx.concatenate([self.keys, keys], axis=2)
            self.values = mx.concatenate([self.values, values], axis=2)
        self.offset += keys.shape[2]
        return self.keys, self.values

    def broadcast(self, rows: int) -> None:
        self.keys = mx.broadcast_to(self.keys, (rows, *self.keys.shape[1:]))
        self.values = mx.broadcast_to(self.values, (rows, *self.values.shape[1:]))


def shareable(model: nn.Module) -> bool:
    """Whether every layer of ``model`` uses mlx-lm's plain KVCache (what :class:`_TracedCache` replaces)."""
    make = getattr(model, "make_cache", None)
    if make is not None:
        return all(type(c) is KVCache for c in make())
    return hasattr(model, "layers") or hasattr(getattr(model, "model", None), "layers")


def shared_prefix_len(inputs: np.ndarray, mask: np.ndarray) -> int:
    """Length of the longest prefix all rows of ``inputs`` [B, L] share with no loss token in it
    (``mask`` [B, L] is on targets, target j follows input j), or 0 when not worth sharing."""
    inputs, mask = np.asarray(inputs), np.asarray(mask)
    if inputs.shape[0] < 2:
        return 0
    differs = (inputs != inputs[:1]).any(axis=0)
    p = int(np.argmax(differs)) if differs.any() else inputs.shape[1]
    loss = mask.any(axis=0)
    if loss.any():
        p = min(p, int(np.argmax(loss)))
    # the suffix must keep at least one position, and the prefix be worth a second forward
    p = min(p, inputs.shape[1] - 1)
    return p if p >= MIN_PREFIX else 0


def prefix_kv(model: nn.Module, tokens: mx.array) -> list[tuple[mx.array, mx.array]]:
    """Each layer's (keys, values) [1, kv_heads, P, head_dim] for the prefix ``tokens`` [1, P]."""
    cache = [_TracedCache() for _ in model.model.layers]
    model.model(tokens, cache=cache)
    return [(c.keys, c.values) for c in cache]


def hidden_after(model: nn.Module, suffix: mx.array, kv: list[tuple[mx.array, mx.array]]) -> mx.array:
    """Final hidden states [B, S, D] of the rows ``suffix`` [B, S] after a shared prefix whose
    per-layer keys and values are ``kv`` (:func:`prefix_kv`), broadcast to the B rows. The
    gradient reaches ``kv`` as the sum over rows."""
    cache = []
    for k, v in kv:
        c = _TracedCache()
        c.keys, c.values, c.offset = k, v, k.shape[2]
        c.broadcast(suffix.shape[0])
        cache.append(c)
    return model.model(suffix, cache=cache)


def suffix_hidden(model: nn.Module, inputs: mx.array, prefix: int) -> mx.array:
    """Final hidden states [B, L - prefix, D] of the rows' suffixes, with the shared ``prefix``
    tokens (``inputs[0, :prefix]``, identical in every row) run once and broadcast as a KV cache."""
    return hidden_after(model, inputs[:, prefix:], prefix_kv(model, inputs[:1, :prefix]))


def blocks(inputs: np.ndarray, mask: np.ndarray) -> list[tuple[int, int, int]]:
    """The rows cut into runs of consecutive rows that share a prefix (a group's prompt):
    (first row, end row, prefix length; 0 where nothing is shared). A run's prefix is what its
    first two rows share (:func:`shared_prefix_len`), and the run goes on while the next row shares
    all of it, so the next group's rows start a new run instead of shrinking the prefix to the
    system prompt that every group has in common. A row that shares less with the next than the
    next shares with the one after (the last row of a group cut off by a data-parallel shard) is a
    run of its own, and consecutive rows that share nothing form one unshared run (micro-batched
    as before)."""
    inputs, mask = np.asarray(inputs), np.asarray(mask)
    out, i, n = [], 0, inputs.shape[0]

    def pair(a: int) -> int:
        return shared_prefix_len(inputs[a:a + 2], mask[a:a + 2]) if a + 1 < n else 0

    while i < n:
        p, j = pair(i), i + 1
        if p and pair(i + 1) > p:
            p = 0  # a lone row before a group that shares more: not a block with it
        if p:
            while j < n and (inputs[j, :p] == inputs[i, :p]).all() and not mask[j, :p].any():
                j += 1
        if not p and out and out[-1][2] == 0 and out[-1][1] == i:
            out[-1] = (out[-1][0], j, 0)  # extend the previous unshared run
        else:
            out.append((i, j, p))
        i = j
    return out
