"""``mlx_ssp merge CONFIG.yml OUT_DIR``: merge models described by a mergekit YAML file.

A mergekit YAML is not a run file, so it is not read through :func:`mlx_ssp.stage_config.load_stage`:
it has no run directory (OUT_DIR is an argument), no sandbox and no top-level seed; ``--seed``
(default 0) is the DARE seed. Inside ``mlx_ssp run`` the ``merge:`` section's own ``seed`` wins,
else the run's seed (:func:`mlx_ssp.merge.engine.merge_models`)."""

from __future__ import annotations

import json

import click

from mlx_ssp.commands.options import report_to_option, set_option


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
@click.option("--dry-run", is_flag=True, help="Check the config and every tensor, print the plan, write nothing.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@report_to_option
@set_option
def cli(config, out_dir, overwrite, overwrite_any, out_shard_size, copy_tokenizer, seed, vocab_mismatch, workers, dry_run, quiet,
        report_to, overrides):
    """Merge the models of a mergekit CONFIG into OUT_DIR, streaming one tensor at a time (methods:
    mergekit 0.1.5's: linear, task_arithmetic, ties, dare_linear, dare_ties, breadcrumbs(_ties),
    della(_linear), sce, ram, ramplus_tl, slerp, nuslerp, multislerp, karcher, model_stock, nearswap,
    arcee_fusion, passthrough; inputs may be MLX-quantized). --set key=value edits the config.
    --report-to: the timing goes to the trackers (files beside OUT_DIR), the config is their params."""
    import yaml

    from mlx_ssp import trackers
    from mlx_ssp.errors import UserError
    from mlx_ssp.io import output_lock
    from mlx_ssp.merge.config import load_merge_config
    from mlx_ssp.merge.engine import input_paths, plan_merge, write_merge
    from mlx_ssp.merge.outdir import check_clear_of_inputs
    from pathlib import Path

    cli_trackers = trackers.from_cli(report_to) or ()
    cfg, text = load_merge_config(config, tuple(overrides))
    if Path(out_dir).exists() and not (overwrite or overwrite_any) and not dry_run:
        raise UserError(f"{out_dir} already exists; pass --overwrite to replace it")
    job = plan_merge(cfg, vocab_mismatch=vocab_mismatch, source_label=str(config))
    if dry_run:
        check_clear_of_inputs(Path(out_dir), input_paths(job, (Path(config),)))
        dtypes = sorted({p.cd for p in job.plans})
        click.echo(json.dumps({"method": cfg.merge_method, "models": [s.ref for s in job.sources],
                               "tensors": len(job.plans), "compute_dtypes": dtypes}, indent=2))
        return
    params = {**yaml.safe_load(text), "out_dir": str(out_dir), "seed": seed, "out_shard_size": out_shard_size,
              "vocab_mismatch": vocab_mismatch}
    where = Path(out_dir).expanduser().resolve().parent  # not inside OUT_DIR: a merge output is replaced whole
    with output_lock(out_dir), trackers.session(cli_trackers, dir=where, project=trackers.project_of(where),
                                                command="merge", params=params, scope_name="merge"):
        res = write_merge(job, Path(out_dir), overwrite=overwrite, out_shard_size=out_shard_size,
                          copy_tokenizer=copy_tokenizer, seed=seed, config_text=text, progress=not quiet,
                          workers=workers, overwrite_any=overwrite_any, protect=(Path(config),))
    click.echo(json.dumps(res))
