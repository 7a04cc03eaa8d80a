"""Curriculum SFT, stage 2: a specialist's second pass on the hard part of its data.

Source: VibeThinker-3B (arXiv:2606.16140) section 2.1.2. Stage 1 trains on all (quality-filtered)
data; stage 2 continues from stage 1's *last* checkpoint on a hard subset, with the same
hyperparameters for 2 epochs:

1. drop traces shorter than ``min_tokens`` (the report: 5K tokens), then
2. drop the easy queries: a reference model's K rollouts per query (the report: 8) give each query
   an error rate, and queries below ``min_error_rate`` (the report: 0.75) are dropped.

In both stages checkpoints are probed on the domain's probe set and the selection rule (Pass@K by
default) picks one; the specialist is stage 2's pick.

Here: the reference rollouts are the run's own rollout stage (K samples per train prompt from the
teacher, the model itself by default) unless ``sft.curriculum.reference`` names another rollout
JSONL. A training record is matched to its query by its prompt messages (system messages aside:
select may add one) or, for whole episodes, by task id. Records whose query has no reference
rollout are dropped and counted (``no_reference``); nothing is guessed. Deviations: the paper's
numbers are the defaults, so a small run (traces of a few hundred tokens) gets an empty subset:
stage 2 is then skipped, the reason recorded, and stage 1's pick is the specialist; ``epochs``
is converted to optimizer steps as ``ceil(epochs * records / batch_size)`` unless ``iters`` is set.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterable, Optional

from pydantic import Field

from mlx_ssp.config import StrictModel
from mlx_ssp.io import iter_jsonl_numbered


class CurriculumConfig(StrictModel):
    """``sft.curriculum``: stage 2 of each specialist (absent: one stage, as before)."""

    min_tokens: int = Field(5000, ge=0)  # traces shorter than this (prompt + completion tokens) are dropped
    min_error_rate: float = Field(0.75, ge=0.0, le=1.0)  # queries the reference solves more often are dropped
    reference: Optional[str] = None  # rollout JSONL of the reference model; `mlx_ssp run`: its rollout stage
    epochs: float = Field(2.0, gt=0)
    iters: Optional[int] = Field(None, ge=1)  # overrides epochs


def prompt_key(messages: list[dict]) -> str:
    """The query a conversation answers: its messages before the last assistant turn, system
    messages left out (selection may add one), as canonical JSON."""
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=len(messages))
    kept = [{"role": m.get("role"), "content": m.get("content")} for m in messages[:last] if m.get("role") != "system"]
    return json.dumps(kept, sort_keys=True, ensure_ascii=False)


def rollout_key(rec: dict) -> str:
    """:func:`prompt_key` of a rollout record's query (episodes: their task id)."""
    if rec.get("kind") == "episode":
        return "task:" + str(rec["task_id"])
    p = rec["prompt"]
    msgs = [{"role": "user", "content": p}] if isinstance(p, str) else list(p)
    return prompt_key(msgs + [{"role": "assistant", "content": ""}])


def record_key(rec: dict) -> str:
    """The query key of an SFT record (chat, prompt/completion or whole-episode token record)."""
    if "token_ids" in rec and "task_id" in rec:
        return "task:" + str(rec["task_id"])
    if "messages" in rec:
        return prompt_key(rec["messages"])
    return prompt_key([{"role": "user", "content": rec.get("prompt")}, {"role": "assistant", "content": ""}])


def error_rates(rollouts: Iterable[dict]) -> dict[str, float]:
    """Per query: the fraction of its reference rollouts with reward below 1 (a partial reward
    counts as an error, as a binary verifier would score it)."""
    n: dict[str, int] = {}
    bad: dict[str, int] = {}
    for r in rollouts:
        k = rollout_key(r)
        n[k] = n.get(k, 0) + 1
        bad[k] = bad.get(k, 0) + (float(r.get("reward", 0.0)) < 1.0)
    return {k: bad[k] / n[k] for k in n}


def hard_subset(lengths: list[int], rates: list[Optional[float]], *, min_tokens: int,
                min_error_rate: float) -> tuple[list[int], dict]:
    """Indices of the records stage 2 trains on, and the count dropped per reason (each record
    counted once, under the first filter that drops it: length, then no reference, then easy)."""
    keep, counts = [], {"short": 0, "no_reference": 0, "easy": 0}
    for i, (n, e) in enumerate(zip(lengths, rates)):
        if n < min_tokens:
            counts["short"] += 1
        elif e is None:
            counts["no_reference"] += 1
        elif e < min_error_rate:
            counts["easy"] += 1
        else:
            keep.append(i)
    return keep, counts


def stage2_iters(cfg: CurriculumConfig, n_records: int, batch_size: int) -> int:
    return cfg.iters if cfg.iters is not None else max(1, math.ceil(cfg.epochs * n_records / batch_size))


def read_rollouts(path: Path) -> list[dict]:
    return [rec for _, rec in iter_jsonl_numbered(path, what="curriculum reference rollouts")]
