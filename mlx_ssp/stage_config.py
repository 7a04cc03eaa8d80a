"""One loader for a stage's config: every stage command (rollout, eval, select, sft, rl, and
``tasks export`` of a run file) and ``mlx_ssp run`` (:func:`mlx_ssp.pipeline.load_run`) read their run
file through :func:`load_stage`. (``mlx_ssp merge`` reads a mergekit YAML, not a run file.)

What it does, in order:
1. the run file (none: ``--set`` keys and flags only), ``--set`` applied, top-level keys checked;
   ``--model`` and the command's flags written into the data (flags beat the file);
2. the process-wide setup, once per load: the ``distributed:`` section's timeouts/backend
   (:func:`mlx_ssp.distributed.configure`; the group itself is initialised lazily by the stage's
   first collective, as before) and the top-level ``sandbox:`` policy;
3. the stage's section and the ``model:`` section validated, the section's ``output`` checked
   (:func:`mlx_ssp.io.check_output_path`: nothing in /proc, /sys, /dev, no device or pipe).

Flags reach the data through :func:`apply_flags` (the commands in :mod:`mlx_ssp.commands` name
them; this module holds no CLI code).

The rules, one each:
- seed: the section's own ``seed`` when it has one and it is set, else the file's top-level
  ``seed`` (an integer), else 0 (:func:`mlx_ssp.config.section_seed`);
- trackers: the top-level ``report_to`` (:func:`mlx_ssp.trackers.parse_report_to`; a command's
  ``--report-to`` beats it);
- run directory: the top-level ``run_dir``; else ``runs/<config file stem>``; with no file
  ``runs``, so a stage's default outputs ``<run_dir>/<stage>`` are ``runs/<stage>``
  (:func:`default_run_dir`). Older versions of ``mlx_ssp sft`` wrote to ``run`` and ``mlx_ssp rl``
  to ``runs/rl`` for a file without ``run_dir``; :func:`note_old_default` names such a directory
  when it holds an earlier run and the new place does not exist yet.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from mlx_ssp import distributed as dist
from mlx_ssp.config import load_file, load_section, section_seed
from mlx_ssp.errors import UserError
from mlx_ssp.io import check_output_path
from mlx_ssp.sandbox_policy import install_from_config
from mlx_ssp.trackers import parse_report_to


@dataclass(frozen=True)
class StageConfig:
    """A loaded run file as one stage sees it."""

    data: dict[str, Any]  # the raw file after --set and flags
    source: str  # what error messages name: the file, else "flags" / "--set"
    cfg: Any  # the validated section (None when no section was asked for)
    model: Any  # ModelConfig (None when not asked for)
    seed: int
    run_dir: Path
    run_dir_set: bool  # the file (or --set) named run_dir
    report_to: tuple[str, ...] = ()  # the trackers of the top-level report_to (mlx_ssp.trackers)

    def seeded(self):
        """The section with its unset ``seed`` filled in by the seed rule (rollout, eval: their
        requests read ``cfg.seed``)."""
        return with_seed(self.cfg, self.seed)


def top_seed(data: dict[str, Any], source: str) -> int:
    """The top-level ``seed`` (absent: 0); anything but an integer is an error."""
    seed = data.get("seed", 0)
    if not isinstance(seed, int):
        raise UserError(f"{source}: seed: must be an integer (got {seed!r})")
    return seed


def with_seed(cfg: Any, seed: int) -> Any:
    """``cfg`` with an unset ``seed`` replaced by ``seed`` (a copy; ``cfg`` itself is untouched)."""
    if cfg is None or getattr(cfg, "seed", 0) is not None:
        return cfg
    return cfg.model_copy(update={"seed": seed})


def default_run_dir(data: dict[str, Any], config_path: Optional[str | Path]) -> Path:
    """The run directory rule: ``run_dir``, else ``runs/<config stem>``, else ``runs``."""
    run_dir = data.get("run_dir") or ("runs/" + Path(config_path).stem if config_path else "runs")
    return Path(str(run_dir)).expanduser()


def note_old_default(st: StageConfig, old: Path, new: Path, how: str) -> None:
    """One stderr line when the old default location holds an earlier run that this run
    (defaulted to ``new``) would not resume; ``how`` says what to set to resume it."""
    if not st.run_dir_set and old.exists() and not new.exists():
        print(f"note: {old} holds an earlier run (the old default); this run writes {new}; "
              f"to resume the earlier one, {how}", file=sys.stderr)


def apply_flags(data: dict, section: str, flags: dict[str, Any]) -> dict:
    """Put non-None CLI flags into ``data[section]`` (dotted keys), so that flags beat the file."""
    sec = data.setdefault(section, {}) or {}
    if not isinstance(sec, dict):
        raise UserError(f"config section '{section}' must be a mapping")
    data[section] = sec
    for key, value in flags.items():
        if value is None or value == ():
            continue
        node = sec
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = list(value) if isinstance(value, tuple) else value
    return data


def _apply_model_and_flags(data: dict, section: Optional[str], flags: Optional[dict], model: Optional[str]) -> dict:
    if model is not None:
        data["model"] = model
    if flags is not None and section is not None:
        data = apply_flags(data, section, flags)
    return data


def load_stage(
    config_path: Optional[str | Path],
    overrides: tuple[str, ...] | list[str] = (),
    section: Optional[str] = None,
    *,
    flags: Optional[dict[str, Any]] = None,
    model: Optional[str] = None,
    cls: Optional[type] = None,
    with_model: bool = True,
) -> StageConfig:
    """Load ``config_path`` (+ ``overrides``, + ``flags`` into ``section``, + ``--model``), do the
    process-wide setup and validate ``section`` (class ``cls``, default its registered one) and,
    when ``with_model``, the ``model:`` section. ``flags`` (even empty) marks a command with flags:
    with no file, errors name ``flags`` instead of ``--set``."""
    data = _apply_model_and_flags(load_file(config_path, overrides), section, flags, model)
    source = str(config_path) if config_path else ("flags" if flags is not None else "--set")
    report_to = parse_report_to(data.get("report_to"), source)
    dist.configure(load_section(data, "distributed", source=source))  # timeouts under mlx.launch
    install_from_config(data, source)  # bounds what code tasks may ask of the sandbox, in every stage
    cfg = load_section(data, section, source=source, cls=cls) if section is not None else None
    if getattr(cfg, "output", None):  # refused before any work (a file or a directory, by stage)
        check_output_path(cfg.output, f"{section}.output", kind=None)
    mcfg = load_section(data, "model", source=source) if with_model else None
    return StageConfig(
        data=data, source=source, cfg=cfg, model=mcfg, seed=section_seed(cfg, top_seed(data, source)),
        run_dir=default_run_dir(data, config_path), run_dir_set=bool(data.get("run_dir")), report_to=report_to,
    )


def load_task_stage(config_path, overrides, section: str, flags: dict, model, output_what: str):
    """(ModelConfig, section with the seed rule applied, the whole :class:`StageConfig`)
    for a command that reads a task file and writes ``output_what`` (rollout, eval), through
    :func:`load_stage`; both paths must be set, by flag or file."""
    st = load_stage(config_path, overrides, section, flags=flags, model=model)
    cfg = st.seeded()
    if not cfg.tasks:
        raise UserError(f"no task file: pass --tasks FILE (or set {section}.tasks)")
    if not cfg.output:
        raise UserError(f"no output: pass -o {output_what} (or set {section}.output)")
    check_output_path(cfg.output, f"{section}.output")  # a file, before the model is loaded
    return st.model, cfg, st


__all__ = ["StageConfig", "apply_flags", "default_run_dir", "load_stage", "load_task_stage", "note_old_default",
           "section_seed", "top_seed", "with_seed"]
