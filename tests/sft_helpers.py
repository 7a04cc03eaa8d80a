"""Shared by the SFT tests: a tiny model with live LoRA adapters, and a few steps of mlx-lm's compiled ``train`` through the SFT stage's own
batching, returning the train losses it reports."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_map_with_path
from mlx_lm.tuner.trainer import TrainingArgs, train

from mlx_ssp.finetune.lora import LoRAConfig, attach_lora
from mlx_ssp.models import load_model
from mlx_ssp.sft.stage import batching, build_optimizer


def write_stage_data(tmp_path: Path, recs: list[dict]) -> tuple[Path, Path]:
    """A token-id train file of ``recs`` and a one-task probe file, as a domain's ``data`` / ``probe_tasks``."""
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in recs))
    probe = tmp_path / "probe.jsonl"
    probe.write_text(json.dumps({"id": "p0", "domain": "d", "prompt": "hi", "answer": "x", "verifier": "exact"}) + "\n")
    return data, probe


def train_losses(model, cfg, plan, iters: int, adapter_file: Path) -> list[float]:
    """``iters`` steps of mlx-lm's ``train`` (seeded, batch 4) with the stage's batching for ``plan``;
    the train loss reported after every step."""
    seen: list[float] = []

    class Spy:
        def on_train_loss_report(self, info):
            seen.append(info["train_loss"])

        def on_val_loss_report(self, info):
            pass

    mx.random.seed(0)
    model.train()
    train(model=model, optimizer=build_optimizer(cfg), train_dataset=plan.train_set, training_callback=Spy(),
          args=TrainingArgs(batch_size=4, iters=iters, steps_per_report=1, steps_per_eval=10**9,
                            steps_per_save=10**9, max_seq_length=2048, adapter_file=str(adapter_file)),
          **batching(cfg, plan, 0))
    return seen


def tiny_lora_model(path):
    """The tiny model at ``path`` with LoRA on every layer, the B matrices made non-zero (seeded) so
    every adapter changes the output and gets a gradient."""
    model, tok, _ = load_model(str(path))
    attach_lora(model, LoRAConfig(rank=4, num_layers=-1), seed=0)
    mx.random.seed(1)
    model.update(tree_map_with_path(lambda k, v: mx.random.normal(v.shape) * 0.05 if k.endswith("lora_b") else v,
                                    model.trainable_parameters()))
    return model, tok
