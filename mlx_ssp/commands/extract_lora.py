"""``mlx_ssp extract-lora BASE TUNED OUT --rank R``: a fine-tuned model as an mlx-lm LoRA adapter
of BASE (randomized truncated SVD of each linear layer's weight difference;
:mod:`mlx_ssp.merge.extract_lora`)."""

from __future__ import annotations

import json

import click

from mlx_ssp.merge.extract_lora import run_extract


@click.command("extract-lora")
@click.argument("base")
@click.argument("tuned")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--rank", type=click.IntRange(min=1), required=True, help="LoRA rank of every adapted layer.")
@click.option("--oversample", type=click.IntRange(min=0), default=8, show_default=True,
              help="Extra sketch columns of the randomized SVD (accuracy for speed).")
@click.option("--power-iters", type=click.IntRange(min=0), default=2, show_default=True,
              help="Subspace iterations of the randomized SVD (accuracy for speed).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random sketches (per tensor).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True,
              help="dtype of the stored lora_a / lora_b.")
@click.option("--overwrite", is_flag=True, help="Replace OUT_DIR if it is an adapter this command wrote.")
@click.option("--quiet", is_flag=True, help="Print only the summary, not each layer's error.")
def cli(base, tuned, out_dir, rank, oversample, power_iters, seed, dtype, overwrite, quiet):
    """Write OUT_DIR (adapters.safetensors + adapter_config.json) such that
    mlx_lm.load(BASE, adapter_path=OUT_DIR) approximates TUNED; prints each layer's relative
    reconstruction error ||D - D_r|| / ||D||. BASE and TUNED are model specs (directories, hub ids,
    MODEL+ADAPTER); MLX-quantized models are dequantized on read."""
    from pathlib import Path


    def show(fit):
        if not quiet:
            click.echo(f"{fit.module}  {fit.shape[0]}x{fit.shape[1]}  rel_error {fit.rel_error:.3e}")

    res = run_extract(base, tuned, Path(out_dir), rank, oversample=oversample, power_iters=power_iters, seed=seed,
                      dtype=dtype, overwrite=overwrite, on_module=show)
    if res["not_captured"]:
        click.echo(f"not captured by a LoRA adapter (relative difference): {json.dumps(res['not_captured'])}", err=True)
    click.echo(json.dumps(res))
