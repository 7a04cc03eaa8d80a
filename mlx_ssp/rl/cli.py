"""``mlx_ssp rl CONFIG.yaml [--set rl.key=value ...]``: MGPO-GRPO on the run file's model.

Reads the ``model:`` section (the policy to train; usually the merged model), the ``rl:`` section
and, when ``rl.tasks`` is not set, the ``tasks:`` section's ``train`` split. Writes to
``rl.output`` (default ``<run_dir>/rl``): metrics.jsonl, checkpoints/step_N/, and the latest
adapters.safetensors + adapter_config.json (fuse with ``mlx_lm fuse --adapter-path``). Rerunning
the same command resumes from the last checkpoint; ``--restart`` starts afresh.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from mlx_ssp.cli import set_option
from mlx_ssp.errors import UserError


def load_config(config_path, overrides):
    from mlx_ssp.config import load_file, load_section

    data = load_file(config_path, overrides)
    source = str(config_path or "--set")
    from mlx_ssp import distributed as dist

    dist.configure(load_section(data, "distributed", source=source))  # timeouts under mlx.launch (issue 10)
    from mlx_ssp.sandbox_policy import install_from_config

    install_from_config(data, source)  # bounds what code tasks may ask of the sandbox
    cfg = load_section(data, "rl", source=source)
    mcfg = load_section(data, "model", source=source)
    seed = cfg.seed if cfg.seed is not None else int(data.get("seed", 0) or 0)
    if cfg.output:
        out = Path(cfg.output)
    else:
        out = Path(data["run_dir"]) / "rl" if data.get("run_dir") else Path("runs/rl")
    return data, cfg, mcfg, seed, out


def load_train_tasks(data: dict, cfg, source: str):
    from mlx_ssp.tasks import load_tasks

    if cfg.tasks:
        return load_tasks(cfg.tasks)
    if data.get("tasks"):
        from mlx_ssp.config import load_section
        from mlx_ssp.tasks import build_split

        tasks = build_split(load_section(data, "tasks", source=source), "train")
        if not tasks:
            raise UserError(f"{source}: the tasks: section gives no train tasks")
        return tasks
    raise UserError(f"{source}: no training tasks; set rl.tasks (a task JSONL) or a tasks: section")


def run(config_path, overrides=(), *, restart: bool = False) -> dict:
    """Load everything named in the run file and train; returns the summary."""
    data, cfg, mcfg, seed, out = load_config(config_path, overrides)
    source = str(config_path or "--set")
    tasks = load_train_tasks(data, cfg, source)
    from mlx_ssp.rl.loop import load_and_train

    summary, *_ = load_and_train(mcfg, tasks, cfg, out, seed=seed, resume=not restart)
    return summary


@click.command("rl")
@click.argument("config_path", type=click.Path(dir_okay=False), required=False)
@click.option("--restart", is_flag=True, help="Ignore existing checkpoints and start afresh.")
@set_option
def cli(config_path, restart, overrides):
    """MGPO-weighted GRPO with verifiable rewards on the run file's model.

    CONFIG_PATH is a run YAML with model:, rl: and tasks: (or rl.tasks) sections; --set rl.steps=10
    etc. override it. Rerunning resumes from the last checkpoint."""
    if config_path is None and not overrides:
        raise UserError("give a run YAML (mlx_ssp rl CONFIG.yaml) or --set keys")
    summary = run(config_path, overrides, restart=restart)
    from mlx_ssp import distributed as dist

    if not dist.is_main():  # rank 0 reports for all ranks
        return
    last = summary.get("last") or {}
    click.echo(json.dumps({
        "steps": summary["steps"], "skipped": summary["skipped_total"], "checkpoint": summary["checkpoint"],
        "reward_mean": last.get("reward_mean"), "out_dir": summary["out_dir"],
    }))
