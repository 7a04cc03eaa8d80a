"""``mlx_ssp sft CONFIG.yaml [--set sft.key=value ...] [--domain D] [--overwrite]``: one LoRA
specialist per domain (:func:`mlx_ssp.sft.stage.run_sft`), then one line per domain."""

from __future__ import annotations

from pathlib import Path

import click

from mlx_ssp import distributed as dist
from mlx_ssp import trackers
from mlx_ssp.commands.options import (
    export_gguf_option,
    no_progress_option,
    report_to_option,
    set_option,
    upload_options,
)
from mlx_ssp.doctor import model_config_json
from mlx_ssp.errors import UserError
from mlx_ssp.gguf_export import check_exportable
from mlx_ssp.gguf_export import export_gguf as write_gguf
from mlx_ssp.hub import check_upload, upload_model
from mlx_ssp.sft.config import SFTConfig
from mlx_ssp.sft.stage import run_sft, sft_out_dir
from mlx_ssp.stage_config import load_stage, note_old_default


def load_config(config_path: str, overrides, overwrite: bool):
    """The run file's sft section (``--overwrite`` sets ``sft.overwrite``) through the one stage loader."""
    return load_stage(config_path, overrides, "sft", flags={"overwrite": True} if overwrite else None,
                      cls=SFTConfig)


@click.command("sft")
@click.argument("config_path", metavar="CONFIG.yaml", type=click.Path(dir_okay=False))
@set_option
@click.option("--domain", "domains", multiple=True, help="Train only this domain (repeatable).")
@click.option("--overwrite", is_flag=True, help="Discard earlier checkpoints and specialists instead of resuming.")
@export_gguf_option("each specialist trained")
@upload_options("the one specialist trained (give a single domain: sft.domains has one, or one --domain)")
@report_to_option
@no_progress_option
def cli(config_path: str, overrides: tuple[str, ...], domains: tuple[str, ...], overwrite: bool, export_gguf: bool,
        upload_repo: str | None, public: bool, report_to: tuple[str, ...]) -> None:
    """Train one LoRA specialist per domain (sft: section), keep the checkpoint with the best
    probe Pass@K, fuse it into OUT/specialists/<domain>/ with its model card. Re-running resumes."""
    cli_trackers = trackers.from_cli(report_to)
    check_upload(upload_repo, public)
    st = load_config(config_path, overrides, overwrite)
    if export_gguf:  # before training: the base's architecture decides whether its specialists convert

        base = model_config_json(st.model.path, st.model.revision)
        if st.cfg.dequantize:
            base = {k: v for k, v in base.items() if k not in ("quantization", "quantization_config")}
        check_exportable(base, f"--export-gguf (model {st.model.path})")
    chosen = list(dict.fromkeys(domains)) or list(st.cfg.domains)
    if upload_repo and len(chosen) != 1:
        raise UserError(f"--upload-repo uploads one specialist, and this run trains {len(chosen)} "
                        f"({', '.join(chosen) or 'none'}): add --domain D")
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
    for name in chosen:  # only this call's domains (the summary keeps earlier calls' too)
        spec = summary["domains"][name]["specialist"]
        if export_gguf:
            click.echo(f"{name}: GGUF -> {write_gguf(spec)}")
        if upload_repo:
            click.echo(f"{name}: uploaded -> {upload_model(spec, upload_repo, public=public)}")
