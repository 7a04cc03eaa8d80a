"""``mlx_ssp verify IN.jsonl -o OUT.jsonl``: (re-)score completions with their tasks' verifiers
(:mod:`mlx_ssp.verify.rescore`), then the mean reward and the counts by reason."""

from __future__ import annotations

import os
from pathlib import Path

import click

from mlx_ssp.errors import UserError
from mlx_ssp.io import check_output_path, exclusive_lock, read_jsonl
from mlx_ssp.progress import bar as progress_bar
from mlx_ssp.rollout.resume import lock_path
from mlx_ssp.sandbox_policy import parse_policy, set_policy
from mlx_ssp.verify import PARALLEL
from mlx_ssp.verify.rescore import partial_path, rescore, tasks_of
from mlx_ssp.verify.sandbox import describe


@click.command("verify")
@click.argument("in_path", metavar="IN.jsonl", type=click.Path(dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="Scored JSONL to write (each input line plus reward, reason, detail); a killed run resumes from OUT.jsonl.partial.")
@click.option("--tasks", "tasks_path", default=None, type=click.Path(dir_okay=False), help="Task file for records that carry only a task_id (rollouts.jsonl).")
@click.option("--workers", default=None, type=click.IntRange(1), help="Parallel sandbox workers for code tasks (default: CPU count).")
@click.option("--sandbox", "sandbox", multiple=True, metavar="KEY=VALUE",
              help="Operator bound on tasks' metadata.sandbox: a ceiling (wall_s=30) or a permission (network=true).")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def cli(in_path: str, output: str, tasks_path: str | None, workers: int | None, sandbox: tuple[str, ...],
        no_progress: bool) -> None:
    """Score each line of IN.jsonl ({"task": {...} or "task_id": ..., "completion": "..."}, or an
    episode: {"task": ..., "messages": [OpenAI chat messages]}) with its task's verifier and write
    OUT.jsonl: the input plus `reward` and `reason` (episodes: also per-turn verdicts). Use it to
    re-score old rollouts after fixing a verifier; prints the mean reward and the counts by reason.
    Each verdict is saved as it comes to OUT.jsonl.partial: rerun a killed run to score only the rest."""
    if sandbox:
        try:
            set_policy(parse_policy(list(sandbox)))
        except ValueError as e:
            raise UserError(str(e)) from None
    check_output_path(output, "-o")
    check_output_path(partial_path(output), "-o's partial file")
    for written in (output, partial_path(output)):
        if os.path.realpath(in_path) == os.path.realpath(written):
            raise UserError("the output must not overwrite the input; choose another -o path")
    records = read_jsonl(in_path, what="completions")
    if not records:
        raise UserError(f"{in_path}: no records")
    tasks = tasks_of(records, tasks_path, in_path)
    workers = workers or os.cpu_count() or 1
    if any(t.verifier in PARALLEL for t in tasks):
        click.echo(describe(), err=True)
    bar = progress_bar(len(records), unit="completion", desc="verify", enabled=not no_progress)
    try:
        with exclusive_lock(lock_path(Path(output)), output):  # one run appends to the partial file at a time
            scores = rescore(records, tasks, output, workers=workers, progress=bar.update)
    finally:
        bar.close()
    n = len(records)
    if scores.resumed:
        click.echo(f"resumed {scores.resumed} verdicts from {partial_path(output)}; scored the other {n - scores.resumed}")
    click.echo(f"scored {n} completions -> {output}: mean reward {scores.total / n:.4f}")
    for d, rs in sorted(scores.by_domain.items()):
        click.echo(f"  domain {d:24s} n={len(rs):6d} mean={sum(rs) / len(rs):.4f}")
    click.echo("  reasons: " + ", ".join(f"{k}={v}" for k, v in scores.reasons.most_common()))
