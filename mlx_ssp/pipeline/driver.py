"""The driver of ``mlx_ssp run``: plan every stage from its state and fingerprint (:func:`plan_stage`),
then pass, skip, run, resume or rerun it; under mlx.launch rank 0 plans and every rank follows."""

from __future__ import annotations

import json
import time
from functools import partial
from pathlib import Path
from typing import Callable, Optional

from mlx_ssp import distributed as dist
from mlx_ssp import trackers
from mlx_ssp.errors import UserError
from mlx_ssp.hub import require_token
from mlx_ssp.io import JsonlAppender
from mlx_ssp.pipeline.outputs import add_table_to_cards, upload_final
from mlx_ssp.pipeline.registry import STAGE_REGISTRY, STAGES, active_stages, fingerprint
from mlx_ssp.pipeline.rundir import lock_run, move_stale, prepare_run_dir, read_state, write_state
from mlx_ssp.pipeline.runfile import Run, load_run
from mlx_ssp.pipeline.table import format_eval_table


def plan_stage(
    stage: str, state: dict, fp: str, *, from_stage: Optional[str], only: Optional[str], invalidated: bool
) -> tuple[str, str]:
    """What to do with one stage (pure): ``(action, why)`` with action one of ``pass`` (not ours to
    run: --only another stage), ``skip`` (complete and current), ``run``, ``resume`` (interrupted,
    same config, no earlier stage rerun: also when --from/--only force it, since its partial
    outputs are this config's) or ``rerun`` (outputs exist but are stale, or complete and forced:
    move them aside first). Raises UserError when --from/--only needs an earlier stage that is not
    complete."""
    idx = STAGES.index(stage)
    current = state.get("fingerprint") == fp and bool(state.get("complete"))
    if only is not None and stage != only:
        if not current and idx < STAGES.index(only):
            raise UserError(
                f"--only {only}: stage '{stage}' before it is not complete for this config; "
                f"run without --only (or with --from {stage}) first"
            )
        return "pass", ""
    forced = only == stage or (from_stage is not None and idx >= STAGES.index(from_stage))
    if from_stage is not None and not forced:
        if not current:
            raise UserError(
                f"--from {from_stage}: stage '{stage}' before it is not complete for this config; "
                "run without --from first"
            )
        return "skip", f"kept by --from {from_stage}"
    stale = bool(state) and state.get("fingerprint") != fp
    if current and not forced and not invalidated:
        return "skip", f"fingerprint {fp}"
    if stale:
        return "rerun", "its config (or an earlier stage's) changed"
    if state and invalidated:
        return "rerun", "an earlier stage reran"
    if state and not state.get("complete"):
        return "resume", "interrupted"
    if state and forced:
        return "rerun", "forced by --from/--only"
    return "run", ""



def execute_stage(run: Run, stage: str, fp: str, log: JsonlAppender) -> dict:
    """Run one stage between an incomplete and a complete state record (a kill leaves it incomplete)."""
    t0 = time.time()
    write_state(run, stage, {"fingerprint": fp, "complete": False, "started": t0})
    log.write({"stage": stage, "event": "start", "time": t0, "fingerprint": fp})
    with trackers.scope(stage):  # what the stage logs is under its name
        metrics = STAGE_REGISTRY[stage].run(run)
    t1 = time.time()
    done = {"fingerprint": fp, "complete": True, "started": t0, "finished": t1, "seconds": t1 - t0, "metrics": metrics}
    write_state(run, stage, done)
    log.write({"stage": stage, "event": "end", "time": t1, "seconds": t1 - t0, "fingerprint": fp, "metrics": metrics})
    trackers.log(stage, {"stage_seconds": t1 - t0}, step=0)  # the stage's own metrics went from inside it
    return done


def run_pipeline(
    config_path: str | Path,
    overrides: tuple[str, ...] = (),
    *,
    from_stage: Optional[str] = None,
    only: Optional[str] = None,
    progress: bool = True,
    echo: Callable[[str], None] = partial(print, flush=True),  # flushed: progress bars write between lines
    report_to: Optional[tuple[str, ...]] = None,
) -> dict:
    """Run (or resume) the loop of ``config_path``; ``report_to``: the trackers (None: the run
    file's ``report_to``), one tracker run for the whole call in ``RUN_DIR`` (:mod:`mlx_ssp.trackers`)."""
    for name, stage in (("--from", from_stage), ("--only", only)):
        if stage is not None and stage not in STAGES:
            raise UserError(f"{name} {stage}: unknown stage; valid: {', '.join(STAGES)}")
    run = load_run(config_path, overrides, progress)
    upload = run.section("upload") if run.data.get("upload") is not None else None
    if upload is not None and upload.public and upload.repo is None:
        raise UserError(f"{run.source}: upload.public (--public) is set but upload.repo is not; "
                        "give --upload-repo ORG/NAME (or upload.repo), or drop --public")
    if upload is not None and upload.repo is not None:
        require_token()  # before the run, not after hours of it
    for name, stage in (("--from", from_stage), ("--only", only)):
        if stage is not None and not STAGE_REGISTRY[stage].enabled(run):
            raise UserError(f"{name} {stage}: {run.source} has no {STAGE_REGISTRY[stage].section}: section, so no {stage} stage")
    if run.run_dir.exists() and not run.run_dir.is_dir():
        raise UserError(f"run_dir {run.run_dir} is a file, not a directory; set run_dir to a new or empty directory")
    run.run_dir.mkdir(parents=True, exist_ok=True)
    with lock_run(run):
        resolved = prepare_run_dir(run)
        with trackers.session(run.report_to if report_to is None else report_to, dir=run.run_dir,
                              project=trackers.project_of(run.run_dir), command="run", name=run.data.get("name"),
                              params=resolved):
            results = run_stages(run, from_stage=from_stage, only=only, echo=echo)
        table_path = run.stage_dir("eval") / "table.json"
        if table_path.exists() and read_state(run, "eval").get("complete"):
            text = format_eval_table(json.loads(table_path.read_text()))
            echo("\n" + text)
            if "eval" in results:  # eval is current, so is every stage: the cards get its table, then the upload
                add_table_to_cards(run, text)
                upload_final(run, upload, echo)
    return results



def run_stages(run: Run, *, from_stage: Optional[str], only: Optional[str], echo: Callable[[str], None]) -> dict:
    """Every stage in order: plan it from its state and fingerprint, then pass, skip or run it.
    Under mlx.launch rank 0 plans and keeps the books (state records, the run's metrics.jsonl, stale
    outputs moved aside) and every rank follows its plan: a rank reading the state rank 0 is writing
    would plan otherwise, and one moving outputs aside would move rank 0's."""
    previous = ""
    invalidated = False  # a stage ran: every stage after it must run too
    results: dict[str, dict] = {}
    with dist.appender(run.run_dir / "metrics.jsonl") as log:
        for stage in active_stages(run):
            fp = previous = fingerprint(run, stage, previous)
            msg = None
            if dist.is_main():  # the other ranks' state files may lag (or not be shared): rank 0 decides
                try:
                    state = read_state(run, stage)
                    action, why = plan_stage(stage, state, fp, from_stage=from_stage, only=only,
                                             invalidated=invalidated)
                    msg = {"plan": [action, why], "metrics": state.get("metrics", {})}
                except UserError as e:  # every rank fails with it, not just rank 0
                    msg = {"error": str(e)}
            msg = dist.broadcast_object(msg, what=f"the plan of stage {stage}")
            if "error" in msg:
                raise UserError(msg["error"])
            (action, why), state = msg["plan"], {"metrics": msg["metrics"]}
            if action == "pass":
                continue
            if action == "skip":
                echo(f"[{stage}] complete, skipping ({why})")
                results[stage] = state.get("metrics", {})
                continue
            invalidated = True
            results[stage] = act_on_stage(run, stage, action, why, fp, log, echo)
    return results


def act_on_stage(run: Run, stage: str, action: str, why: str, fp: str, log: JsonlAppender,
                 echo: Callable[[str], None]) -> dict:
    """Run, resume or rerun one stage (a rerun first moves the stale outputs aside); its metrics."""
    if action == "rerun":
        moved = move_stale(run, stage) if dist.is_main() else None
        dist.barrier(f"stale outputs of {stage} moved")  # before any rank writes the stage's new ones
        echo(f"[{stage}] rerunning: {why}; old outputs moved to {moved or '(by rank 0)'}")
    else:
        echo(f"[{stage}] " + ("resuming an interrupted run" if action == "resume" else "running"))
    done = execute_stage(run, stage, fp, log)
    echo(f"[{stage}] done in {done['seconds']:.1f}s")
    return done["metrics"]
