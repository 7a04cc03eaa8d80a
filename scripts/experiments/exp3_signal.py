"""Experiment 3 (Signal): MGPO vs plain GRPO (lambda = 0) at equal steps and rollouts.

VibeThinker-1.5B (arXiv:2511.06221) section 3.4 weights each prompt's GRPO advantages by
w(q) = exp(-lambda * D_ME(p || 0.5)) (p = the group's accuracy), focusing the update on prompts the
model solves about half the time. This script runs two RL arms from the same starting point,
experiment 2's merged model, with ``mlx_ssp.rl.loop.train``:

- ``mgpo``: ``rl.mgpo_lambda`` as configured (must be > 0);
- ``grpo``: the same config with ``mgpo_lambda = 0`` (w = 1: plain GRPO).

Everything else is identical: steps, prompts per step, group size G, sampling, learning rate, LoRA,
training seed (so both arms see the same prompt order and the same first-step rollouts).

MGPO's weights are at most 1, so its loss is also smaller on average (mean weight about 0.75 at
lambda = 1). With the default AdamW that alone changes little: Adam divides each gradient by its
running RMS, so a constant factor on the loss cancels (up to epsilon and the clip threshold); only
how the weights vary between prompts and steps is left. To measure rather than argue it,
``grpo_lr_scale`` adds a third arm, ``grpo_lr``: GRPO at that multiple of the learning rate (a
number, or ``mgpo``: the MGPO arm's mean weight over its steps, measured after it has run). Every
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
    if "grpo_lr" in curve:
        out["grpo_lr pass@1"] = curve["grpo_lr"][last]["pass@1"]
        out["mgpo - grpo_lr pass@1"] = curve["mgpo_minus_grpo_lr"][last]["d_pass@1"]
        out["grpo_lr lr scale"] = res["grpo_lr_scale"]
    return out


def curves(seed_dir: Path, seed: int) -> dict[str, list[Path]]:
    """label -> this seed's RL run directories (the seed driver draws their per-step reward and
    pass rate with a band across seeds: ``mlx_ssp report``)."""
    res = json.loads((seed_dir / "exp3" / "results.json").read_text())
    labels = {"mgpo": "MGPO", "grpo": "GRPO", "grpo_lr": "GRPO (lr scaled)"}
    return {labels[arm]: [Path(d)] for arm, d in res.get("run_dirs", {}).items()}


def lr_scale(setting, mgpo_metrics: list[dict]) -> float:
    """The ``grpo_lr_scale`` setting as a number: itself, or for ``"mgpo"`` the MGPO arm's mean
    weight over its steps (the mean of each step's mean group weight)."""
    if setting == "mgpo":
        by_step = {m.get("step"): m for m in mgpo_metrics}  # a resumed run may log a step twice: the last counts
        w = [m["mgpo_weight_mean"] for m in by_step.values() if m.get("mgpo_weight_mean") is not None]
        if not w:
            raise UserError("grpo_lr_scale=mgpo: the MGPO arm's metrics.jsonl has no mgpo_weight_mean")
        return sum(w) / len(w)
    return float(setting)


def check_lr_scale(setting) -> None:
    ok = setting is None or setting == "mgpo" or (
        isinstance(setting, (int, float)) and not isinstance(setting, bool) and setting > 0)
    if not ok:
        raise UserError(f"grpo_lr_scale: {setting!r} is not valid; valid: null, a number > 0, or mgpo")


def metrics(path: Path) -> list[dict]:
    from mlx_ssp.io import read_jsonl

    return read_jsonl(path) if path.exists() else []


def run(ctx: common.Ctx) -> dict:
    k = ctx.eval_cfg.k
    lam = ctx.rl_cfg.mgpo_lambda
    if lam <= 0:
        raise UserError("experiment 3 compares MGPO with GRPO: rl.mgpo_lambda must be > 0 (the GRPO arm uses 0)")
    scale_setting = ctx.raw.get("grpo_lr_scale")
    check_lr_scale(scale_setting)
    start, specs = merged_model(ctx)
    domains = list(specs)
    seed = ctx.sft_seeds[0]
    start_eval = ctx.evaluate(f"merged-diverse-s{seed}-{ctx.merge_cfg.method}", start, domains)
    tag = common._fingerprint({"rl": ctx.raw["rl"], "every": ctx.rl_eval_every, "start": start})[:8]
    out = ctx.path("rl", tag)
    arms = {"mgpo": lam, "grpo": 0.0}
    evals = {arm: common.rl_arm(ctx, arm, l, start, out, domains) for arm, l in arms.items()}
    steps = ctx.rl_cfg.steps
    scale = None
    if scale_setting is not None:
        scale = lr_scale(scale_setting, metrics(out / "mgpo" / "metrics.jsonl"))
        lr = ctx.rl_cfg.learning_rate * scale
        # the directory names the learning rate, so arms at different scales do not share a run
        lr_arm = f"grpo-lr{lr:.4g}"
        evals["grpo_lr"] = common.rl_arm(ctx, lr_arm, 0.0, start, out, domains, update={"learning_rate": lr})
    s0 = common.scores(start_eval, k)
    p0 = common.fmt(s0["pass@1"], s0["pass@1_se"])
    rows = [["0 (merged)", p0, p0, "-", "-", "-"]]
    curve: dict = {arm: {0: s0} for arm in arms}
    for s in sorted(evals["mgpo"]):
        sc = {arm: common.scores(evals[arm][s], k) for arm in arms}
        gain = {arm: common.paired(start_eval, evals[arm][s], k) for arm in arms}
        diff = common.paired(evals["grpo"][s], evals["mgpo"][s], k)
        for arm in arms:
            curve[arm][s] = {**sc[arm], "gain": gain[arm]}
        curve.setdefault("mgpo_minus_grpo", {})[s] = diff
        rows.append([str(s), common.fmt(sc["mgpo"]["pass@1"], sc["mgpo"]["pass@1_se"]),
                     common.fmt(sc["grpo"]["pass@1"], sc["grpo"]["pass@1_se"]),
                     common.fdiff(gain["mgpo"], "pass@1"), common.fdiff(gain["grpo"], "pass@1"),
                     common.fdiff(diff, "pass@1")])
    per_step = {arm: {"pass@1_gain_per_step": curve[arm][steps]["gain"]["d_pass@1"] / steps,
                      "se": (curve[arm][steps]["gain"]["d_pass@1_se"] or 0.0) / steps} for arm in arms}
    train_rows = []
    logs = {arm: metrics(out / arm / "metrics.jsonl") for arm in arms}
    for i in range(steps):
        r = [str(i + 1)]
        for arm in arms:
            m = logs[arm][i] if i < len(logs[arm]) else {}
            r += [common.fmt(m.get("pass_rate")), common.fmt(m.get("mgpo_weight_mean")),
                  common.fmt(m.get("frac_groups_mixed"))]
        train_rows.append(r)
    extra = []
    if scale is not None:
        logs["grpo_lr"] = metrics(out / lr_arm / "metrics.jsonl")
        curve["grpo_lr"] = {0: s0}
        lr_rows = []
        for s in sorted(evals["grpo_lr"]):
            sc = common.scores(evals["grpo_lr"][s], k)
            curve["grpo_lr"][s] = {**sc, "gain": common.paired(start_eval, evals["grpo_lr"][s], k)}
            diff = common.paired(evals["grpo_lr"][s], evals["mgpo"][s], k)
            curve.setdefault("mgpo_minus_grpo_lr", {})[s] = diff
            lr_rows.append([str(s), common.fmt(sc["pass@1"], sc["pass@1_se"]),
                            common.fdiff(curve["grpo_lr"][s]["gain"], "pass@1"), common.fdiff(diff, "pass@1")])
        extra = ["", f"GRPO at {scale:.4g} x the learning rate ({lr:.4g}; grpo_lr_scale={scale_setting}):", "",
                 common.md_table(["step", "GRPO (scaled lr) pass@1", "its gain vs step 0", "MGPO - it"], lr_rows)]
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
                         "GRPO train pass rate", "GRPO mean w", "GRPO mixed groups"], train_rows),
        *extra,
    ])
    results = {"k": k, "lambda": lam, "steps": steps, "curve": curve, "per_step": per_step,
               "train_metrics": logs, "out_dir": str(out)}
    results["run_dirs"] = {arm: str(out / arm) for arm in arms}
    if scale is not None:
        results["grpo_lr_scale"] = scale
        results["run_dirs"]["grpo_lr"] = str(out / lr_arm)
    common.write_results(ctx, "exp3", results, text)
    # keep every RL setting's results (exp3/results.* is the latest run)
    for name in ("results.json", "results.md"):
        shutil.copyfile(ctx.path("exp3", name), out / name)
    return results


cli = common.entry_point(run, "Experiment 3: MGPO vs plain GRPO at equal steps and rollouts.")


if __name__ == "__main__":
    common.main(cli)
