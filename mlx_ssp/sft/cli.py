"""``mlx_ssp sft CONFIG.yaml [--set sft.key=value ...] [--domain D] [--overwrite]``."""

from __future__ import annotations

import click

from mlx_ssp import distributed as dist
from mlx_ssp.cli import set_option
from mlx_ssp.sft.config import SFTConfig
from mlx_ssp.sft.stage import run_sft


def _load_config(config_path: str, overrides, overwrite: bool):
    from mlx_ssp.config import load_file, load_section

    data = load_file(config_path, overrides)
    if overwrite:
        if data.get("sft") is None:
            data["sft"] = {}
        if isinstance(data["sft"], dict):
            data["sft"]["overwrite"] = True
    cfg = load_section(data, "sft", source=str(config_path), cls=SFTConfig)
    model_cfg = load_section(data, "model", source=str(config_path))
    dist.configure(load_section(data, "distributed", source=str(config_path)))  # under mlx.launch (issue 10)
    from mlx_ssp.sandbox_policy import install_from_config

    install_from_config(data, str(config_path))  # the probes may verify code tasks
    return data, cfg, model_cfg


@click.command("sft")
@click.argument("config_path", metavar="CONFIG.yaml", type=click.Path(dir_okay=False))
@set_option
@click.option("--domain", "domains", multiple=True, help="Train only this domain (repeatable).")
@click.option("--overwrite", is_flag=True, help="Discard earlier checkpoints and specialists instead of resuming.")
def cli(config_path: str, overrides: tuple[str, ...], domains: tuple[str, ...], overwrite: bool) -> None:
    """Train one LoRA specialist per domain (sft: section), keep the checkpoint with the best
    probe Pass@K, fuse it into OUT/specialists/<domain>/. Re-running resumes."""
    data, cfg, model_cfg = _load_config(config_path, overrides, overwrite)
    summary = run_sft(
        cfg, model_cfg, run_dir=data.get("run_dir", "run"), run_data=data, seed=int(data.get("seed", 0) or 0),
        source=str(config_path), only=list(domains) or None,
    )
    if not dist.is_main():  # rank 0 reports for all ranks
        return
    for name, d in summary["domains"].items():
        click.echo(f"{name}: step {d['chosen_step']} ({d['rule']}: pass@1 {d['pass@1']}, pass@k {d['pass@k']}) -> {d['specialist']}")
