"""The issue-23 options inside the RL loop on a tiny model: each trains, masked tokens carry no
gradient, entropy selection keeps its fraction and is micro-batch invariant, TIS weights appear,
and the defaults leave the loss exactly as before (lambda = 0 stays GRPO: test_rl_math)."""

from __future__ import annotations

import numpy as np
import pytest

import mlx_ssp  # noqa: F401
import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_ssp.finetune.optim import OPTIMIZERS
from mlx_ssp.rl.config import RLConfig
from mlx_ssp.rl.batch import build_batch
from mlx_ssp.rl.trainer import Trainer
from test_rl_loop import _cfg, _nested, _policy, _tasks


def _records(n=8, seed=0, truncated=()):
    rng = np.random.default_rng(seed)
    recs = []
    for i in range(n):
        c = 2 + i % 4
        recs.append({"prompt_token_ids": rng.integers(0, 300, 5 + i % 3).tolist(), "token_ids": rng.integers(0, 300, c).tolist(),
                     "logprobs": (-1.0 - 0.1 * rng.random(c)).tolist(), "finish_reason": "length" if i in truncated else "stop"})
    return recs


def _update(path, recs, adv, prep=None, **kw):
    cfg = _cfg(optimizer="sgd", learning_rate=1.0, max_grad_norm=None, **kw)
    model, tok = _policy(path, cfg)
    for name, p in tree_flatten(model.trainable_parameters()):  # non-zero lora_b: every path is live
        if name.endswith("lora_b"):
            model.update(_nested(name, mx.random.normal(p.shape, key=mx.random.key(1)) * 0.1))
    before = {k: np.array(v) for k, v in tree_flatten(model.trainable_parameters())}
    tr = Trainer(model, tok, _tasks(), cfg, "/tmp", seed=0)
    batch = build_batch(recs, adv)
    ok, stats = tr.updater.update(prep(batch) if prep else batch)
    assert ok
    delta = {k: np.array(v) - before[k] for k, v in tree_flatten(model.trainable_parameters())}
    return delta, stats


@pytest.mark.parametrize("kw", [dict(loss="cispo"), dict(importance_sampling_level="sequence", mu=2),
                                dict(old_logprobs="behaviour", tis_cap=2.0), dict(top_entropy_quantile=0.5)])
def test_each_objective_trains(tiny_llama, kw):
    adv = np.random.default_rng(1).normal(size=8).astype(np.float32)
    delta, stats = _update(tiny_llama, _records(), adv, **kw)
    assert any(np.abs(d).max() > 0 for d in delta.values()) and np.isfinite(stats["loss"])
    if "tis_cap" in kw:
        assert 0 < stats["tis_weight"] <= 2.0
    if "top_entropy_quantile" in kw:
        assert 0.45 <= stats["entropy_kept_frac"] <= 0.6  # ceil(q * n) of the batch's tokens


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_every_registered_optimizer_trains(tiny_llama, optimizer):
    """``rl.optimizer`` takes every entry of the optimizer registry, and each one moves the LoRA."""
    cfg = _cfg(optimizer=optimizer, learning_rate=1e-2)
    model, tok = _policy(tiny_llama, cfg)
    before = {k: np.array(v) for k, v in tree_flatten(model.trainable_parameters())}
    ok, _ = Trainer(model, tok, _tasks(), cfg, "/tmp", seed=0).updater.update(
        build_batch(_records(), np.random.default_rng(1).normal(size=8).astype(np.float32)))
    after = dict(tree_flatten(model.trainable_parameters()))
    assert ok and any(np.abs(np.array(after[k]) - v).max() > 0 for k, v in before.items())


def test_entropy_selection_is_micro_batch_invariant(tiny_llama):
    adv = np.random.default_rng(2).normal(size=8).astype(np.float32)
    a, _ = _update(tiny_llama, _records(), adv, top_entropy_quantile=0.3, micro_batch_size=8)
    b, _ = _update(tiny_llama, _records(), adv, top_entropy_quantile=0.3, micro_batch_size=3)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-3, atol=1e-5)


def test_masked_truncated_completions_carry_no_gradient(tiny_llama):
    from mlx_ssp.rl.batch import advantage_batch

    adv = np.random.default_rng(3).normal(size=8).astype(np.float32)
    cfg = _cfg(mask_truncated_completions=True)
    recs = _records(truncated=range(8))
    groups = [[r | {"reward": float(i % 2), "num_tokens": len(r["token_ids"])} for i, r in enumerate(recs[:4])],
              [r | {"reward": float(i % 2), "num_tokens": len(r["token_ids"])} for i, r in enumerate(recs[4:])]]
    rec: dict = {}
    batch = advantage_batch(cfg, groups, rec)
    assert rec["truncated_masked"] == 8 and float(batch["mask"].sum().item()) == 0.0
    # with some truncated: the update equals the update on the others alone
    part = _records(truncated={1, 5})
    from mlx_ssp.rl.batch import mask_truncated

    d_mask, _ = _update(tiny_llama, part, adv, prep=lambda b: mask_truncated(b, part)[0])
    keep = [i for i in range(8) if i not in (1, 5)]
    d_keep, _ = _update(tiny_llama, [part[i] for i in keep], adv[keep])
    for k in d_mask:
        np.testing.assert_allclose(d_mask[k], d_keep[k], rtol=1e-3, atol=1e-6)


def test_config_rules():
    with pytest.raises(ValueError, match="old_logprobs: behaviour"):
        RLConfig(tis_cap=2.0)
    with pytest.raises(ValueError, match="overlong.buffer"):
        RLConfig(overlong={"buffer": 300}, sampling={"temperature": 1.0, "max_tokens": 256})
    with pytest.raises(ValueError, match="loss"):
        RLConfig(loss="ppo2")
    dumped = RLConfig().model_dump()
    assert "loss" not in dumped and "tis_cap" not in dumped  # old fingerprints hold
    assert RLConfig(loss="cispo").model_dump()["loss"] == "cispo"


def test_overlong_shaping_penalises_only_the_last_buffer_tokens():
    from mlx_ssp.rl.shaping import apply_shapings

    cfg = RLConfig(overlong={"buffer": 4, "penalty": 1.0}, sampling={"temperature": 1.0, "max_tokens": 8})
    out = apply_shapings(cfg, np.array([1.0, 1.0, 0.0, 1.0]), np.array([3, 6, 8, 4]), np.zeros(4, int))
    assert np.allclose(out, [1.0, 0.5, -1.0, 1.0])


def test_long2short_sees_the_verifier_rewards_when_overlong_is_on():
    """Both shapings on: Long2Short's correct set is the verifier's, not the length-penalised one."""
    from mlx_ssp.rl.shaping import apply_shapings, long2short

    cfg = RLConfig(overlong={"buffer": 4}, long2short={"lambda": 0.2}, sampling={"temperature": 1.0, "max_tokens": 8})
    r, L, g = np.array([1.0, 1.0, 0.0]), np.array([2, 7, 3]), np.zeros(3, int)
    out = apply_shapings(cfg, r, L, g)
    expect = long2short(r, L, g, 0.2) + np.array([0.0, -0.75, 0.0])
    assert np.allclose(out, expect)


def test_tis_weights_follow_the_sampler_mismatch(tiny_llama):
    """Behaviour log-probs far below the trainer's: every weight is the cap (truncate) or 0 (mask:
    nothing trains); behaviour log-probs of 0: the weight is the trainer's probability itself."""
    adv = np.random.default_rng(4).normal(size=8).astype(np.float32)

    def recs_with(lp):
        return [r | {"logprobs": [lp] * len(r["token_ids"])} for r in _records()]

    _, st = _update(tiny_llama, recs_with(-30.0), adv, old_logprobs="behaviour", tis_cap=2.0)
    assert st["tis_weight"] == pytest.approx(2.0)
    d, st = _update(tiny_llama, recs_with(-30.0), adv, old_logprobs="behaviour", tis_cap=2.0, tis_mode="mask")
    assert st["tis_weight"] == 0.0 and all(np.abs(v).max() == 0 for v in d.values())
    # behaviour 0: w = exp(logp_trainer) < 1 < cap, the mean token probability under the trainer
    cfg = _cfg(optimizer="sgd", learning_rate=1.0, max_grad_norm=None)
    model, _ = _policy(tiny_llama, cfg)
    for name, p in tree_flatten(model.trainable_parameters()):
        if name.endswith("lora_b"):
            model.update(_nested(name, mx.random.normal(p.shape, key=mx.random.key(1)) * 0.1))
    from mlx_ssp.rl.pieces import sequence_logprobs

    b = build_batch(recs_with(0.0), adv)
    lp = np.array(sequence_logprobs(model, b["inputs"], b["targets"], 1.0, None))
    m = np.array(b["mask"])
    _, st = _update(tiny_llama, recs_with(0.0), adv, old_logprobs="behaviour", tis_cap=2.0)
    assert st["tis_weight"] == pytest.approx(float((np.exp(lp) * m).sum() / m.sum()), rel=1e-4)
