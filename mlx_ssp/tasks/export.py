"""Tasks from a YAML file for ``mlx_ssp tasks export``: a run file's ``tasks:`` section (read through
the one stage loader, as ``mlx_ssp run`` reads it: same ``tasks.seed``, same sandbox policy for the
code tasks' checks) or a bare ``tasks:`` section, with the command's ``--seed``/``--size``/``--split``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from mlx_ssp.config import apply_overrides, read_yaml, validate
from mlx_ssp.stage_config import load_stage
from mlx_ssp.tasks.build import build_split
from mlx_ssp.tasks.config import SPLITS, TasksConfig


def is_yaml(source: str) -> bool:
    return source.endswith((".yaml", ".yml")) and Path(source).is_file()


def load_tasks_section(source: str, overrides: tuple[str, ...]):
    """The validated ``tasks:`` section of ``source`` (+ ``--set``): a run file through
    :func:`mlx_ssp.stage_config.load_stage`, a bare section (not a run file) as written."""
    raw = read_yaml(source)
    if "tasks" in raw:
        return load_stage(source, overrides, "tasks", with_model=False).cfg
    section = apply_overrides({"tasks": raw}, overrides)["tasks"]
    return validate(TasksConfig, section, source=source, prefix="tasks")


def export_yaml(source: str, overrides: tuple[str, ...] = (), *, seed: Optional[int] = None,
                size: Optional[int] = None, split: Optional[str] = None) -> list:
    """The tasks of ``split`` (``None``/``all``: every split, each task tagged with metadata.split);
    ``seed`` replaces ``tasks.seed`` and ``size`` every domain's size of the chosen splits."""
    cfg = load_tasks_section(source, overrides)
    if seed is not None:
        cfg.seed = seed
    splits = SPLITS if split in (None, "all") else (split,)
    if size is not None:
        for d in cfg.domains.values():
            for s in splits:
                setattr(d.sizes, s, size)
    return [t for s in splits for t in build_split(cfg, s)]
