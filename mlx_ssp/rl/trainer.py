"""The MGPO-GRPO training loop (``mlx_ssp rl``): Signal phase of SSP.

Each step (VibeThinker-1.5B section 3.4; GRPO, DeepSeekMath arXiv:2402.03300 section 4):

1-2. rollouts of ``batch_size`` prompts, ``group_size`` completions each, from the current policy,
     with dynamic sampling (DAPO) where set (:mod:`mlx_ssp.rl.collect`);
3.   reward shaping, MGPO advantages A' = w(p) * A and the padded training batch
     (:mod:`mlx_ssp.rl.batch`);
4-5. ``mu`` inner updates and the optimizer step, all or nothing (:mod:`mlx_ssp.rl.step`; the loss
     and gradients of each piece of rows: :mod:`mlx_ssp.rl.pieces`); a step whose loss or
     gradients are not finite is skipped and counted, and ``max_bad_steps`` in a row stop the run
     with a checkpoint of the last good state.

This module runs the steps: metrics (one JSON line per step in ``metrics.jsonl``, ``pass@1`` and
``correct_len_mean`` among them), checkpoints every ``checkpoint_every`` steps in
``checkpoints/step_NNNNNNN`` (adapters or weights, optimizer state, RNG and stream state) and a
resumable run directory (a resume checks the config fingerprint, :func:`fingerprint`). The policy
is loaded and set up by :mod:`mlx_ssp.rl.policy`.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_ssp import distributed as dist
from mlx_ssp import progress, trackers
from mlx_ssp.errors import UserError
from mlx_ssp.finetune import checkpoints as ckpts
from mlx_ssp.finetune.seed import step_seed
from mlx_ssp.io import write_json_atomic
from mlx_ssp.rl import kernels
from mlx_ssp.rl.batch import advantage_batch
from mlx_ssp.rl.collect import TaskStream, collect, reward_metrics
from mlx_ssp.rl.config import RLConfig
from mlx_ssp.rl.policy import adapter_config, load_policy
from mlx_ssp.rl.shaping import correct_length_metrics
from mlx_ssp.rl.step import Updater
from mlx_ssp.tasks import Task, render_prompt

ADAPTER_FILE = ckpts.ADAPTER_FILE


class Trainer:
    """State of one RL run: model, its :class:`mlx_ssp.rl.step.Updater` (optimizer, layout), task
    stream, counters; ``step()`` does one step."""

    def __init__(self, model, tokenizer, tasks: list[Task], cfg: RLConfig, out_dir: Path, *, seed: int = 0,
                 ref_model: Optional[nn.Module] = None, model_path: str = ""):
        self.model, self.tokenizer, self.tasks, self.cfg = model, tokenizer, tasks, cfg
        self.out_dir, self.seed, self.ref_model, self.model_path = Path(out_dir), seed, ref_model, model_path
        self.stream = TaskStream(len(tasks), seed)
        self.step_no = 0
        self.bad_in_row = 0
        self.skipped_total = 0
        self.last_good_ckpt: Optional[str] = None
        self.updater = Updater(model, cfg, ref_model)

    @property
    def opt(self):
        """The optimizer (the updater's)."""
        return self.updater.opt

    def collect(self) -> tuple[list[list[dict]], dict, list[list[dict]]]:
        """(kept groups, generation info, every sampled group) of this step from the current policy
        (:func:`mlx_ssp.rl.collect.collect`)."""
        return collect(self.model, self.tokenizer, self.tasks, self.cfg, self.stream, seed=self.seed,
                       step_no=self.step_no)

    def step(self) -> dict:
        """One GRPO step: rollouts (dynamic sampling in :meth:`collect`) -> rewards -> MGPO
        advantages -> ``mu`` inner updates -> metrics."""
        t_step, cpu_step = time.perf_counter(), time.process_time()
        groups, info, sampled = self._sample()
        rec: dict = {"step": self.step_no + 1, **reward_metrics(sampled), **correct_length_metrics(sampled)}
        rec.update(info)
        if not groups:
            rec.update(skipped=True, reason="no informative groups", step_s=time.perf_counter() - t_step)
            self.step_no += 1
            return rec
        batch = advantage_batch(self.cfg, groups, rec)
        t_train = time.perf_counter()
        ok, train_stats = self.updater.update(batch)
        train_s = time.perf_counter() - t_train
        rec.update(train_stats)
        rec.update(throughput(info, batch, self.cfg.mu, train_s, t_step, cpu_step))
        rec["skipped"] = not ok
        self._count_outcome(ok)
        rec["skipped_total"] = self.skipped_total
        return rec

    def _sample(self) -> tuple[list[list[dict]], dict, list[list[dict]]]:
        """Rollouts of the current policy (:meth:`collect`) with the generation's peak memory."""
        mx.reset_peak_memory()
        # the global MLX RNG (LoRA dropout) is reseeded from (seed, step): resuming at step k
        # draws what an uninterrupted run draws, with no RNG state to save
        mx.random.seed(step_seed(self.seed, self.step_no))
        groups, info, sampled = self.collect()
        info["peak_memory_gen_mb"] = mx.get_peak_memory() / 2**20
        mx.reset_peak_memory()
        return groups, info, sampled

    def _count_outcome(self, ok: bool) -> None:
        """Advance the step; a skipped step extends the run of bad steps that ``max_bad_steps`` stops."""
        self.step_no += 1
        if ok:
            self.bad_in_row = 0
        else:
            self.bad_in_row += 1
            self.skipped_total += 1

    # -- checkpoints -------------------------------------------------------------------------
    def trained_weights(self) -> dict[str, mx.array]:
        return dict(tree_flatten(self.model.trainable_parameters()))

    def save_checkpoint(self) -> Path:
        ckpt = ckpts.checkpoint_dir(self.out_dir / "checkpoints", self.step_no)
        self.last_good_ckpt = str(ckpt)
        if not dist.is_main():  # rank 0 writes; every rank holds the same weights
            return ckpt
        ckpts.write_checkpoint(ckpt, self.trained_weights(), adapter_config(self.cfg, self.model),
                               dict(tree_flatten(self.opt.state)), {
            "step": self.step_no, "stream": self.stream.state(), "bad_in_row": self.bad_in_row,
            "skipped_total": self.skipped_total, "seed": self.seed, "model": self.model_path,
        })
        ckpts.trim_optimizer_states(ckpt.parent, self.step_no)
        # the latest adapters beside the run, where `mlx_lm fuse --adapter-path` looks
        for name in (ADAPTER_FILE, "adapter_config.json"):
            shutil.copyfile(ckpt / name, self.out_dir / f".{name}.tmp")
            (self.out_dir / f".{name}.tmp").replace(self.out_dir / name)
        return ckpt

    def load_checkpoint(self, ckpt: Path) -> None:
        state = json.loads((ckpt / "state.json").read_text())
        ckpts.load_adapter_weights(self.model, ckpt)
        ckpts.load_optimizer_state(self.opt, self.model, ckpt, hint="pass --restart")
        self.step_no = int(state["step"])
        self.stream = TaskStream(len(self.tasks), self.seed, state["stream"]["epoch"], state["stream"]["cursor"])
        self.bad_in_row = int(state["bad_in_row"])
        self.skipped_total = int(state["skipped_total"])
        self.last_good_ckpt = str(ckpt)
        mx.eval(self.model.parameters(), self.opt.state)


def throughput(info: dict, batch: dict, mu: int, train_s: float, t_step: float, cpu_step: float) -> dict:
    """Timing, throughput and peak-memory metrics of the step (``t_step``, ``cpu_step``: its start)."""
    rec = {"train_s": train_s}
    rec["gen_tokens_per_s"] = info["gen_tokens"] / info["gen_s"] if info["gen_s"] > 0 else 0.0
    rec["train_tokens_per_s"] = batch["tokens"] * mu / train_s if train_s > 0 else 0.0
    rec["train_model_tokens"] = batch["model_tokens"]  # tokens in the loss (episodes: the model's only)
    rec["step_s"] = time.perf_counter() - t_step
    rec["step_cpu_s"] = time.process_time() - cpu_step  # all threads; less sensitive to a busy machine
    rec["peak_memory_train_mb"] = mx.get_peak_memory() / 2**20
    rec["peak_memory_mb"] = max(rec["peak_memory_train_mb"], info["peak_memory_gen_mb"])
    return rec


def latest_checkpoint(out_dir: Path) -> Optional[Path]:
    done = ckpts.list_checkpoints(Path(out_dir) / "checkpoints")
    return done[-1] if done else None


#: rl: keys a resumed run may change (how long, how often, how verbose); any other change stops it
RESUMABLE_KEYS = ("steps", "checkpoint_every", "max_bad_steps", "progress", "kernels", "output",
                  # the update's layout (gradients accumulate, so the update is the same); a key that
                  # every earlier record holds stays out of here: finished phases hash these fingerprints
                  "auto_micro_batch", "trim_padding", "gen_fold_lora")


def config_record(cfg: RLConfig, seed: int, model_path: str) -> dict:
    """``rl_config.json``: the resolved settings of the run (``lora.fine_tune_type`` is excluded from
    dumps: RL admits only ``lora``, recorded as ``fine_tune_type``)."""
    return {"seed": seed, "model": model_path, "rl": cfg.model_dump(mode="json")}


def fingerprint(record: dict) -> dict:
    """The keys of a :func:`config_record` that a resume compares: the seed and the rl: settings
    (not the model path: a run directory copied or moved with its merged model is the same run)."""
    rl = {f"rl.{k}": v for k, v in (record.get("rl") or {}).items() if k not in RESUMABLE_KEYS}
    return {"seed": record.get("seed"), **rl}


def train(model, tokenizer, tasks: list[Task], cfg: RLConfig, out_dir: str | Path, *, seed: int = 0,
          resume: bool = True, ref_model=None, model_path: str = "", on_step: Optional[Callable] = None) -> dict:
    """Run (or resume) MGPO-GRPO. ``model`` must already be set up (:func:`mlx_ssp.rl.policy.setup_model`).
    Returns a summary; writes metrics.jsonl, checkpoints/ and the latest adapters to ``out_dir``.

    Load or resume (config fingerprint, optimizer keys) -> one :meth:`Trainer.step` per line of
    metrics -> a checkpoint every ``checkpoint_every`` steps (and a stop after ``max_bad_steps``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _check_inputs(tokenizer, tasks, cfg)
    tr = Trainer(model, tokenizer, tasks, cfg, out, seed=seed, ref_model=ref_model, model_path=model_path)
    metrics_path = out / "metrics.jsonl"
    _start_or_resume(tr, metrics_path, resume)
    bar = progress.bar(cfg.steps, initial=tr.step_no, desc="rl", unit="step", enabled=cfg.progress and dist.is_main())
    last = {}
    with dist.appender(metrics_path) as log:  # rank 0 writes the metrics
        while tr.step_no < cfg.steps:
            rec = tr.step()
            log.write(rec)
            trackers.log("", rec, rec["step"])  # rl/reward_mean, ... (rl/<phase>/... in a phase)
            last = rec
            if on_step is not None:
                on_step(tr, rec)
            bar.set_postfix(reward=f"{rec['reward_mean']:.3f}", loss=f"{rec.get('loss', float('nan')):.4f}")
            bar.update(1)
            _checkpoint_or_stop(tr)
    bar.close()
    return {"steps": tr.step_no, "skipped_total": tr.skipped_total, "last": last, "checkpoint": tr.last_good_ckpt,
            "out_dir": str(out)}


def _check_inputs(tokenizer, tasks: list[Task], cfg: RLConfig) -> None:
    """Select the kernel mode and fail early on prompts the tokenizer cannot render."""
    if cfg.kernels is not None:
        kernels.set_mode(cfg.kernels)
    for t in tasks:
        render_prompt(tokenizer, t, cfg.system)


def _start_or_resume(tr: Trainer, metrics_path: Path, resume: bool) -> None:
    """Resume from the latest checkpoint (its config fingerprint and optimizer keys checked; the
    metrics trimmed to its step) or start afresh; record the run's config either way."""
    out = tr.out_dir
    ckpt = latest_checkpoint(out) if resume else None
    record = config_record(tr.cfg, tr.seed, tr.model_path)
    dist.check_same(str(ckpt), what=f"the checkpoint to resume from in {out} (it must be on a disk all hosts share)")
    if ckpt is not None:
        saved = out / "rl_config.json"
        if saved.is_file():
            ckpts.check_fingerprint(fingerprint(json.loads(saved.read_text())), fingerprint(record), where=out,
                                    hint="pass --restart to start afresh")
        tr.load_checkpoint(ckpt)
        if dist.is_main():
            ckpts.trim_metrics(metrics_path, tr.step_no)
    elif metrics_path.exists() and dist.is_main():
        metrics_path.unlink()
    if dist.is_main():
        write_json_atomic(out / "rl_config.json", record)


def _checkpoint_or_stop(tr: Trainer) -> None:
    """After a step: stop with the last good state after ``max_bad_steps`` skipped steps in a row,
    else checkpoint every ``checkpoint_every`` steps and at the end."""
    cfg = tr.cfg
    if tr.bad_in_row >= cfg.max_bad_steps:
        path = tr.save_checkpoint()  # skipped steps changed nothing: this is the last good state
        raise UserError(
            f"rl: {tr.bad_in_row} steps in a row had a non-finite loss or gradient (step {tr.step_no}); "
            f"stopped. Last good state saved to {path}; lower rl.learning_rate or check the rewards."
        )
    if tr.step_no % cfg.checkpoint_every == 0 or tr.step_no == cfg.steps:
        tr.save_checkpoint()


def load_and_train(model_cfg, tasks: list[Task], cfg: RLConfig, out_dir: str | Path, *, seed: int = 0,
                   resume: bool = True):
    """:func:`mlx_ssp.rl.policy.load_policy`, then :func:`train`.
    Returns ``(summary, model, tokenizer, model_path)`` so callers can fuse or save the result."""
    model, tokenizer, path, ref = load_policy(model_cfg, cfg, seed)
    summary = train(model, tokenizer, tasks, cfg, out_dir, seed=seed, resume=resume, ref_model=ref,
                    model_path=str(path))
    return summary, model, tokenizer, path
