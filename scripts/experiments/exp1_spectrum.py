"""Experiment 1 (Spectrum): diverse-K selection vs first-win selection at the same number of SFT examples.

VibeThinker-1.5B (arXiv:2511.06221) section 3.2 argues that SFT data should keep *many distinct*
correct solutions per problem (the "spectrum") rather than the first correct one, and that the
specialist should be chosen by Pass@K. This script tests that claim on the demo model:

1. K rollouts per train prompt of the base model (shared with experiment 2), verified;
2. two selections from the same rollouts: ``diverse`` (``mlx_ssp select --policy diverse``: up to M
   distinct correct solutions per prompt, greedy farthest-point) and ``first`` (the first correct
   one); the first-win solution of each prompt is *repeated* to the number of solutions the diverse
   set holds for that prompt, so both arms train on the same prompts, the same number of examples
   per prompt and the same number of gradient steps: the only difference is the diversity of the
   solutions. (Subsampling the diverse set to one per prompt would instead halve the data and
   confound diversity with data size.)
3. one LoRA specialist per domain and arm (``run_sft``: same iterations, seed, probe-based checkpoint
   choice by Pass@K), for every seed in ``sft_seeds``;
4. each specialist (and the base model) evaluated on its own domain's held-out tasks: Pass@1 and
   Pass@K (unbiased estimator, n samples per task), with the same sampling seeds for every model;
5. the same RL budget from each specialist (the ``rl:`` section, ``mlx_ssp.rl.trainer.train`` on that
   domain's train prompts, same seed for both arms), then the same held-out evaluation: the recipe's
   claim is that a wider spectrum gives RL more to sharpen, so the question is the arms' difference
   after RL as well as after SFT.

Prints a table (per domain and seed: base, first-win, diverse, diverse - first with a paired
standard error across held-out tasks) and writes WORK_DIR/exp1/results.{json,md}.

    python scripts/experiments/exp1_spectrum.py            # demo model (minutes)
    python scripts/experiments/exp1_spectrum.py --tiny     # tiny random model (seconds; checks plumbing)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from mlx_ssp.io import read_jsonl  # noqa: E402

ARMS = ("first_matched", "diverse")


def spectrum_stats(ctx: common.Ctx) -> dict:
    """Per domain and arm: SFT examples, prompts, distinct correct per prompt, mean pairwise distance,
    and how far the arms' data differ: distinct solutions per prompt in each arm's SFT data, and the
    share of prompts whose two sets differ (0 would make the comparison empty)."""
    data = common.spectrum_data(ctx)
    rep = json.loads((data["diverse"] / "spectrum.json").read_text())
    out = {}
    for dom, row in rep["domains"].items():
        if not row.get("dir"):
            out[dom] = {"n_prompts": row["n_prompts"], "prompts_with_correct": 0}
            continue
        recs = {arm: read_jsonl(data[arm] / row["dir"] / "train.jsonl") for arm in ARMS}
        n = {arm: len(r) for arm, r in recs.items()}
        out[dom] = {
            "n_prompts": row["n_prompts"],
            "prompts_with_correct": row["prompts_with_correct"],
            "mean_correct_per_prompt": row["mean_correct_per_prompt"],
            "mean_distinct_correct_per_prompt": row["mean_distinct_correct_per_prompt"],
            "mean_selected_per_prompt": row["mean_selected_per_prompt"],
            "mean_pairwise_distance_selected": row["mean_pairwise_distance"],
            "train_examples": n,
            **arms_differ(recs),
        }
    return out


def arms_differ(recs: dict[str, list[dict]]) -> dict:
    """Distinct solutions per prompt in each arm's records, and the share of prompts where the arms'
    sets of solutions differ (pure: records in mlx-lm chat format)."""
    sets: dict[str, dict[str, set]] = {}
    for arm, rows in recs.items():
        per: dict[str, set] = {}
        for r in rows:
            per.setdefault(common.prompt_key(r), set()).add(r["messages"][-1]["content"])
        sets[arm] = per
    a, b = (sets[arm] for arm in ARMS)
    prompts = sorted(set(a) | set(b))
    return {"distinct_per_prompt": {arm: (sum(len(v) for v in sets[arm].values()) / len(sets[arm]) if sets[arm] else None)
                                    for arm in ARMS},
            "prompts_differing": (sum(a.get(p) != b.get(p) for p in prompts) / len(prompts)) if prompts else None}


def curves(seed_dir: Path, seed: int) -> dict[str, list[Path]]:
    """label -> this seed's RL run directories, as its results.json names them (the seed driver
    draws their per-step reward and pass rate with a band across seeds: ``mlx_ssp report``)."""
    res = json.loads((seed_dir / "exp1" / "results.json").read_text())
    out: dict[str, list[Path]] = {}
    for per in res["per_seed"].values():
        for d, r in per.items():
            for arm, run in r.get("rl_dir", {}).items():
                out.setdefault(f"{d}, {'first-win' if arm == 'first_matched' else arm}", []).append(Path(run))
    return out


def headline(res: dict) -> dict[str, float]:
    """One seed's numbers the seed driver averages (scripts/experiments/seeds.py): per domain, the
    arms' held-out pass@1 / pass@k after SFT and pass@1 after RL, and their paired differences
    (one SFT seed per run: the driver sets it)."""
    if len(res["per_seed"]) != 1:
        raise ValueError(f"headline needs a run of one SFT seed, got {len(res['per_seed'])}")
    out = {}
    for per in res["per_seed"].values():
        for d, r in per.items():
            for arm in ARMS:
                out[f"{d} {arm} SFT pass@1"] = r[arm]["pass@1"]
                out[f"{d} {arm} SFT pass@k"] = r[arm]["pass@k"]
                out[f"{d} {arm} RL pass@1"] = r["rl"][arm]["pass@1"]
            out[f"{d} base pass@1"] = r["base"]["pass@1"]
            out[f"{d} diverse - first, SFT pass@1"] = r["diverse_minus_first"]["d_pass@1"]
            out[f"{d} diverse - first, SFT pass@k"] = r["diverse_minus_first"]["d_pass@k"]
            out[f"{d} diverse - first, RL pass@1"] = r["rl_diverse_minus_first"]["d_pass@1"]
            for arm in ("base", *ARMS):
                for label, v in r.get("spectrum", {}).get(arm, {}).items():
                    out[f"{d} {arm} SFT {label}"] = v
            for label, v in r.get("spectrum_diverse_minus_first", {}).items():
                out[f"{d} diverse - first, SFT {label}"] = v
    return out


def task_diffs(res: dict) -> dict[str, dict[str, float]]:
    """headline metric -> {task id: difference} of one seed's run (seeds.py: the SE over seeds x tasks)."""
    ((_, per),) = res["per_seed"].items()
    return {f"{d} diverse - first, {m}": diffs for d, r in per.items() for m, diffs in r.get("task_diffs", {}).items()}


def spectrum_curve(ctx: common.Ctx, name: str, model_dir, domain: str) -> dict[str, float]:
    """pass@k at ``spectrum_eval.ks`` from ``spectrum_eval.n`` samples per held-out task of ``domain``
    (None when ``spectrum_eval`` is null): how wide the model's distribution of answers is."""
    setting = common.samples_setting(ctx.raw.get("spectrum_eval"), "spectrum_eval")
    if setting is None:
        return {}
    n, ks = setting
    res = ctx.evaluate(f"{name}-n{n}", model_dir, [domain], n=n)
    return {f"pass@{k} (n={n})": v for k, v in common.pass_at_ks(res, ks, domain).items()}


def seed_domain_result(ctx: common.Ctx, seed: int, d: str, specs: dict, evals: dict, base, after_rl: dict) -> dict:
    """One (seed, domain) cell: scores before and after RL, paired differences, spectrum curves."""
    k = ctx.eval_cfg.k
    r = {
        "rl": {arm: common.scores(after_rl[arm][d], k, d) for arm in ARMS},
        "rl_dir": {arm: str(common.rl_from_dir(ctx, f"{arm}-s{seed}-{d}", specs[arm][d])) for arm in ARMS},
        "rl_diverse_minus_first": common.paired(after_rl["first_matched"][d], after_rl["diverse"][d], k, d),
        "base": common.scores(base, k, d),
        "first_matched": common.scores(evals["first_matched"][d], k, d),
        "diverse": common.scores(evals["diverse"][d], k, d),
        "diverse_minus_first": common.paired(evals["first_matched"][d], evals["diverse"][d], k, d),
        "first_minus_base": common.paired(base, evals["first_matched"][d], k, d),
        "diverse_minus_base": common.paired(base, evals["diverse"][d], k, d),
        "spectrum": {"base": spectrum_curve(ctx, "base", None, d),
                     **{arm: spectrum_curve(ctx, f"{arm}-s{seed}-{d}", specs[arm][d], d) for arm in ARMS}},
        "chosen_step": {arm: json.loads((ctx.sft_dir(f"{arm}-s{seed}") / d / "result.json").read_text())
                        ["chosen_step"] for arm in ARMS},
    }
    r["task_diffs"] = {  # diverse - first per held-out task: the seeds x tasks SE (seeds.py)
        "SFT pass@1": common.task_diff_map(evals["first_matched"][d], evals["diverse"][d], k, d),
        "RL pass@1": common.task_diff_map(after_rl["first_matched"][d], after_rl["diverse"][d], k, d)}
    sp = r["spectrum"]
    r["spectrum_diverse_minus_first"] = {m: sp["diverse"][m] - sp["first_matched"][m] for m in sp["diverse"]}
    return r


def result_row(d: str, seed: int, r: dict) -> list[str]:
    """The main table's row for one (seed, domain) cell."""
    return [d, str(seed), str(r["diverse"]["n_tasks"]),
            common.fmt(r["base"]["pass@1"]), common.fmt(r["first_matched"]["pass@1"]),
            common.fmt(r["diverse"]["pass@1"]),
            common.fdiff(r["diverse_minus_first"], "pass@1"),
            common.fmt(r["base"]["pass@k"]), common.fmt(r["first_matched"]["pass@k"]),
            common.fmt(r["diverse"]["pass@k"]),
            common.fdiff(r["diverse_minus_first"], "pass@k"),
            common.fmt(r["rl"]["first_matched"]["pass@1"]), common.fmt(r["rl"]["diverse"]["pass@1"]),
            common.fdiff(r["rl_diverse_minus_first"], "pass@1")]


def report(ctx: common.Ctx, rows: list, stats: dict, per_seed: dict, pooled: dict, n_pooled: int) -> str:
    """The markdown report: the main table, the data statistics, the pooled line, the spectrum curves."""
    k = ctx.eval_cfg.k
    head = ["domain", "seed", "held-out tasks", "base pass@1", "first-win pass@1", "diverse pass@1",
            "diverse - first (±SE)", f"base pass@{k}", f"first-win pass@{k}", f"diverse pass@{k}",
            "diverse - first (±SE)", "after RL: first-win pass@1", "after RL: diverse pass@1",
            "after RL: diverse - first (±SE)"]
    text = "\n".join([
        f"## Experiment 1: diverse vs first-win selection (K={k}, n={ctx.eval_cfg.n or k} samples per held-out task)",
        "",
        common.md_table(head, rows),
        "",
        common.md_table(
            ["domain", "prompts", "with a correct rollout", "correct/prompt", "distinct correct/prompt",
             "selected/prompt (diverse)", "mean pairwise distance (diverse)", "SFT examples first-win / diverse",
             "distinct solutions/prompt in SFT data first-win / diverse", "prompts whose arms differ"],
            [[d, str(s["n_prompts"]), str(s["prompts_with_correct"]),
              common.fmt(s.get("mean_correct_per_prompt")), common.fmt(s.get("mean_distinct_correct_per_prompt")),
              common.fmt(s.get("mean_selected_per_prompt")), common.fmt(s.get("mean_pairwise_distance_selected")),
              (f"{s['train_examples']['first_matched']} / {s['train_examples']['diverse']}"
               if "train_examples" in s else "-"),
              (" / ".join(common.fmt(s["distinct_per_prompt"][a]) for a in ARMS) if "distinct_per_prompt" in s else "-"),
              common.fmt(s.get("prompts_differing"))] for d, s in stats.items()]),
        "",
        f"pooled diverse - first over domains x seeds ({n_pooled} task x seed pairs): "
        f"pass@1 {common.fmt(*pooled['pass@1'], signed=True)}, pass@{k} {common.fmt(*pooled['pass@k'], signed=True)}",
    ])
    curve_rows = [[d, str(seed), arm, *(common.fmt(v) for v in r["spectrum"][arm].values())]
                  for seed, per in per_seed.items() for d, r in per.items() for arm in ("base", *ARMS)
                  if r["spectrum"].get(arm)]
    if curve_rows:
        labels = next(iter(next(iter(per_seed.values())).values()))["spectrum"]["diverse"]
        text += "\n\n" + common.md_table(["domain", "seed", "model (after SFT)", *labels], curve_rows)
    return text


def run(ctx: common.Ctx) -> dict:
    k = ctx.eval_cfg.k
    common.samples_setting(ctx.raw.get("spectrum_eval"), "spectrum_eval")  # fail before any work
    stats = spectrum_stats(ctx)
    rows = []
    per_seed: dict = {}
    pooled_diffs: dict[str, list[float]] = {"pass@1": [], "pass@k": []}
    for seed in ctx.sft_seeds:
        specs = {arm: common.specialists(ctx, arm, seed) for arm in ARMS}
        evals = {
            arm: {d: ctx.evaluate(f"{arm}-s{seed}-{d}", p, [d]) for d, p in specs[arm].items()} for arm in ARMS
        }
        base = ctx.evaluate("base", None)  # after the specialists: the comparison comes first
        after_rl = {arm: {d: common.rl_from(ctx, f"{arm}-s{seed}-{d}", p, d) for d, p in specs[arm].items()}
                    for arm in ARMS}
        per_seed[seed] = {}
        for d in specs["diverse"]:
            r = seed_domain_result(ctx, seed, d, specs, evals, base, after_rl)
            per_seed[seed][d] = r
            for m, xs in common.task_diffs(evals["first_matched"][d], evals["diverse"][d], k, d).items():
                pooled_diffs[m] += xs
            rows.append(result_row(d, seed, r))
    # pooled over domains and seeds: every (task, seed) paired difference; the SE treats them as
    # independent, which understates it when seeds of one task are correlated
    pooled = {m: common.mean_se(xs) for m, xs in pooled_diffs.items()}
    n_pooled = len(pooled_diffs["pass@1"])
    text = report(ctx, rows, stats, per_seed, pooled, n_pooled)
    results = {"k": k, "spectrum_source": ctx.raw.get("spectrum_source", "rollouts"), "spectrum": stats, "per_seed": per_seed, "pooled_diverse_minus_first": pooled}
    common.write_results(ctx, "exp1", results, text)
    return results


cli = common.entry_point(run, "Experiment 1: diverse-K vs first-win selection at equal SFT examples.")


if __name__ == "__main__":
    common.main(cli)
