"""``mlx_ssp rollout``: a task file rolled out into ROLLOUTS.jsonl (resumed if it exists) and its summary.
With ``--endpoint URL --model NAME`` the completions are asked of an OpenAI-compatible server
instead (:mod:`mlx_ssp.rollout.endpoint`; a ``teacher: {endpoint: ...}`` section of ``--config``
supplies its other settings)."""

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
from mlx_ssp.config import apply_overrides, load_file, parse_override, validate
from mlx_ssp.errors import UserError
from mlx_ssp.rollout.endpoint import EndpointTeacherConfig
from mlx_ssp.rollout.stage import run_rollouts
from mlx_ssp.rollout.summary import format_table
from mlx_ssp.stage_config import load_task_stage


@click.command("rollout")
@click.option("--model", "model", default=None,
              help="Model: a directory, a Hugging Face id, or 'demo'; with --endpoint, the server's model name.")
@click.option("--endpoint", default=None,
              help="OpenAI-compatible server URL (e.g. http://127.0.0.1:8080) to ask instead.")
@click.option("--api-key-env", default=None, metavar="VAR",
              help="With --endpoint: environment variable holding the API key.")
@click.option("--concurrency", type=int, default=None, help="With --endpoint: requests in flight. Default 4.")
@click.option("--tokenizer", default=None,
              help="With --endpoint: the student's tokenizer, for token ids in the records.")
@click.option("--tasks", "tasks_path", default=None, help="Task JSONL file.")
@click.option("--k", "k", type=int, default=None, help="Samples per task. Default 8.")
@sampling_options
@click.option("--system", default=None, help="System prompt for tasks that have none.")
@click.option("-o", "--output", default=None, help="rollouts.jsonl to write (resumed if it exists).")
@click.option("--overwrite", is_flag=True, help="Start the output afresh instead of resuming it.")
@no_progress_option
@report_to_option
@config_option
@set_option
def cli(model, endpoint, api_key_env, concurrency, tokenizer, tasks_path, k, system, output, overwrite,
        config_path, overrides, report_to, **kw):
    """Sample K completions per task with behaviour log-probs and verifier rewards.

    Writes ROLLOUTS.jsonl (one record per completion; rerunning resumes it) and
    ROLLOUTS.summary.json (pass@1 / pass@K per domain)."""
    from pathlib import Path


    flags = {"k": k, "tasks": tasks_path, "output": output, "system": system, **sampling_flags(kw)}
    teacher_flags = {"endpoint": endpoint, "api_key_env": api_key_env, "concurrency": concurrency,
                     "tokenizer": tokenizer}
    teacher = endpoint_teacher(config_path, overrides, {**teacher_flags, "model": model})
    if teacher is not None:
        model = None  # --model named the server's model
    elif any(v is not None for v in teacher_flags.values()):
        raise UserError("--api-key-env, --concurrency and --tokenizer go with --endpoint URL")
    cli_trackers = trackers.from_cli(report_to)
    mcfg, cfg, st = load_task_stage(config_path, overrides, "rollout", flags, model, "ROLLOUTS.jsonl")
    with trackers.for_stage(st, cli_trackers, command="rollout", dir=Path(cfg.output).parent, section="rollout"):
        summary = run_rollouts(teacher or mcfg, cfg.tasks, cfg, cfg.output, overwrite=overwrite)
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


def endpoint_teacher(config_path, overrides, flags: dict):
    """The endpoint teacher of this command when ``--endpoint`` is given (None otherwise; like a local
    ``teacher:``, the section alone does not switch the command off the ``model:`` it rolls out): the
    config's ``teacher: {endpoint: ...}`` section when it has one (its retries, sampling,
    extra_body...), then every ``--set teacher.KEY=...`` (with or without ``teacher.endpoint``: with
    ``--endpoint`` they are this teacher's settings, and an unknown key is refused naming the valid
    ones), then the flags. A local ``teacher:`` of the file (no ``endpoint``) plays no part."""
    load_file(config_path, overrides)  # the file and every --set checked, with or without --endpoint
    if flags.get("endpoint") is None:
        return None
    raw = load_file(config_path).get("teacher") if config_path else None
    raw = dict(raw) if isinstance(raw, dict) and "endpoint" in raw else {}
    mine = [o for o in overrides or () if parse_override(o)[0][0] == "teacher"]
    raw = apply_overrides({"teacher": raw}, mine)["teacher"]
    if not isinstance(raw, dict):
        raise UserError("--endpoint: the teacher section set with --set teacher=... must be a mapping of endpoint "
                        "settings (or use --set teacher.KEY=VALUE)")
    if raw.get("model") is None and flags.get("model") is None:
        raise UserError("--endpoint needs --model NAME: the model name the server knows")
    raw.update({key: v for key, v in flags.items() if v is not None})
    return validate(EndpointTeacherConfig, raw, source=str(config_path or "--endpoint"), prefix="teacher")
