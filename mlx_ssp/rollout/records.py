"""The records of a rollout: one in-flight sample's book-keeping, its finished record (keys in
:mod:`mlx_ssp.rollout`), and the per-task grouping that hands out a task once all its samples are in."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, Optional

from mlx_ssp.tasks import Task


class LiveSequence:
    """Book-keeping of one in-flight sample."""

    __slots__ = ("uid", "task_idx", "sample", "tokens", "lps", "detok", "text", "t0", "max_tokens")

    def __init__(self, uid, task_idx, sample, t0, max_tokens):
        self.uid = uid
        self.task_idx = task_idx
        self.sample = sample
        self.tokens: list[int] = []
        self.lps: list[float] = []
        self.detok = None  # a streaming detokenizer, only when stop strings are matched
        self.text = ""
        self.t0 = t0
        self.max_tokens = max_tokens


def completion_text(tokenizer, seq: LiveSequence, reason: str, stop_hit: Optional[str]) -> str:
    """The decoded completion: cut before the stop string hit, else without the ending EOS."""
    if stop_hit is not None:
        return seq.text[: seq.text.index(stop_hit)]
    toks = seq.tokens
    text_ids = toks[:-1] if (reason == "stop" and toks and toks[-1] in tokenizer.eos_token_ids) else toks
    return tokenizer.decode(text_ids)


def build_record(task: Task, seq: LiveSequence, prompt_ids: list[int], text: str, reason: str,
                 stop_hit: Optional[str], logprob_temperature: float) -> dict[str, Any]:
    """The record of one finished sample, unscored (``reward``/``reason``/``detail`` None)."""
    toks = seq.tokens
    return {
        "task_id": task.id,
        "domain": task.domain,
        "sample": seq.sample,
        "prompt": task.prompt,
        "prompt_token_ids": prompt_ids,
        "completion": text,
        "token_ids": list(toks),
        "logprobs": seq.lps,
        "logprob_temperature": logprob_temperature,
        "finish_reason": reason,
        "stop": stop_hit,
        "num_tokens": len(toks),
        "reward": None,
        "reason": None,
        "detail": None,
        "latency_s": round(time.perf_counter() - seq.t0, 4),
        "verify_s": 0.0,
    }


class TaskGroups:
    """Collects finished records per task; a task's records come out together, by sample index,
    when the last of its expected samples arrives."""

    def __init__(self, expected: dict[int, int]):
        self.remaining = defaultdict(int, expected)
        self.done: dict[int, list[dict]] = defaultdict(list)

    def add(self, task_idx: int, rec: dict) -> Optional[list[dict]]:
        self.done[task_idx].append(rec)
        self.remaining[task_idx] -= 1
        if self.remaining[task_idx] == 0:
            return sorted(self.done.pop(task_idx), key=lambda r: r["sample"])
        return None
