"""Collection of an RL step's rollouts: the task stream, the sampled groups, dynamic sampling.

Steps 1-2 of a step (VibeThinker-1.5B section 3.4; GRPO, DeepSeekMath arXiv:2402.03300 section 4):

1. take ``batch_size`` prompts from a seeded, per-epoch shuffled stream of the training tasks
   (:class:`TaskStream`; its position is saved in checkpoints);
2. sample ``group_size`` completions per prompt from the *current* policy with the rollout engine
   (:func:`mlx_ssp.rollout.generate_rollouts`: mlx-lm's BatchGenerator, behaviour log-probs kept,
   verifier rewards; with ``gen_fold_lora`` on the LoRA adapters folded into a copy of the weights,
   :func:`mlx_ssp.finetune.lora.folded_adapters`); with ``dynamic_sampling`` (DAPO) groups whose rewards are all equal (p in
   {0, 1} for binary rewards: no learning signal) are dropped and more prompts are sampled, at
   most ``max_refill_rounds`` extra rounds (:func:`collect`).

The G samples of a prompt share its prefill in the rollout engine. :func:`reward_metrics` gives the
reward statistics of every sampled group, kept or dropped.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import mlx.nn as nn
import numpy as np

from mlx_ssp.finetune.lora import folded_adapters
from mlx_ssp.rl.config import RLConfig
from mlx_ssp.rollout import generate_rollouts
from mlx_ssp.tasks import Task


class TaskStream:
    """Prompts in a per-epoch permutation seeded by (seed, epoch); the position is the state."""

    def __init__(self, n: int, seed: int, epoch: int = 0, cursor: int = 0):
        self.n, self.seed, self.epoch, self.cursor = n, seed, epoch, cursor
        self._order = self._perm()

    def _perm(self) -> np.ndarray:
        return np.random.default_rng([self.seed, self.epoch]).permutation(self.n)

    def take(self, k: int) -> list[int]:
        out = []
        for _ in range(k):
            if self.cursor >= self.n:
                self.epoch, self.cursor = self.epoch + 1, 0
                self._order = self._perm()
            out.append(int(self._order[self.cursor]))
            self.cursor += 1
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}


def rollout_groups(model: nn.Module, tokenizer, tasks: list[Task], cfg: RLConfig, *, seed: int, step_no: int,
                   round_no: int) -> tuple[list[list[dict]], dict]:
    """(the groups of ``group_size`` rollouts of ``tasks``, in task order, the engine's stats); the
    sampling seed is a function of (run seed, step, refill round), so a resumed run draws the same."""
    stats: dict = {}
    with folded_adapters(model) if cfg.gen_fold_lora else nullcontext():
        recs = generate_rollouts(
            model, tokenizer, tasks, k=cfg.group_size, sampling=cfg.sampling,
            seed=(seed * 1_000_003 + step_no * 101 + round_no) % (2**31), batch_size=cfg.gen_batch_size,
            progress=False, system=cfg.system, stats=stats,
        )
    by: dict[str, list[dict]] = {}
    for r in recs:
        by.setdefault(r["task_id"], []).append(r)
    return [by[t.id] for t in tasks if t.id in by], stats


def collect(model: nn.Module, tokenizer, tasks: list[Task], cfg: RLConfig, stream: TaskStream, *, seed: int,
            step_no: int) -> tuple[list[list[dict]], dict, list[list[dict]]]:
    """(kept groups, generation info, every sampled group): ``batch_size`` groups from the
    current policy, prompts taken from ``stream``; with dynamic sampling only groups whose rewards differ are kept."""
    kept: list[list[dict]] = []
    info = {"gen_s": 0.0, "gen_tokens": 0, "groups_sampled": 0, "groups_dropped": 0, "refill_rounds": 0}
    all_groups: list[list[dict]] = []
    for rnd in range(1 + (cfg.max_refill_rounds if cfg.dynamic_sampling else 0)):
        need = cfg.batch_size - len(kept)
        if need <= 0:
            break
        t0 = time.perf_counter()
        groups, _ = rollout_groups(model, tokenizer, [tasks[i] for i in stream.take(need)], cfg, seed=seed,
                                   step_no=step_no, round_no=rnd)
        info["gen_s"] += time.perf_counter() - t0
        # model-sampled tokens only: an episode's tool results and user turns were not generated
        info["gen_tokens"] += sum(r["num_tokens"] for g in groups for r in g)
        info["groups_sampled"] += len(groups)
        info["refill_rounds"] = rnd
        all_groups.extend(groups)
        for g in groups:
            rs = [float(r["reward"]) for r in g]
            if cfg.dynamic_sampling and max(rs) == min(rs):
                info["groups_dropped"] += 1
                continue
            kept.append(g)
    info["groups_kept"] = min(len(kept), cfg.batch_size)
    return kept[: cfg.batch_size], info, all_groups


def reward_metrics(sampled: list[list[dict]]) -> dict:
    """Reward statistics over every sampled group (kept or dropped by dynamic sampling)."""
    rewards_all = np.array([float(r["reward"]) for g in sampled for r in g], np.float32)
    rec = {"reward_mean": float(rewards_all.mean()) if rewards_all.size else 0.0}
    rec["pass_rate"] = float((rewards_all >= 0.999).mean()) if rewards_all.size else 0.0
    p_all = [float(np.mean([r["reward"] for r in g])) for g in sampled]
    rec["frac_groups_mixed"] = float(np.mean([0.0 < p < 1.0 for p in p_all])) if p_all else 0.0
    return rec
