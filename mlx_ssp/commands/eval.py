"""``mlx_ssp eval``: pass@1 / pass@k per domain of a model on a task file, printed and written as JSON."""

from __future__ import annotations

import click

from mlx_ssp import distributed as dist
from mlx_ssp import trackers
from mlx_ssp.commands.options import (
    config_option,
    no_progress_option,
    report_to_option,
    sampling_flags,
    sampling_options,
    set_option,
)
from mlx_ssp.eval import run_eval
from mlx_ssp.rollout.summary import format_table
from mlx_ssp.stage_config import load_task_stage


@click.command("eval")
@click.option("--model", "model", default=None, help="Model: a directory, a Hugging Face id, or 'demo'.")
@click.option("--tasks", "tasks_path", default=None, help="Task JSONL file.")
@click.option("--k", "k", type=int, default=None, help="k of pass@k. Default 8.")
@click.option("--n", "n", type=int, default=None, help="Samples per task (>= k; default k).")
@click.option("--greedy/--no-greedy", default=None, help="Also report greedy pass@1.")
@sampling_options
@click.option("--system", default=None, help="System prompt for tasks that have none.")
@click.option("-o", "--output", default=None, help="EVAL.json to write.")
@no_progress_option
@report_to_option
@config_option
@set_option
def cli(model, tasks_path, k, n, greedy, system, output, config_path, overrides, report_to, **kw):
    """pass@1 and pass@k per domain (unbiased estimator), printed and written as JSON."""
    from pathlib import Path


    flags = {"k": k, "n": n, "greedy": greedy, "tasks": tasks_path, "output": output, "system": system, **sampling_flags(kw)}
    cli_trackers = trackers.from_cli(report_to)
    mcfg, cfg, st = load_task_stage(config_path, overrides, "eval", flags, model, "EVAL.json")
    # one job writes EVAL.json at a time
    with dist.output_lock(cfg.output), \
            trackers.for_stage(st, cli_trackers, command="eval", dir=Path(cfg.output).parent, section="eval"):
        result = run_eval(mcfg, cfg.tasks, cfg, cfg.output)
    if not dist.is_main():  # rank 0 reports for all ranks
        return
    click.echo(format_table(result, extra=("greedy_pass@1",) if cfg.greedy else ()))
    if result["skipped"]:
        click.echo(f"warning: skipped {len(result['skipped'])} task(s) whose prompt does not fit the context", err=True)
    click.echo(f"-> {cfg.output}")
