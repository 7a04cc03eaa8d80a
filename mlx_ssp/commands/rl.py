"""``mlx_ssp rl CONFIG.yaml [--set rl.key=value ...] [--restart]``: MGPO-GRPO on the run file's model
(:func:`mlx_ssp.rl.stage.run`), then one JSON line of its summary."""

from __future__ import annotations

import json

import click

from mlx_ssp import distributed as dist
from mlx_ssp.commands.options import no_progress_option, report_to_option, set_option, upload_options
from mlx_ssp.errors import UserError
from mlx_ssp.hub import check_upload, upload_model
from mlx_ssp.rl.stage import run
from mlx_ssp.trackers import from_cli


@click.command("rl")
@click.argument("config_path", type=click.Path(dir_okay=False), required=False)
@click.option("--restart", is_flag=True, help="Ignore existing checkpoints and start afresh.")
@upload_options("the final model: the adapters fused into OUT/fused (with rl.phases: the last phase's model)")
@set_option
@report_to_option
@no_progress_option
def cli(config_path, restart, upload_repo, public, overrides, report_to):
    """MGPO-weighted GRPO with verifiable rewards on the run file's model.

    CONFIG_PATH is a run YAML with model:, rl: and tasks: (or rl.tasks) sections; --set rl.steps=10
    etc. override it. Rerunning resumes from the last checkpoint. With rl.phases the phases run in
    order, each from the previous one's model; finished phases are skipped. --upload-repo fuses the
    final adapters into OUT/fused (with its model card) and uploads that directory."""
    if config_path is None and not overrides:
        raise UserError("give a run YAML (mlx_ssp rl CONFIG.yaml) or --set keys")
    cli_trackers = from_cli(report_to)  # a bad name stops here, before training
    check_upload(upload_repo, public)  # before training
    summary = run(config_path, overrides, restart=restart, fuse=upload_repo is not None, report_to=cli_trackers)
    if not dist.is_main():  # rank 0 reports for all ranks
        return
    last = summary.get("last") or {}
    line = {
        "steps": summary["steps"], "skipped": summary["skipped_total"], "checkpoint": summary["checkpoint"],
        "reward_mean": last.get("reward_mean"), "out_dir": summary["out_dir"],
    }
    for key in ("prompt_filter", "model"):  # set by the 0/1 filter and by phases only
        if summary.get(key) is not None:
            line[key] = summary[key]
    if summary.get("phases"):
        line["phases"] = [{"name": p["name"], "steps": p["steps"], "model": p["model"],
                           "pass@1": (p.get("last") or {}).get("pass@1"),
                           "correct_len_mean": (p.get("last") or {}).get("correct_len_mean"),
                           "prompt_filter": p.get("prompt_filter")} for p in summary["phases"]]
    if upload_repo:
        line["uploaded"] = upload_model(summary["model"], upload_repo, public=public)
    click.echo(json.dumps(line))
