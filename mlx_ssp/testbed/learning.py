"""The learning check (issue 21): does one Spectrum-phase round raise held-out pass@1 on the testbed?

One round of the recipe's Spectrum phase (VibeThinker-1.5B, arXiv:2511.06221, section 3.2) at its
smallest, through the project's own stage functions and nothing hand-written:

1. ``tasks``: train / probe / eval splits of one ``testbed:DOMAIN`` source
   (:func:`mlx_ssp.tasks.build_split`); eval and probe are held out from pretraining;
2. ``rollout``: K samples per train prompt from the model itself, verified
   (:func:`mlx_ssp.rollout.generate_rollouts`);
3. ``select``: the correct ones, diverse selection (:func:`mlx_ssp.select.select`);
4. ``sft``: one LoRA specialist trained on them and fused (:func:`mlx_ssp.sft.run_sft`);
5. ``eval``: held-out pass@1 of the base and of the specialist on the same eval tasks, same
   sampling seed (:func:`mlx_ssp.eval.evaluate`): the gain is a paired difference.

:func:`learning_round` returns the gain; a CI regression test is to require it above a margin set
from its seed-to-seed spread, measured by ``scripts/testbed.py spread`` (not in the suite yet: no
``micro`` / ``nano`` design has learnt so far, EXPERIMENTS.md). Deviations from the paper's Spectrum phase: the teacher is the model itself (rejection
sampling, as ``mlx_ssp run`` does by default), one checkpoint only (``save_every = iters``: the
Pass@K checkpoint choice has a single candidate, so the probe costs one pass), and the sizes are
those of a CI test, not of a training run.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Literal

from pydantic import Field

from mlx_ssp.config import StrictModel


class LearningConfig(StrictModel):
    """What one learning round does. The defaults are the CI test's (measured: EXPERIMENTS.md)."""

    domain: str = "sum"
    levels: tuple[int, int] = (2, 3)
    train_space: Literal["seen", "held_out"] = "seen"  # where train prompts come from (source param)
    tasks_seed: int = 11  # fixed: the seeds that vary are the SFT's and the sampler's
    n_train: int = Field(64, ge=1)
    n_eval: int = Field(64, ge=1)
    n_probe: int = Field(8, ge=1)
    k: int = Field(8, ge=1)  # rollouts per train prompt
    per_prompt: int = Field(4, ge=1)  # selected correct solutions per prompt (diverse)
    iters: int = Field(40, ge=1)
    batch_size: int = Field(8, ge=1)
    learning_rate: float = Field(3e-4, gt=0)  # 2e-3 diverged on the first micro design (EXPERIMENTS.md)
    lora_rank: int = Field(8, ge=1)
    lora_scale: float = Field(20.0, gt=0)  # mlx-lm's default; large for a 64-wide model (EXPERIMENTS.md)
    eval_n: int = Field(8, ge=1)  # samples per eval task (pass@1 = c / n)
    temperature: float = Field(1.0, gt=0)
    max_tokens: int = Field(48, ge=1)


def learning_round(model_dir: str | Path, work: str | Path, cfg: LearningConfig = LearningConfig(), *,
                   seed: int = 0) -> dict:
    """One round on the model at ``model_dir`` in the empty directory ``work``. ``seed`` drives the
    rollout sampling, the LoRA init and batch order, and the eval sampling. Returns base and
    specialist pass@1, their paired gain, the amount of SFT data, and the wall time of each part."""
    from mlx_ssp.config import validate
    from mlx_ssp.eval import evaluate
    from mlx_ssp.io import write_jsonl_atomic
    from mlx_ssp.models import load_model
    from mlx_ssp.rollout import SamplingConfig, generate_rollouts
    from mlx_ssp.select import SelectConfig, select
    from mlx_ssp.sft import SFTConfig, run_sft
    from mlx_ssp.tasks import TasksConfig, build_split, write_tasks

    work = Path(work)
    times: dict[str, float] = {}
    tic = time.perf_counter()
    tcfg = validate(TasksConfig, {"seed": cfg.tasks_seed, "domains": {cfg.domain: {
        "source": f"testbed:{cfg.domain}", "params": {"levels": list(cfg.levels), "train_space": cfg.train_space},
        "sizes": {"train": cfg.n_train, "probe": cfg.n_probe, "eval": cfg.n_eval}}}})
    splits = {s: build_split(tcfg, s) for s in ("train", "probe", "eval")}
    write_tasks(work / "probe.jsonl", splits["probe"])
    sampling = SamplingConfig(temperature=cfg.temperature, max_tokens=cfg.max_tokens)
    model, tok, path = load_model(str(model_dir))

    def held_out_pass1(m) -> dict:
        # the same tasks and sampling seed for both models: the gain is a paired difference
        r = evaluate(m, tok, splits["eval"], k=1, n=cfg.eval_n, sampling=sampling, seed=seed, batch_size=256, progress=False)
        return {"pass@1": float(r["overall"]["pass@1"]), "per_task": {t["task_id"]: t["pass@1"] for t in r["tasks"]}}

    base = held_out_pass1(model)
    times["base_eval"] = time.perf_counter() - tic
    tic = time.perf_counter()
    recs = generate_rollouts(model, tok, splits["train"], k=cfg.k, sampling=sampling, seed=seed, batch_size=256,
                             progress=False)
    data, report = select(recs, validate(SelectConfig, {"policy": "diverse", "per_prompt": cfg.per_prompt,
                                                        "valid_fraction": 0.0}))
    train = data.get(cfg.domain, {}).get("train", [])
    times["rollout_select"] = time.perf_counter() - tic
    out = {"base": base["pass@1"], "rollout_reward": sum(r["reward"] for r in recs) / max(1, len(recs)),
           "sft_records": len(train), "seed": seed}
    if len(train) < cfg.batch_size:  # nothing to learn from: no gain to report (None, not a made-up 0)
        return {**out, "specialist": None, "gain": None, "times": times, "note": "too little SFT data"}
    tic = time.perf_counter()
    write_jsonl_atomic(work / "select" / "train.jsonl", train)
    scfg = validate(SFTConfig, {
        "domains": {cfg.domain: {"data": str(work / "select"), "probe_tasks": str(work / "probe.jsonl")}},
        "out_dir": str(work / "sft"), "lora": {"rank": cfg.lora_rank, "scale": cfg.lora_scale, "num_layers": -1},
        "learning_rate": cfg.learning_rate, "iters": cfg.iters, "batch_size": cfg.batch_size, "max_seq_length": 96,
        "save_every": cfg.iters, "report_every": cfg.iters, "val_batches": 0, "seed": seed,
        "probe": {"k": 1, "max_tasks": cfg.n_probe, "sampling": sampling.model_dump(), "progress": False}})
    summary = run_sft(scfg, None, run_dir=work, seed=seed, model_and_tokenizer=(model, tok, path))
    times["sft"] = time.perf_counter() - tic
    tic = time.perf_counter()
    spec, _, _ = load_model(summary["domains"][cfg.domain]["specialist"])
    after = held_out_pass1(spec)
    times["specialist_eval"] = time.perf_counter() - tic
    diffs = [after["per_task"][t] - p for t, p in base["per_task"].items()]
    return {**out, "specialist": after["pass@1"], "gain": after["pass@1"] - base["pass@1"],
            "tasks_improved": sum(d > 0 for d in diffs), "tasks_worse": sum(d < 0 for d in diffs),
            "times": {k: round(v, 1) for k, v in times.items()}}
