"""``mlx_ssp merge CONFIG.yml OUT_DIR``: merge models described by a mergekit YAML file, or run the
merges of a multimerge config (several YAML documents; :mod:`mlx_ssp.merge.multi`).

A mergekit YAML is not a run file, so it is not read through :func:`mlx_ssp.stage_config.load_stage`:
it has no run directory (OUT_DIR is an argument), no sandbox and no top-level seed; ``--seed``
(default 0) is the DARE seed. Inside ``mlx_ssp run`` the ``merge:`` section's own ``seed`` wins,
else the run's seed (:func:`mlx_ssp.merge.engine.merge_models`)."""

from __future__ import annotations

import json
from pathlib import Path

import click
import yaml

from mlx_ssp import trackers
from mlx_ssp.commands.options import export_gguf_option, report_to_option, set_option, upload_options
from mlx_ssp.errors import UserError
from mlx_ssp.gguf_export import check_exportable
from mlx_ssp.gguf_export import export_gguf as write_gguf
from mlx_ssp.hub import check_upload, upload_model
from mlx_ssp.io import output_lock
from mlx_ssp.merge.config import load_merge_config
from mlx_ssp.merge.engine import input_paths, output_config, plan_merge, write_merge
from mlx_ssp.merge.multi import (
    Layout,
    default_intermediate_dir,
    is_multimerge,
    load_multimerge,
    read_merge_documents,
    run_multimerge,
)
from mlx_ssp.merge.multi import dry_run as multi_dry_run
from mlx_ssp.merge.outdir import check_clear_of_inputs


@click.command("merge")
@click.argument("config", type=click.Path(dir_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--overwrite", is_flag=True,
              help="Replace OUT_DIR if it is a previous merge output (it is swapped in only at the end).")
@click.option("--overwrite-any", is_flag=True,
              help="Replace OUT_DIR even if it is not a previous merge output (its contents are deleted). "
                   "An OUT_DIR that is, holds or lies inside an input, or holds the working directory, is "
                   "always refused.")
@click.option("--out-shard-size", default="5GB", show_default=True, help="Largest output shard (e.g. 2GB, 500MB).")
@click.option("--copy-tokenizer/--no-copy-tokenizer", default=True, show_default=True,
              help="Copy the tokenizer files of the base (or tokenizer_source) model.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="DARE seed; masks depend only on (seed, tensor name, model).")
@click.option("--vocab-mismatch", type=click.Choice(["error", "truncate", "pad"]), default="error", show_default=True,
              help="Embedding/lm_head rows that differ from the reference model: fail, cut longer ones, or fill "
                   "shorter ones with the reference's rows.")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Tensors merged side by side on threads [default: 2 on the CPU, 1 on a GPU]; each adds one "
                   "tensor's working set to the peak memory. The output does not depend on it.")
@click.option("--intermediate-dir", "-I", type=click.Path(file_okay=False), default=None,
              help="Multimerge config (several merges): where the named merges are written "
                   "[default: OUT_DIR.intermediates beside OUT_DIR].")
@click.option("--lazy/--no-lazy", default=True, show_default=True,
              help="Multimerge config: keep each merge whose fingerprint (config, inputs, options) is unchanged; "
                   "--no-lazy redoes every merge.")
@click.option("--dry-run", is_flag=True, help="Check the config and every tensor (every merge of a multimerge), "
                                              "print the plan, write nothing.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@export_gguf_option("the merged model")
@upload_options("OUT_DIR (the merged model; the GGUF file too with --export-gguf)")
@report_to_option
@set_option
def cli(config, out_dir, overwrite, overwrite_any, out_shard_size, copy_tokenizer, seed, vocab_mismatch, workers,
        intermediate_dir, lazy, dry_run, quiet, export_gguf, upload_repo, public, report_to, overrides):
    """Merge the models of a mergekit CONFIG into OUT_DIR, streaming one tensor at a time (methods:
    mergekit 0.1.5's: linear, task_arithmetic, ties, dare_linear, dare_ties, breadcrumbs(_ties),
    della(_linear), sce, ram, ramplus_tl, slerp, nuslerp, multislerp, karcher, model_stock, nearswap,
    arcee_fusion, passthrough; inputs may be MLX-quantized). --set key=value edits the config.
    OUT_DIR gets a model card (README.md: method, inputs, the config). --report-to: the timing goes to
    the trackers (files beside OUT_DIR), the config is their params.

    A CONFIG of several YAML documents, each named (name: X) but the final one, is a multimerge
    (the format of mergekit's mergekit-multi): the named merges are written to --intermediate-dir and
    read by name, the final one to OUT_DIR; a rerun keeps each merge whose config and inputs are
    unchanged."""
    cli_trackers = trackers.from_cli(report_to) or ()
    check_upload(upload_repo, public)  # a bad repo id or no token stops here, before the merge
    docs = read_merge_documents(config)
    if is_multimerge(docs):
        if overrides:
            raise UserError(f"{config}: --set does not apply to a multimerge config (several merges); edit the file")
        mm = load_multimerge(config, docs)
        layout = Layout(Path(out_dir), Path(intermediate_dir) if intermediate_dir else default_intermediate_dir(out_dir))
        opts = {"out_shard_size": out_shard_size, "copy_tokenizer": copy_tokenizer, "seed": seed,
                "vocab_mismatch": vocab_mismatch, "lazy": lazy}
        if dry_run:
            click.echo(json.dumps(multi_dry_run(mm, layout, **opts), indent=2))
            return
        check = (lambda job: check_exportable(output_config(job), f"--export-gguf ({config})")) if export_gguf else None
        params = {"config": mm.source, "merges": [s.name for s in mm.steps], "out_dir": str(out_dir), "seed": seed,
                  "out_shard_size": out_shard_size, "vocab_mismatch": vocab_mismatch} if cli_trackers else None
        layout.check(mm)  # before the locks: a lock file beside -I inside OUT_DIR would create OUT_DIR
        where = Path(out_dir).expanduser().resolve().parent
        with output_lock(out_dir), output_lock(layout.intermediate_dir), \
                trackers.session(cli_trackers, dir=where, project=trackers.project_of(where), command="merge",
                                 params=params, scope_name="merge"):
            res = run_multimerge(mm, layout, overwrite=overwrite, overwrite_any=overwrite_any, progress=not quiet,
                                 workers=workers, before_final=check, echo=lambda line: click.echo(line, err=True),
                                 **opts)
            if export_gguf:
                res["gguf"] = str(write_gguf(out_dir))
        if upload_repo:
            res["uploaded"] = upload_model(out_dir, upload_repo, public=public)
        click.echo(json.dumps(res))
        return
    for given, opt in ((intermediate_dir, "--intermediate-dir"), (not lazy, "--no-lazy")):
        if given:
            raise UserError(f"{config}: {opt} applies to a multimerge config (several merges) only")
    cfg, text = load_merge_config(config, tuple(overrides))
    if Path(out_dir).exists() and not (overwrite or overwrite_any) and not dry_run:
        raise UserError(f"{out_dir} already exists; pass --overwrite to replace it")
    job = plan_merge(cfg, vocab_mismatch=vocab_mismatch, source_label=str(config))
    if export_gguf:
        check_exportable(output_config(job), f"--export-gguf ({config})")
    if dry_run:
        check_clear_of_inputs(Path(out_dir), input_paths(job, (Path(config),)))
        dtypes = sorted({p.cd for p in job.plans})
        click.echo(json.dumps({"method": cfg.merge_method, "models": [s.ref for s in job.sources],
                               "tensors": len(job.plans), "compute_dtypes": dtypes}, indent=2))
        return
    params = None  # the trackers' run parameters, only built when one is on
    if cli_trackers:
        params = {**yaml.safe_load(text), "out_dir": str(out_dir), "seed": seed, "out_shard_size": out_shard_size,
                  "vocab_mismatch": vocab_mismatch}
    where = Path(out_dir).expanduser().resolve().parent  # not inside OUT_DIR: a merge output is replaced whole
    with output_lock(out_dir), trackers.session(cli_trackers, dir=where, project=trackers.project_of(where),
                                                command="merge", params=params, scope_name="merge"):
        res = write_merge(job, Path(out_dir), overwrite=overwrite, out_shard_size=out_shard_size,
                          copy_tokenizer=copy_tokenizer, seed=seed, config_text=text, progress=not quiet,
                          workers=workers, overwrite_any=overwrite_any, protect=(Path(config),))
        if export_gguf:
            res["gguf"] = str(write_gguf(out_dir))
    if upload_repo:
        res["uploaded"] = upload_model(out_dir, upload_repo, public=public)
    click.echo(json.dumps(res))
