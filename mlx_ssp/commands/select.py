"""``mlx_ssp select``: diverse correct solutions from ROLLOUTS.jsonl as per-domain SFT data."""

from __future__ import annotations

import click

from mlx_ssp.commands.options import config_option, set_option
from mlx_ssp.errors import UserError
from mlx_ssp.io import output_lock
from mlx_ssp.models import load_tokenizer
from mlx_ssp.select import DISTANCE_CHOICES, POLICIES, DecontaminateConfig, format_report, gold_records, run_select
from mlx_ssp.stage_config import load_stage
from mlx_ssp.tasks import load_tasks


@click.command("select")
@click.argument("rollouts", required=False)
@click.option("--policy", type=click.Choice(list(POLICIES)), default=None, help="Selection policy (default diverse).")
@click.option("--per-prompt", "per_prompt", type=int, default=None, help="M: most solutions per prompt (diverse). Default 4.")
@click.option("--distance", type=click.Choice(DISTANCE_CHOICES), default=None, help="Diversity distance (default ngram).")
@click.option("--near-duplicate", type=float, default=None, help="Distance at or below which two solutions are duplicates.")
@click.option("-o", "--output", default=None, help="OUT_DIR for <domain>/train.jsonl, valid.jsonl and spectrum.json.")
@click.option("--overwrite", is_flag=True, help="Replace an existing OUT_DIR.")
@click.option("--gold/--no-gold", default=None, help="Episode tasks: also offer each task's gold episode (needs --tasks, --model).")
@click.option("--tasks", "tasks_path", default=None, type=click.Path(dir_okay=False), help="Task file the rollouts came from (for --gold and select.pseudo_label).")
@click.option("--model", default=None, help="Model whose tokenizer the gold episodes are written in (for --gold).")
@click.option("--held-out", "held_out", multiple=True, type=click.Path(dir_okay=False),
              help="Held-out task file whose prompts training must not overlap (turns on select.decontaminate; repeatable).")
@config_option
@set_option
def cli(rollouts, policy, per_prompt, distance, near_duplicate, output, overwrite, gold, tasks_path, model,
        held_out, config_path, overrides):
    """Pick diverse correct solutions from ROLLOUTS.jsonl as mlx-lm chat SFT data, per domain."""
    flags = {"policy": policy, "per_prompt": per_prompt, "distance": distance, "near_duplicate": near_duplicate,
             "input": rollouts, "output": output, "gold": gold}
    cfg = load_stage(config_path, overrides, "select", flags=flags, with_model=False).cfg
    if not cfg.input:
        raise UserError("no rollouts file: pass ROLLOUTS.jsonl (or set select.input)")
    if not cfg.output:
        raise UserError("no output directory: pass -o OUT_DIR (or set select.output)")
    golds = None
    if cfg.gold:
        if not tasks_path or not model:
            raise UserError("--gold needs --tasks TASKS.jsonl and --model SPEC (the tokenizer of the student)")

        golds = gold_records(load_tasks(tasks_path), load_tokenizer(model))
    if held_out and cfg.decontaminate is None:  # --held-out turns decontamination on, with its defaults

        cfg = cfg.model_copy(update={"decontaminate": DecontaminateConfig()})
    if cfg.pseudo_label is not None and not tasks_path:
        raise UserError("select.pseudo_label needs --tasks TASKS.jsonl (the tasks the rollouts came from)")
    with output_lock(cfg.output):  # one process writes OUT_DIR at a time
        report = run_select(cfg.input, cfg, cfg.output, overwrite=overwrite, gold=golds, held_out=list(held_out),
                            tasks_path=tasks_path if cfg.pseudo_label is not None else None)
    click.echo(format_report(report))
    if report["repeated_records_dropped"]:
        click.echo(f"warning: {report['repeated_records_dropped']} repeated (task, sample) record(s) in {cfg.input} were counted once", err=True)
    empty = [d for d, row in report["domains"].items() if not row["n_train"]]
    if empty:
        click.echo(f"warning: no correct solution selected for domain(s) {', '.join(empty)}: no training data written for them", err=True)
    decon = report.get("decontamination")
    if decon:
        click.echo(f"decontamination: {decon['contaminated_prompts']} of {decon['train_prompts']} training prompts share "
                   f"a {decon['n']}-gram with {decon['reference_prompts']} reference prompts; left out")
    click.echo(f"-> {cfg.output}")
