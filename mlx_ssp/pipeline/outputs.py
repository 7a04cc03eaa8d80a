"""The models a run wrote (in the eval table's order), its final model, and what happens to them once
the eval table is made: the table goes into their cards and the final model is uploaded."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from mlx_ssp import distributed as dist
from mlx_ssp.card import add_eval_table
from mlx_ssp.distill import read_report
from mlx_ssp.errors import UserError
from mlx_ssp.hub import upload_model
from mlx_ssp.models import resolve_model
from mlx_ssp.pipeline.runfile import BLEND, Run
from mlx_ssp.rl.phases import phase_dir, phase_models


def eval_models(run: Run) -> dict[str, str]:
    """Every model the loop produced, in table order: base, specialists, the blend (if trained), merged,
    RL (with ``rl.phases``: one row ``rl:<phase>`` per phase, in phase order)."""
    return {"base": str(resolve_model(run.section("model").path)), **run_models(run)}


def run_models(run: Run) -> dict[str, str]:
    """The models this run wrote, in table order (:func:`eval_models` without the base)."""
    models = {}
    for d, p in run.specialists().items():
        models[f"specialist:{d}"] = str(p)
    if run.blend() is not None:
        models[BLEND] = str(run.blend())
    models["merged"] = str(run.stage_dir("merge") / "model")
    models.update(rl_models(run))
    distilled = (read_report(run.stage_dir("distill")) or {}).get("model") if run.data.get("distill") is not None else None
    if distilled:
        models["distilled"] = distilled
    return models


def rl_models(run: Run) -> dict[str, str]:
    """The kept RL checkpoints, fused, in order: ``rl:<phase>`` per phase, or the one ``rl`` model."""
    rl_cfg = run.section("rl")
    if rl_cfg.phases:
        return {f"rl:{name}": p for name, p in phase_models(run.stage_dir("rl"), rl_cfg).items()}
    rl_model = run.stage_dir("rl") / "model"
    return {"rl": str(rl_model)} if rl_model.exists() else {}


def add_table_to_cards(run: Run, table_md: str) -> None:
    """Put the held-out table into the card of every model this run wrote (never the base's, nor a
    directory outside the run). Under mlx.launch rank 0 alone writes them (the ranks are one run)."""
    if not dist.is_main():
        return
    root = run.run_dir.resolve()
    for name, path in run_models(run).items():
        p = Path(path).resolve()
        if root in p.parents:
            add_eval_table(p, table_md, note=f"The held-out table of the run that made this model "
                                             f"(this model is the row `{name}`).")


def final_model(run: Run) -> str:
    """The run's final model: the distilled student with a ``distill:`` section, else the RL model (with
    ``rl.phases``, the last phase's); a one-line UserError when it is not there."""
    if run.data.get("distill") is not None:
        path = (read_report(run.stage_dir("distill")) or {}).get("model")
        what = "the distilled student"
    else:
        phases = run.section("rl").phases
        path = phase_dir(run.stage_dir("rl"), phases[-1].name) / "model" if phases else run.stage_dir("rl") / "model"
        what = f"the RL model of phase {phases[-1].name}" if phases else "the RL model"
    if not path or not (Path(path) / "config.json").is_file():
        raise UserError(f"{run.run_dir}: {what} is missing ({path or 'no distill report'}); rerun the run to make it")
    return str(path)


def upload_final(run: Run, upload, echo: Callable[[str], None]) -> Optional[str]:
    """Upload :func:`final_model` as ``upload.repo`` says; its URL (None: no upload asked, or not rank 0:
    under mlx.launch the ranks are one run, and one upload)."""
    if upload is None or upload.repo is None or not dist.is_main():
        return None
    path = final_model(run)
    url = upload_model(path, upload.repo, public=upload.public)
    echo(f"[upload] {path} -> {url} ({'public' if upload.public else 'private unless the repo already existed'})")
    return url

