"""``mlx_ssp run CONFIG.yaml [--from STAGE | --only STAGE]``: the whole loop
(:func:`mlx_ssp.pipeline.run_pipeline`); the stage choices come from :data:`mlx_ssp.pipeline.STAGES`."""

from __future__ import annotations

from typing import Optional

import click

from mlx_ssp.commands.options import no_progress_option, report_to_option, set_option, upload_options
from mlx_ssp.errors import UserError
from mlx_ssp.pipeline import STAGES, run_pipeline
from mlx_ssp.trackers import from_cli


@click.command("run")
@click.argument("config_path", metavar="CONFIG.yaml", type=click.Path(dir_okay=False))
@set_option
@click.option("--from", "from_stage", type=click.Choice(STAGES), default=None,
              help="Rerun this stage and every stage after it (earlier stages must be complete; "
                   "an interrupted stage resumes).")
@click.option("--only", type=click.Choice(STAGES), default=None,
              help="Run only this stage: rerun it if complete, resume it if interrupted (earlier stages must "
                   "be complete).")
@upload_options("the run's final model (the distilled student, else the last RL model) once every stage is "
                "complete (config: upload.repo, upload.public)")
@report_to_option
@no_progress_option
def cli(config_path: str, overrides: tuple[str, ...], from_stage: Optional[str], only: Optional[str],
        upload_repo: Optional[str], public: bool, report_to: tuple[str, ...]) -> None:
    """Run the whole SSP loop from CONFIG.yaml: tasks -> rollout -> select -> sft -> merge -> rl -> eval,
    into the run directory (config key run_dir; --set run_dir=PATH moves it).

    Rerunning skips complete stages, resumes an interrupted one, and reruns a stage whose config
    changed together with every stage after it (saying so). The final table compares the base model,
    each specialist, the merged model and the RL model on held-out tasks. One process at a time
    writes a run directory (a second one stops at once); a non-empty directory that is not a run
    is refused. Every model the run writes gets a model card (README.md) with the held-out table.
    With report_to (or --report-to) the metrics also go to one tracker run, each stage its own
    namespace.
    """
    if from_stage and only:
        raise UserError("give --from or --only, not both")
    if upload_repo is not None:  # the flags are the upload: section's keys (beating the file)
        overrides = (*overrides, f"upload.repo={upload_repo}")
    if public:
        overrides = (*overrides, "upload.public=true")
    run_pipeline(config_path, overrides, from_stage=from_stage, only=only, report_to=from_cli(report_to))
