"""The run file of ``mlx_ssp run``: the :class:`Run` every stage gets, the run file's sections
(:data:`SECTIONS`, checked up front by :func:`load_run`) and their resolved form (config.resolved.yaml)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from mlx_ssp.config import load_section, plain, validate
from mlx_ssp.errors import UserError
from mlx_ssp.rollout.endpoint import teacher_section
from mlx_ssp.select import safe_dirname
from mlx_ssp.sft import SFTConfig
from mlx_ssp.stage_config import load_stage

#: the SFT "domain" trained on every domain's data mixed when ``sft.blend`` is set
BLEND = "blend"


@dataclass(frozen=True)
class Section:
    """One top-level section of a run file, as an entry of :data:`SECTIONS`."""

    name: str
    check: Callable[[Run], Any]  # validates it (load_run calls these in SECTIONS order)
    resolve: Optional[Callable[[Run], Any]] = None  # its form in config.resolved.yaml; None: as written
    optional: bool = False  # counts in a fingerprint only when the run file sets it


@dataclass
class Run:
    """What every stage function gets: the run directory, the raw file and the validated sections."""

    run_dir: Path
    data: dict[str, Any]
    source: str
    seed: int
    sections: dict[str, Any] = field(default_factory=dict)
    progress: bool = True
    report_to: tuple[str, ...] = ()  # the run file's trackers (mlx_ssp.trackers)

    def section(self, name: str):
        if name not in self.sections:
            if name == "teacher" and self.data.get("teacher") is None:
                self.sections[name] = None
            else:
                self.sections[name] = load_section(self.data, name, source=self.source)
        return self.sections[name]

    def stage_dir(self, stage: str) -> Path:
        return self.run_dir / stage

    @property
    def domains(self) -> list[str]:
        return list(self.section("tasks").domains)

    def tasks_path(self, split: str) -> Path:
        return self.run_dir / "tasks" / f"{split}.jsonl"

    def specialists(self) -> dict[str, Path]:
        """The fused specialist of each domain (the blend, if trained, is not one: it is never merged)."""
        return {d: p for d, p in self._sft_models().items() if d != BLEND}

    def blend(self) -> Optional[Path]:
        return self._sft_models().get(BLEND)

    def _sft_models(self) -> dict[str, Path]:
        summary = json.loads((self.stage_dir("sft") / "summary.json").read_text())
        return {d: Path(v["specialist"]) for d, v in summary["domains"].items()}


def sft_config(run: Run):
    """The sft section with the run's defaults filled in: every task domain, its probe split."""
    raw = dict(run.data.get("sft") or {})
    domains = raw.get("domains") or run.domains
    if isinstance(domains, (list, tuple)):
        domains = {d: {} for d in domains}
    filled = {}
    for d, spec in domains.items():
        spec = dict(spec or {})
        spec.setdefault("data", str(run.stage_dir("select") / safe_dirname(d)))
        spec.setdefault("probe_tasks", str(run.tasks_path("probe")))
        filled[d] = spec
    if raw.get("blend"):
        if BLEND in filled:
            raise UserError(f"{run.source}: sft.blend trains a specialist named '{BLEND}': rename the domain '{BLEND}'")
        filled[BLEND] = {"data": str(run.stage_dir("select") / "_blend"), "probe_tasks": str(run.tasks_path("probe")),
                         "probe_domains": [d for d in filled if d != BLEND]}
    raw["domains"] = filled
    raw.setdefault("out_dir", str(run.stage_dir("sft")))
    if isinstance(raw.get("curriculum"), dict):  # stage 2's reference: the teacher's K rollouts of this run
        raw["curriculum"] = {"reference": str(run.stage_dir("rollout") / "rollouts.jsonl"), **raw["curriculum"]}

    return validate(SFTConfig, raw, source=run.source, prefix="sft")



def _section(name: str) -> Callable[[Run], Any]:
    return lambda run: run.section(name)


def _resolved(name: str) -> Callable[[Run], Any]:
    return lambda run: plain(run.section(name))


def _check_teacher(run: Run) -> Any:
    """A local model or, with an ``endpoint`` key, a server (mlx_ssp.rollout.endpoint); cached for run.section."""
    run.sections["teacher"] = teacher_section(run.data, run.source)
    return run.sections["teacher"]


def _check_sft(run: Run) -> None:
    if run.data.get("tasks") is None:
        raise UserError(f"{run.source}: a run needs a tasks: section with at least one domain")
    sft_config(run)  # validates the sft section with its run defaults



#: the run file's sections, in the order load_run checks them and config.resolved.yaml adds the missing
#: ones; sft comes last because its defaults are the task domains and select's outputs.
SECTIONS: dict[str, Section] = {
    sec.name: sec
    for sec in (
        Section("model", _section("model"), _resolved("model")),
        Section("teacher", _check_teacher),  # kept as written (absent: the model itself)
        Section("tasks", _section("tasks"), _resolved("tasks")),
        Section("rollout", _section("rollout"), _resolved("rollout")),
        Section("select", _section("select"), _resolved("select")),
        Section("merge", _section("merge"), _resolved("merge")),
        Section("rl", _section("rl"), _resolved("rl")),
        Section("eval", _section("eval"), _resolved("eval")),
        # added later: a run that never set it keeps its fingerprints, so it is not redone
        # (load_stage installs it: one policy for every stage, also when a resume skips rollout)
        Section("sandbox", _section("sandbox"), optional=True),
        Section("distill", lambda run: run.section("distill") if run.data.get("distill") is not None else None,
                _resolved("distill"), optional=True),
        Section("sft", _check_sft, lambda run: plain(sft_config(run))),
        # where the final model goes after the run; no stage's fingerprint covers it
        Section("upload", _section("upload"), optional=True),
    )
}


def load_run(config_path: str | Path, overrides: tuple[str, ...] = (), progress: bool = True) -> Run:
    """Read and validate the whole run file up front (every section), so a typo in the last stage's
    section fails before the first stage runs."""
    st = load_stage(config_path, overrides, with_model=False)  # no section: the seed is the top-level one
    run = Run(run_dir=st.run_dir, data=st.data, source=st.source, seed=st.seed, progress=progress,
              report_to=st.report_to)
    for sec in SECTIONS.values():
        sec.check(run)
    return run



def resolved_config(run: Run) -> dict:
    """Every section with its defaults filled in (config.resolved.yaml; the trackers' params)."""
    resolved = dict(run.data)
    resolved.update({s.name: s.resolve(run) for s in SECTIONS.values() if s.resolve is not None})
    resolved["run_dir"], resolved["seed"] = str(run.run_dir), run.seed
    return resolved

