"""Experiment 4 on the testbed: MGPO vs GRPO learning curves, lambda x dynamic sampling x seeds.

VibeThinker-1.5B (arXiv:2511.06221) section 3.4 weights each prompt's GRPO advantages by
w(q) = exp(-lambda * D_ME(p || 0.5)); lambda = 0 is plain GRPO. DAPO's dynamic sampling drops groups
whose pass rate is 0 or 1 and refills the batch. This script runs one RL learning round
(:func:`mlx_ssp.testbed.learning.learning_round`, ``stage: rl``) per (lambda, dynamic sampling,
training seed) on one testbed model, everything else equal (steps, prompts per step, G, learning
rate, LoRA, tasks), and reports per setting:

- the per-step training reward: mean over the first and last 10 steps, mean +- standard error across
  seeds, and the curves with a band across seeds (``mlx_ssp report``'s comparison:
  OUT/report/rl_bands.png and OUT/report/compare.md);
- the held-out pass@1 gain of the round (128 held-out prompts x 8 samples, base and trained model
  with the same sampling seed), mean +- SE across seeds;
- the paired difference of that gain against lambda = 0 with the same dynamic-sampling setting and
  the same seeds (same prompt order and first-step rollouts), mean +- SE over seeds.

    python scripts/experiments/testbed_signal.py [--size ci] [--seeds 0-4] [--steps 100] [--jobs 2] [--out runs/testbed_signal]

Resumable: a round whose ``learning.json`` exists is not run again. ``--jobs`` runs rounds in
parallel processes (one core each on a 2-core machine); a kept round from another size or step count
stops the run (use another OUT). Results: OUT/results.{json,md}, OUT/report/.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

LAMBDAS = (0.0, 0.5, 1.0, 2.0, 4.0)


def _label(lam: float, ds: bool) -> str:
    return f"lambda {lam:g}, DS {'on' if ds else 'off'}"  # no "=": report labels end at the first


def _dir(out: Path, lam: float, ds: bool, seed: int) -> Path:
    return out / f"lam{lam:g}-ds{int(ds)}" / f"seed-{seed}"


def one(size: str, lam: float, ds: bool, seed: int, steps: int, work: Path) -> None:
    """One round into ``work`` (written atomically: learning.json last, so a killed round reruns)."""
    import shutil

    import mlx_ssp  # noqa: F401  (OpenBLAS before mlx.core)
    from mlx_ssp.io import write_json_atomic
    from mlx_ssp.testbed.build import ensure_testbed
    from mlx_ssp.testbed.learning import LearningConfig, learning_round

    shutil.rmtree(work, ignore_errors=True)  # a half-finished round starts over
    work.mkdir(parents=True)
    model = ensure_testbed(f"testbed:{size}:0", progress=False)
    cfg = LearningConfig(stage="rl", rl={"steps": steps, "mgpo_lambda": lam, "dynamic_sampling": ds})
    t0 = time.perf_counter()
    r = learning_round(model, work, cfg, seed=seed)
    r.update(mgpo_lambda=lam, dynamic_sampling=ds, size=size, steps=steps, seconds=round(time.perf_counter() - t0, 1))
    write_json_atomic(work / "learning.json", r)


def _avg(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _fmt(ms: tuple[float, float], signed: bool = False) -> str:
    return f"{ms[0]:+.3f} +- {ms[1]:.3f}" if signed else f"{ms[0]:.3f} +- {ms[1]:.3f}"


def summarize(out: Path, seeds: list[int], settings: list[tuple[float, bool]]) -> str:
    from mlx_ssp.io import write_json_atomic, write_text_atomic
    from mlx_ssp.report import build_comparison
    from mlx_ssp.report import mean_se as _mean_se

    res = {}
    for lam, ds in settings:
        runs = [json.loads((_dir(out, lam, ds, s) / "learning.json").read_text()) for s in seeds]
        res[_label(lam, ds)] = {"lambda": lam, "dynamic_sampling": ds, "runs": runs}
    head = ("| setting | seeds | prompts sampled / step | reward, first 10 steps | reward, last 10 steps "
            "| held-out pass@1 base -> trained | gain | gain - gain(lambda=0), paired by seed "
            "| gain - gain(DS off), paired by seed | s / round |")
    rows = [head, "|" + "---|" * 10]
    for label, r in res.items():
        runs = r["runs"]
        g0 = {x["seed"]: x["gain"] for x in res[_label(0.0, r["dynamic_sampling"])]["runs"]}
        paired = [x["gain"] - g0[x["seed"]] for x in runs]
        off = res.get(_label(r["lambda"], False))
        g_off = {x["seed"]: x["gain"] for x in off["runs"]} if off and r["dynamic_sampling"] else None
        sampled = []  # the rollout budget: dynamic sampling refills, so it samples more prompts per step
        for s in seeds:
            m = [json.loads(line) for line in (_dir(out, r["lambda"], r["dynamic_sampling"], s) / "rl" / "metrics.jsonl")
                 .read_text().splitlines()]
            sampled.append(_avg([x["groups_sampled"] for x in m]))
        rows.append(" | ".join([
            f"| {label}", str(len(runs)), f"{_avg(sampled):.1f}", _fmt(_mean_se([_avg(x["rewards"][:10]) for x in runs])),
            _fmt(_mean_se([_avg(x["rewards"][-10:]) for x in runs])),
            f"{_mean_se([x['base'] for x in runs])[0]:.3f} -> {_mean_se([x['trained'] for x in runs])[0]:.3f}",
            _fmt(_mean_se([x["gain"] for x in runs]), True),
            "-" if r["lambda"] == 0 else _fmt(_mean_se(paired), True),
            "-" if g_off is None else _fmt(_mean_se([x["gain"] - g_off[x["seed"]] for x in runs]), True),
            f"{_mean_se([x['seconds'] for x in runs])[0]:.0f} |"]))
    table = "\n".join(rows)
    build_comparison([f"{label}={_dir(out, r['lambda'], r['dynamic_sampling'], s)}" for label, r in res.items() for s in seeds],
                     out / "report")
    write_json_atomic(out / "results.json", res)
    write_text_atomic(out / "results.md", table + "\n\nCurves: report/rl_bands.png (mean +- 1 SE across seeds).\n")
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="ci")
    ap.add_argument("--seeds", default="0-4")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--lambdas", default=",".join(f"{x:g}" for x in LAMBDAS))
    ap.add_argument("--dynamic-sampling", choices=("off", "on", "both"), default="both")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--out", default="runs/testbed_signal")
    ap.add_argument("--one", nargs=3, metavar=("LAMBDA", "DS", "SEED"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    out = Path(args.out)
    if args.one:
        lam, ds, seed = float(args.one[0]), args.one[1] == "1", int(args.one[2])
        one(args.size, lam, ds, seed, args.steps, _dir(out, lam, ds, seed))
        return
    a, _, b = args.seeds.partition("-")
    seeds = list(range(int(a), int(b or a) + 1))
    lams = [float(x) for x in args.lambdas.split(",")]
    dss = {"off": [False], "on": [True], "both": [False, True]}[args.dynamic_sampling]
    settings = [(lam, ds) for ds in dss for lam in lams]
    if 0.0 not in lams:
        raise SystemExit("--lambdas must include 0 (plain GRPO: the paired baseline)")
    for lam, ds in settings:
        for s in seeds:
            f = _dir(out, lam, ds, s) / "learning.json"
            if f.is_file() and (lambda r: (r.get("size"), r.get("steps")))(json.loads(f.read_text())) != (args.size, args.steps):
                raise SystemExit(f"{f} is from another --size or --steps: use another --out")
    todo = [(lam, ds, s) for s in seeds for lam, ds in settings if not (_dir(out, lam, ds, s) / "learning.json").is_file()]
    if todo:  # built once here, not by each parallel round
        import mlx_ssp  # noqa: F401
        from mlx_ssp.testbed.build import ensure_testbed

        ensure_testbed(f"testbed:{args.size}:0")
    print(f"{len(todo)} rounds to run ({len(settings) * len(seeds) - len(todo)} done)", file=sys.stderr, flush=True)
    running: list[tuple[subprocess.Popen, tuple]] = []
    t0 = time.perf_counter()
    while todo or running:
        while todo and len(running) < args.jobs:
            lam, ds, s = todo.pop(0)
            cmd = [sys.executable, __file__, "--size", args.size, "--steps", str(args.steps), "--out", str(out),
                   "--one", f"{lam:g}", str(int(ds)), str(s)]
            running.append((subprocess.Popen(cmd, env={**os.environ, "PYTHONWARNINGS": "ignore"}), (lam, ds, s)))
        time.sleep(1)
        for p, key in list(running):
            if p.poll() is not None:
                running.remove((p, key))
                if p.returncode != 0:
                    for q, _ in running:  # no round left writing while a rerun clears its directory
                        q.kill()
                        q.wait()
                    raise SystemExit(f"round {key} failed (exit {p.returncode})")
                r = json.loads((_dir(out, *key) / "learning.json").read_text())
                print(f"[{time.perf_counter() - t0:.0f} s] {_label(key[0], key[1])} seed {key[2]}: held-out "
                      f"{r['base']:.3f} -> {r['trained']:.3f}, reward {_avg(r['rewards'][:10]):.2f} -> "
                      f"{_avg(r['rewards'][-10:]):.2f} ({r['seconds']} s)", file=sys.stderr, flush=True)
    print(summarize(out, seeds, settings))


if __name__ == "__main__":
    main()
