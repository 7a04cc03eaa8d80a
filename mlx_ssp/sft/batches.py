"""Batch iteration: mlx-lm's ``iterate_batches`` made reproducible and resumable, and the flat
indices of a batch's weighted targets (:func:`target_index`: the chunked loss runs the LM head there only)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlx_ssp.sft.packing import packed_batch

#: the target index is padded to a multiple of this many entries: few distinct shapes for the
#: compiled step to trace
INDEX_MULTIPLE = 16


def target_index(weights) -> mx.array:
    """The flat indices (into ``weights.reshape(-1)``) of the nonzero target weights, in order, as
    int32, padded with -1 to a multiple of :data:`INDEX_MULTIPLE` entries (at least one multiple).
    Computed with the batch, outside the compiled step, whose shapes cannot depend on the data."""
    flat = np.flatnonzero(np.asarray(weights).reshape(-1)).astype(np.int32)
    n = max(INDEX_MULTIPLE, -(-flat.size // INDEX_MULTIPLE) * INDEX_MULTIPLE)
    return mx.array(np.concatenate([flat, np.full(n - flat.size, -1, np.int32)]))


def default_loss_mask(lengths, width: int) -> np.ndarray:
    """The ``(B, width - 1)`` target mask of mlx-lm's ``default_loss`` for a ``(batch, lengths)``
    batch of that width: target ``t`` counts when ``offset <= t + 1 <= length``."""
    lengths = np.asarray(lengths)
    steps = np.arange(1, width)
    return (steps >= lengths[:, 0:1]) & (steps <= lengths[:, 1:])


def make_iterate_batches(seed: int, skip: int = 0, gather: bool = False):
    """mlx-lm's ``iterate_batches`` with its NumPy shuffling confined to a private, seeded
    ``RandomState`` (training and validation get separate streams), and the first ``skip``
    training batches dropped (resume: they were already trained on). The training stream starts
    from ``seed`` exactly as ``mlx_lm lora`` seeds NumPy, so the batch order is the same as its.
    With ``gather`` each ``(batch, lengths)`` also carries the :func:`target_index` of its
    ``default_loss`` mask: ``(batch, lengths, index)``."""
    from mlx_lm.tuner.trainer import iterate_batches

    base_seed = seed  # mlx-lm's `seed=` argument of the iterator below is not ours

    def wrapped(dataset, batch_size, max_seq_length, loop=False, seed=None, comm_group=None):
        own = np.random.RandomState(stream_seed(base_seed, loop)).get_state()
        inner = iterate_batches(dataset, batch_size, max_seq_length, loop=loop, comm_group=comm_group)
        n = 0
        while True:
            outer = np.random.get_state()
            np.random.set_state(own)
            try:
                batch = next(inner)
            except StopIteration:
                return
            finally:
                own = np.random.get_state()
                np.random.set_state(outer)
            n += 1
            if loop and n <= skip:
                continue
            if gather:
                batch = (*batch, target_index(default_loss_mask(batch[1], batch[0].shape[1])))
            yield batch

    return wrapped


def stream_seed(seed: int, loop: bool) -> int:
    """The batch-order seed: training (``loop``) the seed itself, so the order equals
    ``mlx_lm lora --seed SEED``'s; validation ``seed + 1``."""
    return (seed + (0 if loop else 1)) % (1 << 32)


#: batch widths are rounded up to a multiple of this (plus one), as mlx-lm does: fewer distinct
#: shapes for the compiled step to trace
PAD_TO = 32


def masked_batch(items: list[tuple[list[int], list[int]]], max_seq_length: int):
    """``(tokens, weights)`` of a list of ``(token_ids, mask)`` items: ``tokens`` is ``(B, W)``
    int32, right-padded with 0 to ``W = min(1 + PAD_TO * ceil(longest / PAD_TO), max_seq_length)``
    (mlx-lm's width); ``weights`` is ``(B, W - 1)`` bool aligned with the *targets*
    ``tokens[:, 1:]``: ``weights[b, t] = mask_b[t + 1]``, so padding and every mask-0 token weigh
    nothing. Items longer than ``max_seq_length`` are cut (the loader already did; this keeps the
    shape bound for a dataset made elsewhere)."""
    longest = max(len(ids) for ids, _ in items)
    width = min(1 + PAD_TO * ((longest + PAD_TO - 1) // PAD_TO), max_seq_length)
    tokens = np.zeros((len(items), width), np.int32)
    mask = np.zeros((len(items), width), np.bool_)
    for b, (ids, m) in enumerate(items):
        n = min(len(ids), width)
        tokens[b, :n] = ids[:n]
        mask[b, :n] = np.asarray(m[:n], dtype=np.bool_)
    return mx.array(tokens), mx.array(mask[:, 1:])


def as_masked_item(item) -> tuple[list[int], list[int]]:
    """A dataset item as ``(token_ids, mask)``: token records already are; mlx-lm's chat,
    completions and text items ``(token_ids, offset)`` get mask 0 before the offset (the prompt
    under ``mask_prompt``), 1 from it."""
    ids, second = item
    if isinstance(second, int):
        return list(ids), [0] * second + [1] * (len(ids) - second)
    return ids, second


def make_masked_iterate_batches(seed: int, skip: int = 0, pack: bool = False, gather: bool = False):
    """The batch iterator for token records (:class:`~mlx_ssp.sft.episodes.TokenDataset`), with
    mlx-lm's ``iterate_batches`` signature and batching rule: items sorted by length, cut into
    consecutive batches of ``batch_size`` (length bucketing: a batch holds episodes of similar
    length, so little of it is padding; the last partial batch is left out), the batch order a
    fresh permutation per pass from a private seeded ``RandomState`` (training: ``seed``;
    validation: ``seed + 1``), each rank taking every ``size``-th item of a batch. Yields
    :func:`masked_batch`'s ``(tokens, weights)``, the arguments of :func:`~mlx_ssp.sft.loss.masked_loss`.
    With ``loop`` the first ``skip`` batches are dropped (resume: they were trained on).
    With ``pack`` each batch holds the same records, packed into as few rows as fit
    (:func:`~mlx_ssp.sft.packing.packed_batch`: ``(tokens, weights, segments)``), and mlx-lm's
    ``(token_ids, offset)`` items are taken too (:func:`as_masked_item`). With ``gather`` every
    batch also ends with the :func:`target_index` of its weights."""
    collate = packed_batch if pack else masked_batch

    base_seed = seed  # mlx-lm's `seed=` argument of the iterator below is not ours

    def iterate(dataset, batch_size, max_seq_length, loop=False, seed=None, comm_group=None):
        if len(dataset) < batch_size:
            raise ValueError(f"Dataset must have at least batch_size={batch_size} examples but only has {len(dataset)}.")
        rank, size = (comm_group.rank(), comm_group.size()) if comm_group is not None else (0, 1)
        if batch_size % size:
            raise ValueError("The batch size must be divisible by the number of workers")
        order = sorted(range(len(dataset)), key=dataset.itemlen)
        batches = [order[i + rank: i + batch_size: size] for i in range(0, len(order) - batch_size + 1, batch_size)]
        rng = np.random.RandomState(stream_seed(base_seed, loop))
        n = 0
        while True:
            for i in rng.permutation(len(batches)):
                n += 1
                if loop and n <= skip:
                    continue
                batch = collate([as_masked_item(dataset[j]) for j in batches[i]], max_seq_length)
                yield (*batch, target_index(batch[1])) if gather else batch
            if not loop:
                return

    return iterate
