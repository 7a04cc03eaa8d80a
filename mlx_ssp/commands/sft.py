"""``mlx_ssp sft CONFIG.yaml [--set sft.key=value ...] [--domain D] [--overwrite]``: one LoRA
specialist per domain (:func:`mlx_ssp.sft.stage.run_sft`), then one line per domain."""

from __future__ import annotations

from pathlib import Path

import click

from mlx_ssp.commands.options import no_progress_option, report_to_option, set_option


def load_config(config_path: str, overrides, overwrite: bool):
    """The run file's sft section (``--overwrite`` sets ``sft.overwrite``) through the one stage loader."""
    from mlx_ssp.sft.config import SFTConfig
    from mlx_ssp.stage_config import load_stage

    return load_stage(config_path, overrides, "sft", flags={"overwrite": True} if overwrite else None,
                      cls=SFTConfig)


@click.command("sft")
@click.argument("config_path", metavar="CONFIG.yaml", type=click.Path(dir_okay=False))
@set_option
@click.option("--domain", "domains", multiple=True, help="Train only this domain (repeatable).")
@click.option("--overwrite", is_flag=True, help="Discard earlier checkpoints and specialists instead of resuming.")
@report_to_option
@no_progress_option
def cli(config_path: str, overrides: tuple[str, ...], domains: tuple[str, ...], overwrite: bool,
        report_to: tuple[str, ...]) -> None:
    """Train one LoRA specialist per domain (sft: section), keep the checkpoint with the best
    probe Pass@K, fuse it into OUT/specialists/<domain>/. Re-running resumes."""
    from mlx_ssp import distributed as dist
    from mlx_ssp import trackers
    from mlx_ssp.sft.stage import run_sft, sft_out_dir
    from mlx_ssp.stage_config import note_old_default

    cli_trackers = trackers.from_cli(report_to)
    st = load_config(config_path, overrides, overwrite)
    if not st.cfg.out_dir:
        note_old_default(st, Path("run") / "sft", st.run_dir / "sft", "pass --set run_dir=run")
    out = sft_out_dir(st.cfg, st.run_dir)
    with dist.output_lock(out), trackers.for_stage(st, cli_trackers, command="sft", dir=out, section="sft"):
        summary = run_sft(
            st.cfg, st.model, run_dir=st.run_dir, run_data=st.data, seed=st.seed, source=st.source,
            only=list(domains) or None,
        )
    if not dist.is_main():  # rank 0 reports for all ranks
        return
    for name, d in summary["domains"].items():
        click.echo(f"{name}: step {d['chosen_step']} ({d['rule']}: pass@1 {d['pass@1']}, pass@k {d['pass@k']}) -> {d['specialist']}")
