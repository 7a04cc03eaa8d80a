"""Decoding on the LoRA adapters folded into the weights (mlx_ssp.finetune.lora.folded_adapters,
``rl.gen_fold_lora``): the same outputs up to float rounding, the adapter layers back afterwards,
and an RL step on folded rollouts still on-policy and still training only the adapters."""

from __future__ import annotations

import json

import mlx_ssp  # noqa: F401
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from mlx_ssp.finetune.lora import folded_adapters, lora_modules
from mlx_ssp.models import load_model
from mlx_ssp.rl.config import RLConfig
from mlx_ssp.rl.policy import setup_model
from mlx_ssp.rl.trainer import config_record, fingerprint, train
from mlx_ssp.rollout import SamplingConfig, generate_rollouts
from mlx_ssp.tasks import Task
from mlx_ssp.verify import VerifyResult, register


def _policy(path, train_dtype="float32"):
    """A LoRA policy whose adapters do something (lora_b starts at 0)."""
    model, tok, _ = load_model(str(path))
    setup_model(model, RLConfig(lora={"rank": 4}, train_dtype=train_dtype))
    model.update(tree_map(lambda p: p + 0.05 * mx.random.normal(p.shape, key=mx.random.key(7)),
                          model.trainable_parameters()))
    return model, tok


def _tasks(n=2):
    return [Task(id=f"t{i}", domain="toy", prompt=f"count to {i + 3}", answer="-", verifier="lora_fold_test_parity")
            for i in range(n)]


register("lora_fold_test_parity")(lambda completion, task: VerifyResult(float(len(completion) % 2), "correct"))


def test_folded_model_computes_the_adapter_model_and_is_put_back(tiny_qwen3):
    model, _ = _policy(tiny_qwen3)
    model.eval()
    x = mx.array([[3, 17, 42, 9, 100, 5]])
    wrapped = dict(lora_modules(model))
    params = dict(tree_flatten(model.parameters()))
    want = model(x)
    with folded_adapters(model):
        assert lora_modules(model) == []  # every linear adapter is one plain layer inside
        got = model(x)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)
    assert dict(lora_modules(model)) == wrapped  # the same adapter objects back
    after = dict(tree_flatten(model.parameters()))
    assert after.keys() == params.keys() and all(after[k] is params[k] for k in params)  # nothing rewritten
    # the adapters matter here: switched off, the output moves well beyond the tolerance above
    for _, m in lora_modules(model):
        m.scale = 0.0
    assert float(mx.abs(model(x) - want).max()) > 1e-2


def test_bf16_layers_are_not_folded_and_decode_through_their_adapters(tiny_qwen3):
    """fuse rounds B A and W + s B A to bf16, which would drop most of a small update: bf16 layers
    keep their adapters, so decoding inside the block is the adapter path itself."""
    model, tok = _policy(tiny_qwen3, train_dtype="bfloat16")
    wrapped = lora_modules(model)
    assert wrapped and all(m.linear.weight.dtype == mx.bfloat16 for _, m in wrapped)
    kw = dict(k=4, sampling=SamplingConfig(temperature=1.0, max_tokens=16), seed=3, batch_size=8, progress=False,
              verify=False)
    plain = generate_rollouts(model, tok, _tasks(), **kw)
    with folded_adapters(model):
        assert lora_modules(model) == wrapped  # nothing folded
        folded = generate_rollouts(model, tok, _tasks(), **kw)
    assert [r["token_ids"] for r in folded] == [r["token_ids"] for r in plain]
    assert [r["logprobs"] for r in folded] == [r["logprobs"] for r in plain]
    # what the fold would lose: the bf16-rounded fused weight misses part of the float32 update
    _, m = wrapped[0]
    exact = m.linear.weight.astype(mx.float32) + m.scale * (m.lora_b.T @ m.lora_a.T)
    lost = float(mx.abs(m.fuse().weight.astype(mx.float32) - exact).max())
    assert lost > 0


def test_only_float32_layers_are_folded(tiny_qwen3):
    model, _ = _policy(tiny_qwen3)
    names = [n for n, _ in lora_modules(model)]
    half = set(names[: len(names) // 2])
    for n, m in lora_modules(model):
        if n in half:
            m.linear.set_dtype(mx.bfloat16)
    with folded_adapters(model):
        assert {n for n, _ in lora_modules(model)} == half  # the float32 ones are plain layers inside
    assert [n for n, _ in lora_modules(model)] == names


def test_folded_decoding_draws_the_same_tokens(tiny_qwen3):
    model, tok = _policy(tiny_qwen3)
    kw = dict(k=4, sampling=SamplingConfig(temperature=1.0, max_tokens=16), seed=3, batch_size=8, progress=False,
              verify=False)
    plain = generate_rollouts(model, tok, _tasks(), **kw)
    with folded_adapters(model):
        folded = generate_rollouts(model, tok, _tasks(), **kw)
    assert [r["token_ids"] for r in folded] == [r["token_ids"] for r in plain]
    for a, b in zip(folded, plain):
        np.testing.assert_allclose(a["logprobs"], b["logprobs"], rtol=0, atol=1e-4)


def test_rl_step_on_folded_rollouts_is_on_policy_and_trains_only_adapters(tiny_qwen3, tmp_path):
    model, tok = _policy(tiny_qwen3)
    base = {k: v for k, v in tree_flatten(model.parameters()) if "lora" not in k}
    lora = {k: np.array(v) for k, v in tree_flatten(model.trainable_parameters())}
    cfg = RLConfig(steps=1, batch_size=2, group_size=4, sampling={"temperature": 1.0, "max_tokens": 12},
                   progress=False, lora={"rank": 4}, learning_rate=1e-2)
    assert cfg.gen_fold_lora  # the default
    train(model, tok, _tasks(), cfg, tmp_path)
    rec = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert rec["behaviour_logp_absdiff"] < 1e-4  # the sampler's log-probs are the trainer's, to rounding
    assert rec["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    now = dict(tree_flatten(model.parameters()))
    assert all(mx.array_equal(now[k], v).item() for k, v in base.items())  # the base is untouched
    moved = max(float(np.abs(np.array(now[k]) - v).max()) for k, v in lora.items())
    assert moved > 0  # and the adapters trained


def test_gen_fold_lora_keeps_fingerprints():
    assert "gen_fold_lora" not in config_record(RLConfig(), 0, "m")["rl"]
    assert config_record(RLConfig(gen_fold_lora=False), 0, "m")["rl"]["gen_fold_lora"] is False
    on, off = (fingerprint(config_record(RLConfig(gen_fold_lora=f), 0, "m")) for f in (True, False))
    assert on == off
