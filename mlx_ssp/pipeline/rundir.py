"""The run directory: its state records, the check that it is a run (or empty), config.resolved.yaml,
the driver's locks and stale outputs moved aside."""

from __future__ import annotations

import json
import os
import shutil
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator, Optional

import yaml

from mlx_ssp import distributed as dist
from mlx_ssp.errors import UserError
from mlx_ssp.io import exclusive_lock, output_lock, write_json_atomic, write_text_atomic
from mlx_ssp.pipeline.registry import STAGES, active_stages
from mlx_ssp.pipeline.runfile import Run, resolved_config, sft_config

STATE_FILE = "_stage.json"
#: the run's own state file, written when a run starts (every version wrote it): a directory with it is a run
RUN_MARKER = "config.resolved.yaml"
#: the driver's lock file in the run directory, held for the whole run
RUN_LOCK = ".run.lock"


def read_state(run: Run, stage: str) -> dict:
    p = run.stage_dir(stage) / STATE_FILE
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def write_state(run: Run, stage: str, state: dict) -> None:
    if dist.is_main():  # one writer under mlx.launch: the other ranks follow rank 0's plan
        write_json_atomic(run.stage_dir(stage) / STATE_FILE, state)


def move_stale(run: Run, stage: str) -> Optional[Path]:
    """Move a stage's outputs aside (never reuse stale outputs, never lose them)."""
    d = run.stage_dir(stage)
    if not d.exists():
        return None
    dest = run.run_dir / ".stale" / f"{stage}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(d), dest)
    return dest


def prepare_run_dir(run: Run) -> dict:
    """Check the run directory (:func:`check_run_dir`) and write config.resolved.yaml; the resolved
    config. Under mlx.launch rank 0 alone does both and a refusal reaches every rank as one line: a
    rank checking while rank 0 writes the marker would see a directory that holds a file but no run."""
    resolved, error = resolved_config(run), None
    if dist.is_main():
        try:
            check_run_dir(run.run_dir)
            write_text_atomic(run.run_dir / RUN_MARKER, yaml.safe_dump(resolved, sort_keys=False))
        except UserError as e:
            error = str(e)
    error = dist.broadcast_object(error, what="the check of the run directory")
    if error is not None:
        raise UserError(error)
    return resolved



def stage_outputs(run: Run) -> list[Path]:
    """Every directory the run's stages write: ``RUN_DIR/<stage>`` (and ``sft.out_dir`` when set)."""
    outs = [run.stage_dir(s) for s in active_stages(run)]
    sft_out = Path(sft_config(run).out_dir)
    return outs + ([sft_out] if sft_out != run.stage_dir("sft") else [])


@contextmanager
def lock_run(run: Run) -> Iterator[None]:
    """Hold the run directory's lock (:data:`RUN_LOCK`) and the output lock of every stage directory
    (:func:`stage_outputs`) for the block, or fail at once with one line naming the directory and the
    holder's pid. Different files from the locks the stages take inside (``rollout/.rollouts.jsonl.lock``),
    so the driver never waits on itself. Under mlx.launch rank 0 alone holds them (the other ranks
    are the same run)."""
    if not dist.is_main():
        yield
        return
    with ExitStack() as locks:
        locks.enter_context(exclusive_lock(run.run_dir / RUN_LOCK, f"run directory {run.run_dir}"))
        for out in stage_outputs(run):
            locks.enter_context(output_lock(out, f"{out} (a stage directory of run {run.run_dir})"))
        yield


#: entries a directory may hold and still count as empty for a new run
_IGNORED = frozenset({RUN_LOCK, ".DS_Store"} | {f".{s}.lock" for s in STAGES})


def check_run_dir(run_dir: Path) -> None:
    """Refuse a run directory that holds something and is not a run (no :data:`RUN_MARKER`): the run
    would write its stage folders into it and later move them, or its own, to ``.stale/``."""
    if (run_dir / RUN_MARKER).exists():
        return
    others = sorted(p.name for p in run_dir.iterdir() if p.name not in _IGNORED)
    if others:
        shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        raise UserError(f"run_dir {run_dir} is not empty ({shown}) and is not an mlx_ssp run (no {RUN_MARKER}); "
                        "set run_dir to a new or empty directory (--set run_dir=PATH)")

