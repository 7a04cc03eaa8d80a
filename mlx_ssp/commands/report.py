"""``mlx_ssp report RUN_DIR``: the run's Markdown summary and plots (:func:`mlx_ssp.report.build_report`);
with several runs, a comparison with bands across seeds (:func:`mlx_ssp.report.build_comparison`)."""

from __future__ import annotations

import click

from mlx_ssp.errors import UserError
from mlx_ssp.report import build_comparison, build_report


@click.command("report")
@click.argument("runs", metavar="RUN_DIR... | LABEL=RUN_DIR...", nargs=-1, required=True)
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="where a comparison of several runs is written (required with more than one run)")
def cli(runs: tuple[str, ...], out: str | None) -> None:
    """One RUN_DIR: write RUN_DIR/report/report.md with PNG plots: pass@k by stage and domain, the
    specialists' probe curves with the chosen checkpoint marked, RL reward / pass rate / MGPO weight /
    clip fraction per step, and the spectrum (distinct correct solutions per prompt).

    Several runs (``LABEL=RUN_DIR``: runs sharing a label are seeds of one setting): write
    OUT/compare.md and OUT/rl_bands.png, per-step reward and pass@1 of each setting with a band of
    +- 1 standard error across its seeds, and the first / last steps' means with their errors."""
    from pathlib import Path


    if len(runs) == 1 and ("=" not in runs[0] or Path(runs[0]).is_dir()) and out is None:
        click.echo(str(build_report(runs[0])))
        return
    if out is None:
        raise UserError("a comparison of several runs needs --out DIR")
    click.echo(str(build_comparison(list(runs), out)))
