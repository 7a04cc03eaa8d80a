"""Experiment 3 (Signal): MGPO vs plain GRPO (lambda = 0) at equal steps and rollouts.

VibeThinker-1.5B (arXiv:2511.06221) section 3.4 weights each prompt's GRPO advantages by
w(q) = exp(-lambda * D_ME(p || 0.5)) (p = the group's accuracy), focusing the update on prompts the
model solves about half the time. This script runs two RL arms from the same starting point,
experiment 2's merged model, with ``mlx_ssp.rl.trainer.train``:

- ``mgpo``: ``rl.mgpo_lambda`` as configured (must be > 0);
- ``grpo``: the same config with ``mgpo_lambda = 0`` (w = 1: plain GRPO).

Everything else is identical: steps, prompts per step, group size G, sampling, learning rate, LoRA,
training seed (so both arms see the same prompt order and the same first-step rollouts).

MGPO's weights are at most 1, so its loss is also smaller on average (mean weight about 0.75 at
lambda = 1). With the default AdamW that alone changes little: Adam divides each gradient by its
running RMS, so a constant factor on the loss cancels (up to epsilon and the clip threshold); only
how the weights vary between prompts and steps is left. To measure rather than argue it,
``grpo_lr_scale`` adds a third arm, ``grpo_lr``: GRPO at that multiple of the learning rate (a
number, or ``mgpo``: the MGPO arm's mean weight over its steps, measured after it has run).
``extra_lambdas`` adds an MGPO arm per lambda (``mgpo-l<lambda>``, e.g. ``[0.5, 2, 4]``: the
lambda grid of the testbed's experiment 4 with one GRPO arm for all), each compared with GRPO. Every
``rl_eval_every`` steps (and at the last step) the in-memory policy is evaluated on the held-out
split of every domain (pass@1, pass@K, same sampling seeds for every model); step 0 is the merged
model's own evaluation. Reported: held-out pass@1 per evaluated step, the gain over step 0 with a
paired standard error across tasks, the gain per step, and the training pass rate / mean MGPO
weight of every step.

    python scripts/experiments/exp3_signal.py [--tiny] [--work-dir DIR] [--set rl.steps=10]

Results: WORK_DIR/exp3/results.{json,md} (the latest run) and WORK_DIR/rl/<settings hash>/results.*.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from exp2_merge_vs_blend import merged_model  # noqa: E402

from mlx_ssp.errors import UserError  # noqa: E402


def headline(res: dict) -> dict[str, float]:
    """One seed's numbers the seed driver averages (scripts/experiments/seeds.py): held-out pass@1 at
    the last step, each arm's gain over the start, and MGPO - GRPO (paired per task)."""
    curve, last = res["curve"], str(res["steps"])  # results.json: steps are string keys
    out = {"start pass@1": curve["mgpo"]["0"]["pass@1"]}
    for arm in ("mgpo", "grpo"):
        out[f"{arm} pass@1"] = curve[arm][last]["pass@1"]
        out[f"{arm} - start pass@1"] = curve[arm][last]["gain"]["d_pass@1"]
    out["mgpo - grpo pass@1"] = curve["mgpo_minus_grpo"][last]["d_pass@1"]
    for arm in res.get("extra_lambdas", {}):
        out[f"{arm} pass@1"] = curve[arm][last]["pass@1"]
        out[f"{arm} - start pass@1"] = curve[arm][last]["gain"]["d_pass@1"]
        out[f"{arm} - grpo pass@1"] = curve[f"{arm}_minus_grpo"][last]["d_pass@1"]
    if "grpo_lr" in curve:
        out["grpo_lr pass@1"] = curve["grpo_lr"][last]["pass@1"]
        out["grpo_lr - start pass@1"] = curve["grpo_lr"][last]["gain"]["d_pass@1"]
        out["mgpo - grpo_lr pass@1"] = curve["mgpo_minus_grpo_lr"][last]["d_pass@1"]
        out["grpo_lr lr scale"] = res["grpo_lr_scale"]
    for arm, logs in res.get("train_metrics", {}).items():
        w = [m["mgpo_weight_mean"] for m in logs if m.get("mgpo_weight_mean") is not None]
        if w and not arm.startswith("grpo"):  # GRPO (lambda 0) weighs every group 1
            out[f"{arm} mean MGPO weight"] = sum(w) / len(w)
    return out


def task_diffs(res: dict) -> dict[str, dict[str, float]]:
    """headline metric -> {task id: difference} at the last step (seeds.py: the SE over seeds x tasks)."""
    return res.get("task_diffs", {})


def curves(seed_dir: Path, seed: int) -> dict[str, list[Path]]:
    """label -> this seed's RL run directories (the seed driver draws their per-step reward and
    pass rate with a band across seeds: ``mlx_ssp report``)."""
    res = json.loads((seed_dir / "exp3" / "results.json").read_text())
    labels = {"mgpo": "MGPO", "grpo": "GRPO", "grpo_lr": "GRPO (lr scaled)",
              **{arm: f"MGPO lambda {lam:g}" for arm, lam in res.get("extra_lambdas", {}).items()}}  # no "=" (mlx_ssp report: LABEL=DIR)
    # results written before run_dirs existed: the two arms live under out_dir by name
    dirs = res.get("run_dirs") or {arm: str(Path(res["out_dir"]) / arm) for arm in ("mgpo", "grpo")}
    return {labels[arm]: [Path(d)] for arm, d in dirs.items()}


def lr_scale(setting, mgpo_metrics: list[dict]) -> float:
    """The ``grpo_lr_scale`` setting as a number: itself, or for ``"mgpo"`` the MGPO arm's mean
    weight over its steps (the mean of each step's mean group weight)."""
    if setting == "mgpo":
        w = [m["mgpo_weight_mean"] for m in mgpo_metrics if m.get("mgpo_weight_mean") is not None]
        if not w:
            raise UserError("grpo_lr_scale=mgpo: the MGPO arm's metrics.jsonl has no mgpo_weight_mean")
        return sum(w) / len(w)
    return float(setting)


def check_lr_scale(setting) -> None:
    """Fail before any work unless ``grpo_lr_scale`` is null, ``mgpo`` or a finite number > 0."""
    ok = setting is None or setting == "mgpo" or (
        isinstance(setting, (int, float)) and not isinstance(setting, bool) and math.isfinite(setting) and setting > 0)
    if not ok:
        raise UserError(f"grpo_lr_scale: {setting!r} is not valid; valid: null, a finite number > 0, or mgpo")


def extra_arms(setting, lam: float) -> dict[str, float]:
    """``extra_lambdas`` as {arm name: lambda}; fail before any work unless it is a list of distinct
    finite numbers > 0 (distinct as arm names, ``mgpo-l<x:g>``), none equal to ``rl.mgpo_lambda``
    (that arm is ``mgpo``)."""
    def ok(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0

    if not isinstance(setting, list) or not all(ok(x) for x in setting) or len(set(setting)) != len(setting) \
            or any(math.isclose(x, lam) for x in setting) or len({f"{x:g}" for x in setting}) != len(setting):
        raise UserError(f"extra_lambdas: {setting!r} is not valid; valid: a list of distinct finite numbers > 0, "
                        f"none equal to rl.mgpo_lambda ({lam})")
    return {f"mgpo-l{x:g}": float(x) for x in setting}


def check_cached_lr(run_dir: Path, lr: float) -> None:
    """The scaled arm's directory is named by its learning rate to 4 digits: refuse a cached run whose
    learning rate differs beyond that (its results would be reported as this scale's)."""
    f = run_dir / "rl_config.json"
    if f.exists():
        have = json.loads(f.read_text())["rl"]["learning_rate"]
        if not math.isclose(have, lr, rel_tol=1e-6):
            raise UserError(f"{run_dir} holds a run at learning rate {have}, not {lr}; delete it to rerun")


def metrics(path: Path) -> list[dict]:
    from mlx_ssp.io import read_jsonl

    return read_jsonl(path) if path.exists() else []


def train_arms(ctx: common.Ctx, lam: float, extra: dict, start, domains: list, scale_setting):
    """Train and evaluate every RL arm from the merged model: MGPO, GRPO, the extra lambdas and the scaled-lr GRPO."""
    tag = common._fingerprint({"rl": ctx.raw["rl"], "every": ctx.rl_eval_every, "start": start})[:8]
    out = ctx.path("rl", tag)
    arms = {"mgpo": lam, "grpo": 0.0}
    evals = {arm: common.rl_arm(ctx, arm, l, start, out, domains) for arm, l in {**arms, **extra}.items()}
    run_dirs = {arm: out / arm for arm in {**arms, **extra}}
    scale = lr = None
    if scale_setting is not None:
        scale = lr_scale(scale_setting, metrics(out / "mgpo" / "metrics.jsonl"))
        lr = ctx.rl_cfg.learning_rate * scale
        # the directory names the learning rate, so arms at different scales do not share a run
        run_dirs["grpo_lr"] = out / f"grpo-lr{lr:.4g}"
        check_cached_lr(run_dirs["grpo_lr"], lr)
        evals["grpo_lr"] = common.rl_arm(ctx, run_dirs["grpo_lr"].name, 0.0, start, out, domains,
                                         update={"learning_rate": lr})
    return out, arms, evals, run_dirs, scale, lr


def arm_curves(start_eval, evals: dict, extra: dict, k: int) -> dict:
    """Every arm's held-out curve: pass@1 / pass@k and the paired gain over the merged model, plus the paired arm differences."""
    s0 = common.scores(start_eval, k)
    curve: dict = {arm: {0: s0} for arm in evals}
    for arm, ev in evals.items():
        for s in sorted(ev):
            curve[arm][s] = {**common.scores(ev[s], k), "gain": common.paired(start_eval, ev[s], k)}
    for other in [a for a in evals if a in ("grpo", "grpo_lr")]:
        curve[f"mgpo_minus_{other}"] = {s: common.paired(evals[other][s], evals["mgpo"][s], k) for s in evals["mgpo"]}
    for arm in extra:
        curve[f"{arm}_minus_grpo"] = {s: common.paired(evals["grpo"][s], evals[arm][s], k) for s in evals[arm]}
    return curve


def train_rows(logs: dict, arms: dict, steps: int) -> list[list[str]]:
    """Per training step: each arm's train pass rate, mean MGPO weight and fraction of mixed groups."""
    rows = []
    for i in range(steps):
        r = [str(i + 1)]
        for arm in arms:
            m = logs[arm][i] if i < len(logs[arm]) else {}
            r += [common.fmt(m.get("pass_rate")), common.fmt(m.get("mgpo_weight_mean")),
                  common.fmt(m.get("frac_groups_mixed"))]
        rows.append(r)
    return rows


def more_tables(curve: dict, evals: dict, extra: dict, scale, lr, scale_setting, cell) -> list[str]:
    """The optional tables: the extra lambdas and GRPO at the scaled learning rate."""
    more = []
    if extra:
        lam_rows = [[f"{extra[arm]:g}", str(s), cell(arm, s), common.fdiff(curve[arm][s]["gain"], "pass@1"),
                     common.fdiff(curve[f"{arm}_minus_grpo"][s], "pass@1")] for arm in extra for s in sorted(evals[arm])]
        more += ["", "Other lambdas (extra_lambdas), each against the same GRPO arm:", "",
                 common.md_table(["lambda", "step", "pass@1", "gain vs step 0", "minus GRPO"], lam_rows)]
    if scale is not None:
        lr_rows = [[str(s), cell("grpo_lr", s), common.fdiff(curve["grpo_lr"][s]["gain"], "pass@1"),
                    common.fdiff(curve["mgpo_minus_grpo_lr"][s], "pass@1")] for s in sorted(evals["grpo_lr"])]
        more += ["", f"GRPO at {scale:.4g} x the learning rate ({lr:.4g}; grpo_lr_scale={scale_setting}):", "",
                 common.md_table(["step", "GRPO (scaled lr) pass@1", "its gain vs step 0", "MGPO - it"], lr_rows)]
    return more


def keep_copies(ctx: common.Ctx, out: Path, extra: dict, scale_setting) -> None:
    """Keep every RL setting's results next to its runs (exp3/results.* is the latest run)."""
    # the arms a run adds to the shared two name its copy, so a grid run and a plain one keep theirs
    arms_key = {"extra_lambdas": sorted(extra.values()), "grpo_lr_scale": scale_setting}
    suffix = "" if not extra and scale_setting is None else f"-{common._fingerprint(arms_key)[:8]}"
    for name in ("results.json", "results.md"):
        shutil.copyfile(ctx.path("exp3", name), out / name.replace("results", f"results{suffix}"))


def run(ctx: common.Ctx) -> dict:
    k = ctx.eval_cfg.k
    lam = ctx.rl_cfg.mgpo_lambda
    if lam <= 0:
        raise UserError("experiment 3 compares MGPO with GRPO: rl.mgpo_lambda must be > 0 (the GRPO arm uses 0)")
    scale_setting = ctx.raw.get("grpo_lr_scale")
    check_lr_scale(scale_setting)
    extra = extra_arms(ctx.raw.get("extra_lambdas", []), lam)
    start, specs = merged_model(ctx)
    domains = list(specs)
    seed = ctx.sft_seeds[0]
    start_eval = ctx.evaluate(f"merged-diverse-s{seed}-{ctx.merge_cfg.method}", start, domains)
    out, arms, evals, run_dirs, scale, lr = train_arms(ctx, lam, extra, start, domains, scale_setting)
    steps = ctx.rl_cfg.steps
    curve = arm_curves(start_eval, evals, extra, k)
    s0 = curve["mgpo"][0]
    steps_ = ctx.rl_cfg.steps
    task_diffs_ = {f"{arm} - grpo pass@1": common.task_diff_map(evals["grpo"][steps_], evals[arm][steps_], k)
                   for arm in ("mgpo", *extra)}

    def cell(arm: str, s: int) -> str:
        return common.fmt(curve[arm][s]["pass@1"], curve[arm][s]["pass@1_se"])

    p0 = cell("mgpo", 0)
    rows = [["0 (merged)", p0, p0, "-", "-", "-"]]
    rows += [[str(s), cell("mgpo", s), cell("grpo", s), common.fdiff(curve["mgpo"][s]["gain"], "pass@1"),
              common.fdiff(curve["grpo"][s]["gain"], "pass@1"), common.fdiff(curve["mgpo_minus_grpo"][s], "pass@1")]
             for s in sorted(evals["mgpo"])]
    per_step = {arm: {"pass@1_gain_per_step": curve[arm][steps]["gain"]["d_pass@1"] / steps,
                      "se": (curve[arm][steps]["gain"]["d_pass@1_se"] or 0.0) / steps} for arm in arms}
    logs = {arm: metrics(d / "metrics.jsonl") for arm, d in run_dirs.items()}
    more = more_tables(curve, evals, extra, scale, lr, scale_setting, cell)
    c = ctx.rl_cfg
    text = "\n".join([
        f"## Experiment 3: MGPO (lambda={lam}) vs GRPO (lambda=0) from the merged model "
        f"({steps} steps x {c.batch_size} prompts x G={c.group_size}, lr {c.learning_rate}; "
        f"held-out pass@1 with n={ctx.eval_cfg.n or k}; ± = SE across {s0['n_tasks']} tasks)",
        "",
        common.md_table(["step", "MGPO pass@1", "GRPO pass@1", "MGPO gain vs step 0", "GRPO gain vs step 0",
                         "MGPO - GRPO"], rows),
        "",
        "pass@1 gain per step: " + ", ".join(
            f"{arm.upper()} {common.fmt(per_step[arm]['pass@1_gain_per_step'], per_step[arm]['se'], signed=True)}"
            for arm in arms),
        "",
        common.md_table(["step", "MGPO train pass rate", "MGPO mean w", "MGPO mixed groups",
                         "GRPO train pass rate", "GRPO mean w", "GRPO mixed groups"], train_rows(logs, arms, steps)),
        *more,
    ])
    results = {"k": k, "lambda": lam, "steps": steps, "curve": curve, "per_step": per_step,
               "train_metrics": logs, "task_diffs": task_diffs_, "out_dir": str(out), "run_dirs": {a: str(d) for a, d in run_dirs.items()}}
    if scale is not None:
        results["grpo_lr_scale"] = scale
    if extra:
        results["extra_lambdas"] = extra
    common.write_results(ctx, "exp3", results, text)
    keep_copies(ctx, out, extra, scale_setting)
    return results


cli = common.entry_point(run, "Experiment 3: MGPO vs plain GRPO at equal steps and rollouts.")


if __name__ == "__main__":
    common.main(cli)
