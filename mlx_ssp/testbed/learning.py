"""The learning check: does one round of the recipe raise held-out pass@1 on the testbed?

One round at its smallest, through the project's own stage functions and nothing hand-written, in
either of the recipe's two phases (``stage``):

- ``rl`` -- the Signal phase (VibeThinker-1.5B, arXiv:2511.06221, section 3.3): MGPO-GRPO with LoRA
  on the train prompts (:func:`mlx_ssp.rl.trainer.train`, reward = the ``testbed`` verifier);
- ``sft`` -- the Spectrum phase (section 3.2): K samples per train prompt from the model itself,
  verified (:func:`mlx_ssp.rollout.generate_rollouts`), diverse selection of the correct ones
  (:func:`mlx_ssp.select.select`), one LoRA specialist trained on them and fused
  (:func:`mlx_ssp.sft.run_sft`).

Both start from the same train / probe / eval splits of one ``testbed:DOMAIN`` source
(:func:`mlx_ssp.tasks.build.build_split`; eval and probe are held out from pretraining) and end with
held-out pass@1 of the base and of the trained model on the same eval tasks with the same sampling
seed (:func:`mlx_ssp.eval.evaluate`), so the gain is a paired difference.

:func:`learning_round` returns the gain; ``tests/test_learning.py`` requires it above a margin set
from its seed-to-seed spread (``scripts/testbed.py spread``; EXPERIMENTS.md says how). Deviations
from the paper: the SFT teacher is the model itself (rejection sampling, as ``mlx_ssp run`` does by
default), one checkpoint only (``save_every = iters``: the Pass@K choice has a single candidate),
RL has no KL term (``beta = 0``), and the sizes are those of a CI test, not of a training run. The RL
round evaluates the trained LoRA model in memory (the same weights a fuse would write).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Literal

from pydantic import Field

from mlx_ssp.config import StrictModel, validate
from mlx_ssp.eval import evaluate
from mlx_ssp.io import write_jsonl_atomic
from mlx_ssp.models import load_model
from mlx_ssp.rl.config import RLConfig
from mlx_ssp.rl.policy import setup_model
from mlx_ssp.rl.trainer import train
from mlx_ssp.rollout import SamplingConfig, generate_rollouts
from mlx_ssp.select import SelectConfig, select
from mlx_ssp.sft import SFTConfig, run_sft
from mlx_ssp.tasks import write_tasks
from mlx_ssp.tasks.build import build_split
from mlx_ssp.tasks.config import TasksConfig


class SFTRound(StrictModel):
    """The Spectrum round's settings (measured on ``testbed:ci``: EXPERIMENTS.md)."""

    k: int = Field(8, ge=1)  # rollouts per train prompt
    per_prompt: int = Field(4, ge=1)  # selected correct solutions per prompt (diverse)
    iters: int = Field(160, ge=1)
    batch_size: int = Field(8, ge=1)
    learning_rate: float = Field(1e-4, gt=0)  # 3e-4 lowered pass@1 on testbed:ci (it unlearns arithmetic)
    lora_rank: int = Field(8, ge=1)
    lora_scale: float = Field(20.0, gt=0)  # mlx-lm's default; large for a 64-wide model (EXPERIMENTS.md)


class RLRound(StrictModel):
    """The Signal round's settings (measured on ``testbed:ci``: EXPERIMENTS.md)."""

    steps: int = Field(60, ge=1)
    batch_size: int = Field(8, ge=1)  # prompts per step
    group_size: int = Field(8, ge=2)
    learning_rate: float = Field(3e-4, gt=0)
    lora_rank: int = Field(8, ge=1)
    lora_scale: float = Field(2.0, gt=0)  # a tenth of mlx-lm's 20: a 64-wide model (EXPERIMENTS.md)
    mgpo_lambda: float = Field(1.0, ge=0)
    dynamic_sampling: bool = False  # DAPO's: groups with p in {0, 1} dropped and refilled


class LearningConfig(StrictModel):
    """What one learning round does. The defaults are the CI test's (measured: EXPERIMENTS.md)."""

    stage: Literal["rl", "sft"] = "rl"
    domain: str = "sum"
    levels: tuple[int, int] = (2, 3)
    train_space: Literal["seen", "held_out"] = "seen"  # where train prompts come from (source param)
    tasks_seed: int = 11  # fixed: the seeds that vary are the training's and the sampler's
    n_train: int = Field(256, ge=1)
    n_eval: int = Field(128, ge=1)
    n_probe: int = Field(8, ge=1)
    eval_n: int = Field(8, ge=1)  # samples per eval task (pass@1 = c / n)
    temperature: float = Field(1.0, gt=0)
    max_tokens: int = Field(48, ge=1)
    sft: SFTRound = Field(default_factory=SFTRound)
    rl: RLRound = Field(default_factory=RLRound)


def learning_round(model_dir: str | Path, work: str | Path, cfg: LearningConfig = LearningConfig(), *,
                   seed: int = 0) -> dict:
    """One round of ``cfg.stage`` on the model at ``model_dir`` in the empty directory ``work``.
    ``seed`` drives the training (rollout sampling, LoRA init, batch order) and the eval sampling.
    Returns base and trained pass@1, their paired gain, the amount of training data, and the wall
    time of each part."""
    work = Path(work)
    times: dict[str, float] = {}
    tic = time.perf_counter()
    tcfg = validate(TasksConfig, {"seed": cfg.tasks_seed, "domains": {cfg.domain: {
        "source": f"testbed:{cfg.domain}", "params": {"levels": list(cfg.levels), "train_space": cfg.train_space},
        "sizes": {"train": cfg.n_train, "probe": cfg.n_probe, "eval": cfg.n_eval}}}})
    splits = {s: build_split(tcfg, s) for s in ("train", "probe", "eval")}
    sampling = SamplingConfig(temperature=cfg.temperature, max_tokens=cfg.max_tokens)
    model, tok, path = load_model(str(model_dir))

    def held_out_pass1(m) -> dict:
        # the same tasks and sampling seed for both models: the gain is a paired difference
        r = evaluate(m, tok, splits["eval"], k=1, n=cfg.eval_n, sampling=sampling, seed=seed, batch_size=256, progress=False)
        return {"pass@1": float(r["overall"]["pass@1"]), "per_task": {t["task_id"]: t["pass@1"] for t in r["tasks"]}}

    base = held_out_pass1(model)
    times["base_eval"] = time.perf_counter() - tic
    out = {"stage": cfg.stage, "base": base["pass@1"], "seed": seed}
    trained, extra = ROUNDS[cfg.stage](cfg, model, tok, path, splits, sampling, work, seed, times)
    out.update(extra)
    if trained is None:  # nothing to learn from: no gain to report (None, not a made-up 0)
        out.update(trained=None, gain=None, note="too little training data")
    else:
        tic = time.perf_counter()
        after = held_out_pass1(trained)
        times["trained_eval"] = time.perf_counter() - tic
        diffs = [after["per_task"][t] - p for t, p in base["per_task"].items()]
        out.update(trained=after["pass@1"], gain=after["pass@1"] - base["pass@1"],
                   tasks_improved=sum(d > 0 for d in diffs), tasks_worse=sum(d < 0 for d in diffs))
    return {**out, "times": {k: round(v, 1) for k, v in times.items()}}


def _sft(cfg: LearningConfig, model, tok, path, splits, sampling, work: Path, seed: int, times: dict):
    c = cfg.sft
    tic = time.perf_counter()
    write_tasks(work / "probe.jsonl", splits["probe"])
    recs = generate_rollouts(model, tok, splits["train"], k=c.k, sampling=sampling, seed=seed, batch_size=256,
                             progress=False)
    data, _ = select(recs, validate(SelectConfig, {"policy": "diverse", "per_prompt": c.per_prompt, "valid_fraction": 0.0}))
    train = data.get(cfg.domain, {}).get("train", [])
    times["rollout_select"] = time.perf_counter() - tic
    extra = {"rollout_reward": sum(r["reward"] for r in recs) / max(1, len(recs)), "sft_records": len(train)}
    if len(train) < c.batch_size:
        return None, extra
    tic = time.perf_counter()
    write_jsonl_atomic(work / "select" / "train.jsonl", train)
    scfg = validate(SFTConfig, {
        "domains": {cfg.domain: {"data": str(work / "select"), "probe_tasks": str(work / "probe.jsonl")}},
        "out_dir": str(work / "sft"), "lora": {"rank": c.lora_rank, "scale": c.lora_scale, "num_layers": -1},
        "learning_rate": c.learning_rate, "iters": c.iters, "batch_size": c.batch_size, "max_seq_length": 96,
        "save_every": c.iters, "report_every": c.iters, "val_batches": 0, "seed": seed,
        "probe": {"k": 1, "max_tasks": cfg.n_probe, "sampling": sampling.model_dump(), "progress": False}})
    summary = run_sft(scfg, None, run_dir=work, seed=seed, model_and_tokenizer=(model, tok, path))
    times["sft"] = time.perf_counter() - tic
    spec, _, _ = load_model(summary["domains"][cfg.domain]["specialist"])
    return spec, extra


def _rl(cfg: LearningConfig, model, tok, path, splits, sampling, work: Path, seed: int, times: dict):
    import json


    c = cfg.rl
    tic = time.perf_counter()
    rcfg = validate(RLConfig, {
        "steps": c.steps, "batch_size": c.batch_size, "group_size": c.group_size, "learning_rate": c.learning_rate,
        "lora": {"rank": c.lora_rank, "scale": c.lora_scale}, "mgpo_lambda": c.mgpo_lambda, "beta": 0.0,
        "dynamic_sampling": c.dynamic_sampling,
        "sampling": sampling.model_dump(), "checkpoint_every": c.steps, "progress": False})
    setup_model(model, rcfg, seed)
    train(model, tok, splits["train"], rcfg, work / "rl", seed=seed, model_path=str(path))
    model.eval()
    times["rl"] = time.perf_counter() - tic
    rewards = [json.loads(line)["reward_mean"] for line in (work / "rl" / "metrics.jsonl").read_text().splitlines()]
    return model, {"rewards": rewards}


#: stage -> its round: (cfg, model, tokenizer, path, splits, sampling, work, seed, times) -> (trained model or None, info)
ROUNDS = {"sft": _sft, "rl": _rl}
