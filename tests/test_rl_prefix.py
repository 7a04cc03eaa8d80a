"""Shared prompt prefixes in the trainer's forwards (mlx_ssp.rl.prefix): same log-probs, same
gradients, same update as running every row's prompt."""

from __future__ import annotations

import mlx_ssp  # noqa: F401
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from mlx_ssp.models import load_model
from mlx_ssp.rl.config import RLConfig
from mlx_ssp.rl.lm_heads import head_of, head_vocab
from mlx_ssp.rl.batch import build_batch, trim_padding
from mlx_ssp.rl.pieces import make_loss, sequence_logprobs
from mlx_ssp.rl.policy import setup_model
from mlx_ssp.rl.trainer import Trainer
from mlx_ssp.rl.prefix import MIN_PREFIX, blocks, shareable, shared_prefix_len
from mlx_ssp.tasks import Task


def test_shared_prefix_len():
    a = np.array([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]] * 3)
    a[1, 10] = 0  # rows first differ at position 10
    m = np.zeros(a.shape, np.float32)
    assert shared_prefix_len(a, m) == 10
    m[2, 9] = 1  # a loss token at 9 in one row: the prefix stops before it
    assert shared_prefix_len(a, m) == 9
    assert shared_prefix_len(a[:1], m[:1]) == 0  # one row: nothing to share
    m[0, MIN_PREFIX - 1] = 1
    assert shared_prefix_len(a, m) == 0  # too short to be worth a second forward
    same = np.ones((2, 12), np.int64)
    assert shared_prefix_len(same, np.zeros((2, 12))) == 11  # the suffix keeps a position


def _lora_model(path):
    model, tok, _ = load_model(str(path))
    setup_model(model, RLConfig(lora={"rank": 4}))
    # non-zero lora_b so the adapters change the prompt's keys and values (lora_b starts at 0)
    params = tree_map(lambda p: p + 0.05 * mx.random.normal(p.shape, key=mx.random.key(3)),
                      model.trainable_parameters())
    model.update(params)
    return model, tok


def _group_rows(vocab, P=20, C=9, B=4, seed=0):
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, vocab, P)
    rows = np.stack([np.concatenate([prompt, rng.integers(0, vocab, C)]) for _ in range(B)])
    mask = np.zeros((B, P + C - 1), np.float32)
    mask[:, P - 1:] = 1
    mask[2, -3:] = 0  # a shorter row
    return mx.array(rows[:, :-1]), mx.array(rows[:, 1:]), mask


@pytest.mark.parametrize("entropy", [False, True])
def test_shared_prefix_logprobs_and_gradients_equal_unshared(tiny_qwen3, entropy):
    model, _ = _lora_model(tiny_qwen3)
    assert shareable(model)
    inputs, targets, mask = _group_rows(head_vocab(head_of(model)))
    p = shared_prefix_len(np.asarray(inputs), mask)
    assert p == 19
    m, w = mx.array(mask), mx.random.normal(targets.shape, key=mx.random.key(4))

    def loss(mdl, prefix):
        out = sequence_logprobs(mdl, inputs, targets, 0.7, None, prefix=prefix, save_grad=True, entropy=entropy,
                                entropy_grad=entropy)
        lp = out[0] + 0.3 * out[1] if entropy else out
        return (lp * m * w).sum()

    l0, g0 = nn.value_and_grad(model, lambda mdl: loss(mdl, 0))(model)
    l1, g1 = nn.value_and_grad(model, lambda mdl: loss(mdl, p))(model)
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-5)
    for (k, a), (_, b) in zip(tree_flatten(g0), tree_flatten(g1)):
        scale = float(mx.abs(a).max()) + 1e-6
        assert float(mx.abs(a - b).max()) / scale < 1e-4, k
    lp0 = sequence_logprobs(model, inputs, targets, 0.7, None)
    lp1 = sequence_logprobs(model, inputs, targets, 0.7, None, prefix=p)
    np.testing.assert_allclose(np.asarray(lp1) * mask, np.asarray(lp0) * mask, atol=1e-5)
    assert not np.asarray(lp1)[:, :p].any()  # the prefix positions are 0 (masked by every use)


def _tasks():
    return [Task(id=f"t{i}", domain="toy", prompt="p", answer="-", verifier="exact") for i in range(4)]


def _group(rng, prompt: list[int], lengths) -> list[dict]:
    """Rollout records of one group: the same prompt, random completions of ``lengths`` tokens."""
    return [{"prompt_token_ids": prompt, "token_ids": rng.integers(0, 300, c).tolist(), "logprobs": [-1.0] * c}
            for c in lengths]


def _update(path, cfg: RLConfig, recs, adv):
    """(trainer, batch, how far one update moved each LoRA array) on a fresh policy."""
    model, tok = _lora_model(path)
    before = {k: np.array(v) for k, v in tree_flatten(model.trainable_parameters())}
    tr = Trainer(model, tok, _tasks(), cfg, "/tmp", seed=0)
    batch = build_batch(recs, adv)
    ok, _ = tr.updater.update(batch)
    assert ok
    return tr, batch, {k: np.array(v) - before[k] for k, v in tree_flatten(model.trainable_parameters())}


@pytest.mark.parametrize("options", [dict(beta=0.1), dict(beta=0.0, entropy_coef=0.01, top_entropy_quantile=0.5,
                                                           importance_sampling_level="sequence")])
def test_update_with_shared_prefix_equals_unshared(tiny_llama, options):
    """A whole update (KL to the adapters-off reference, entropy selection and bonus, GSPO) moves the
    LoRA weights the same with and without sharing, at any micro-batch size."""
    rng = np.random.default_rng(1)
    recs = [r for g in range(2) for r in _group(rng, rng.integers(0, 300, 18 + 3 * g).tolist(),
                                                 rng.integers(2, 7, 4).tolist())]
    adv = rng.normal(size=8).astype(np.float32)
    moved = {}
    for share in (False, True):
        for mbs in (8, 4, 3):
            cfg = RLConfig(batch_size=2, group_size=4, micro_batch_size=mbs, optimizer="sgd", learning_rate=1.0,
                           max_grad_norm=None, share_prefix=share, progress=False, lora={"rank": 4}, **options)
            moved[share, mbs] = _update(tiny_llama, cfg, recs, adv)[2]
    ref = moved[False, 8]
    assert max(np.abs(v).max() for v in ref.values()) > 1e-3  # the step did something
    # and the layout machinery against the plain definition: one nn.value_and_grad of the whole
    # batch's loss (SGD at learning rate 1 moves the weights by minus the gradient)
    cfg = RLConfig(batch_size=2, group_size=4, micro_batch_size=8, progress=False, lora={"rank": 4}, **options)
    model, tok = _lora_model(tiny_llama)
    tr = Trainer(model, tok, _tasks(), cfg, "/tmp", seed=0)
    batch, _, units, _ = tr.updater.plan(build_batch(recs, adv))
    batch.pop("entropy_kept_frac", None)
    (_, _), grads = nn.value_and_grad(model, make_loss(cfg, units))(model, {**batch, "old": None})
    for k, g in tree_flatten(grads):
        np.testing.assert_allclose(-np.array(g), ref[k], rtol=1e-3, atol=1e-5, err_msg=f"definition {k}")
    for key, got in moved.items():
        for k in ref:
            np.testing.assert_allclose(got[k], ref[k], rtol=1e-3, atol=1e-5, err_msg=f"{key} {k}")


def test_blocks_follow_the_groups():
    g1, g2 = [5] * 12, [5] * 8 + [6] * 4  # the two prompts share an 8-token system prompt
    rows = np.array([g1 + [1, 2], g1 + [3, 4], g1 + [5, 6], g2 + [1, 2], g2 + [7, 8], [9] * 14])
    mask = np.zeros(rows.shape, np.float32)
    mask[:, 11:] = 1
    assert blocks(rows, mask) == [(0, 3, 11), (3, 5, 11), (5, 6, 0)]
    # a shard that starts with a group's last row: that row alone, not a block over the system prompt
    assert blocks(rows[2:], mask[2:]) == [(0, 1, 0), (1, 3, 11), (3, 4, 0)]
    # rows that share nothing stay one unshared run (micro-batched together)
    lone = np.stack([np.full(14, v) for v in (1, 2, 3)])
    assert blocks(lone, mask[:3]) == [(0, 3, 0)]
    assert blocks(rows[:0], mask[:0]) == []


def test_layout_and_the_two_phase_gradient(tiny_llama, monkeypatch):
    """Pieces fit one chunk of the op where a row does; a row longer than a chunk gets its
    gradient in two phases (the body's output evaluated outside the trace). The prefix's backward
    runs once per block. Same update in every layout."""
    import mlx_ssp.rl.step as step  # where the update looks the piece's gradient up

    calls = []
    real = step.piece_value_and_grad
    monkeypatch.setattr(step, "piece_value_and_grad",
                        lambda *a: calls.append((a[2]["inputs"].shape[0], a[-1])) or real(*a))
    rng = np.random.default_rng(2)
    recs = _group(rng, rng.integers(0, 300, 16).tolist(), (3, 6, 9, 4))
    adv = rng.normal(size=4).astype(np.float32)
    moved = {}
    for share, chunk in ((False, None), (True, None), (True, 5), (False, 5), (True, 24)):
        cfg = RLConfig(batch_size=1, group_size=4, micro_batch_size=4, optimizer="sgd", learning_rate=1.0,
                       max_grad_norm=None, chunk_size=chunk, beta=0.1, progress=False, lora={"rank": 4},
                       share_prefix=share, auto_micro_batch=False,  # pieces by micro_batch_size and chunk alone
                       trim_padding=False)  # every piece as long as the longest row
        del calls[:]
        tr, batch, moved[share, chunk] = _update(tiny_llama, cfg, recs, adv)
        layout = tr.updater.layout(batch)
        if share:
            assert [p for p, _ in layout] == [15]  # the prompt minus its last token
        if chunk == 5:  # suffix 9 (24 unshared) > 5 tokens: one row per piece, each in two phases
            assert calls == [(1, True)] * 4
        elif chunk == 24:  # 2 rows x 9 suffix tokens fit one chunk of 24
            assert layout == [(15, [(0, 2), (2, 4)])] and calls == [(2, False)] * 2
        else:
            assert calls == [(4, False)]
    ref = moved[False, None]
    for key, got in moved.items():
        for k in ref:
            np.testing.assert_allclose(got[k], ref[k], rtol=1e-3, atol=1e-5, err_msg=f"{key} {k}")


def test_two_inner_updates_and_a_rank_without_rows(tiny_llama):
    """mu = 2 (the second update's old log-probs are the first's, per piece) gives the same weights
    shared or not; a rank with no rows lays out nothing."""
    rng = np.random.default_rng(3)
    recs = _group(rng, rng.integers(0, 300, 20).tolist(), (3, 6, 5, 4))
    adv = rng.normal(size=4).astype(np.float32)
    moved = {}
    for share in (False, True):
        cfg = RLConfig(batch_size=1, group_size=4, micro_batch_size=2, mu=2, optimizer="sgd", learning_rate=0.05,
                       max_grad_norm=None, share_prefix=share, progress=False, lora={"rank": 4})
        tr, batch, moved[share] = _update(tiny_llama, cfg, recs, adv)
        empty = {k: (v[:0] if isinstance(v, mx.array) else v) for k, v in batch.items()}
        assert tr.updater.layout(empty) == []
    for k in moved[False]:
        np.testing.assert_allclose(moved[True][k], moved[False][k], rtol=1e-3, atol=1e-5, err_msg=k)


def test_a_run_saved_before_share_prefix_existed_resumes(tiny_llama, tmp_path):
    """A setting added later (share_prefix) is absent from older runs' rl_config.json, and left out
    of dumps at its default (RLConfig.OMIT_AT_DEFAULT): the run resumes; set otherwise it is a
    different run."""
    import json

    from mlx_ssp.errors import UserError
    from mlx_ssp.rl.trainer import train
    from mlx_ssp.verify import VerifyResult, register

    register("rl_prefix_test_any")(lambda completion, task: VerifyResult(float(len(completion) % 2), "correct"))
    tasks = [Task(id=f"t{i}", domain="toy", prompt=f"prompt number {i}", answer="-", verifier="rl_prefix_test_any")
             for i in range(4)]
    kw = dict(batch_size=1, group_size=2, sampling={"temperature": 1.0, "max_tokens": 3}, progress=False,
              checkpoint_every=1, lora={"rank": 4})
    model, tok = _lora_model(tiny_llama)
    train(model, tok, tasks, RLConfig(steps=1, **kw), tmp_path)
    saved = tmp_path / "rl_config.json"
    rec = json.loads(saved.read_text())
    assert "share_prefix" not in rec["rl"]  # as a run saved before the setting existed
    saved.write_text(json.dumps(rec))
    model, tok = _lora_model(tiny_llama)
    assert train(model, tok, tasks, RLConfig(steps=2, **kw), tmp_path)["steps"] == 2
    saved.write_text(json.dumps(rec))
    model, tok = _lora_model(tiny_llama)
    with pytest.raises(UserError, match="share_prefix"):
        train(model, tok, tasks, RLConfig(steps=3, share_prefix=False, **kw), tmp_path)


def test_trim_padding_cuts_after_the_last_loss_token():
    mask = np.zeros((2, 10), np.float32)
    mask[0, 3:5] = 1
    mask[1, 4:7] = 1
    piece = {"inputs": mx.arange(20).reshape(2, 10), "mask": mx.array(mask), "adv": mx.array([1.0, -1.0]),
             "tokens": 20}
    cut = trim_padding(piece)
    assert cut["inputs"].shape == (2, 7) and cut["mask"].shape == (2, 7)
    assert cut["inputs"].tolist() == [list(range(7)), list(range(10, 17))]
    assert cut["adv"].shape == (2,) and cut["tokens"] == 20  # per-row and scalar entries as they are
    assert trim_padding(piece, keep=9)["inputs"].shape == (2, 9)  # never shorter than the shared prefix + 1
    full = {**piece, "mask": mx.ones((2, 10))}
    assert trim_padding(full) is full


@pytest.mark.parametrize("options", [dict(share_prefix=True, mu=2), dict(share_prefix=False, beta=0.1),
                                     dict(share_prefix=True, importance_sampling_level="sequence", entropy_coef=0.01,
                                          top_entropy_quantile=0.5, beta=0.1)])
def test_trimmed_pieces_give_the_same_update(tiny_llama, monkeypatch, options):
    """Pieces cut after their last loss token move the LoRA weights as full-width pieces do (float32
    rounding apart), and run only that far; the base weights stay as they were."""
    import mlx_ssp.rl.step as step

    widths = []
    real = step.piece_value_and_grad
    monkeypatch.setattr(step, "piece_value_and_grad", lambda *a: widths.append(a[2]["inputs"].shape[1]) or real(*a))
    rng = np.random.default_rng(4)
    lengths = (2, 11, 5, 3)
    recs = _group(rng, rng.integers(0, 300, 16).tolist(), lengths)
    adv = rng.normal(size=4).astype(np.float32)
    moved, seen = {}, {}
    for trim in (False, True):
        cfg = RLConfig(batch_size=1, group_size=4, micro_batch_size=1, optimizer="sgd", learning_rate=1.0,
                       max_grad_norm=None, progress=False, lora={"rank": 4}, trim_padding=trim, **options)
        del widths[:]
        tr, _, moved[trim] = _update(tiny_llama, cfg, recs, adv)
        seen[trim] = list(widths)
        base = {k: v for k, v in tree_flatten(tr.model.parameters()) if "lora" not in k}
        fresh = dict(tree_flatten(_lora_model(tiny_llama)[0].parameters()))
        assert all(mx.array_equal(v, fresh[k]).item() for k, v in base.items())  # only the adapters moved
    mu = options.get("mu", 1)
    full = 16 - 1 + max(lengths)  # every row padded to the longest: prompt + completion - 1 inputs
    assert seen[False] == [full] * 4 * mu
    own = [16 - 1 + n for n in lengths] * mu  # each row to its own last token
    if "top_entropy_quantile" in options:  # the selection masks tokens: a row's last loss token may come earlier
        assert all(w <= o for w, o in zip(seen[True], own)) and seen[True] != seen[False]
    else:
        assert seen[True] == own
    assert max(np.abs(v).max() for v in moved[False].values()) > 1e-3  # the step did something
    for k in moved[False]:
        np.testing.assert_allclose(moved[True][k], moved[False][k], rtol=1e-3, atol=1e-5, err_msg=k)


def test_trim_padding_keeps_fingerprints():
    """A layout setting: left out of dumps at its default (runs saved before it existed resume) and
    out of the resume fingerprint (a run may change it when it resumes), as auto_micro_batch."""
    from mlx_ssp.rl.trainer import config_record, fingerprint

    assert "trim_padding" not in config_record(RLConfig(), 0, "m")["rl"]
    assert config_record(RLConfig(trim_padding=False), 0, "m")["rl"]["trim_padding"] is False
    on, off = (fingerprint(config_record(RLConfig(trim_padding=t), 0, "m")) for t in (True, False))
    assert on == off


def test_trimmed_reference_forward_matches_on_the_loss_tokens(tiny_llama):
    """The no-gradient forward (KL reference, entropy selection) with trimmed pieces: the same
    values on every loss token, 0 after a piece's last one; the batch's width is kept."""
    rng = np.random.default_rng(5)
    recs = _group(rng, rng.integers(0, 300, 12).tolist(), (7, 2, 4))
    batch = build_batch(recs, np.zeros(3, np.float32))
    out = {}
    for trim in (False, True):
        cfg = RLConfig(batch_size=1, group_size=3, micro_batch_size=1, beta=0.1, progress=False, lora={"rank": 4},
                       trim_padding=trim)
        model, tok = _lora_model(tiny_llama)
        up = Trainer(model, tok, _tasks(), cfg, "/tmp", seed=0).updater
        out[trim] = np.array(up._ref_logprobs(batch, up.layout(batch)))
    mask = np.array(batch["mask"]) > 0
    assert out[True].shape == out[False].shape == mask.shape
    np.testing.assert_allclose(out[True][mask], out[False][mask], rtol=1e-5, atol=1e-6)
    for r, n in enumerate((7, 2, 4)):  # row r's last loss token is target 12 - 1 + n - 1
        assert np.all(out[True][r, 11 + n:] == 0) and np.any(out[False][r, 11 + n:] != 0) == (n < 7)
