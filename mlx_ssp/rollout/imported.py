"""Imported traces: completions that already exist (a multi-trace dataset, another toolchain's
generations) verified and recorded like sampled ones, so that selection treats them alike.

VibeThinker-1.5B (arXiv:2511.06221, section 3.2) builds its Spectrum from many traces per problem
of a strong teacher; when those traces exist as data, sampling them again is waste. A ``jsonl:`` or
``hf:`` task source with ``params.completions_field`` keeps each row's list of completions in its
task's metadata (:data:`mlx_ssp.tasks.file_sources.IMPORTED`); the rollout stage hands such tasks
here instead of to the teacher, whatever the teacher is, and the others to the teacher.

Records have the keys of sampled ones; deviations:
- sample ``i`` is the row's ``i``-th completion, for ``i < k``: a row with more than K completions
  gives its first K, one with fewer gives fewer samples (pass@K of that task is then undefined).
- a completion given as a mapping is its ``content``, preceded by its ``reasoning_content`` (or
  ``reasoning``) in ``<think>`` tags, as for an endpoint teacher (:func:`.endpoint.join_reasoning`).
- ``logprobs``/``logprob_temperature``/``stop`` are None, ``finish_reason`` is "stop" (nothing
  says the trace was cut), ``latency_s`` is 0; ``token_ids`` are the student's when a tokenizer is
  given, else None with ``num_tokens`` the whitespace-separated word count (a rough length only).
- ``teacher`` is ``{"imported": <the task's source>}``.
- Rows whose prompt repeats an earlier row's are dropped by the source (its deduplication), with
  their completions: merge such rows first if they hold different traces.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Iterator, Optional

from mlx_ssp.rollout.endpoint import StudentTokens, join_reasoning
from mlx_ssp.rollout.records import TaskGroups
from mlx_ssp.rollout.request import RolloutRequest
from mlx_ssp.rollout.scoring import Scorer
from mlx_ssp.tasks import Task
from mlx_ssp.tasks.file_sources import IMPORTED


def has_imported(task: Task) -> bool:
    return bool(task.metadata.get(IMPORTED))


def trace_text(c) -> str:
    """One imported completion as text (a mapping's reasoning kept in ``<think>`` tags)."""
    if isinstance(c, str):
        return c
    return join_reasoning(str(c.get("reasoning_content") or c.get("reasoning") or ""), c["content"])


def iter_imported(request: RolloutRequest, *, samples: Optional[dict[str, list[int]]] = None,
                  stats: Optional[dict] = None, tokenizer=None) -> Iterator[list[dict]]:
    """Each task's records built from its imported completions, verified (the scorer of sampled
    rollouts), a task at a time. ``samples``: task id -> the sample indices wanted (default all K);
    indices past a task's completions are not produced."""
    request.check()
    stats = stats if stats is not None else {}
    for key, zero in (("skipped", []), ("gen_tokens", 0), ("prompt_tokens", 0), ("gen_s", 0.0), ("verify_s", 0.0),
                      ("n_samples", 0)):
        stats.setdefault(key, zero)
    t0 = time.perf_counter()
    plan = []
    for ti, task in enumerate(request.tasks):
        traces = task.metadata.get(IMPORTED) or []
        wanted = [s for s in request.wanted(task.id, samples) if s < len(traces)]
        if wanted:
            plan.append((ti, wanted))
    tokens = StudentTokens(tokenizer, request)
    scorer = Scorer(request.tasks, TaskGroups(Counter({ti: len(ss) for ti, ss in plan})), stats,
                    verify=request.verify, workers=request.verify_workers)
    try:
        for ti, wanted in plan:
            task = request.tasks[ti]
            traces = task.metadata[IMPORTED]
            groups = []
            for s in wanted:
                text = trace_text(traces[s])
                ids = tokens.completion(text, "stop")
                rec = {
                    "task_id": task.id, "domain": task.domain, "sample": s, "prompt": task.prompt,
                    "prompt_token_ids": tokens.prompt(ti), "completion": text, "token_ids": ids,
                    "logprobs": None, "logprob_temperature": None, "finish_reason": "stop", "stop": None,
                    "num_tokens": len(ids) if ids is not None else len(text.split()),
                    "reward": None, "reason": None, "detail": None, "latency_s": 0.0, "verify_s": 0.0,
                    "teacher": {"imported": task.metadata.get("source")},
                }
                stats["gen_tokens"] += rec["num_tokens"]
                grp = scorer.score(ti, task, rec, text)
                if grp is not None:
                    groups.append(grp)
            groups += scorer.collect(wait=True)  # background (sandboxed) verifiers: this task's too
            for g in groups:
                stats["n_samples"] += len(g)
                yield g
    finally:
        scorer.close()
        stats["gen_s"] += time.perf_counter() - t0
