"""The stage functions of ``mlx_ssp run``: each does its stage's work in ``RUN_DIR/<stage>`` by calling
the stage's own command code, and returns the stage's metrics (entries of
:data:`mlx_ssp.pipeline.registry.STAGE_REGISTRY`)."""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path

from mlx_ssp import trackers
from mlx_ssp.agents.episode import is_episode
from mlx_ssp.distill import run_distill
from mlx_ssp.errors import UserError
from mlx_ssp.eval import evaluate
from mlx_ssp.finetune.fuse import fuse_and_save
from mlx_ssp.io import write_json_atomic, write_jsonl_atomic, write_text_atomic
from mlx_ssp.merge.engine import merge_models
from mlx_ssp.models import ModelConfig, load_model, load_tokenizer, resolve_model
from mlx_ssp.pipeline.outputs import eval_models, rl_models
from mlx_ssp.pipeline.runfile import BLEND, Run, sft_config
from mlx_ssp.pipeline.table import eval_table, format_eval_table
from mlx_ssp.rl.phases import rl_card, run_phases, train_one
from mlx_ssp.rollout import run_rollouts
from mlx_ssp.rollout.endpoint import is_endpoint
from mlx_ssp.select import gold_records, run_select
from mlx_ssp.sft import run_sft
from mlx_ssp.stage_config import section_seed, with_seed
from mlx_ssp.tasks import load_tasks, write_tasks
from mlx_ssp.tasks.build import build_split


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

