"""``mlx_ssp rollout``: a task file rolled out into ROLLOUTS.jsonl (resumed if it exists) and its summary."""

from __future__ import annotations

import click

from mlx_ssp.commands.options import config_option, load_task_stage, sampling_flags, sampling_options, set_option


@click.command("rollout")
@click.option("--model", "model", default=None, help="Model: a directory, a Hugging Face id, or 'demo'.")
@click.option("--tasks", "tasks_path", default=None, help="Task JSONL file.")
@click.option("--k", "k", type=int, default=None, help="Samples per task. Default 8.")
@sampling_options
@click.option("--system", default=None, help="System prompt for tasks that have none.")
@click.option("-o", "--output", default=None, help="rollouts.jsonl to write (resumed if it exists).")
@click.option("--overwrite", is_flag=True, help="Start the output afresh instead of resuming it.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@config_option
@set_option
def cli(model, tasks_path, k, system, output, overwrite, no_progress, config_path, overrides, **kw):
    """Sample K completions per task with behaviour log-probs and verifier rewards.

    Writes ROLLOUTS.jsonl (one record per completion; rerunning resumes it) and
    ROLLOUTS.summary.json (pass@1 / pass@K per domain)."""
    from mlx_ssp import distributed as dist
    from mlx_ssp.rollout.stage import run_rollouts
    from mlx_ssp.rollout.summary import format_table

    flags = {"k": k, "tasks": tasks_path, "output": output, "system": system, **sampling_flags(kw)}
    mcfg, cfg = load_task_stage(config_path, overrides, "rollout", flags, model, "ROLLOUTS.jsonl")
    summary = run_rollouts(mcfg, cfg.tasks, cfg, cfg.output, overwrite=overwrite, progress=not no_progress)
    if not dist.is_main():  # rank 0 reports for all ranks
        return
    click.echo(format_table(summary))
    run = summary["this_run"]
    if run["stale_records"] or run["repeated_records"]:
        click.echo(
            f"note: dropped {run['stale_records']} stale record(s) of {len(run['stale_tasks'])} changed task(s) "
            f"(first: {(run['stale_tasks'] or ['-'])[0]}) and {run['repeated_records']} repeated record(s) from "
            f"{cfg.output}; those samples were generated again", err=True,
        )
    if summary["skipped"]:
        click.echo(f"warning: skipped {len(summary['skipped'])} task(s) whose prompt does not fit the context", err=True)
    click.echo(
        f"{run['samples']} new samples, {run['gen_tokens']} tokens in {run['gen_s']}s "
        f"({run['tokens_per_s']} tok/s), verification {run['verify_s']}s -> {cfg.output}"
    )
