"""``mlx_ssp doctor [CONFIG]``: print what :func:`mlx_ssp.doctor.report` measured and what to fix;
with a run file, also the predicted peak memory of its rl: stage (:func:`mlx_ssp.doctor.rl_memory`);
with ``--kernels``, only the custom kernels' self-check (:func:`mlx_ssp.doctor.kernel_check`)."""

from __future__ import annotations

import click

from mlx_ssp.commands.options import set_option
from mlx_ssp.doctor import kernel_check, report, rl_memory
from mlx_ssp.errors import UserError


@click.command("doctor")
@click.argument("config_path", type=click.Path(dir_okay=False, exists=True), required=False)
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=256, show_default=True,
              help="Prompt length (tokens, chat template included) the rl memory prediction assumes.")
@click.option("--kernels", is_flag=True,
              help="Only check the custom kernels: each against its plain-MLX reference on this machine's Metal or "
                   "CUDA back-end, forward and backward, with the worst error and the speedup (under a minute). "
                   "Exits 1 when a check fails; without Metal or CUDA it says so and exits 0.")
@set_option
def cli(config_path, prompt_tokens, kernels, overrides) -> None:
    """Print the platform, mlx and mlx-lm versions, the available backends (Metal, CUDA, CPU),
    the BLAS in use and a measured float32 matmul GFLOP/s, with what to do when something is
    missing. With CONFIG_PATH (a run YAML), also the predicted peak memory of one step of its rl:
    stage, from the model's config.json (no weights loaded), and a warning when it exceeds this
    machine's memory. With --kernels, only the custom kernels' check against their reference."""
    if kernels:
        if config_path is not None or overrides:  # the kernel check reads no run file: say so, not ignore it
            raise UserError("--kernels checks the custom kernels only and takes no CONFIG_PATH or --set; "
                            "run mlx_ssp doctor CONFIG_PATH for the rl memory prediction")
        lines, ok = kernel_check()
        for line in lines:
            click.echo(line)
        if not ok:
            raise SystemExit(1)
        return
    rows, advice = report()
    if config_path is not None or overrides:
        more_rows, more_advice = rl_memory(config_path, overrides, prompt_tokens=prompt_tokens)
        rows, advice = rows + more_rows, advice + more_advice
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        click.echo(f"{k:<{width}}  {v}")
    if advice:
        click.echo("\nto fix:")
        for a in advice:
            click.echo(f"  - {a}")
    else:
        click.echo("\nall good")
