"""The fine-tuning core shared by SFT and RL (issue 16): one LoRA config with each stage's
defaults, the step-seed rule, the checkpoint layout and the resume checks RL now makes too."""

from __future__ import annotations

import json

import pytest

import mlx_ssp  # noqa: F401  (OpenBLAS before mlx.core)
import mlx.core as mx
from pydantic import ValidationError

from mlx_ssp.errors import UserError
from mlx_ssp.finetune import checkpoints as ckpts
from mlx_ssp.finetune.lora import LoRAConfig
from mlx_ssp.finetune.seed import step_seed
from mlx_ssp.rl.config import RLConfig
from mlx_ssp.rl.loss import AGGREGATIONS, aggregation_units
from mlx_ssp.sft import SFTConfig


def test_lora_defaults_per_stage():
    assert LoRAConfig().num_layers == 16 and SFTConfig().lora.num_layers == 16
    assert RLConfig().lora.num_layers == -1 and RLConfig(lora={"rank": 4}).lora.num_layers == -1
    assert SFTConfig(lora={"fine_tune_type": "dora"}).lora.fine_tune_type == "dora"
    with pytest.raises(ValidationError):
        RLConfig(lora={"fine_tune_type": "dora"})  # the KL reference cannot switch DoRA off
    for bad in ({"num_layers": 0}, {"num_layers": -2}, {"keys": []}):
        with pytest.raises(ValidationError):
            LoRAConfig(**bad)


def test_step_seed_is_both_old_rules_in_range():
    cases = [(seed, step) for seed in (0, 1, 3, 7, 1000) for step in (0, 1, 50, 999, 400_000)] + [(4293, 200)]
    for seed, step in cases:
        old_sft = (seed * 1_000_003 + step * 7_919 + 17) % (1 << 62)
        old_rl = (seed * 1_000_003 + step * 7919 + 17) % (2**32)
        assert step_seed(seed, step) == old_sft == old_rl


def test_checkpoint_names_and_listing(tmp_path):
    root = tmp_path / "checkpoints"
    for name in ("0000010", "step_000002", "0000002x", "step_abc", "0000003"):
        (root / name).mkdir(parents=True)
        (root / name / "state.json").write_text("{}")
    (root / "0000099").mkdir()  # no state.json: incomplete
    assert [ckpts.step_of(p.name) for p in ckpts.list_checkpoints(root)] == [2, 3, 10]
    assert ckpts.SFT_NAME.format(50) == "0000050" and ckpts.RL_NAME.format(50) == "step_000050"


def test_aggregation_units_are_registry_entries():
    mask = mx.array([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    want = {"token-mean": 3.0, "seq-mean-token-mean": 2.0, "seq-mean-token-sum-norm": 3.0}
    assert set(want) == set(AGGREGATIONS)
    for name, units in want.items():
        assert float(aggregation_units(name, mask).item()) == units
        assert float(AGGREGATIONS[name].units(mask).item()) == units


def _train(tiny_qwen3, out, **kw):
    from test_rl_loop import _cfg, _policy, _tasks

    from mlx_ssp.rl.loop import train

    cfg = _cfg(**kw)
    model, tok = _policy(tiny_qwen3, cfg)
    return train(model, tok, _tasks(), cfg, out, seed=3)


def test_rl_resume_checks_config_and_optimizer(tiny_qwen3, tmp_path):
    out = tmp_path / "run"
    _train(tiny_qwen3, out, steps=1, checkpoint_every=1)
    with pytest.raises(UserError, match=r"different settings \(rl\.learning_rate\).*--restart"):
        _train(tiny_qwen3, out, steps=2, checkpoint_every=1, learning_rate=1e-3)
    # the optimizer state must have this optimizer's keys
    opt_file = out / "checkpoints" / "step_000001" / "optimizer.safetensors"
    state = mx.load(str(opt_file))
    mx.save_safetensors(str(opt_file), {k: v for k, v in state.items() if k != "step"})
    with pytest.raises(UserError, match="optimizer state does not match"):
        _train(tiny_qwen3, out, steps=2, checkpoint_every=1)
    mx.save_safetensors(str(opt_file), state)
    summary = _train(tiny_qwen3, out, steps=2, checkpoint_every=1)  # more steps: a legal resume
    assert summary["steps"] == 2
    assert json.loads((out / "rl_config.json").read_text())["rl"]["steps"] == 2
