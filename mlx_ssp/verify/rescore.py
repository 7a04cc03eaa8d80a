"""(Re-)scoring a file of completions (``mlx_ssp verify``): each record's task, from the record itself
(``task``) or a task file (``task_id``), then its verifier, in chunks through :func:`verify_many`
(code sandboxes on worker threads), written atomically as the input plus ``reward``, ``reason``,
``detail`` (and what the verifier adds: an episode's ``turns``, ``accuracy``, ``partial``).

Resumable: each verdict is appended, flushed, to ``OUT.jsonl.partial`` as it arrives (the record's
index, a fingerprint of the record, its task and the sandbox policy, and the fields the verdict
adds). A rerun after a kill keeps the verdicts whose fingerprint still matches and scores only the
rest; the output is written in one atomic rename once every record is scored, and the partial
file is then removed. The caller holds the output's lock (``.OUT.jsonl.lock``, as a rollout's).

A record is a completion (``completion``: text) or an episode (``messages``: the conversation in
OpenAI chat format, scored by re-executing its calls; :mod:`mlx_ssp.agents.score`)."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from mlx_ssp import io
from mlx_ssp.errors import UserError
from mlx_ssp.rollout.resume import run_fingerprint, task_fingerprint
from mlx_ssp.sandbox_policy import get_policy
from mlx_ssp.tasks import Task, check_tasks, load_tasks
from mlx_ssp.verify import verify_many

#: records verified per verify_many call: bounds the memory held while the writer streams
CHUNK = 256


def tasks_of(records: list[dict], tasks_path: str | None, in_path: str):
    """The task of each record, checked (errors name ``in_path`` and the record)."""
    from pydantic import ValidationError


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
    """What a rescoring found: counts by reason, rewards by domain, their total, and how many
    verdicts a resume kept from the partial file."""

    reasons: Counter = field(default_factory=Counter)
    by_domain: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    total: float = 0.0
    resumed: int = 0


def subject(record: dict):
    """What a record's verifier scores: an episode's messages, else the completion text."""
    if isinstance(record.get("messages"), list):
        return record["messages"]
    return record.get("completion") or ""


def partial_path(output: str | Path) -> Path:
    """Where the verdicts of an unfinished ``mlx_ssp verify`` are kept: ``OUT.jsonl.partial``."""
    out = Path(output)
    return out.with_name(out.name + ".partial")


def record_keys(records: list[dict], tasks: list) -> list[str]:
    """Per record, a fingerprint of what decides its verdict: the record, its task, the sandbox policy."""
    policy = run_fingerprint(get_policy().model_dump())
    return [run_fingerprint({"record": r, "task": task_fingerprint(t), "sandbox": policy})
            for r, t in zip(records, tasks)]


def load_partial(path: Path, keys: list[str]) -> dict[int, dict]:
    """index -> the fields its verdict adds, for each verdict in ``path`` whose record is still the
    same (by ``keys``); others (a changed input, task or policy) are scored again."""
    if not path.exists():
        return {}
    io.repair_jsonl_tail(path)  # a kill mid-line leaves a torn last line
    done: dict[int, dict] = {}
    for lineno, line in io.iter_jsonl_numbered(path, what="partial verdicts"):
        i, key, added = line.get("i"), line.get("key"), line.get("added")
        ok = isinstance(i, int) and not isinstance(i, bool) and isinstance(added, dict)
        if not ok or not {"reward", "reason"} <= added.keys():
            raise UserError(f"{path}:{lineno}: not a verdict of mlx_ssp verify; delete {path} to score everything again")
        if 0 <= i < len(keys) and key == keys[i]:
            done.setdefault(i, added)
    return done


def rescore(records: list[dict], tasks: list, output: str, *, workers: int,
            progress: Optional[Callable[[int], None]] = None) -> Scores:
    """Score ``records`` against ``tasks`` and write them to ``output`` (atomically, at the end),
    resuming the verdicts a killed run left in :func:`partial_path`."""
    part = partial_path(output)
    keys = record_keys(records, tasks)
    done = load_partial(part, keys)
    scores = Scores(resumed=len(done))
    if done and progress:
        progress(len(done))
    todo = [i for i in range(len(records)) if i not in done]
    # flushed, not fsynced, per verdict: a killed process loses none, and scoring is not held up
    with io.JsonlAppender(part, fsync=False) as app:
        for s in range(0, len(todo), CHUNK):
            idx = todo[s:s + CHUNK]

            def save(j: int, res, idx=idx) -> None:
                added = {"reward": res.reward, "reason": res.reason, "detail": res.detail, **(res.extra or {})}
                app.write({"i": idx[j], "key": keys[idx[j]], "added": added})
                done[idx[j]] = added

            verify_many([(subject(records[i]), tasks[i]) for i in idx], workers=workers, progress=progress,
                        on_result=save)
    for i, t in enumerate(tasks):
        added = done[i]
        scores.reasons[added["reason"]] += 1
        scores.by_domain[t.domain].append(added["reward"])
        scores.total += added["reward"]
    io.write_jsonl_atomic(output, ({**r, **done[i]} for i, r in enumerate(records)))
    part.unlink(missing_ok=True)
    return scores
