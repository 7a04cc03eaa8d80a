"""``mlx_ssp doctor``: print what :func:`mlx_ssp.doctor.report` measured and what to fix."""

from __future__ import annotations

import click


@click.command("doctor")
def cli() -> None:
    """Print the platform, mlx and mlx-lm versions, the available backends (Metal, CUDA, CPU),
    the BLAS in use and a measured float32 matmul GFLOP/s, with what to do when something is
    missing."""
    from mlx_ssp.doctor import report

    rows, advice = report()
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        click.echo(f"{k:<{width}}  {v}")
    if advice:
        click.echo("\nto fix:")
        for a in advice:
            click.echo(f"  - {a}")
    else:
        click.echo("\nall good")
