"""The fine-tuning core shared by SFT and RL: one LoRA config with each stage's
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
from mlx_ssp.rl.objectives import AGGREGATIONS, aggregation_units
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
    # one name for both stages; earlier runs' SFT and RL names are still read, mixed names sort by step
    for name in ("0000010", "step_000002", "0000002x", "step_abc", "0000003", "step_0000007", "step_0000011"):
        (root / name).mkdir(parents=True)
        (root / name / "state.json").write_text("{}")
    (root / "0000099").mkdir()  # no state.json: incomplete
    assert [ckpts.step_of(p.name) for p in ckpts.list_checkpoints(root)] == [2, 3, 7, 10, 11]
    assert ckpts.checkpoint_dir(root, 50) == root / "step_0000050" and ckpts.step_of("step_0000050") == 50
    assert ckpts.find_checkpoint(root, 10).name == "0000010" and ckpts.find_checkpoint(root, 2).name == "step_000002"
    with pytest.raises(UserError, match="no complete checkpoint of step 99"):
        ckpts.find_checkpoint(root, 99)


def test_trim_keeps_the_newest_optimizer_state(tmp_path):
    root = tmp_path / "checkpoints"
    for name in ("0000001", "step_000002", "step_0000003", "step_0000004"):
        (root / name).mkdir(parents=True)
        (root / name / "state.json").write_text("{}")
        (root / name / ckpts.OPTIMIZER_FILE).write_text("x")
    ckpts.trim_optimizer_states(root, 3)  # step 3 was just written; step 4 is not older
    assert [p.name for p in ckpts.list_checkpoints(root) if (p / ckpts.OPTIMIZER_FILE).exists()] == [
        "step_0000003", "step_0000004"]


def test_aggregation_units_are_registry_entries():
    mask = mx.array([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    want = {"token-mean": 3.0, "seq-mean-token-mean": 2.0, "seq-mean-token-sum-norm": 3.0}
    assert set(want) == set(AGGREGATIONS)
    for name, units in want.items():
        assert float(aggregation_units(name, mask).item()) == units
        assert float(AGGREGATIONS[name].units(mask).item()) == units


def _train(tiny_qwen3, out, **kw):
    from test_rl_loop import _cfg, _policy, _tasks

    from mlx_ssp.rl.trainer import train

    cfg = _cfg(**kw)
    model, tok = _policy(tiny_qwen3, cfg)
    return train(model, tok, _tasks(), cfg, out, seed=3)


def test_rl_resume_checks_config_and_optimizer(tiny_qwen3, tmp_path):
    out = tmp_path / "run"
    _train(tiny_qwen3, out, steps=1, checkpoint_every=1)
    with pytest.raises(UserError, match=r"different settings \(rl\.learning_rate\).*--restart"):
        _train(tiny_qwen3, out, steps=2, checkpoint_every=1, learning_rate=1e-3)
    # the optimizer state must have this optimizer's keys
    opt_file = out / "checkpoints" / "step_0000001" / "optimizer.safetensors"
    state = mx.load(str(opt_file))
    mx.save_safetensors(str(opt_file), {k: v for k, v in state.items() if k != "step"})
    with pytest.raises(UserError, match="optimizer state does not match"):
        _train(tiny_qwen3, out, steps=2, checkpoint_every=1)
    mx.save_safetensors(str(opt_file), state)
    summary = _train(tiny_qwen3, out, steps=2, checkpoint_every=1)  # more steps: a legal resume
    assert summary["steps"] == 2
    assert json.loads((out / "rl_config.json").read_text())["rl"]["steps"] == 2


def _rename_to_old_layout(root):
    """A run directory as the RL stage wrote it before the one layout: ``step_NNNNNN`` names."""
    for p in ckpts.list_checkpoints(root):
        p.rename(root / f"step_{ckpts.step_of(p.name):06d}")


def test_rl_checkpoints_one_layout_and_old_runs_resume(tiny_qwen3, tmp_path):
    out = tmp_path / "run"
    _train(tiny_qwen3, out, steps=2, checkpoint_every=1)
    root = out / "checkpoints"
    assert [p.name for p in ckpts.list_checkpoints(root)] == ["step_0000001", "step_0000002"]
    # only the newest checkpoint keeps the optimizer state (the rule SFT has)
    assert [p.name for p in root.iterdir() if (p / ckpts.OPTIMIZER_FILE).exists()] == ["step_0000002"]
    _rename_to_old_layout(root)
    summary = _train(tiny_qwen3, out, steps=3, checkpoint_every=1)  # resumes from the old-named step 2
    assert summary["steps"] == 3
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [p.name for p in ckpts.list_checkpoints(root)] == ["step_000001", "step_000002", "step_0000003"]
    assert [p.name for p in root.iterdir() if (p / ckpts.OPTIMIZER_FILE).exists()] == ["step_0000003"]
