"""``mlx_ssp run``: the whole Spectrum-to-Signal loop from one config, resumably.

Stages, in order (the entries of :data:`STAGE_REGISTRY`, from which the stage list, the sections each
stage's fingerprint covers and the CLI choices all derive), each writing into ``RUN_DIR/<stage>`` in
the format the stage writes on its own:

1. ``tasks``   build the three disjoint splits of every domain (train / probe / eval) as task JSONL.
2. ``rollout`` K rollouts per train prompt from the teacher (default: the model itself), verified.
3. ``select``  diversity-exploring selection of correct solutions -> per-domain SFT data.
4. ``sft``     one LoRA specialist per domain, checkpoint chosen by Pass@K on the probe split, fused.
5. ``merge``   parameter merge of the specialists (VibeThinker: the plain average; any method).
6. ``rl``      MGPO-weighted GRPO on the merged model (VibeThinker-1.5B section 3.4); with ``rl.phases``
               sequential phases, each from the previous one's model (VibeThinker-3B section 2.2.2).
7. ``distill`` (only with a ``distill:`` section) offline self-distillation of the RL checkpoints'
               correct traces into the student (VibeThinker-3B section 2.3; :mod:`mlx_ssp.distill`).
8. ``eval``    pass@1 / pass@k on the held-out split for the base model, every specialist, the merged
               model, the RL model (one row per RL phase) and the distilled student, as one table.

An optional stage (``Stage.section``) whose section the run file lacks is not run and is left out
of the fingerprint chain, so runs made before it existed keep every fingerprint.

Resumability: every stage records a fingerprint of its resolved config (defaults filled in) chained
with the fingerprint of the stage before it, and marks itself complete at the end. A rerun skips
complete stages whose fingerprint matches, continues an incomplete one (the stages resume on their
own: rollouts append, SFT continues from its last checkpoint, RL from its last checkpoint, eval per
model), and when a stage's config changed it says so and reruns that stage and everything after it,
moving the stale outputs to ``RUN_DIR/.stale/`` rather than reusing or deleting them. ``--only``
and ``--from`` force their stage(s): a complete one is rerun, an interrupted one with the same
config resumes (:func:`plan_stage`).

One writer: the driver holds :data:`RUN_LOCK` in the run directory for the whole run, and the output
lock (:func:`mlx_ssp.io.output_lock`) of every stage directory, the one each stage command takes on
its output; a second ``mlx_ssp run`` on the directory, or a stage command writing into one of its
stage directories, fails at once naming the directory and the holder's pid (:func:`lock_run`). A
directory that is neither empty nor a run (no :data:`RUN_MARKER`) is refused (:func:`check_run_dir`).

Deviation from the papers: VibeThinker's Spectrum phase uses a large teacher's distillation data and
its Signal phase runs for thousands of steps on a 1.5B model; here the default teacher is the model
itself (rejection sampling from its own K-rollouts) and the sizes fit a laptop.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import yaml

from mlx_ssp import distributed as dist
from mlx_ssp import trackers
from mlx_ssp.agents.episode import is_episode
from mlx_ssp.card import add_eval_table
from mlx_ssp.config import digest, load_section, plain, validate
from mlx_ssp.distill import read_report, run_distill
from mlx_ssp.errors import UserError
from mlx_ssp.eval import evaluate
from mlx_ssp.finetune.fuse import fuse_and_save
from mlx_ssp.hub import require_token, upload_model
from mlx_ssp.io import (
    JsonlAppender,
    exclusive_lock,
    output_lock,
    write_json_atomic,
    write_jsonl_atomic,
    write_text_atomic,
)
from mlx_ssp.merge.engine import merge_models
from mlx_ssp.models import ModelConfig, load_model, load_tokenizer, resolve_model
from mlx_ssp.rl.phases import phase_dir, phase_models, rl_card, run_phases, train_one
from mlx_ssp.rollout import run_rollouts
from mlx_ssp.rollout.endpoint import is_endpoint, teacher_section
from mlx_ssp.select import gold_records, run_select, safe_dirname
from mlx_ssp.sft import SFTConfig, run_sft
from mlx_ssp.stage_config import load_stage, section_seed, with_seed
from mlx_ssp.tasks import load_tasks, write_tasks
from mlx_ssp.tasks.build import build_split

STATE_FILE = "_stage.json"
#: the run's own state file, written when a run starts (every version wrote it): a directory with it is a run
RUN_MARKER = "config.resolved.yaml"
#: the driver's lock file in the run directory, held for the whole run
RUN_LOCK = ".run.lock"
#: the SFT "domain" trained on every domain's data mixed when ``sft.blend`` is set
BLEND = "blend"


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


# -- fingerprints and state ----------------------------------------------------------------------


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


# -- the stages ----------------------------------------------------------------------------------


def stage_tasks(run: Run) -> dict:
    cfg = run.section("tasks")
    out = {}
    for split in ("train", "probe", "eval"):
        tasks = build_split(cfg, split)
        if not tasks:
            raise UserError(f"{run.source}: the tasks section gives no {split} tasks")
        write_tasks(run.tasks_path(split), tasks)
        out[f"n_{split}"] = len(tasks)
    trackers.log("", out, step=0)
    return out


def stage_rollout(run: Run) -> dict:
    cfg = with_seed(run.section("rollout"), run.seed)
    teacher = run.section("teacher") or run.section("model")
    if is_endpoint(teacher) and teacher.tokenizer is None:  # token ids in the student's tokens (rollout.endpoint)
        teacher = teacher.model_copy(update={"tokenizer": run.section("model").path})
    summary = run_rollouts(
        teacher, run.tasks_path("train"), cfg, run.stage_dir("rollout") / "rollouts.jsonl", progress=run.progress
    )
    return {"summary": summary, "teacher": teacher.label() if is_endpoint(teacher) else teacher.path}


def stage_select(run: Run) -> dict:
    cfg = run.section("select")
    teacher = run.section("teacher")
    gold = None
    if teacher is not None or cfg.gold:  # only episode runs need the tasks and the tokenizers here

        train = load_tasks(run.tasks_path("train"))
        student = load_tokenizer(run.section("model").path)
        # an episode's SFT example is its sampled token ids: they must be the student's tokens
        if teacher is not None and any(is_episode(t) for t in train) and \
                load_tokenizer(teacher.path).get_vocab() != student.get_vocab():
            raise UserError(f"{run.source}: the teacher's tokenizer differs from the model's; episode SFT data are "
                            "the teacher's sampled token ids, so use a teacher of the same tokenizer (or no teacher)")
        if cfg.gold:  # episodes: the ground truth played through the environment, in the student's tokens
            gold = gold_records(train, student)
    report = run_select(run.stage_dir("rollout") / "rollouts.jsonl", cfg, run.stage_dir("select"), overwrite=True,
                        gold=gold, held_out=[run.tasks_path("eval"), run.tasks_path("probe")],  # select.decontaminate
                        tasks_path=run.tasks_path("train") if cfg.pseudo_label is not None else None)
    return {"spectrum": report}


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


def stage_sft(run: Run) -> dict:
    cfg = sft_config(run)
    # only domains that got SFT data: a domain with no correct rollout has nothing to learn from
    missing = [d for d, s in cfg.domains.items() if not (Path(s.data) / "train.jsonl").exists()]
    if missing and len(missing) == len(cfg.domains):
        raise UserError(
            "no domain has SFT data (no correct rollouts at all): raise rollout.k, loosen the answer "
            "extraction, or use an easier task setting"
        )
    if cfg.blend:  # every domain's selected data in one file (what the merge of specialists is compared with)
        _write_blend(cfg, Path(cfg.domains[BLEND].data))
        if (Path(cfg.domains[BLEND].data) / "train.jsonl").exists():
            missing = [d for d in missing if d != BLEND]
    if missing:
        print(f"sft: skipping {', '.join(missing)}: selection found no correct solution", file=sys.stderr)
        cfg = cfg.model_copy(update={"domains": {d: s for d, s in cfg.domains.items() if d not in missing}})
    summary = run_sft(cfg, run.section("model"), run_dir=run.run_dir, run_data=run.data, seed=run.seed)
    return {"summary": summary}


def _write_blend(cfg, out: Path) -> None:
    for part in ("train", "valid"):
        rows = []
        for d, spec in cfg.domains.items():
            f = Path(spec.data) / f"{part}.jsonl"
            if d != BLEND and f.is_file():
                rows += [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
        if rows:
            write_jsonl_atomic(out / f"{part}.jsonl", rows)


def stage_merge(run: Run) -> dict:
    specialists = run.specialists()
    base = resolve_model(run.section("model").path)
    out = run.stage_dir("merge") / "model"
    res = merge_models(
        list(specialists.values()), base, run.section("merge"), out, overwrite=True, seed=run.seed,
        progress=run.progress,
    )
    return {"models": {d: str(p) for d, p in specialists.items()}, "result": res}


def stage_rl(run: Run) -> dict:
    """MGPO-GRPO on the merged model (resuming from the last RL checkpoint), then fuse the
    adapters into ``rl/model`` so that eval and later users load one plain model directory.
    With ``rl.phases``: the phases in order (:func:`mlx_ssp.rl.phases.run_phases`), each fused into
    ``rl/phases/<name>/model``; finished phases are not rerun."""
    cfg = run.section("rl")
    seed = section_seed(cfg, run.seed)
    tasks = load_tasks(cfg.tasks) if cfg.tasks else load_tasks(run.tasks_path("train"))
    out = run.stage_dir("rl")
    merged = ModelConfig(path=str(run.stage_dir("merge") / "model"))
    if cfg.phases:
        summary = run_phases(merged, tasks, cfg, out, seed=seed, echo=partial(print, flush=True))
        return {
            "steps": summary["steps"], "skipped_total": summary["skipped_total"],
            "last_reward_mean": (summary.get("last") or {}).get("reward_mean"), "model": summary["model"],
            "phases": [{k: p.get(k) for k in ("name", "steps", "model", "tasks", "prompt_filter")}
                       | {m: (p.get("last") or {}).get(m) for m in ("reward_mean", "pass@1", "correct_len_mean")}
                       for p in summary["phases"]],
        }
    summary, model, tokenizer, path = train_one(merged, tasks, cfg, out, seed=seed, resume=True)
    fuse_and_save(model, tokenizer, Path(path), out / "model", dequantize=False, overwrite=True,
                  card=rl_card(cfg, path, {"tasks": len(tasks), **summary}, seed))
    last = summary.get("last") or {}
    res = {
        "steps": summary.get("steps"),
        "skipped_total": summary.get("skipped_total"),
        "last_reward_mean": last.get("reward_mean"),
        "model": str(out / "model"),
    }
    if summary.get("prompt_filter") is not None:
        res["prompt_filter"] = summary["prompt_filter"]
    return res


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


def stage_distill(run: Run) -> dict:
    """Offline self-distillation (:mod:`mlx_ssp.distill`): sample the kept RL checkpoints on the train
    tasks, score the correct traces under the student (default: the final RL model), select per
    domain and length bucket, and SFT the student on them (the sft: section's settings, with
    ``distill.sft`` on top)."""
    cfg = run.section("distill")
    sources = {f"src{i}": s for i, s in enumerate(cfg.sources)} if cfg.sources else rl_models(run)
    if not sources:
        raise UserError(f"{run.source}: distill needs RL checkpoints to sample from (or distill.sources)")
    student = cfg.student or list(sources.values())[-1]
    sft_base = {k: v for k, v in (run.data.get("sft") or {}).items() if k not in ("domains", "out_dir", "data_dir")}
    report = run_distill(cfg, sources=sources, student=student, tasks_path=run.tasks_path("train"),
                         probe_path=run.tasks_path("probe"), out_dir=run.stage_dir("distill"),
                         seed=section_seed(cfg, run.seed), sft_base=sft_base, progress=run.progress)
    trackers.log("", report, step=0)  # distill/correct, distill/selected, distill/per_domain/<domain>, ...
    return report


def stage_eval(run: Run) -> dict:
    cfg = run.section("eval")
    seed = section_seed(cfg, run.seed)
    tasks = load_tasks(run.tasks_path("eval"))
    out_dir = run.stage_dir("eval")
    results = {}
    for name, path in eval_models(run).items():
        f = out_dir / f"{name.replace(':', '-')}.json"
        if f.exists():  # resume: this model is already evaluated with this fingerprint
            results[name] = json.loads(f.read_text())
            continue
        model, tok, _ = load_model(path)
        res = evaluate(
            model, tok, tasks, k=cfg.k, n=cfg.n, sampling=cfg.sampling, seed=seed, batch_size=cfg.batch_size,
            greedy=cfg.greedy, progress=run.progress, max_context=cfg.max_context, system=cfg.system,
            model_name=name,
        )
        res["model"] = path
        res["stage"] = name
        write_json_atomic(f, res)
        results[name] = res
        del model
    table = eval_table(results, k=cfg.k)
    write_json_atomic(out_dir / "table.json", table)
    for row in table["rows"]:  # eval/<model>/overall/pass@1, .../domains/<domain>/..., .../breadth/...
        trackers.log(row["stage"], {**trackers.without(results[row["stage"]], "sampling", "seed"),
                                    "breadth": row["breadth"]}, step=0)
    trackers.log("", {"gain": table.get("gain", {})}, step=0)
    text = format_eval_table(table)
    write_text_atomic(out_dir / "table.md", text + "\n")
    return {"table": table}


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


# -- the eval table ------------------------------------------------------------------------------


def eval_table(results: dict[str, dict], k: int) -> dict:
    """{"k": K, "domains": [...], "rows": [{"stage", "overall": {...}, "domains": {D: {...}}}]}."""
    key_k = f"pass@{k}"
    domains: list[str] = []
    rows = []
    for name, res in results.items():
        for d in res.get("domains", {}):
            if d not in domains:
                domains.append(d)
        rows.append(
            {
                "stage": name,
                "overall": {m: res.get("overall", {}).get(m) for m in ("pass@1", key_k)},
                "domains": {
                    d: {m: v.get(m) for m in ("pass@1", key_k)} for d, v in res.get("domains", {}).items()
                },
            }
        )
    for r in rows:  # breadth: every domain counts once, whatever its size (the negative-transfer figure)
        r["breadth"] = {m: _mean([r["domains"].get(d, {}).get(m) for d in domains]) for m in ("pass@1", key_k)}
    table = {"k": k, "domains": domains, "rows": rows}
    base = next((r for r in rows if r["stage"] == "base"), None)
    last = rows[-1] if rows else None
    if base and last and last is not base:
        table["gain"] = {
            "from": "base",
            "to": last["stage"],
            **{m: _sub(last["overall"].get(m), base["overall"].get(m)) for m in ("pass@1", key_k)},
        }
    return table


def _mean(xs: list):
    return None if not xs or any(x is None for x in xs) else sum(xs) / len(xs)


def _sub(a, b):
    return None if a is None or b is None else a - b


def _fmt(x) -> str:
    return "  -  " if x is None else f"{x:.3f}"


def format_eval_table(table: dict) -> str:
    """A Markdown table: one row per stage model, pass@1 / pass@k per domain, overall (the mean over
    tasks) and breadth (the mean over domains)."""
    k = table["k"]
    key_k = f"pass@{k}"
    cols = [f"{d} p@1 | {d} p@{k}" for d in table["domains"]] + [f"overall p@1 | overall p@{k}"]
    cols += [f"breadth p@1 | breadth p@{k}"]
    lines = ["| model | " + " | ".join(cols) + " |", "|---|" + "---|---|" * (len(table["domains"]) + 2)]
    for r in table["rows"]:
        cells = []
        for d in table["domains"]:
            v = r["domains"].get(d, {})
            cells += [_fmt(v.get("pass@1")), _fmt(v.get(key_k))]
        cells += [_fmt(r["overall"].get("pass@1")), _fmt(r["overall"].get(key_k))]
        b = r.get("breadth", {})
        cells += [_fmt(b.get("pass@1")), _fmt(b.get(key_k))]
        lines.append(f"| {r['stage']} | " + " | ".join(cells) + " |")
    g = table.get("gain")
    if g:
        lines.append("")
        lines.append(
            f"gain {g['to']} vs {g['from']}: pass@1 {_signed(g.get('pass@1'))}, pass@{k} {_signed(g.get(key_k))}"
        )
    return "\n".join(lines)


def _signed(x) -> str:
    return "n/a" if x is None else f"{x:+.3f}"


# -- the registries: every list of stages or sections below derives from these two -------------------

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
assert all(s in SECTIONS for st in STAGE_REGISTRY.values() for s in st.sections)


# -- the driver ------------------------------------------------------------------------------------


def load_run(config_path: str | Path, overrides: tuple[str, ...] = (), progress: bool = True) -> Run:
    """Read and validate the whole run file up front (every section), so a typo in the last stage's
    section fails before the first stage runs."""
    st = load_stage(config_path, overrides, with_model=False)  # no section: the seed is the top-level one
    run = Run(run_dir=st.run_dir, data=st.data, source=st.source, seed=st.seed, progress=progress,
              report_to=st.report_to)
    for sec in SECTIONS.values():
        sec.check(run)
    return run


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


def resolved_config(run: Run) -> dict:
    """Every section with its defaults filled in (config.resolved.yaml; the trackers' params)."""
    resolved = dict(run.data)
    resolved.update({s.name: s.resolve(run) for s in SECTIONS.values() if s.resolve is not None})
    resolved["run_dir"], resolved["seed"] = str(run.run_dir), run.seed
    return resolved


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


def active_stages(run: Run) -> list[str]:
    """The stages this run has, in order (an optional stage only when its section is set)."""
    return [s for s in STAGES if STAGE_REGISTRY[s].enabled(run)]


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
