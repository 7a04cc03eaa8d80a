"""``mlx_ssp rl CONFIG.yaml [--set rl.key=value ...] [--restart]``: MGPO-GRPO on the run file's model
(:func:`mlx_ssp.rl.stage.run`), then one JSON line of its summary."""

from __future__ import annotations

import json

import click

from mlx_ssp.commands.options import set_option
from mlx_ssp.errors import UserError


@click.command("rl")
@click.argument("config_path", type=click.Path(dir_okay=False), required=False)
@click.option("--restart", is_flag=True, help="Ignore existing checkpoints and start afresh.")
@set_option
def cli(config_path, restart, overrides):
    """MGPO-weighted GRPO with verifiable rewards on the run file's model.

    CONFIG_PATH is a run YAML with model:, rl: and tasks: (or rl.tasks) sections; --set rl.steps=10
    etc. override it. Rerunning resumes from the last checkpoint."""
    from mlx_ssp import distributed as dist
    from mlx_ssp.rl.stage import run

    if config_path is None and not overrides:
        raise UserError("give a run YAML (mlx_ssp rl CONFIG.yaml) or --set keys")
    summary = run(config_path, overrides, restart=restart)
    if not dist.is_main():  # rank 0 reports for all ranks
        return
    last = summary.get("last") or {}
    click.echo(json.dumps({
        "steps": summary["steps"], "skipped": summary["skipped_total"], "checkpoint": summary["checkpoint"],
        "reward_mean": last.get("reward_mean"), "out_dir": summary["out_dir"],
    }))
