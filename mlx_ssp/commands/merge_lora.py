"""``mlx_ssp merge-lora CONFIG.yml OUT_DIR``: merge LoRA adapters of one base into one adapter,
never building the merged model (:mod:`mlx_ssp.merge.lora_merge`)."""

from __future__ import annotations

import json

import click

from mlx_ssp.commands.options import set_option
from mlx_ssp.io import output_lock
from mlx_ssp.merge.lora_merge import load_lora_merge_config, run_lora_merge


@click.command("merge-lora")
@click.argument("config", type=click.Path(dir_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--seed", type=int, default=0, show_default=True,
              help="DARE / DELLA mask seed (the same masks as `mlx_ssp merge --seed`) and the SVD sketch seed.")
@click.option("--overwrite", is_flag=True, help="Replace OUT_DIR if it is an adapter this command wrote.")
@click.option("--quiet", is_flag=True, help="Print only the summary, not each module's truncation error.")
@set_option
def cli(config, out_dir, seed, overwrite, quiet, overrides):
    """Merge the mlx-lm LoRA adapters listed as the models of CONFIG (mergekit's YAML: models,
    merge_method, parameters, optional base_model, plus rank, dtype, oversample, power_iters) into
    one adapter OUT_DIR, loadable with mlx_lm.load(BASE, adapter_path=OUT_DIR). linear is exact
    on the factors (rank = the sum of the ranks unless `rank` truncates it); task_arithmetic, ties,
    dare_*, breadcrumbs*, della* merge each layer's products and truncate back to `rank` by SVD.
    Prints each module's relative truncation error (also in OUT_DIR/lora_merge.json)."""
    from pathlib import Path


    cfg, data = load_lora_merge_config(config, tuple(overrides))

    def show(res):
        if not quiet:
            click.echo(f"{res.module}  {res.shape[0]}x{res.shape[1]}  rel_error {res.rel_error:.3e}")

    with output_lock(out_dir):
        res = run_lora_merge(cfg, Path(out_dir), seed=seed, overwrite=overwrite, config_data=data,
                             protect=(Path(config),), on_module=show)
    click.echo(json.dumps(res))
