"""(Re-)scoring a file of completions (``mlx_ssp verify``): each record's task, from the record itself
(``task``) or a task file (``task_id``), then its verifier, in chunks through :func:`verify_many`
(code sandboxes on worker threads), written atomically as the input plus ``reward``, ``reason``,
``detail`` (and what the verifier adds: an episode's ``turns``, ``accuracy``, ``partial``).

A record is a completion (``completion``: text) or an episode (``messages``: the conversation in
OpenAI chat format, scored by re-executing its calls; :mod:`mlx_ssp.verify.multi_turn`)."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Callable, Optional

from mlx_ssp.errors import UserError

#: records verified per verify_many call: bounds the memory held while the writer streams
CHUNK = 256


def tasks_of(records: list[dict], tasks_path: str | None, in_path: str):
    """The task of each record, checked (errors name ``in_path`` and the record)."""
    from pydantic import ValidationError

    from mlx_ssp.tasks import Task, check_tasks, load_tasks

    by_id = {t.id: t for t in load_tasks(tasks_path)} if tasks_path else {}
    out = []
    for i, r in enumerate(records, 1):
        if isinstance(r.get("messages"), list):
            pass  # an episode
        elif "completion" not in r or not isinstance(r["completion"], (str, type(None))):
            raise UserError(f"{in_path}: record {i} has no 'completion' string (nor an episode's 'messages' list)")
        if "task" in r:
            try:
                out.append(Task.model_validate(r["task"]))
            except ValidationError as e:
                first = e.errors()[0]
                key = ".".join(str(x) for x in first["loc"])
                raise UserError(f"{in_path}: record {i}: task.{key}: {first['msg']}") from None
        elif "task_id" in r:
            if not by_id:
                raise UserError(f"{in_path}: record {i} names task_id '{r['task_id']}': pass --tasks FILE with the task records")
            if r["task_id"] not in by_id:
                raise UserError(f"{in_path}: record {i}: task_id '{r['task_id']}' is not in {tasks_path}")
            out.append(by_id[r["task_id"]])
        else:
            raise UserError(f"{in_path}: record {i} has neither 'task' (a task record) nor 'task_id'")
    check_tasks(list({t.id: t for t in out}.values()), source=in_path)
    return out


@dataclass
class Scores:
    """What a rescoring found: counts by reason, rewards by domain, their total."""

    reasons: Counter = field(default_factory=Counter)
    by_domain: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    total: float = 0.0


def subject(record: dict):
    """What a record's verifier scores: an episode's messages, else the completion text."""
    if isinstance(record.get("messages"), list):
        return record["messages"]
    return record.get("completion") or ""


def rescore(records: list[dict], tasks: list, output: str, *, workers: int,
            progress: Optional[Callable[[int], None]] = None) -> Scores:
    """Score ``records`` against ``tasks`` and write them to ``output`` (atomically, streamed)."""
    from mlx_ssp.io import write_jsonl_atomic
    from mlx_ssp.verify import verify_many

    scores = Scores()

    def scored():
        for s in range(0, len(records), CHUNK):
            recs, ts = records[s:s + CHUNK], tasks[s:s + CHUNK]
            items = [(subject(r), t) for r, t in zip(recs, ts)]
            for r, t, res in zip(recs, ts, verify_many(items, workers=workers, progress=progress)):
                scores.reasons[res.reason] += 1
                scores.by_domain[t.domain].append(res.reward)
                scores.total += res.reward
                yield {**r, "reward": res.reward, "reason": res.reason, "detail": res.detail, **(res.extra or {})}

    write_jsonl_atomic(output, scored())
    return scores
