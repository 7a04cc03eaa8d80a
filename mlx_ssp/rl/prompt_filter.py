"""The 0/1 prompt filter before an RL phase (VibeThinker-3B report, arXiv:2606.16140, section 2.2.2):
prompts whose accuracy under the phase's starting checkpoint is exactly 0 or exactly 1 are removed
(no group of them can have a mixed outcome often enough to teach anything).

:func:`split_by_accuracy` is the pure rule; :func:`filter_prompts` measures the accuracies with K
rollouts of the starting policy through the rollout engine (:func:`mlx_ssp.rollout.generate_rollouts`)
and writes ``prompt_filter.json`` (counts per reason, the kept and removed ids) into the phase's
directory, where a resumed phase reads it back instead of sampling again.

Choices the report does not give: K (``rl.prompt_filter.k``, default 8) and the sampling (default
the phase's own ``rl.sampling``); "correct" is ``reward >= 0.999`` (:data:`mlx_ssp.rl.shaping.CORRECT_AT`);
a prompt the engine skipped (longer than the context) has no accuracy and is removed as ``skipped``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from mlx_ssp import distributed as dist
from mlx_ssp.errors import UserError
from mlx_ssp.io import write_json_atomic
from mlx_ssp.rl.shaping import is_correct
from mlx_ssp.rollout import generate_rollouts

FILE = "prompt_filter.json"
#: why a prompt is removed, by its accuracy
REASONS = ("all_correct", "all_wrong")


def accuracies(records: list[dict]) -> dict[str, float]:
    """Per task id: the fraction of its records that are correct."""
    by: dict[str, list[float]] = {}
    for r in records:
        by.setdefault(r["task_id"], []).append(float(r["reward"]))
    return {t: float(is_correct(rs).mean()) for t, rs in by.items()}


def split_by_accuracy(acc: dict[str, float]) -> tuple[list[str], dict[str, list[str]]]:
    """(kept ids, {reason: removed ids}): accuracy exactly 1 is ``all_correct``, exactly 0
    ``all_wrong``; everything strictly between is kept. Order of ``acc`` is kept."""
    removed: dict[str, list[str]] = {r: [] for r in REASONS}
    kept = []
    for t, a in acc.items():
        if a >= 1.0:
            removed["all_correct"].append(t)
        elif a <= 0.0:
            removed["all_wrong"].append(t)
        else:
            kept.append(t)
    return kept, removed


def _key(tasks, cfg, seed: int) -> str:
    """What decides the filter's outcome besides the starting weights: the tasks, K, sampling, seed."""
    blob = json.dumps({
        "tasks": [t.model_dump(mode="json") for t in tasks], "k": cfg.prompt_filter.k,
        "sampling": _sampling(cfg).model_dump(mode="json"), "seed": seed, "system": cfg.system,
    }, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _sampling(cfg):
    return cfg.prompt_filter.sampling or cfg.sampling


def filter_prompts(model, tokenizer, tasks: list, cfg, out_dir: Path, *, seed: int = 0, resume: bool = True,
                   where: str = "rl") -> tuple[list, dict]:
    """(the tasks kept, the report written to ``out_dir/prompt_filter.json``). With ``resume`` and a
    report of the same tasks and settings already there, its kept ids are used as they are (a resumed
    phase trains on the same prompts, and its starting policy is no longer in memory)."""
    path = Path(out_dir) / FILE
    key = _key(tasks, cfg, seed)
    report = None
    if resume and path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("key") == key:
            report = saved
    if report is None:
        report = measure(model, tokenizer, tasks, cfg, seed=seed)
        report["key"] = key
        if dist.is_main():
            write_json_atomic(path, report)
    keep = set(report["kept_ids"])
    kept = [t for t in tasks if t.id in keep]
    if not kept:
        raise UserError(f"{where}: the 0/1 prompt filter removed every prompt ({_counts_text(report)}); "
                        "use other tasks, a larger rl.prompt_filter.k, or leave rl.prompt_filter out")
    return kept, report


def measure(model, tokenizer, tasks: list, cfg, *, seed: int = 0) -> dict:
    """K rollouts per task from ``model`` and the 0/1 split of their accuracies (counts and ids)."""
    stats: dict = {}
    recs = generate_rollouts(
        model, tokenizer, tasks, k=cfg.prompt_filter.k, sampling=_sampling(cfg),
        # a stream of its own: the training steps' seeds are (seed, step, round) mixes
        seed=(seed * 1_000_003 + 7_777_777) % (2**31), batch_size=cfg.gen_batch_size, progress=False,
        system=cfg.system, stats=stats,
    )
    acc = accuracies(recs)
    kept, removed = split_by_accuracy(acc)
    skipped = [t.id for t in tasks if t.id not in acc]
    counts = {"prompts": len(tasks), "kept": len(kept), **{r: len(v) for r, v in removed.items()},
              "skipped": len(skipped)}
    return {"k": cfg.prompt_filter.k, "counts": counts, "accuracy_mean": float(np.mean(list(acc.values()))) if acc else None,
            "kept_ids": kept, "removed": {**removed, "skipped": skipped}}


def _counts_text(report: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in report["counts"].items())
