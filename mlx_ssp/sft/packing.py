"""Sequence packing: a batch's records laid end to end in as few rows as fit, each record attending
only to itself.

A batch holds the same records as without packing (the same ``batch_size`` records, the same order
of batches): :func:`pack_rows` places them first-fit decreasing into rows no wider than the unpacked
batch would be, so a packed batch never has more rows, nor wider ones, and the loss is that of the
unpacked batch. Padding is what packing removes (with mixed lengths most of an unpacked batch).

Attention stays within a record through a block-diagonal causal mask built from per-token segment
ids. mlx-lm's models take no mask argument: they build theirs with ``create_attention_mask(h,
cache[0])``, which asks the cache's ``make_mask``; :class:`SegmentMask` is a pass-through "cache"
(offset 0, keys and values returned as given) whose ``make_mask`` is the block-diagonal mask. The
model types this is verified on are :data:`PACKABLE_MODEL_TYPES` (tests build each).

Positions: a record packed at row offset ``o`` gets RoPE positions ``o .. o + n - 1`` instead of
``0 .. n - 1``. RoPE rotates query and key at position ``p`` by angles ``p * theta_d``, so an attention
logit depends on ``q R(i)^T R(j) k = q R(j - i) k``, the relative position only: the logits, hence
the loss and its gradients, are the unpacked ones exactly in real arithmetic, and equal to the
rounding of the rotation angles in floating point (tested against unpacked batches). This holds for
every RoPE variant whose angle is position times a per-dimension frequency (default, linear, llama3,
yarn); a model with absolute position embeddings would not be exact and is not in the list.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

#: ``model_type`` values whose backbone builds its mask through the cache's ``make_mask`` and
#: applies RoPE with the cache's offset (mlx-lm's llama and qwen3 code; the tests build each)
PACKABLE_MODEL_TYPES = frozenset({"llama", "qwen3"})


def pack_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """Item indices per row: first-fit decreasing of ``lengths`` into rows of ``capacity`` tokens.
    An item is never split; one longer than ``capacity`` gets a row of its own (callers cut items
    to ``capacity`` first)."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r, f in enumerate(free):
            if lengths[i] <= f:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(capacity - lengths[i])
    return rows


def packed_batch(items: list[tuple[list[int], list[int]]], max_seq_length: int, pad_to: int = 32):
    """``(tokens, weights, segments)`` of ``(token_ids, mask)`` items packed into rows.

    The width is the unpacked batch's (``min(1 + pad_to * ceil(longest / pad_to), max_seq_length)``,
    :func:`~mlx_ssp.sft.batches.masked_batch`); items are cut to it as there, then packed with
    :func:`pack_rows`. ``tokens`` ``(R, W)`` int32 (0 padding); ``weights`` ``(R, W - 1)`` bool,
    aligned with the targets ``tokens[:, 1:]``: a record's ``mask[t + 1]`` at its position ``t``, and 0
    at its last token (whose next token belongs to another record); ``segments`` ``(R, W - 1)``
    int32, the record number (from 1) of every input token, 0 for padding."""
    longest = max(len(ids) for ids, _ in items)
    width = min(1 + pad_to * ((longest + pad_to - 1) // pad_to), max_seq_length)
    cut = [(ids[:width], m[:width]) for ids, m in items]
    rows = pack_rows([len(ids) for ids, _ in cut], width)
    tokens = np.zeros((len(rows), width), np.int32)
    weights = np.zeros((len(rows), width), np.bool_)
    segments = np.zeros((len(rows), width), np.int32)
    for r, row in enumerate(rows):
        s = 0
        for k, i in enumerate(row, start=1):
            ids, m = cut[i]
            n = len(ids)
            tokens[r, s:s + n] = ids
            weights[r, s:s + n - 1] = np.asarray(m[1:n], dtype=np.bool_)
            segments[r, s:s + n] = k
            s += n
    return mx.array(tokens), mx.array(weights[:, :-1]), mx.array(segments[:, :-1])


class SegmentMask:
    """A pass-through KV "cache" for one forward pass over packed rows: offset 0, keys and values
    returned unchanged, and a ``make_mask`` that is causal within each segment and blocks across
    segments (mlx-lm's ``create_attention_mask`` asks it for the mask)."""

    offset = 0

    def __init__(self, segments: mx.array):
        self.segments = segments

    def make_mask(self, n: int, return_array: bool = False, window_size=None) -> mx.array:
        seg = self.segments[:, :n]
        pos = mx.arange(n)
        causal = pos[:, None] >= pos[None]
        if window_size is not None:
            causal = causal & (pos[:, None] < pos[None] + window_size)
        return (seg[:, None, :, None] == seg[:, None, None, :]) & causal

    def update_and_fetch(self, keys, values):
        return keys, values


def packed_hidden(model, inputs: mx.array, segments: mx.array) -> mx.array:
    """The backbone's final hidden states of packed rows: ``inputs`` ``(R, L)`` with ``segments``
    ``(R, L)`` (:func:`packed_batch`), every segment attending only to itself."""
    check_packable(model)
    mask = SegmentMask(segments)
    return model.model(inputs, cache=[mask] * len(model.layers))


def check_packable(model) -> None:
    """ValueError unless the model's type is one packing is verified on."""
    mt = getattr(model, "model_type", None)
    if mt not in PACKABLE_MODEL_TYPES:
        raise ValueError(f"sequence packing supports model types {', '.join(sorted(PACKABLE_MODEL_TYPES))}; "
                         f"this model is {mt!r} (set sft.pack: false)")
