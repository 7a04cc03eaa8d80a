"""``mlx_ssp verify IN.jsonl -o OUT.jsonl``: (re-)score completions with their tasks' verifiers."""

from __future__ import annotations

import os
from collections import Counter, defaultdict

import click

from mlx_ssp.errors import UserError


def _tasks_of(records: list[dict], tasks_path: str | None, in_path: str):
    from pydantic import ValidationError

    from mlx_ssp.tasks import Task, check_tasks, load_tasks

    by_id = {t.id: t for t in load_tasks(tasks_path)} if tasks_path else {}
    out = []
    for i, r in enumerate(records, 1):
        if "completion" not in r or not isinstance(r["completion"], (str, type(None))):
            raise UserError(f"{in_path}: record {i} has no 'completion' string")
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


@click.command("verify")
@click.argument("in_path", metavar="IN.jsonl", type=click.Path(dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Scored JSONL to write (each input line plus reward, reason, detail).")
@click.option("--tasks", "tasks_path", default=None, type=click.Path(dir_okay=False), help="Task file for records that carry only a task_id (rollouts.jsonl).")
@click.option("--workers", default=None, type=click.IntRange(1), help="Parallel sandbox workers for code tasks (default: CPU count).")
@click.option("--sandbox", "sandbox", multiple=True, metavar="KEY=VALUE",
              help="Operator bound on tasks' metadata.sandbox: a ceiling (wall_s=30) or a permission (network=true).")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def cli(in_path: str, output: str, tasks_path: str | None, workers: int | None, sandbox: tuple[str, ...],
        no_progress: bool) -> None:
    """Score each line of IN.jsonl ({"task": {...} or "task_id": ..., "completion": "..."}) with its
    task's verifier and write OUT.jsonl: the input plus `reward` and `reason`. Use it to re-score old
    rollouts after fixing a verifier; prints the mean reward and the counts by reason."""
    from tqdm import tqdm

    from mlx_ssp.io import read_jsonl, write_jsonl_atomic
    from mlx_ssp.verify import PARALLEL, verify_many

    if sandbox:
        from mlx_ssp.sandbox_policy import parse_policy, set_policy

        try:
            set_policy(parse_policy(list(sandbox)))
        except ValueError as e:
            raise UserError(str(e)) from None
    if os.path.abspath(in_path) == os.path.abspath(output):
        raise UserError("the output must not overwrite the input; choose another -o path")
    records = read_jsonl(in_path, what="completions")
    if not records:
        raise UserError(f"{in_path}: no records")
    tasks = _tasks_of(records, tasks_path, in_path)
    workers = workers or os.cpu_count() or 1
    if any(t.verifier in PARALLEL for t in tasks):
        from mlx_ssp.verify.sandbox import describe

        click.echo(describe(), err=True)
    bar = tqdm(total=len(records), unit="completion", desc="verify", disable=no_progress, dynamic_ncols=True)
    reasons: Counter = Counter()
    by_domain: dict[str, list[float]] = defaultdict(list)
    total = [0.0]

    def scored():
        chunk = 256
        for s in range(0, len(records), chunk):
            items = [(r.get("completion") or "", t) for r, t in zip(records[s:s + chunk], tasks[s:s + chunk])]
            for r, t, res in zip(records[s:s + chunk], tasks[s:s + chunk], verify_many(items, workers=workers, progress=bar.update)):
                reasons[res.reason] += 1
                by_domain[t.domain].append(res.reward)
                total[0] += res.reward
                yield {**r, "reward": res.reward, "reason": res.reason, "detail": res.detail}

    try:
        write_jsonl_atomic(output, scored())
    finally:
        bar.close()
    n = len(records)
    click.echo(f"scored {n} completions -> {output}: mean reward {total[0] / n:.4f}")
    for d, rs in sorted(by_domain.items()):
        click.echo(f"  domain {d:24s} n={len(rs):6d} mean={sum(rs) / len(rs):.4f}")
    click.echo("  reasons: " + ", ".join(f"{k}={v}" for k, v in reasons.most_common()))
