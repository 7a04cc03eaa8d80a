"""The SFT loss at the weighted targets only (``sft.gather_targets``): the batch iterators' target
index, and the gathered chunked loss against the full-width one (value, token count, LoRA gradients,
per-token log-probs) on padded, packed and mlx-lm batches, through mlx-lm's compiled train step."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from sft_helpers import tiny_lora_model, train_losses, write_stage_data

from mlx_ssp.config import plain
from mlx_ssp.finetune.lora import attach_lora
from mlx_ssp.models import load_model
from mlx_ssp.rl.lm_heads import head_of
from mlx_ssp.rl.logprobs import token_logprobs
from mlx_ssp.sft import SFTConfig
from mlx_ssp.sft.batches import (
    INDEX_MULTIPLE,
    default_loss_mask,
    make_iterate_batches,
    make_masked_iterate_batches,
    masked_batch,
    target_index,
)
from mlx_ssp.sft.loss import default_loss, masked_loss
from mlx_ssp.sft.packing import packed_batch


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def lora_model(request, tiny_qwen3, tiny_llama):
    """A tiny float32 model with LoRA on every layer (qwen3: tied head; llama: its own lm_head)."""
    return tiny_lora_model(tiny_qwen3 if request.param == "qwen3" else tiny_llama)


def _items(vocab: int, lengths, seed: int = 0):
    """Token records with a prompt (weight 0) and a completion (weight 1); a record of length <= 8 has no
    weight at all."""
    rng = np.random.RandomState(seed)
    out = []
    for L in lengths:
        ids = rng.randint(1, vocab, size=L).tolist()
        out.append((ids, [int(L > 8 and j >= (2 * L) // 3) for j in range(L)]))
    return out


def _loss_and_grads(model, fn, *batch):
    loss, grads = nn.value_and_grad(model, lambda m, *b: fn(m, *b)[0])(model, *batch)
    ntoks = fn(model, *batch)[1]
    mx.eval(loss, grads, ntoks)
    return float(loss), int(ntoks), dict(tree_flatten(grads))


def _rel(a: dict, b: dict) -> tuple[float, float]:
    """Over the gradient matrices: the largest ``|a - b|_F / |b|_F``, and the largest entry of
    ``|a - b|`` relative to the largest of ``|b|`` in the same matrix."""
    assert a.keys() == b.keys() and a
    fro = elem = 0.0
    for k in a:
        scale = float(mx.abs(b[k]).max())
        assert scale > 0, k  # every LoRA matrix gets a gradient, or the comparison proves nothing
        d = a[k] - b[k]
        fro = max(fro, float(mx.sqrt((d * d).sum() / (b[k] * b[k]).sum())))
        elem = max(elem, float(mx.abs(d).max()) / scale)
    return fro, elem


#: gathered vs full width, each with its automatic chunking: the chunks hold fewer rows, and OpenBLAS
#: rounds the backward's d h = d logits . W of a 16-row chunk otherwise than of a 48-row one at this
#: tiny size (not at the demo model's 49,152 x 576 head; the forward's rows are bit-identical at both):
#: measured at most 1.0e-6 in norm, 1.3e-6 at the largest entry, 0 on most batches
GRAD_RTOL, ENTRY_RTOL = 2e-6, 3e-6


def test_target_index_pads_with_minus_one_to_a_multiple():
    w = np.zeros((3, 10), bool)
    w[0, 4:9] = True
    w[2, 1] = True
    idx = np.array(target_index(mx.array(w)))
    assert idx.dtype == np.int32 and idx.size == INDEX_MULTIPLE
    assert idx[:6].tolist() == [4, 5, 6, 7, 8, 21] and (idx[6:] == -1).all()
    full = np.ones((2, 17), bool)
    idx = np.array(target_index(full))
    assert idx.size == 48 and idx[:34].tolist() == list(range(34)) and (idx[34:] == -1).all()
    assert np.array(target_index(np.zeros((2, 5), bool))).tolist() == [-1] * INDEX_MULTIPLE


def test_default_loss_mask_is_the_loss_mask():
    lengths = np.array([[3, 9], [0, 12], [5, 5]])
    m = default_loss_mask(lengths, 13)
    steps = np.arange(1, 13)
    assert m.shape == (3, 12)
    for b, (off, n) in enumerate(lengths):
        assert m[b].tolist() == [bool(off <= s <= n) for s in steps]


def _batches(model, tok):
    """(name, full-width loss fn, batch without index, index) for a padded, a packed and an mlx-lm batch,
    each with a record of no weight."""
    from mlx_lm.tuner.datasets import CacheDataset, create_dataset
    from mlx_lm.tuner.trainer import iterate_batches

    items = _items(model.args.vocab_size, [40, 7, 23, 61], seed=3)
    padded = masked_batch(items, 2048)
    packed = packed_batch(items, 2048)
    data = [{"messages": [{"role": "user", "content": f"What is {i} + {2 * i}? Think."},
                          {"role": "assistant", "content": f"{i} + {2 * i} = {3 * i}. " * (1 + i % 3)}]}
            for i in range(4)]
    ds = CacheDataset(create_dataset(data, tok, SimpleNamespace(mask_prompt=True)))
    chat = next(iterate_batches(ds, 4, 2048))
    chat_mask = default_loss_mask(chat[1], chat[0].shape[1])
    return [("padded", masked_loss, padded, target_index(padded[1])),
            ("packed", masked_loss, packed, target_index(packed[1])),
            ("mlx-lm", default_loss, chat, target_index(chat_mask))]


def test_gathered_loss_and_lora_gradients_equal_the_full_width(lora_model):
    """Token count equal; loss and every LoRA gradient at the gathered targets equal the full-width
    chunked loss's (each with its automatic chunking): the loss within 1e-6 relative (measured: equal),
    the gradients within :data:`GRAD_RTOL`, on padded, packed and mlx-lm batches, each with a record of
    no weight."""
    model, tok = lora_model
    for name, fn, batch, index in _batches(model, tok):
        assert int((np.array(index) >= 0).sum()) < batch[0].shape[0] * (batch[0].shape[1] - 1)  # some are left out
        full = _loss_and_grads(model, fn, *batch)
        got = _loss_and_grads(model, lambda m, *b, fn=fn: fn(m, *b[:-1], index=b[-1]), *batch, index)
        assert got[1] == full[1], name
        assert abs(got[0] - full[0]) <= 1e-6 * abs(full[0]), (name, got[0], full[0])
        fro, elem = _rel(got[2], full[2])
        print(f"{name}: loss rel {abs(got[0] - full[0]) / abs(full[0]):.2e}, grad norm rel {fro:.2e}, entry rel {elem:.2e}")
        assert fro <= GRAD_RTOL and elem <= ENTRY_RTOL, (name, fro, elem)


def test_gathered_logprobs_bit_identical_at_equal_chunking(lora_model):
    """Per-token log-probs of the gathered rows are the full-width op's at those positions, bit for
    bit: with one chunk each, and with the gathered rows in 16-row chunks (OpenBLAS gives a row of the
    head's matmul the same result whatever the row count here, from 16 rows up)."""
    model, _ = lora_model
    head = head_of(model)
    tokens, weights = masked_batch(_items(model.args.vocab_size, [40, 7, 23, 61], seed=3), 2048)
    h = model.model(tokens[:, :-1])
    flat_h, flat_t = h.reshape(-1, h.shape[-1]), tokens[:, 1:].reshape(-1)
    idx = mx.array(np.flatnonzero(np.array(weights).reshape(-1)).astype(np.int32))
    full = token_logprobs(flat_h, head, flat_t, chunk_size=flat_t.size)
    got = token_logprobs(flat_h[idx], head, flat_t[idx], chunk_size=flat_t.size)
    assert np.array_equal(np.array(full[idx]), np.array(got))
    small = token_logprobs(flat_h[idx], head, flat_t[idx], chunk_size=16)
    assert np.array_equal(np.array(full[idx]), np.array(small))


def test_gathered_loss_under_mx_compile_with_changing_index_lengths(lora_model):
    """mlx-lm's step compiles value and gradient; compiled, on batches whose index lengths differ,
    the gathered loss and gradients equal the compiled full-width ones (:data:`GRAD_RTOL`)."""
    model, _ = lora_model
    compiled = partial(mx.compile, inputs=[model.state], outputs=[model.state])
    vg_full = nn.value_and_grad(model, lambda m, *b: masked_loss(m, *b)[0])
    vg_gather = nn.value_and_grad(model, lambda m, *b: masked_loss(m, *b[:-1], index=b[-1])[0])
    full_step = compiled(lambda *b: vg_full(model, *b))
    gather_step = compiled(lambda *b: vg_gather(model, *b))
    for lengths in ([40, 7, 23, 61], [12, 90, 33, 45]):
        batch = masked_batch(_items(model.args.vocab_size, lengths, seed=4), 2048)
        ref, ref_grads = full_step(*batch)
        loss, grads = gather_step(*batch, target_index(batch[1]))
        mx.eval(ref, ref_grads, loss, grads)
        assert abs(float(loss) - float(ref)) <= 1e-6 * abs(float(ref))
        fro, elem = _rel(dict(tree_flatten(grads)), dict(tree_flatten(ref_grads)))
        print(f"compiled {lengths}: loss rel {abs(float(loss) - float(ref)) / abs(float(ref)):.2e}, "
              f"grad norm rel {fro:.2e}, entry rel {elem:.2e}")
        assert fro <= GRAD_RTOL and elem <= ENTRY_RTOL, (lengths, fro, elem)


@pytest.mark.parametrize("pack", [False, True])
def test_iterators_append_the_index_of_the_batch_weights(pack):
    class DS(list):
        def itemlen(self, i):
            return len(self[i][0])

    ds = DS(_items(50, [12, 30, 9, 25, 17, 40, 22, 8], seed=1))
    plain_it = make_masked_iterate_batches(7, pack=pack)(ds, 4, 2048, loop=False)
    gather_it = make_masked_iterate_batches(7, pack=pack, gather=True)(ds, 4, 2048, loop=False)
    n = 0
    for a, b in zip(plain_it, gather_it):
        assert len(b) == len(a) + 1
        for x, y in zip(a, b):
            assert np.array_equal(np.array(x), np.array(y))
        assert np.array_equal(np.array(b[-1]), np.array(target_index(a[1])))
        n += 1
    assert n == 2


def test_mlx_lm_iterator_appends_the_index_of_the_default_loss_mask(tiny_qwen3):
    from mlx_lm.tuner.datasets import CacheDataset, create_dataset

    _, tok, _ = load_model(str(tiny_qwen3))
    data = [{"messages": [{"role": "user", "content": f"Add {i} and {i}."},
                          {"role": "assistant", "content": f"{2 * i}. " * (1 + i % 4)}]} for i in range(8)]
    ds = CacheDataset(create_dataset(data, tok, SimpleNamespace(mask_prompt=True)))
    a = list(make_iterate_batches(3)(ds, 4, 2048))
    b = list(make_iterate_batches(3, gather=True)(ds, 4, 2048))
    assert len(a) == len(b) == 2
    for (x, lx), (y, ly, idx) in zip(a, b):
        assert np.array_equal(np.array(x), np.array(y)) and np.array_equal(np.array(lx), np.array(ly))
        steps = mx.arange(1, x.shape[1])
        mask = mx.logical_and(steps >= lx[:, 0:1], steps <= lx[:, 1:])  # default_loss's own mask
        assert np.array_equal(np.array(idx), np.array(target_index(mask)))


def test_compiled_training_steps_change_only_lora_weights(tmp_path, tiny_qwen3):
    """Two steps of mlx-lm's compiled ``train`` with the stage's gathered batching (two: LoRA's A has
    no gradient while B is still 0): every LoRA matrix changes, no base weight does (bit for bit);
    the loss reports equal the full-width run's."""
    from mlx_ssp.finetune.fuse import restore_base
    from mlx_ssp.sft.data import plan_domains

    model, tok, _ = load_model(str(tiny_qwen3))
    recs = [{"token_ids": ids, "mask": m} for ids, m in _items(model.args.vocab_size, [40, 17, 23, 61], seed=2)]
    data, probe = write_stage_data(tmp_path, recs)
    losses = {}
    for gather in (False, True):
        cfg = SFTConfig(domains={"d": {"data": str(data), "probe_tasks": str(probe)}}, gather_targets=gather,
                        lora={"rank": 4, "num_layers": -1}, learning_rate=1e-2, batch_size=4, max_seq_length=2048,
                        seed=0)
        (plan,) = plan_domains(cfg, model, tok, {}, tmp_path)
        attach_lora(model, cfg.lora, 0)
        try:
            before = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
            seen = train_losses(model, cfg, plan, 2, tmp_path / "a.safetensors")
            after = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
            assert before.keys() == after.keys()
            lora = [k for k in before if "lora_" in k]
            assert lora and all(not np.array_equal(before[k], after[k]) for k in lora)
            assert all(np.array_equal(before[k], after[k]) for k in before if "lora_" not in k)
            losses[gather] = seen
        finally:
            restore_base(model)
    assert len(losses[True]) == 2 and np.allclose(losses[True], losses[False], rtol=1e-6, atol=0), losses


def test_gather_key_default_leaves_dumps_and_fingerprints_as_they_were():
    from mlx_ssp.sft.stage import fingerprint

    cfg = SFTConfig()
    assert cfg.gather_targets is True and "gather_targets" not in plain(cfg)
    assert plain(SFTConfig(gather_targets=False))["gather_targets"] is False
    # a run written before the key existed (no key in its resolved section) loads with the default
    assert SFTConfig(**plain(cfg)).gather_targets is True
    plan = SimpleNamespace(train_path=Path("t"), valid_path=None)
    assert fingerprint(SFTConfig(gather_targets=False), 0, Path("m"), plan) == fingerprint(cfg, 0, Path("m"), plan)
    with pytest.raises(ValueError, match="gather_targets"):
        SFTConfig(gather_targets="sometimes")
