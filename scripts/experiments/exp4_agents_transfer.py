"""Experiment 4 (agents): does a narrow specialist erode the other backends, and does merging not?

The agents configuration trains one LoRA specialist per BFCL backend and merges them, because training
on one backend, or on all of them blended, can erode a model's breadth across the backends (negative
transfer). This script measures, on every backend's
held-out multi-turn episodes (``bfcl_multi_turn:base``, one domain per backend), for each SFT seed:

- ``specialist:<backend>``: one LoRA per backend, trained on that backend's selected passing episodes
  (the model's own K rollouts that pass, and the gold episodes of BFCL's ground truth played through
  the environment: ``select.gold``), checkpoint by Pass@K on its probe episodes, fused;
- ``merged``: the specialists merged (``merge.method``, default linear);
- ``blend``: one LoRA on all backends' data mixed, for as many iterations as all specialists together
  (equal training compute), probed on every backend's probe episodes;
- ``base``: the untrained model.

Reported: each model's pass rate per backend, its *breadth* (the mean over backends), the
specialists' own-backend pass rate and their breadth, and the differences that carry the question
(merged - specialist on the specialist's own backend; breadth of merged, blend and specialists vs
base), as means over SFT seeds with the standard error across seeds (and, per seed, the paired SE
across tasks in results.json). Reward per episode: ``partial`` (the fraction of turns passed) by
default, because at demo scale BFCL's all-turns accuracy is 0 almost everywhere.

    python scripts/experiments/exp4_agents_transfer.py [--profile demo|tools] [--tiny] [--work-dir DIR] [--set KEY=VALUE]

``--profile demo`` (default): BFCL's base episodes on the demo model, ``tools: used`` (only the
functions an episode's ground truth calls are offered: short prompts, an easier task than BFCL's).
``--profile tools``: the tool-use testbed (``testbed:tools``, its four toy backends as domains; reward:
every turn passed), where the models are also merged with TIES (``ties``) beside the merge section's
method. Over seeds: ``python scripts/experiments/seeds.py exp4 --profile tools --seeds 0-4``.
``--tiny``: a random model, minimal sizes, seconds.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from mlx_ssp.io import read_jsonl, write_jsonl_atomic  # noqa: E402

BACKENDS = ("file_system", "vehicle_control", "trading", "travel")
_S = {"temperature": 0.7, "top_p": 1.0, "max_tokens": 96}


def _domains(sizes: dict, tools: str = "used") -> dict:
    return {b: {"source": "bfcl_multi_turn:base", "params": {"backend": b, "tools": tools, "reward": "partial"},
                "sizes": dict(sizes)} for b in BACKENDS}


DEFAULTS = {
    **copy.deepcopy(common.DEFAULTS),
    "tasks": {"seed": 1234, "domains": _domains({"train": 8, "probe": 2, "eval": 6})},
    "rollout": {"k": 2, "sampling": _S, "batch_size": 16},
    "select": {"per_prompt": 2, "gold": True, "drop_truncated": False},
    "sft": {
        "lora": {"rank": 8, "num_layers": 8, "scale": 20.0}, "learning_rate": 2e-4, "iters": 24, "batch_size": 1,
        "save_every": 12, "report_every": 6, "val_batches": 0, "max_seq_length": 4096,
        "probe": {"k": 2, "max_tasks": 2, "batch_size": 16, "sampling": _S, "progress": False},
    },
    "sft_seeds": [0, 1, 2],
    "eval": {"k": 2, "n": 2, "sampling": _S, "batch_size": 16},
    "rl_from_merged": False,
}

#: the tool-use testbed profile: MGPO-GRPO and GRPO (lambda 0) from the merged model, on every
#: backend's train episodes, evaluated after the last step only
TOOLS = {
    **copy.deepcopy(common.TOOLS),
    "rl": {**common.TOOLS["rl"], "steps": 30},
    "rl_eval_every": 30,
    "rl_from_merged": True,
}


def _tiny() -> dict:
    d = copy.deepcopy(DEFAULTS)
    s = {"temperature": 1.0, "max_tokens": 6}
    d["tasks"]["domains"] = {b: v for b, v in _domains({"train": 2, "probe": 1, "eval": 1}).items()
                             if b in ("file_system", "trading")}
    d["rollout"].update(k=2, sampling=s, batch_size=8)
    d["sft"].update(iters=2, save_every=1, report_every=1, max_seq_length=2048, lora={"rank": 2, "num_layers": 1},
                    probe={"k": 2, "max_tasks": 1, "batch_size": 8, "sampling": s, "progress": False})
    d["sft_seeds"] = [0, 1]
    d["eval"].update(k=2, n=2, sampling=s, batch_size=8)
    return d


def _tiny_tools() -> dict:
    """The tools profile at plumbing size: a short build of the tool testbed model, two backends."""
    d = copy.deepcopy(TOOLS)
    s = {"temperature": 1.0, "max_tokens": 8}
    d["tasks"]["domains"] = {b: {**v, "sizes": {"train": 4, "probe": 2, "eval": 2}}
                             for b, v in d["tasks"]["domains"].items() if b in ("kv", "bank")}
    d["rollout"].update(k=2, sampling=s, batch_size=8)
    d["sft"].update(iters=2, batch_size=1, save_every=1, report_every=1, lora={"rank": 2, "num_layers": 1},
                    probe={"k": 2, "max_tasks": 1, "batch_size": 8, "sampling": s, "progress": False})
    d["eval"].update(k=2, n=2, sampling=s, batch_size=8)
    d["rl"].update(steps=1, batch_size=2, group_size=2, sampling=s, gen_batch_size=8, micro_batch_size=4,
                   checkpoint_every=1, lora={"rank": 2, "num_layers": 1})
    d["rl_eval_every"] = 1
    return d


def run_seed(ctx: common.Ctx, seed: int) -> dict:
    """Every model of one SFT seed, each evaluated on every backend."""
    sel = ctx.selection("diverse")
    doms = common.domains_with_data(sel)
    if not doms:
        raise common.UserError("no backend has SFT data (no passing episode and no gold episode)")
    probe = str(ctx.tasks("probe"))
    specs = ctx.sft(f"spec-s{seed}", {d: {"data": str(sel / d), "probe_tasks": probe} for d in doms}, seed)
    merged = ctx.merge(f"s{seed}-{ctx.merge_cfg.method}", list(specs.values()))
    mixed = _blend_dir(ctx, sel, doms)
    blend = ctx.sft(f"blend-s{seed}", {"blend": {"data": str(mixed), "probe_tasks": probe, "probe_domains": doms}},
                    seed, iters=ctx.raw["sft"]["iters"] * len(doms),
                    probe_max_tasks=ctx.raw["sft"]["probe"]["max_tasks"] * len(doms))["blend"]
    ev = {f"specialist:{d}": ctx.evaluate(f"s{seed}-spec-{d}", p) for d, p in specs.items()}
    ev["merged"] = ctx.evaluate(f"s{seed}-merged", merged)
    ev["blend"] = ctx.evaluate(f"s{seed}-blend", blend)
    for method in ctx.raw.get("extra_merges", []) if len(specs) > 1 else []:
        other = ctx.merge(f"s{seed}-{method}", list(specs.values()), method=method)
        ev[method] = ctx.evaluate(f"s{seed}-{method}", other)
    if ctx.raw.get("rl_from_merged"):
        ev.update(rl_from_merged(ctx, seed, merged))
    return ev


#: the RL arms started from the merged model: name -> lambda (None: ``rl.mgpo_lambda``)
RL_ARMS = {"rl:mgpo": None, "rl:grpo": 0.0}


def rl_from_merged(ctx: common.Ctx, seed: int, merged: str) -> dict[str, dict]:
    """RL from the merged model with the same budget per arm (``rl``: steps x prompts x G), MGPO at
    ``rl.mgpo_lambda`` and GRPO (lambda 0), trained on every backend's train episodes mixed; each arm's
    held-out eval after its last step, with the arm's mean MGPO weight over its steps."""
    out = common.rl_from_dir(ctx, f"s{seed}", merged)
    backends = list(ctx.domains)
    ev = {}
    for name, lam in RL_ARMS.items():
        lam = ctx.rl_cfg.mgpo_lambda if lam is None else lam
        arm = name.split(":", 1)[1]
        res = dict(common.rl_arm(ctx, arm, lam, merged, out, backends)[ctx.rl_cfg.steps])
        w = [m["mgpo_weight_mean"] for m in read_jsonl(out / arm / "metrics.jsonl") if "mgpo_weight_mean" in m]
        res["mgpo_weight_mean"] = sum(w) / len(w) if w else None
        ev[name] = res
    return ev


def _blend_dir(ctx: common.Ctx, sel: Path, doms: list[str]) -> Path:
    out = ctx.select_dir("blend") / "blend"
    for part in ("train", "valid"):
        f = out / f"{part}.jsonl"
        if not f.exists():
            write_jsonl_atomic(f, [r for d in doms for r in read_jsonl(sel / d / f"{part}.jsonl")])
    return out


#: the figure compared: the mean episode reward (the fraction of turns passed, ``reward: partial``),
#: because BFCL's all-turns accuracy (pass@1 here) is 0 almost everywhere at demo scale; both are kept
METRIC = "mean_reward"


def per_backend(res: dict, k: int, backends: list[str], metric: str = METRIC) -> dict[str, float]:
    """The mean over a backend's held-out tasks of ``metric`` (``mean_reward`` or ``pass@1``)."""
    out = {}
    for b in backends:
        xs = [t[metric] for t in res["tasks"] if t["domain"] == b]
        out[b] = sum(xs) / len(xs) if xs else float("nan")
    return out


def breadth(p: dict[str, float]) -> float:
    return sum(p.values()) / len(p)


def summarize(base: dict, seeds: dict[int, dict], k: int, backends: list[str]) -> dict:
    """Means over seeds (± SE across seeds) of pass@1 per backend and breadth, per model kind."""
    kinds: dict[str, list[dict]] = {}
    own, own_minus_merged = [], []
    for ev in seeds.values():
        for name, res in ev.items():
            kinds.setdefault(name, []).append(per_backend(res, k, backends))
        spec_own = {b: per_backend(ev[f"specialist:{b}"], k, backends)[b] for b in backends if f"specialist:{b}" in ev}
        merged = per_backend(ev["merged"], k, backends)
        own.append(breadth(spec_own))
        own_minus_merged.append(sum(merged[b] - v for b, v in spec_own.items()) / len(spec_own))
    b0 = per_backend(base, k, backends)
    out = {"base": {"per_backend": b0, "breadth": (breadth(b0), None)}}
    for name, rows in kinds.items():
        out[name] = {"per_backend": {b: common.mean_se([r[b] for r in rows]) for b in backends},
                     "breadth": common.mean_se([breadth(r) for r in rows])}
    spec_breadth = [breadth(r) for n, rows in kinds.items() if n.startswith("specialist:") for r in rows]
    out["specialists"] = {"own_backend": common.mean_se(own), "breadth": common.mean_se(spec_breadth)}
    out["merged_minus_specialist_own"] = common.mean_se(own_minus_merged)
    return out


def headline(res: dict) -> dict[str, float]:
    """One seed's numbers the seed driver averages (scripts/experiments/seeds.py): each model's
    breadth and per-backend score, and the paired differences the experiment is about."""
    (ev,) = res["per_seed"].values()
    backends = res["backends"]
    base = res["summary"]["base"]["per_backend"]
    out = {"base breadth": breadth(base)}
    for name, m in ev.items():
        out[f"{name} breadth"] = breadth(m["per_backend"])
        for b in backends:
            out[f"{name} on {b}"] = m["per_backend"][b]
    specs = {n.split(":", 1)[1]: m["per_backend"] for n, m in ev.items() if n.startswith("specialist:")}
    if specs:
        own = {b: p[b] for b, p in specs.items()}
        out["specialists own backend"] = sum(own.values()) / len(own)
        out["merged - specialist (own backend)"] = sum(ev["merged"]["per_backend"][b] - v for b, v in own.items()) / len(own)
        others = [p[o] - base[o] for b, p in specs.items() for o in backends if o != b]
        out["specialist - base (other backends)"] = sum(others) / len(others) if others else None
    out["merged - blend (breadth)"] = breadth(ev["merged"]["per_backend"]) - breadth(ev["blend"]["per_backend"])
    if "ties" in ev:
        out["ties - blend (breadth)"] = breadth(ev["ties"]["per_backend"]) - breadth(ev["blend"]["per_backend"])
    if "rl:mgpo" in ev:
        b = {n: breadth(ev[n]["per_backend"]) for n in ("merged", *RL_ARMS)}
        out["rl:mgpo - merged (breadth)"] = b["rl:mgpo"] - b["merged"]
        out["rl:grpo - merged (breadth)"] = b["rl:grpo"] - b["merged"]
        out["rl:mgpo - rl:grpo (breadth)"] = b["rl:mgpo"] - b["rl:grpo"]
        # the recipe's whole path (merge, then RL) against the blend alone, which had no RL budget
        out["rl:mgpo - blend (breadth)"] = b["rl:mgpo"] - breadth(ev["blend"]["per_backend"])
        out["rl:mgpo mean MGPO weight"] = ev["rl:mgpo"].get("mgpo_weight_mean")
    return out


#: the paired differences given per task as well (seeds.py: their SE over seeds x tasks)
TASK_DIFFS = {"merged - blend (breadth)": ("blend", "merged"), "ties - blend (breadth)": ("blend", "ties"),
              "rl:mgpo - merged (breadth)": ("merged", "rl:mgpo"), "rl:grpo - merged (breadth)": ("merged", "rl:grpo"),
              "rl:mgpo - rl:grpo (breadth)": ("rl:grpo", "rl:mgpo"), "rl:mgpo - blend (breadth)": ("blend", "rl:mgpo")}


def task_diffs(res: dict) -> dict[str, dict[str, float]]:
    """headline metric -> {task id: b - a} of one seed's run, for the differences of whole models
    (every backend has as many eval tasks, so the mean over tasks is the breadth difference)."""
    (ev,) = res["per_seed"].values()
    out = {}
    for key, (a, b) in TASK_DIFFS.items():
        if a in ev and b in ev and "tasks" in ev[a]:
            out[key] = {t: ev[b]["tasks"][t] - v for t, v in ev[a]["tasks"].items() if t in ev[b]["tasks"]}
    return out


def run(ctx: common.Ctx) -> dict:
    k = ctx.eval_cfg.k
    backends = list(ctx.domains)
    base = ctx.evaluate("base", None)
    seeds = {s: run_seed(ctx, s) for s in ctx.sft_seeds}
    summ = summarize(base, seeds, k, backends)
    tools = "extra_merges" in ctx.raw  # the tool-use testbed profile
    what = "the tool-use testbed's episodes" if tools else "BFCL multi-turn episodes"
    measure = "episodes with every turn passed" if tools else "mean fraction of turns passed"
    f = common.fmt
    head = ["model", *backends, "breadth"]
    rows = [["base", *(f(summ["base"]["per_backend"][b]) for b in backends), f(summ["base"]["breadth"][0])]]
    for name in [n for n in summ if n.startswith("specialist:")] + ["blend", "merged", *ctx.raw.get("extra_merges", []),
                                                                    *RL_ARMS]:
        if name not in summ:
            continue
        r = summ[name]
        rows.append([name, *(f(*r["per_backend"][b]) for b in backends), f(*r["breadth"])])
    sp = summ["specialists"]
    text = "\n".join([
        f"## Experiment 4: specialists per backend vs blend vs merge on {what} "
        f"({measure}, n={ctx.eval_cfg.n or k} per task; {len(ctx.sft_seeds)} SFT seeds; "
        "± = SE across seeds)",
        "",
        common.md_table(head, rows),
        "",
        f"specialists on their own backend: {f(*sp['own_backend'])}; specialists' breadth: {f(*sp['breadth'])}; "
        f"merged - specialist on the specialist's backend: {f(*summ['merged_minus_specialist_own'], signed=True)}",
    ])
    if "rl:mgpo" in summ:
        steps = ctx.rl_cfg
        text += (f"\n\nRL from the merged model ({steps.steps} steps x {steps.batch_size} episodes x G={steps.group_size}, "
                 f"all backends' train episodes): MGPO at lambda={steps.mgpo_lambda:g} and GRPO (lambda 0), same budget.")
    acc = {n: {"per_backend": per_backend(r, k, backends, "pass@1")} for n, r in (("base", base),)}
    results = {"k": k, "backends": backends, "metric": METRIC, "summary": summ, "accuracy_base": acc, "per_seed": {
        s: {n: {"per_backend": per_backend(r, k, backends), "accuracy_per_backend": per_backend(r, k, backends, "pass@1"),
                "vs_base_accuracy": common.paired(base, r, k),
                "tasks": {t["task_id"]: t[METRIC] for t in r["tasks"]},
                **({"mgpo_weight_mean": r["mgpo_weight_mean"]} if "mgpo_weight_mean" in r else {})}
            for n, r in ev.items()} for s, ev in seeds.items()}}
    accs = [v for ev in results["per_seed"].values() for m in ev.values() for v in m["accuracy_per_backend"].values()]
    if not tools:
        text += f"\n\nBFCL accuracy (every turn passed): {sum(1 for a in accs if a > 0)} of {len(accs)} (model, backend, seed) cells above 0."
    common.write_results(ctx, "exp4", results, text)
    return results


def _make_ctx(tiny, work_dir, overrides, no_progress):
    if tiny and not any(o.startswith("model=") for o in overrides):
        # a tokenizer trained on the tool schemas: the default tiny model's turns prompts into ~4k tokens
        from mlx_ssp.testing import make_tiny_agent_model

        mdir = Path(work_dir or "runs/experiments-agents-tiny") / "tiny_agent_model"
        if not (mdir / "config.json").exists():
            make_tiny_agent_model(mdir)
        overrides = (*overrides, f"model={mdir}")
    return common.make_ctx(tiny, work_dir, overrides, no_progress, defaults=DEFAULTS, tiny_defaults=_tiny(),
                           name="experiments-agents")


#: --profile NAME -> this experiment's defaults (BFCL on the demo model, or the tool-use testbed)
PROFILES = {"demo": DEFAULTS, "tools": TOOLS}


@common.click.command(help="Experiment 4: specialists per backend vs blend vs merge (breadth).")
@common.options
@common.click.option("--profile", type=common.click.Choice(sorted(common.PROFILES)), default="demo", show_default=True,
                     help="demo: BFCL's base episodes on the demo model; tools: the tool-use testbed.")
def cli(tiny, work_dir, overrides, no_progress, profile):
    if profile not in PROFILES:
        raise common.UserError(f"experiment 4 runs with --profile {' or '.join(PROFILES)} (not {profile})")
    if profile == "tools":
        if tiny and not any(o.startswith("model=") for o in overrides):
            # a few steps of the tool testbed's own build: its tokenizer and chat template, seconds
            from mlx_ssp.testbed.build import build

            mdir = Path(work_dir or "runs/experiments-tools-tiny") / "tiny_tools_model"
            if not (mdir / "config.json").exists():
                build("tools", 0, mdir, steps=2, corpus_size=8, progress=False)
            overrides = (*overrides, f"model={mdir}")
        run(common.make_ctx(tiny, work_dir, overrides, no_progress, defaults=PROFILES[profile],
                            tiny_defaults=_tiny_tools(), name="experiments-tools"))
        return
    run(_make_ctx(tiny, work_dir, overrides, no_progress))


if __name__ == "__main__":
    common.main(cli)
