"""SFT sequence packing and the chunked cross-entropy: packed batches give the unpacked loss and
gradients, the chunked loss gives mlx-lm's, through mlx-lm's compiled train step too, with less peak
memory at a large vocabulary; the config keys are validated and leave old fingerprints alone."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from sft_helpers import tiny_lora_model, train_losses, write_stage_data

from mlx_ssp.config import plain
from mlx_ssp.finetune.lora import LoRAConfig, attach_lora
from mlx_ssp.models import load_model
from mlx_ssp.sft import SFTConfig
from mlx_ssp.sft.batches import masked_batch
from mlx_ssp.sft.loss import default_loss, masked_loss
from mlx_ssp.sft.packing import check_packable, pack_rows, packed_batch, packed_hidden


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def lora_model(request, tiny_qwen3, tiny_llama):
    """A tiny model with LoRA on every layer (qwen3: tied head; llama: its own lm_head)."""
    return tiny_lora_model(tiny_qwen3 if request.param == "qwen3" else tiny_llama)


def _records(vocab: int, lengths, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """Multi-turn-like token records: two target spans each (an answer in the middle and the end)."""
    rng = np.random.RandomState(seed)
    out = []
    for L in lengths:
        ids = rng.randint(1, vocab, size=L).tolist()
        a = L // 3
        out.append((ids, [int(a <= j < a + 4 or j >= L - L // 3) for j in range(L)]))
    return out


def _loss_and_grads(model, fn, *batch):
    loss, grads = nn.value_and_grad(model, lambda m, *b: fn(m, *b)[0])(model, *batch)
    mx.eval(loss, grads)
    return float(loss), dict(tree_flatten(grads))


def _close_grads(a: dict, b: dict, rtol: float) -> None:
    assert a.keys() == b.keys() and a
    for k in a:
        scale = float(mx.abs(a[k]).max())
        assert scale > 0, k  # a test that cannot fail: every LoRA matrix must get a gradient
        err = float(mx.abs(a[k] - b[k]).max())
        assert err <= rtol * scale, (k, err, scale)


def test_pack_rows_first_fit_decreasing_never_splits():
    lengths = [30, 5, 64, 17, 40, 9, 64, 2]
    rows = pack_rows(lengths, 64)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))  # every item once, whole
    assert all(sum(lengths[i] for i in r) <= 64 for r in rows)
    assert len(rows) == 4  # 64 | 64 | 40+17+5+2 | 30+9 (sum 231: 4 rows is the least)
    assert pack_rows([100, 10], 64) == [[0], [1]]  # too long: a row of its own (callers cut it first)


def test_packed_batch_layout_matches_the_unpacked_targets():
    items = _records(200, [12, 40, 7, 25, 33])
    tokens, weights, seg = (np.array(x) for x in packed_batch(items, 2048))
    t0, w0 = masked_batch(items, 2048)
    assert tokens.shape[1] == t0.shape[1] == 65 and tokens.shape[0] == 2 < t0.shape[0]  # same width, fewer rows
    assert int(weights.sum()) == int(w0.sum())  # the same number of targets
    seen = []
    for r in range(tokens.shape[0]):  # each segment is one whole record, followed by its own targets
        for k in range(1, seg[r].max() + 1):
            pos = np.flatnonzero(seg[r] == k)
            assert (np.diff(pos) == 1).all()
            (i,) = [i for i, (ids, _) in enumerate(items) if ids == tokens[r, pos[0]:pos[0] + len(ids)].tolist()]
            ids, m = items[i]
            # inputs are tokens[:, :-1]: a record ending in the last column has one input fewer
            assert len(pos) == min(len(ids), tokens.shape[1] - 1 - pos[0])
            # each input's target weight is the record's next-token mask; never the next record's token
            assert weights[r, pos].tolist() == [bool(m[j + 1]) if j + 1 < len(ids) else False for j in range(len(pos))]
            seen.append(i)
        assert (tokens[r][seg[r].tolist().index(0):] == 0).all() if 0 in seg[r] else True  # padding at the end
    assert sorted(seen) == list(range(len(items)))


@pytest.mark.parametrize("kind", ["logits", "chunked"])
def test_packed_equals_unpacked_loss_and_gradients(lora_model, kind):
    """Mixed lengths, two of them longer than max_seq_length (cut, as unpacked): the packed batch's
    loss and LoRA gradients are the unpacked batch's to float32 rounding (RoPE's relative positions
    make a record's attention logits the same wherever it sits in a row)."""
    model, _ = lora_model
    items = _records(model.args.vocab_size, [9, 70, 23, 41, 5, 100, 17, 30], seed=2)
    max_len = 64
    chunk = 24  # several chunks of the log-prob op
    ref = _loss_and_grads(model, lambda m, *b: masked_loss(m, *b, kind="logits"), *masked_batch(items, max_len))
    pb = packed_batch(items, max_len)
    assert pb[0].shape[0] < len(items)
    got = _loss_and_grads(model, lambda m, *b: masked_loss(m, *b, kind=kind, chunk_size=chunk), *pb)
    assert abs(got[0] - ref[0]) <= 2e-6 * abs(ref[0]), (got[0], ref[0])
    _close_grads(got[1], ref[1], rtol=2e-5)


def test_packing_keeps_records_apart(lora_model):
    """A record's hidden states do not depend on what it is packed after (the block mask, not only
    the causal one): changing the first record's tokens changes nothing of the second's."""
    model, _ = lora_model
    V = model.args.vocab_size
    a1, a2, b = _records(V, [20, 20, 10], seed=3)
    hs = []
    for a in (a1, a2):
        t, w, s = packed_batch([a, b], 2048)
        assert t.shape[0] == 1 and t[0, 20:30].tolist() == b[0]  # one row: a, then b
        hs.append(np.array(packed_hidden(model, t[:, :-1], s)[0, 20:30]))
    assert np.abs(hs[0] - hs[1]).max() < 1e-5
    causal_only = [np.array(model.model(mx.array([a + b[0]]))[0, 20:30]) for a, _ in (a1, a2)]
    assert np.abs(causal_only[0] - causal_only[1]).max() > 1e-3  # without the block mask it would see a


def test_chunked_default_loss_equals_mlx_lm_default_loss(lora_model):
    """Chat records through mlx-lm's own dataset, batches and default_loss: the chunked loss (several
    chunks) has its value, token count and gradients."""
    from mlx_lm.tuner.datasets import CacheDataset, create_dataset
    from mlx_lm.tuner.trainer import default_loss as mlx_default_loss
    from mlx_lm.tuner.trainer import iterate_batches

    model, tok = lora_model
    data = [{"messages": [{"role": "user", "content": f"What is {i} + {2 * i}? Think."},
                          {"role": "assistant", "content": f"{i} + {2 * i} = {3 * i}. " * (1 + i % 3)}]}
            for i in range(4)]
    ds = CacheDataset(create_dataset(data, tok, SimpleNamespace(mask_prompt=True)))
    batch = next(iterate_batches(ds, 4, 2048))
    want = _loss_and_grads(model, mlx_default_loss, *batch)
    got = _loss_and_grads(model, lambda m, *b: default_loss(m, *b, kind="chunked", chunk_size=16), *batch)
    assert int(default_loss(model, *batch)[1]) == int(mlx_default_loss(model, *batch)[1])
    assert abs(got[0] - want[0]) <= 2e-6 * abs(want[0])
    _close_grads(got[1], want[1], rtol=2e-5)


def test_chunked_packed_loss_under_mx_compile(lora_model):
    """mlx-lm's train step is an ``mx.compile`` of ``value_and_grad(loss)``: there the chunked op
    cannot evaluate chunk by chunk, and must still give the eager logits loss and gradients with
    several chunks, packed."""
    from functools import partial

    model, _ = lora_model
    items = _records(model.args.vocab_size, [9, 50, 23, 41], seed=5)
    pb = packed_batch(items, 2048)
    ref = _loss_and_grads(model, lambda m, *b: masked_loss(m, *b, kind="logits"), *masked_batch(items, 2048))
    vg = nn.value_and_grad(model, lambda m, *b: masked_loss(m, *b, kind="chunked", chunk_size=16)[0])
    step = partial(mx.compile, inputs=[model.state], outputs=[model.state])(lambda *b: vg(model, *b))
    loss, grads = step(*pb)
    mx.eval(loss, grads)
    assert abs(float(loss) - ref[0]) <= 2e-6 * abs(ref[0])
    _close_grads(dict(tree_flatten(grads)), ref[1], rtol=2e-5)


@pytest.mark.slow
def test_packed_chunked_training_equals_unpacked_logits_through_the_compiled_step(tmp_path, tiny_qwen3):
    """Token records of mixed length through the stage's batching and mlx-lm's compiled ``train``
    (4 steps of Adam): with ``pack`` and the chunked loss the loss reports and the trained adapter are
    those of unpacked batches with mlx-lm's cross-entropy, to float32 rounding."""
    from mlx_ssp.finetune.fuse import restore_base
    from mlx_ssp.sft.data import plan_domains

    model, tok, _ = load_model(str(tiny_qwen3))
    items = _records(model.args.vocab_size, [9, 50, 23, 41, 5, 60, 17, 30], 4)
    recs = [{"token_ids": ids, "mask": m} for ids, m in items]
    data, probe = write_stage_data(tmp_path, recs)
    runs = {}
    for kw in ({"loss": "logits", "pack": False}, {"loss": "chunked", "pack": True}):
        cfg = SFTConfig(domains={"d": {"data": str(data), "probe_tasks": str(probe)}},
                        lora={"rank": 4, "num_layers": -1}, learning_rate=1e-3, batch_size=4, max_seq_length=2048,
                        seed=0, **kw)
        (plan,) = plan_domains(cfg, model, tok, {}, tmp_path)
        attach_lora(model, cfg.lora, 0)
        try:
            losses = train_losses(model, cfg, plan, 4, tmp_path / "a.safetensors")
            runs[kw["pack"]] = (losses, {k: np.array(v) for k, v in tree_flatten(model.trainable_parameters())})
        finally:
            restore_base(model)
    (l0, w0), (l1, w1) = runs[False], runs[True]
    assert len(l0) == 4 and np.allclose(l0, l1, rtol=1e-5, atol=0), (l0, l1)
    assert l0[-1] < l0[0]  # it trains
    for k in w0:
        assert np.abs(w0[k] - w1[k]).max() <= 1e-4 * max(np.abs(w0[k]).max(), 1e-3), k


@pytest.mark.slow
def test_chunked_loss_lowers_peak_memory_at_a_large_vocabulary():
    """A tiny-width model with a 32k vocabulary, 1k tokens, the value and gradient compiled as
    mlx-lm's train step does, each loss with its default chunking: the chunked loss peaks well under
    the logits loss (which holds the (T, V) logits and their gradient). scripts/bench_sft_peers.py
    measures it at Qwen3's vocabulary and 2k tokens."""
    from functools import partial

    from mlx_lm.models.qwen3 import Model, ModelArgs

    V, T = 32768, 1024
    args = ModelArgs(model_type="qwen3", hidden_size=64, num_hidden_layers=1, intermediate_size=128,
                     num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=V,
                     max_position_embeddings=4096, rope_theta=10000.0, head_dim=16, tie_word_embeddings=True)
    model = Model(args)
    attach_lora(model, LoRAConfig(rank=4, num_layers=-1), seed=0)
    rng = np.random.RandomState(0)
    tokens = mx.array(rng.randint(1, V, size=(1, T + 1)).astype(np.int32))
    weights = mx.ones((1, T), mx.bool_)
    mx.eval(model.parameters())
    peaks, losses = {}, {}
    for kind in ("logits", "chunked"):
        vg = nn.value_and_grad(model, lambda m, t, w, kind=kind: masked_loss(m, t, w, kind=kind)[0])
        step = partial(mx.compile, inputs=[model.state], outputs=[model.state])(lambda t, w, vg=vg: vg(model, t, w))
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        loss, grads = step(tokens, weights)
        mx.eval(loss, grads)
        peaks[kind] = mx.get_peak_memory() - base
        losses[kind] = float(loss)
        del grads
    assert abs(losses["chunked"] - losses["logits"]) <= 2e-6 * losses["logits"]
    assert peaks["chunked"] < 0.5 * peaks["logits"], peaks


def test_config_keys_validated_and_old_fingerprints_kept():
    from mlx_ssp.sft.stage import fingerprint

    with pytest.raises(ValueError, match="'chunked' or 'logits'"):
        SFTConfig(loss="fused")
    cfg = SFTConfig()
    assert cfg.loss == "chunked" and cfg.pack is False
    # at their defaults the new keys leave the resolved section (hence the pipeline's fingerprint)
    # as it was before they existed; set, they are recorded
    assert "loss" not in plain(cfg) and "pack" not in plain(cfg)
    assert plain(SFTConfig(pack=True))["pack"] is True and plain(SFTConfig(loss="logits"))["loss"] == "logits"
    # the domain's resume fingerprint leaves them out: both are exact, a resume may switch them
    plan = SimpleNamespace(train_path=Path("t"), valid_path=None)
    assert fingerprint(SFTConfig(pack=True, loss="logits"), 0, Path("m"), plan) == fingerprint(cfg, 0, Path("m"), plan)


def test_packing_refuses_a_model_type_it_is_not_verified_on():
    model = SimpleNamespace(model_type="gpt2")
    with pytest.raises(ValueError, match="llama, qwen3.*'gpt2'"):
        check_packable(model)


def test_chunked_loss_is_used_only_where_the_logits_are_the_head_of_the_hidden_states(lora_model):
    """The stage checks that model(x) == head(backbone(x)) before using the chunked loss: true for
    mlx-lm's llama and qwen3; false for a model that scales its logits after the head (the stage then
    uses the logits loss)."""
    from mlx_ssp.sft.loss import chunked_is_exact

    model, _ = lora_model
    assert chunked_is_exact(model)

    class Scaled(type(model)):
        def __call__(self, inputs, *a, **k):
            return super().__call__(inputs, *a, **k) * 0.5

    scaled = Scaled(model.args)
    attach_lora(scaled, LoRAConfig(rank=4, num_layers=-1), seed=0)  # the same layout, then the same weights
    scaled.update(model.parameters())
    assert not chunked_is_exact(scaled)
