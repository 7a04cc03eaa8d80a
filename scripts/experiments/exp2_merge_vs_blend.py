"""Experiment 2 (merge vs blend): merged specialists vs one LoRA trained on all domains' data mixed.

VibeThinker-1.5B (arXiv:2511.06221) section 3.2 trains one specialist per domain and merges them
(a parameter average) instead of training one model on the mixture, on the argument that the
domains interfere (negative transfer) when trained together. This script measures, on every
domain's held-out tasks:

- ``specialist``: that domain's own specialist (experiment 1's diverse-selection specialist, seed =
  the first of ``sft_seeds``, so the two experiments share it);
- ``merged``: the specialists merged with the ``merge:`` method (default ``linear``, the plain
  average, as VibeThinker) through ``mlx_ssp.merge.engine.merge_models``;
- ``blend``: ONE LoRA trained by ``run_sft`` on the union of every domain's diverse-selection data
  (the same examples the specialists saw, shuffled together), for as many iterations as all
  specialists together (equal training compute), its checkpoint chosen by Pass@K on the union of
  the probe tasks (``probe.max_tasks`` per domain, as each specialist gets);
- ``base``: the untrained model, for reference.

With ``merge_controls: {alphas: [...]}`` (the question why merge and blend trade places between
scales), also:

- ``blend_half``: the blend's chosen checkpoint fused at half its LoRA scale (a linear merge of N
  specialists applies each one's update at 1/N strength: is the blend just too strong?);
- ``blend_soup``: the linear merge of two blends trained with different seeds (is the merge's gain
  plain weight averaging of two updates that teach the same thing, a model soup?);
- ``merge_x{alpha}``: base + alpha x the mean of the specialists' task vectors (``task_arithmetic``
  with weights alpha / N; alpha 1 is the linear merge, alpha N their sum): does the merge dilute?
- the task vectors' norms and pairwise cosines (specialists and the blend, :mod:`mlx_ssp.merge.vectors`).

The negative-transfer question is "merged (or blend) minus specialist on the specialist's own
domain"; both differences are reported with a paired standard error across held-out tasks. The
interference between domains is each specialist's held-out pass@1 on the *other* domains minus the
base model's (a specialist that forgets, or that writes its own domain's operator everywhere).

    python scripts/experiments/exp2_merge_vs_blend.py [--tiny] [--work-dir DIR] [--set KEY=VALUE]
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from mlx_ssp.io import write_json_atomic  # noqa: E402
from mlx_ssp.merge.vectors import task_vectors  # noqa: E402

#: the second blend of the soup control trains with the seed plus this
SOUP_SEED = 1000


def blend_data(ctx: common.Ctx, domains: list[str]) -> tuple[Path, Path]:
    """(train/valid dir of all domains' diverse data mixed, probe task file relabelled to 'blend')."""
    from mlx_ssp.io import read_jsonl, write_json_atomic, write_jsonl_atomic
    from mlx_ssp.tasks import write_tasks

    out = ctx.select_dir("blend")
    probe = ctx.path("tasks", ctx.k_tasks, "probe_blend.jsonl")
    if not (out / "done.json").exists():
        div = common.spectrum_data(ctx)["diverse"]
        for part in ("train", "valid"):
            # mlx-lm's batch iterator shuffles, so the concatenation order does not matter
            recs = [r for d in domains for r in read_jsonl(div / d / f"{part}.jsonl")]
            write_jsonl_atomic(out / "blend" / f"{part}.jsonl", recs)
        write_json_atomic(out / "done.json", {"domains": domains})
    if not probe.exists():
        tasks = ctx.load_tasks("probe", domains)
        # SFT probes the tasks of its own domain; the verifier of each task is unchanged
        write_tasks(probe, [t.model_copy(update={"domain": "blend"}) for t in tasks])
    return out / "blend", probe


def controls_setting(raw) -> Optional[list[float]]:
    """``merge_controls`` as its alphas (None when null); anything else fails before any work."""
    if raw is None:
        return None
    valid = "null or {alphas: [a, ...]} with each a > 0 (1 is the linear merge itself)"
    al = raw.get("alphas") if isinstance(raw, dict) and set(raw) == {"alphas"} else None
    if not isinstance(al, list) or not al or not all(
            isinstance(a, (int, float)) and not isinstance(a, bool) and math.isfinite(a) and a > 0 for a in al):
        raise common.UserError(f"merge_controls: {raw!r} is not valid; valid: {valid}")
    return [float(a) for a in al]


def controls(ctx: common.Ctx, seed: int, specs: dict[str, str], blend: str, iters: int, data: Path, probe: Path,
             probe_max: Optional[int], alphas: list[float]) -> tuple[dict[str, str], dict]:
    """The control models (name -> model dir) and the task vectors' statistics."""
    n = len(specs)
    step = json.loads((ctx.sft_dir(f"mixed-s{seed}") / "blend" / "result.json").read_text())["chosen_step"]
    lora = dict(ctx.raw["sft"]["lora"])
    half = {"lora": {**lora, "scale": lora.get("scale", 20.0) / 2}}
    models = {"blend_half": common.fuse_checkpoint(ctx, ctx.sft_dir(f"mixed-s{seed}") / "blend", step,
                                                   ctx.sft_dir(f"mixed-s{seed}") / "blend_half", half)}
    other = ctx.sft(f"mixed-s{seed + SOUP_SEED}", {"blend": {"data": str(data), "probe_tasks": str(probe)}},
                    seed + SOUP_SEED, iters=iters, probe_max_tasks=probe_max)["blend"]
    plain = {"weights": None, "density": None, "parameters": {}}  # not the merge section's own options
    models["blend_soup"] = ctx.merge(f"blend-soup-s{seed}", [blend, other], method="linear", update=plain)
    for a in alphas:
        models[f"merge_x{a:g}"] = ctx.merge(f"diverse-s{seed}-x{a:g}", list(specs.values()), method="task_arithmetic",
                                            update={**plain, "weights": [a / n] * n})
    tv = ctx.path("merge", ctx.k_merge, f"task-vectors-s{seed}.json")
    if not tv.exists():
        write_json_atomic(tv, {"models": [*specs, "blend", "blend_seed2"],
                               **task_vectors(ctx.model_path, [*specs.values(), blend, other])})
    return models, json.loads(tv.read_text())


def merged_model(ctx: common.Ctx) -> tuple[str, dict[str, str]]:
    """(merged model dir, {domain: specialist dir}): shared with experiment 3."""
    seed = ctx.sft_seeds[0]
    specs = common.specialists(ctx, "diverse", seed)
    return ctx.merge(f"diverse-s{seed}-{ctx.merge_cfg.method}", list(specs.values())), specs


def headline(res: dict) -> dict[str, float]:
    """One seed's numbers the seed driver averages (scripts/experiments/seeds.py)."""
    out = {}
    for d, r in res["per_domain"].items():
        for name in ("base", "specialist", "merged", "blend"):
            out[f"{d} {name} pass@1"] = r[name]["pass@1"]
        for name in ("merged_minus_specialist", "blend_minus_specialist", "merged_minus_blend"):
            out[f"{d} {name.replace('_minus_', ' - ')} pass@1"] = r[name]["d_pass@1"]
        for e, x in r.get("specialists", {}).items():
            if e != d:
                out[f"{d} specialist:{e} - base pass@1"] = x["minus_base"]["d_pass@1"]
    for name in ("base", "merged", "blend"):
        out[f"overall {name} pass@1"] = res["overall"][name]["pass@1"]
    out["overall merged - blend pass@1"] = res["overall"]["merged_minus_blend"]["d_pass@1"]
    for name, r in res.get("controls", {}).get("models", {}).items():
        out[f"overall {name} pass@1"] = r["pass@1"]
        out[f"overall {name} - blend pass@1"] = r["minus_blend"]["d_pass@1"]
        out[f"overall merged - {name} pass@1"] = r["merged_minus"]["d_pass@1"]
    tv = res.get("controls", {}).get("task_vectors")
    if tv:
        out["cosine between specialists (mean)"] = tv["mean_cosine_specialists"]
        out["cosine specialist-blend (mean)"] = tv["mean_cosine_specialist_blend"]
        out["cosine blend-blend (two seeds)"] = tv["cosine_blends"]
    return out


def run(ctx: common.Ctx) -> dict:
    k = ctx.eval_cfg.k
    seed = ctx.sft_seeds[0]
    alphas = controls_setting(ctx.raw.get("merge_controls"))
    merged, specs = merged_model(ctx)
    domains = list(specs)
    spec_eval = {d: ctx.evaluate(f"diverse-s{seed}-{d}", p, [d]) for d, p in specs.items()}
    merged_eval = ctx.evaluate(f"merged-diverse-s{seed}-{ctx.merge_cfg.method}", merged, domains)
    data, probe = blend_data(ctx, domains)
    iters = ctx.raw["sft"]["iters"] * len(domains)
    # probe as many tasks of every domain as a specialist probes of its own (probe.max_tasks takes
    # the first N of the file, so N per domain times the number of domains)
    per = ctx.raw["sft"].get("probe", {}).get("max_tasks", 32)
    probe_max = None if per is None else per * len(domains)
    blend = ctx.sft(f"mixed-s{seed}", {"blend": {"data": str(data), "probe_tasks": str(probe)}}, seed, iters=iters,
                    probe_max_tasks=probe_max)
    blend_eval = ctx.evaluate(f"mixed-s{seed}", blend["blend"], domains)
    base = ctx.evaluate("base", None)
    # interference: every specialist on every domain (its own domain is spec_eval's tasks again)
    cross = {d: ctx.evaluate(f"diverse-s{seed}-{d}-all", p, domains) for d, p in specs.items()}

    per_domain = {}
    rows = []
    for d in domains:
        r = {
            "base": common.scores(base, k, d),
            "specialist": common.scores(spec_eval[d], k, d),
            "merged": common.scores(merged_eval, k, d),
            "blend": common.scores(blend_eval, k, d),
            "merged_minus_specialist": common.paired(spec_eval[d], merged_eval, k, d),
            "blend_minus_specialist": common.paired(spec_eval[d], blend_eval, k, d),
            "merged_minus_blend": common.paired(blend_eval, merged_eval, k, d),
        }
        r["specialists"] = {e: {**common.scores(cross[e], k, d), "minus_base": common.paired(base, cross[e], k, d)}
                            for e in domains}
        per_domain[d] = r
        for m, label in (("pass@1", "pass@1"), ("pass@k", f"pass@{k}")):
            rows.append([d, label, str(r["specialist"]["n_tasks"]), common.fmt(r["base"][m]),
                         common.fmt(r["specialist"][m], r["specialist"][f"{m}_se"]),
                         common.fmt(r["merged"][m], r["merged"][f"{m}_se"]),
                         common.fmt(r["blend"][m], r["blend"][f"{m}_se"]),
                         common.fdiff(r["merged_minus_specialist"], m), common.fdiff(r["blend_minus_specialist"], m),
                         common.fdiff(r["merged_minus_blend"], m)])
    models = (("base", base), ("merged", merged_eval), ("blend", blend_eval))
    overall = {name: common.scores(ev, k) for name, ev in models}
    overall["merged_minus_blend"] = common.paired(blend_eval, merged_eval, k)
    head = ["domain", "metric", "held-out tasks", "base", "specialist (own domain)", "merged", "blend (one LoRA)",
            "merged - specialist", "blend - specialist", "merged - blend"]
    text = "\n".join([
        f"## Experiment 2: merged specialists ({ctx.merge_cfg.method}) vs one blended LoRA "
        f"(K={k}, n={ctx.eval_cfg.n or k}; blend trained {iters} iters = specialists' total; ± = SE across tasks)",
        "",
        common.md_table(head, rows),
        "",
        "overall (all domains' held-out tasks): " + ", ".join(
            f"{n} pass@1 {common.fmt(overall[n]['pass@1'], overall[n]['pass@1_se'])} "
            f"pass@{k} {common.fmt(overall[n]['pass@k'], overall[n]['pass@k_se'])}" for n, _ in models)
        + f"; merged - blend pass@1 {common.fdiff(overall['merged_minus_blend'], 'pass@1')}",
    ])
    cross_rows = [["base"] + [common.fmt(per_domain[d]["base"]["pass@1"]) for d in domains]]
    cross_rows += [[f"specialist:{e}"] + [f"{common.fmt(per_domain[d]['specialists'][e]['pass@1'])} "
                                          f"({common.fdiff(per_domain[d]['specialists'][e]['minus_base'], 'pass@1')})"
                                          for d in domains] for e in domains]
    text += "\n\n" + "\n".join([
        "Interference: held-out pass@1 of each specialist on every domain (in brackets: minus the base, paired):", "",
        common.md_table(["model", *domains], cross_rows)])
    results = {"k": k, "blend_iters": iters, "merged_model": merged, "per_domain": per_domain, "overall": overall}
    if alphas is not None:
        models, tv = controls(ctx, seed, specs, blend["blend"], iters, data, probe, probe_max, alphas)
        evs = {name: ctx.evaluate(f"control-{name}-s{seed}", m, domains) for name, m in models.items()}
        results["controls"] = {"models": {name: {**common.scores(ev, k), "minus_blend": common.paired(blend_eval, ev, k),
                                                 "merged_minus": common.paired(ev, merged_eval, k)}
                                          for name, ev in evs.items()},
                               "task_vectors": summarize_vectors(tv, len(specs))}
        text += "\n\n" + controls_md(results["controls"], k)
    common.write_results(ctx, "exp2", results, text)
    return results


def summarize_vectors(tv: dict, n: int) -> dict:
    """The task vectors' statistics as the table needs them: the raw matrix plus mean cosines
    between specialists, between each specialist and the blend, and between the two blends."""
    c = tv["cosine"]
    pairs = [c[i][j] for i in range(n) for j in range(i + 1, n)]
    return {**tv, "mean_cosine_specialists": sum(pairs) / len(pairs) if pairs else None,
            "mean_cosine_specialist_blend": sum(c[i][n] for i in range(n)) / n, "cosine_blends": c[n][n + 1]}


def controls_md(ctl: dict, k: int) -> str:
    rows = [[name, common.fmt(r["pass@1"], r["pass@1_se"]), common.fdiff(r["minus_blend"], "pass@1"),
             common.fdiff(r["merged_minus"], "pass@1")] for name, r in ctl["models"].items()]
    tv = ctl["task_vectors"]
    names = tv["models"]
    vec = [[a, common.fmt(tv["norms"][i]), *(common.fmt(x) for x in tv["cosine"][i])] for i, a in enumerate(names)]
    return "\n".join([
        "Controls (overall held-out pass@1; paired differences across tasks):", "",
        common.md_table(["model", "pass@1", "minus blend", "merged minus it"], rows), "",
        "Task vectors (fine-tune - base): norms and cosines:", "",
        common.md_table(["model", "norm", *names], vec)])


cli = common.entry_point(run, "Experiment 2: merged specialists vs one LoRA on all domains' data mixed.")


if __name__ == "__main__":
    common.main(cli)
