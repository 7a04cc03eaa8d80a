"""``mlx_ssp report RUN_DIR``: the run's Markdown summary and plots (:func:`mlx_ssp.report.build_report`)."""

from __future__ import annotations

import click


@click.command("report")
@click.argument("run_dir", metavar="RUN_DIR", type=click.Path(file_okay=False))
def cli(run_dir: str) -> None:
    """Write RUN_DIR/report/report.md with PNG plots: pass@k by stage and domain, the specialists'
    probe curves with the chosen checkpoint marked, RL reward / pass rate / MGPO weight / clip
    fraction per step, and the spectrum (distinct correct solutions per prompt)."""
    from mlx_ssp.report import build_report

    path = build_report(run_dir)
    click.echo(str(path))
