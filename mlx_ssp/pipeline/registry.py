"""The stage registry (:data:`STAGE_REGISTRY`): the stages in run order, the sections each one's
fingerprint covers and the function that runs it. The stage list, the fingerprint chain and the CLI
choices all derive from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from mlx_ssp.config import digest, plain
from mlx_ssp.pipeline.runfile import SECTIONS, Run
from mlx_ssp.pipeline.stages import (
    stage_distill,
    stage_eval,
    stage_merge,
    stage_rl,
    stage_rollout,
    stage_select,
    stage_sft,
    stage_tasks,
)


@dataclass(frozen=True)
class Stage:
    """One step of the loop, as an entry of :data:`STAGE_REGISTRY`."""

    name: str
    sections: tuple[str, ...]  # run-file sections its fingerprint covers (besides the previous stage's)
    run: Callable[[Run], dict]  # does the work in RUN_DIR/<name>; returns the stage's metrics
    reports: str  # what those metrics hold (kept in _stage.json and metrics.jsonl)
    #: an optional stage (its section absent: not run, and not in the fingerprint chain, so runs
    #: made before it existed keep their fingerprints); None: always on
    section: Optional[str] = None

    def enabled(self, run: "Run") -> bool:
        return self.section is None or run.data.get(self.section) is not None



#: the stages in run order. Fingerprint sections must stay as they are: a run directory made before a
#: change would otherwise be redone.
STAGE_REGISTRY: dict[str, Stage] = {
    st.name: st
    for st in (
        Stage("tasks", ("tasks",), stage_tasks, "n_train, n_probe, n_eval: tasks per split"),
        Stage("rollout", ("model", "teacher", "rollout", "sandbox"), stage_rollout,
              "summary: the rollout summary (tasks, rollouts, rewards); teacher: its path"),
        Stage("select", ("select",), stage_select, "spectrum: per-domain selection report"),
        Stage("sft", ("model", "sft", "sandbox"), stage_sft, "summary: per-domain chosen step and specialist"),
        Stage("merge", ("merge",), stage_merge, "models: the merged specialists; result: the merge report"),
        Stage("rl", ("rl", "sandbox"), stage_rl,
              "steps, skipped_total, last_reward_mean, model; prompt_filter (counts) when set; phases (per phase)"),
        Stage("distill", ("distill", "sft", "sandbox"), stage_distill,
              "correct, selected, per_domain, selection (per domain/bucket), model: the distilled student",
              section="distill"),
        Stage("eval", ("model", "eval", "sandbox"), stage_eval, "table: pass@1 / pass@k per model and domain"),
    )
}
STAGES = tuple(STAGE_REGISTRY)


assert all(s in SECTIONS for st in STAGE_REGISTRY.values() for s in st.sections)


def fingerprint(run: Run, stage: str, previous: str) -> str:
    """Hash of the stage's resolved sections, the seed and the previous stage's fingerprint."""
    payload = {
        "stage": stage,
        "previous": previous,
        "seed": run.seed,
        "sections": {s: plain(run.section(s)) for s in STAGE_REGISTRY[stage].sections
                     if not SECTIONS[s].optional or run.data.get(s) is not None},
    }
    return digest(payload)



def active_stages(run: Run) -> list[str]:
    """The stages this run has, in order (an optional stage only when its section is set)."""
    return [s for s in STAGES if STAGE_REGISTRY[s].enabled(run)]

