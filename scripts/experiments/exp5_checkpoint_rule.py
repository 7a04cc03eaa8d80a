"""Experiment 5 (checkpoint rule): which SFT checkpoint should start RL? Pass@K vs Pass@1 vs lowest
validation loss, judged by held-out pass@1 after the same RL budget from each.

VibeThinker-1.5B (arXiv:2511.06221) section 3.2 picks each specialist's checkpoint by Pass@K on a
probe set rather than by Pass@1 or validation loss, on the argument that the Spectrum phase should
hand RL the widest spread of correct solutions, and RL then turns that spread into Pass@1. Published
work finds the SFT score a weak predictor of post-RL results and Pass@(large k) a better one. This
script measures it, per domain:

1. one diverse-selection specialist (experiment 1's data and settings) trained with validation loss
   on (``sft.val_batches = -1``: the selection's valid split), every checkpoint probed
   (``sft.save_every``: pass@1 and pass@k on the probe split, validation loss);
2. **every** checkpoint fused into a model and given the same RL budget (the ``rl:`` section, on the
   domain's train prompts, the same seed), then evaluated on the held-out split (pass@1, n samples
   per task, the same sampling seeds for every model); its post-SFT held-out pass@1 too;
3. each rule's choice among the checkpoints (:func:`mlx_ssp.sft.probe.select_checkpoint`, the rule
   ``mlx_ssp sft`` applies) and the post-RL pass@1 of that choice, its regret (the best checkpoint's
   post-RL pass@1 minus the choice's), and the paired differences between the rules' choices;
4. how well each probe signal predicts the post-RL result across the checkpoints: the Spearman rank
   correlation of probe pass@k, probe pass@1, minus validation loss and held-out post-SFT pass@1
   and pass@k with post-RL pass@1 (None where a signal is constant over the checkpoints).
5. with ``large_k: {n: N, ks: [...]}``, Pass@(large k) as well: every checkpoint sampled N times on
   each probe prompt, pass@k for each k of ks (the unbiased estimator from N samples) added as a
   signal, and a rule ``pass@K`` (K the largest of ks, ties broken like the Pass@K rule: pass@1,
   then validation loss) whose choice is judged after RL like the others. The probe split is the
   one ``mlx_ssp sft`` probes, so this is a rule a user could apply.

    python scripts/experiments/exp5_checkpoint_rule.py [--profile testbed] [--tiny] [--set sft.save_every=20]
    python scripts/experiments/seeds.py exp5 --profile testbed --seeds 0-4 --jobs 2   # 5 training seeds
    python scripts/experiments/exp5_checkpoint_rule.py --profile testbed --set 'large_k={n: 256, ks: [8, 64, 256]}'

Results: WORK_DIR/exp5/results.{json,md}. Deviation from the paper: its probe rule picks among
checkpoints of a full SFT run on a large model; here the checkpoints are few (``iters / save_every``).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Optional


sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

RULES = ("pass@k", "pass@1", "val_loss")
#: the probe signals whose rank correlation with post-RL pass@1 is reported (higher = better for each)
#: (the held-out ones read the held-out split, n samples on each of its tasks: a larger probe, but a
#: diagnostic only; a checkpoint rule that used them would select on the test set)
SIGNALS = ("probe pass@k", "probe pass@1", "-val_loss", "held-out SFT pass@1", "held-out SFT pass@k")


def signals(ckpts: list[dict]) -> dict[str, list[Optional[float]]]:
    """Each signal of :data:`SIGNALS` over the checkpoints, oriented so that higher is better, then
    the Pass@(large k) ones where the checkpoints have them (``probe large k``: {label: value})."""
    out = {"probe pass@k": [c["probe pass@k"] for c in ckpts], "probe pass@1": [c["probe pass@1"] for c in ckpts],
           "-val_loss": [None if c["val_loss"] is None else -c["val_loss"] for c in ckpts],
           "held-out SFT pass@1": [c["sft"]["pass@1"] for c in ckpts],
           "held-out SFT pass@k": [c["sft"]["pass@k"] for c in ckpts]}
    for label in ckpts[0].get("probe large k", {}) if ckpts else ():
        out[label] = [c["probe large k"][label] for c in ckpts]
    return out


def large_k_setting(raw) -> Optional[tuple[int, list[int]]]:
    """The ``large_k`` setting as (n, ks), None when off; anything else fails before any work."""
    return common.samples_setting(raw, "large_k", "samples per probe prompt")


def check_probe_matches(ctx: common.Ctx, domains: list[str]) -> None:
    """The large-k probe samples the probe split with ``eval.sampling``; it is the probe ``mlx_ssp
    sft`` runs only if that equals ``sft.probe.sampling`` and every probe task of a domain is among
    the first ``sft.probe.max_tasks``: fail before any work otherwise."""
    from mlx_ssp.config import validate
    from mlx_ssp.sft.config import ProbeConfig

    probe = validate(ProbeConfig, ctx.raw["sft"].get("probe", {}), source="experiment", prefix="sft.probe")
    if probe.sampling != ctx.eval_cfg.sampling:
        raise common.UserError("large_k samples the probe split with eval.sampling, which differs from "
                               "sft.probe.sampling: set them equal so that it probes what mlx_ssp sft probes")
    for d in domains:
        n = len(ctx.load_tasks("probe", [d]))
        if probe.max_tasks is not None and n > probe.max_tasks:
            raise common.UserError(f"large_k samples all {n} probe tasks of {d}, mlx_ssp sft probes the first "
                                   f"sft.probe.max_tasks={probe.max_tasks}: make them equal")


def large_k_rule(probed: list[dict], large: list[dict[str, float]], label: str) -> int:
    """Index of the checkpoint the Pass@K rule picks when pass@k is the large-k probe's ``label``
    (``probed``: the SFT probe's rows; ties go to its pass@1, then validation loss, then the earlier step)."""
    from mlx_ssp.sft.probe import select_checkpoint

    return select_checkpoint([{**p, "pass@k": lk[label]} for p, lk in zip(probed, large)], "pass@k")


def large_k_scores(res: dict, n: int, ks: list[int], domain: str) -> dict[str, float]:
    """label -> mean over the domain's probe tasks of the unbiased pass@k from each task's samples."""
    return {f"probe pass@{k} (n={n})": v for k, v in common.pass_at_ks(res, ks, domain).items()}


def spearman(xs: list[Optional[float]], ys: list[float]) -> Optional[float]:
    """Spearman's rank correlation (average ranks for ties); None if either side is constant or
    fewer than 3 points have both values."""
    pts = [(x, y) for x, y in zip(xs, ys) if x is not None and y is not None]
    if len(pts) < 3:
        return None

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for t in range(i, j + 1):
                r[order[t]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks([p[0] for p in pts]), ranks([p[1] for p in pts])
    if len(set(rx)) == 1 or len(set(ry)) == 1:
        return None
    return statistics.correlation(rx, ry)  # Pearson's r of the ranks


def run(ctx: common.Ctx) -> dict:
    from mlx_ssp.select import safe_dirname
    from mlx_ssp.sft.probe import read_curve, select_checkpoint

    k = ctx.eval_cfg.k
    seed = ctx.sft_seeds[0]
    large = large_k_setting(ctx.raw.get("large_k"))
    if large:
        check_probe_matches(ctx, ctx.domains)
    data = common.spectrum_data(ctx)["diverse"]
    doms = common.domains_with_data(data)
    if not doms:
        raise common.UserError("the base model's rollouts have no correct solution in any domain: nothing to train on")
    probe = str(ctx.tasks("probe"))
    overrides = {"val_batches": -1}
    specs = ctx.sft(f"ckpt-diverse-s{seed}", {d: {"data": str(data / d), "probe_tasks": probe} for d in doms}, seed,
                    overrides=overrides)
    per_domain: dict = {}
    rows_md, corr_md = [], []
    for d in doms:
        ddir = Path(specs[d]).parents[1] / safe_dirname(d)
        curve = read_curve(ddir)
        ckpts = []
        for row in curve:
            step = row["step"]
            mdir = common.fuse_checkpoint(ctx, ddir, step, ddir.parent / "checkpoint_models" / f"{safe_dirname(d)}-step{step}",
                                          overrides)
            sft_ev = ctx.evaluate(f"ckpt-s{seed}-{d}-step{step}", mdir, [d])
            rl_ev = common.rl_from(ctx, f"ckpt-s{seed}-{d}-step{step}", mdir, d)
            ckpts.append({"step": step, "probe pass@1": row["pass@1"], "probe pass@k": row["pass@k"], "probe k": row["k"],
                          "val_loss": row["val_loss"], "sft": common.scores(sft_ev, k, d),
                          "rl": common.scores(rl_ev, k, d), "_sft_eval": sft_ev, "_rl_eval": rl_ev})
            if large:
                big = ctx.evaluate(f"ckpt-s{seed}-{d}-step{step}-probe", mdir, [d], split="probe", n=large[0])
                ckpts[-1]["probe large k"] = large_k_scores(big, *large, d)
        best = max(c["rl"]["pass@1"] for c in ckpts)
        probed = [{"step": c["step"], "pass@1": c["probe pass@1"], "pass@k": c["probe pass@k"], "val_loss": c["val_loss"]}
                  for c in ckpts]
        chosen = {rule: ckpts[select_checkpoint(probed, rule)] for rule in RULES}
        rules = list(RULES)
        if large:  # the Pass@K rule with K large: the same rule on the large-k probe's pass@K
            label, top = f"probe pass@{large[1][-1]} (n={large[0]})", f"pass@{large[1][-1]}"
            chosen[top] = ckpts[large_k_rule(probed, [c["probe large k"] for c in ckpts], label)]
            rules.append(top)
        r = {"checkpoints": [{kk: v for kk, v in c.items() if not kk.startswith("_")} for c in ckpts],
             "best_rl_pass@1": best, "rules": {}, "paired": {}, "spearman": {}}
        for rule, c in chosen.items():
            r["rules"][rule] = {"step": c["step"], "sft_pass@1": c["sft"]["pass@1"], "rl_pass@1": c["rl"]["pass@1"],
                                "regret": best - c["rl"]["pass@1"]}
            rows_md.append([d, rule, str(c["step"]), common.fmt(c["probe pass@1"]), common.fmt(c["probe pass@k"]),
                            common.fmt(c["val_loss"]), common.fmt(c["sft"]["pass@1"]),
                            common.fmt(c["rl"]["pass@1"], c["rl"]["pass@1_se"]), common.fmt(best - c["rl"]["pass@1"])])
        pairs = [("pass@k", "pass@1"), ("pass@k", "val_loss"), ("pass@1", "val_loss")]
        pairs += [(rules[-1], "pass@k"), (rules[-1], "pass@1")] if large else []
        for a, b in pairs:
            r["paired"][f"{a} - {b}"] = common.paired(chosen[b]["_rl_eval"], chosen[a]["_rl_eval"], k, d)
        post = [c["rl"]["pass@1"] for c in ckpts]
        signal = signals(ckpts)
        r["spearman"] = {s: spearman(v, post) for s, v in signal.items()}
        corr_md.append([d, str(len(ckpts))] + [common.fmt(v, signed=True) for v in r["spearman"].values()])
        per_domain[d] = r
    c = ctx.rl_cfg
    probe_k = {ck["probe k"] for r in per_domain.values() for ck in r["checkpoints"]}  # sft.probe.k, not eval.k
    probe_k_head = f"probe pass@{probe_k.pop()}" if len(probe_k) == 1 else "probe pass@k"
    text = "\n".join([
        f"## Experiment 5: the checkpoint rule, judged after RL ({c.steps} RL steps x {c.batch_size} prompts x "
        f"G={c.group_size} from every checkpoint; held-out pass@1 with n={ctx.eval_cfg.n or k}; ± = SE across tasks)",
        "",
        common.md_table(["domain", "rule", "chosen step", "probe pass@1", probe_k_head, "val loss",
                         "held-out pass@1 after SFT", "held-out pass@1 after RL", "regret (best after RL - this)"],
                        rows_md),
        "",
        "Spearman correlation with post-RL pass@1 across the checkpoints:",
        "",
        common.md_table(["domain", "checkpoints", *signal], corr_md),
    ])
    results = {"k": k, "per_domain": per_domain}
    common.write_results(ctx, "exp5", results, text)
    return results


def headline(res: dict) -> dict[str, Optional[float]]:
    """One seed's numbers the seed driver averages (scripts/experiments/seeds.py)."""
    out: dict[str, Optional[float]] = {}
    for d, r in res["per_domain"].items():
        for rule, x in r["rules"].items():
            out[f"{d} {rule} rule: chosen step"] = x["step"]
            out[f"{d} {rule} rule: SFT pass@1"] = x["sft_pass@1"]
            out[f"{d} {rule} rule: RL pass@1"] = x["rl_pass@1"]
            out[f"{d} {rule} rule: regret"] = x["regret"]
        for pair, p in r["paired"].items():
            out[f"{d} RL pass@1, {pair} rule"] = p["d_pass@1"]
        for s, v in r["spearman"].items():
            out[f"{d} spearman({s}, RL pass@1)"] = v
    return out


cli = common.entry_point(run, "Experiment 5: the SFT checkpoint rule (Pass@K, Pass@1, val loss) judged after RL.")


if __name__ == "__main__":
    common.main(cli)
