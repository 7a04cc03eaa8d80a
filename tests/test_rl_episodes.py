"""Multi-turn MGPO-GRPO on a tiny model: the trainer's rollouts are BFCL episodes, the
loss covers the model's tokens only (tool results and user turns are in the forward, never in the
loss), one step changes the LoRA weights only, and lambda = 0 is plain GRPO on episode records.

A scripted policy (samples 0-2 "call" each turn's ground truth, sample 3 calls nothing) makes the
tool path run on a random model, so tool-result tokens really are in the conversation, and gives
every group mixed rewards (scripted: 1, unscripted: 0; p = 0.75, so MGPO's weight is not 1), hence
non-zero advantages."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

import mlx_ssp  # noqa: F401
from mlx_ssp.agents.calls import parse_ground_truth
from mlx_ssp.agents.episode import Episode
from mlx_ssp.models import load_model
from mlx_ssp.rl.batch import advantage_batch, build_batch
from mlx_ssp.rl.config import RLConfig
from mlx_ssp.rl.loss import policy_loss
from mlx_ssp.rl.pieces import make_loss
from mlx_ssp.rl.policy import setup_model
from mlx_ssp.rl.trainer import Trainer, train
from mlx_ssp.tasks.build import export_source

IDS = ("multi_turn_base_0", "multi_turn_base_1")


@pytest.fixture(scope="module")
def tasks():
    """Two file-system entries; no tool schemas in the prompt (~10k tokens of BPE for a tiny model)."""
    ts = [t for t in export_source("bfcl_multi_turn:base") if t.metadata["bfcl_id"] in IDS]
    for t in ts:
        t.metadata["tools"] = []
    assert len(ts) == 2
    return ts


def _scripted_parse(self, text):
    """Samples 0-2: the first message of each turn "calls" the turn's ground truth, the next ends
    the turn (reward 1). Sample 3 never calls anything (reward 0)."""
    if self.sample == 3 or self.steps:
        return []
    return [parse_ground_truth(c) for c in self.task.metadata["episode"]["ground_truth"][self.turn]]


@pytest.fixture
def scripted(monkeypatch):
    monkeypatch.setattr(Episode, "parse_calls", _scripted_parse)


def _cfg(**kw):
    base = dict(steps=1, batch_size=2, group_size=4, sampling={"temperature": 1.0, "max_tokens": 6},
                learning_rate=2e-2, progress=False, checkpoint_every=100, micro_batch_size=8)
    base.update(kw)
    return RLConfig(**base)


def _trainer(path, tasks, cfg, tmp_path):
    model, tok, _ = load_model(str(path))
    setup_model(model, cfg)
    return Trainer(model, tok, tasks, cfg, tmp_path, seed=3)


@pytest.fixture(scope="module")
def rollouts(tiny_qwen3, tasks, tmp_path_factory):
    """(trainer, kept groups, generation info) of one collect() on the two episode tasks (shared by
    the tests that only read them: one collection instead of one per test)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Episode, "parse_calls", _scripted_parse)
        tr = _trainer(tiny_qwen3, tasks, _cfg(), tmp_path_factory.mktemp("rl_episodes"))
        groups, info, _ = tr.collect()
    return tr, groups, info


def _grads(model, loss_fn, mb):
    (loss, _), g = nn.value_and_grad(model, loss_fn)(model, mb)
    mx.eval(loss, g)
    return float(loss.item()), {k: np.array(v) for k, v in tree_flatten(g)}


def test_episode_batch_masks_tool_results_and_aligns_behaviour(rollouts):
    tr, groups, info = rollouts
    recs = [r for g in groups for r in g]
    assert len(groups) == 2 and all(len(g) == 4 and len({r["task_id"] for r in g}) == 1 for g in groups)
    assert all(r["kind"] == "episode" for r in recs)
    assert [[r["reward"] for r in g] for g in groups] == [[1.0, 1.0, 1.0, 0.0]] * 2, [r["detail"] for r in recs]
    # tool results / user turns are in the conversation (outside the model's mask) for the scripted samples
    assert all(0 < r["num_tokens"] < len(r["token_ids"]) for r in recs if r["sample"] != 3)
    # generation throughput counts the model's tokens, not the environment's
    assert info["gen_tokens"] == sum(r["num_tokens"] for r in recs) < sum(len(r["token_ids"]) for r in recs)

    batch = build_batch(recs, np.ones(len(recs), np.float32))
    mask, beh = np.array(batch["mask"]), np.array(batch["behaviour"])
    for i, r in enumerate(recs):
        p, c = len(r["prompt_token_ids"]), len(r["token_ids"])
        assert mask[i, p - 1 : p - 1 + c].tolist() == [float(m) for m in r["model_mask"]]
        assert mask[i, : p - 1].sum() == 0 and mask[i, p - 1 + c :].sum() == 0
        np.testing.assert_allclose(beh[i, p - 1 : p - 1 + c], r["logprobs"])
    assert batch["model_tokens"] == sum(r["num_tokens"] for r in recs)

    # the trainer's log-probs over the whole conversation match the sampler's on the model's tokens
    adv_batch = advantage_batch(tr.cfg, groups, {})
    ok, stats = tr.updater.update(adv_batch)
    assert ok and stats["behaviour_logp_absdiff"] < 1e-3


@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"])
def test_no_gradient_through_tool_result_tokens(rollouts, aggregation):
    """Changing what the batch says at tool-result / user-turn positions (their targets and
    behaviour log-probs) leaves the loss and every gradient unchanged; d loss / d logp is 0 there."""
    tr, groups, _ = rollouts
    cfg = _cfg(aggregation=aggregation, old_logprobs="behaviour", mu=1)
    recs = [r for g in groups for r in g][:2]  # two episodes with tool results: enough, and 4x cheaper
    rng = np.random.default_rng(0)
    adv = rng.normal(size=len(recs)).astype(np.float32)
    batch = build_batch(recs, adv)
    m = np.array(batch["mask"])
    off = np.zeros_like(m, bool)  # the conversation's non-model positions
    for i, r in enumerate(recs):
        p, c = len(r["prompt_token_ids"]), len(r["token_ids"])
        off[i, p - 1 : p - 1 + c] = np.asarray(r["model_mask"]) == 0
    assert off.sum() > 0
    vocab = tr.model.args.vocab_size
    tampered = dict(batch)
    tampered["targets"] = mx.array(np.where(off, rng.integers(0, vocab, m.shape), np.array(batch["targets"])).astype(np.int32))
    tampered["behaviour"] = mx.array(np.where(off, rng.normal(-3, 2, m.shape), np.array(batch["behaviour"])).astype(np.float32))
    loss_fn = make_loss(cfg, 1.0)
    la, ga = _grads(tr.model, loss_fn, {**batch, "old": batch["behaviour"]})
    lb, gb = _grads(tr.model, loss_fn, {**tampered, "old": tampered["behaviour"]})
    assert la == pytest.approx(lb, abs=1e-7)
    assert any(np.abs(v).max() > 0 for v in ga.values())
    for k in ga:
        np.testing.assert_allclose(gb[k], ga[k], rtol=1e-5, atol=1e-8)

    # the surrogate's gradient w.r.t. each token's log-prob is exactly 0 off the model's tokens
    logp = mx.array(rng.normal(-2, 0.5, m.shape).astype(np.float32))
    g = mx.grad(lambda lp: policy_loss(lp, batch["behaviour"], batch["adv"], batch["mask"], aggregation=aggregation,
                                       max_tokens=6).loss)(logp)
    g = np.array(g)
    assert np.all(g[m == 0] == 0) and np.abs(g[m > 0]).max() > 0


def test_one_step_on_episodes_changes_lora_and_nothing_frozen(tiny_qwen3, tasks, scripted, tmp_path):
    cfg = _cfg(mu=2, beta=0.05)
    model, tok, _ = load_model(str(tiny_qwen3))
    setup_model(model, cfg)
    before = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    trainable = {k for k, _ in tree_flatten(model.trainable_parameters())}
    s = train(model, tok, tasks, cfg, tmp_path / "run", seed=3)
    rec = s["last"]
    assert not rec["skipped"] and rec["frac_groups_mixed"] == 1.0 and rec["adv_abs_mean"] > 0
    after = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    changed = {k for k in after if not np.array_equal(after[k], before[k])}
    assert changed and changed <= trainable and any(k.endswith("lora_b") for k in changed)
    # the loss counted the model's tokens only: fewer than the conversations' tokens after the prompts
    assert 0 < rec["train_model_tokens"] == rec["gen_tokens"]
    assert rec["behaviour_logp_absdiff"] < 1e-3


def test_lambda_zero_is_plain_grpo_on_episodes(rollouts, tiny_qwen3, tasks, tmp_path):
    """MGPO with lambda = 0 on episode groups: advantages (r - mean) / (std + eps) per task (sample
    std), and the update equals one computed from those hand-made advantages; lambda = 1 scales
    each group's advantages by exp(-D_ME(p || 0.5))."""
    tr0, groups, _ = rollouts
    recs = [r for g in groups for r in g]
    grpo = []
    for g in groups:
        r = np.array([x["reward"] for x in g], np.float64)
        grpo += list((r - r.mean()) / (r.std(ddof=1) + 1e-6))
    grpo = np.array(grpo, np.float32)

    def update(trainer, batch):
        before = {k: np.array(v) for k, v in tree_flatten(trainer.model.trainable_parameters())}
        ok, _ = trainer.updater.update(batch)
        assert ok
        return {k: np.array(v) - before[k] for k, v in tree_flatten(trainer.model.trainable_parameters())}

    sgd = dict(optimizer="sgd", learning_rate=1.0, max_grad_norm=None)
    tr_mgpo = _trainer(tiny_qwen3, tasks, _cfg(mgpo_lambda=0.0, **sgd), tmp_path)
    b_mgpo = advantage_batch(tr_mgpo.cfg, groups, {})
    np.testing.assert_allclose(np.array(b_mgpo["adv"]), grpo, rtol=1e-6, atol=1e-6)
    tr_ref = _trainer(tiny_qwen3, tasks, _cfg(mgpo_lambda=0.0, **sgd), tmp_path)
    d_mgpo, d_ref = update(tr_mgpo, b_mgpo), update(tr_ref, build_batch(recs, grpo))
    assert any(np.abs(v).max() > 0 for v in d_ref.values())
    for k in d_ref:
        np.testing.assert_array_equal(d_mgpo[k], d_ref[k])

    tr1 = _trainer(tiny_qwen3, tasks, _cfg(mgpo_lambda=1.0, **sgd), tmp_path)
    adv1 = np.array(advantage_batch(tr1.cfg, groups, {})["adv"])
    p = np.repeat([np.mean([x["reward"] for x in g]) for g in groups], [len(g) for g in groups])
    q = np.clip(p, 1e-12, 1 - 1e-12)
    w = np.exp(-(q * np.log(2 * q) + (1 - q) * np.log(2 * (1 - q))))
    np.testing.assert_allclose(adv1, w * grpo, rtol=1e-5, atol=1e-6)


def test_cache_reuse_samples_the_recorded_conversation(tiny_qwen3, tasks, scripted):
    """With KV-cache reuse across turns the behaviour log-probs are those of the recorded
    conversation: the same records as re-prefilling every message (mlx-lm 0.32's cache has already
    seen a message's last sampled token; feeding it again shifted every later message)."""
    from mlx_ssp.agents.engine import run_episodes
    from mlx_ssp.rollout.config import SamplingConfig
    from mlx_ssp.rollout.request import RolloutRequest

    model, tok, _ = load_model(str(tiny_qwen3))
    req = RolloutRequest(tasks=tasks[:1], k=2, sampling=SamplingConfig(temperature=1.0, max_tokens=6), seed=5,
                         batch_size=2, progress=False)
    a, b = ([r for g in run_episodes(model, tok, req, reuse_cache=reuse) for r in g] for reuse in (True, False))
    assert all(r["num_messages"] > 1 for r in a)
    for x, y in zip(a, b):
        assert x["token_ids"] == y["token_ids"] and x["model_mask"] == y["model_mask"]
        np.testing.assert_allclose(x["logprobs"], y["logprobs"], atol=1e-4)
