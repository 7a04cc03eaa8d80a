"""Run one SSP experiment over several training seeds and average it (issue 21: at least 5 seeds,
mean and standard error across seeds, paired differences on the same held-out tasks).

    python scripts/experiments/seeds.py EXP [--profile testbed] [--seeds 0-4] [--jobs 2] [--out DIR] [--set KEY=VALUE ...]

EXP is one of ``exp1`` (spectrum: diverse vs first-win, after SFT and after RL), ``exp2`` (merge vs
blend vs specialists), ``exp3`` (MGPO vs GRPO) or ``exp5`` (the checkpoint rule, judged after RL).
Each seed S runs the experiment's own script in its own work directory ``OUT/seed-S`` with
``--set seed=S --set sft_seeds=[S]``: S drives everything that is drawn in training (the rollouts
that SFT data are selected from, the LoRA init and batch order, the RL sampling) and the eval
sampling; the model, the tasks and the settings are the same for every seed. Within a seed every
model is evaluated on the same held-out tasks with the same sampling seed, so each paired difference
the script reports (``A - B``) is paired per task; across seeds, this driver reports every number of
the script's ``headline`` as mean ± standard error (sd / sqrt(seeds)) and the per-seed values.

Resumable: each seed's steps are cached (a rerun redoes only what is missing). ``--jobs`` runs seeds
in parallel processes (a 2-core machine: 2). Results: OUT/summary.{json,md}.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXPERIMENTS = {"exp1": "exp1_spectrum", "exp2": "exp2_merge_vs_blend", "exp3": "exp3_signal",
               "exp5": "exp5_checkpoint_rule"}


def parse_seeds(text: str) -> list[int]:
    if "-" in text:
        a, b = text.split("-", 1)
        return list(range(int(a), int(b) + 1))
    return [int(x) for x in text.split(",") if x.strip()]


def aggregate(per_seed: dict[int, dict[str, float | None]]) -> dict[str, dict]:
    """metric -> {mean, se, n, values by seed} over the seeds that have it (None values skipped)."""
    sys.path.insert(0, str(HERE))
    import common

    keys: list[str] = []
    for h in per_seed.values():
        keys += [k for k in h if k not in keys]
    out = {}
    for key in keys:
        vals = {s: h[key] for s, h in per_seed.items() if h.get(key) is not None}
        m, se = common.mean_se(list(vals.values()))
        out[key] = {"mean": m, "se": se, "n": len(vals), "values": vals}
    return out


def summary_md(exp: str, agg: dict[str, dict], seeds: list[int], command: str) -> str:
    sys.path.insert(0, str(HERE))
    import common

    rows = []
    for key, a in agg.items():
        signed = " - " in key or "regret" in key or "spearman" in key
        rows.append([key, str(a["n"]), common.fmt(a["mean"], a["se"], signed=signed),
                     " ".join("-" if a["values"].get(s) is None else f"{a['values'][s]:.3f}" for s in seeds)])
    return "\n".join([f"## {exp} over seeds {seeds[0]}-{seeds[-1]} (mean ± SE across seeds)", "", f"`{command}`", "",
                      common.md_table(["metric", "seeds", "mean ± SE", "per seed"], rows)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("exp", choices=sorted(EXPERIMENTS))
    ap.add_argument("--profile", default="demo", choices=("demo", "testbed"))
    ap.add_argument("--seeds", default="0-4")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--out", default=None, help="default runs/seeds-PROFILE-EXP")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="passed to every seed's run (not seed or sft_seeds)")
    ap.add_argument("--tiny", action="store_true", help="the scripts' --tiny (plumbing check)")
    args = ap.parse_args()
    bad = [o for o in args.overrides if o.split("=", 1)[0] in ("seed", "sft_seeds")]
    if bad:
        raise SystemExit(f"--set {bad[0]}: the seed is this driver's (--seeds)")
    seeds = parse_seeds(args.seeds)
    name = EXPERIMENTS[args.exp]
    out = Path(args.out or f"runs/seeds-{args.profile}-{args.exp}{'-tiny' if args.tiny else ''}")
    out.mkdir(parents=True, exist_ok=True)
    result_dir = name.split("_")[0]

    def cmd(seed: int) -> list[str]:
        c = [sys.executable, str(HERE / f"{name}.py"), "--profile", args.profile, "--work-dir", str(out / f"seed-{seed}"),
             "--no-progress", "--set", f"seed={seed}", "--set", f"sft_seeds=[{seed}]"]
        for o in args.overrides:
            c += ["--set", o]
        return c + (["--tiny"] if args.tiny else [])

    if not args.tiny:  # the model is built (or converted) once here, not by each parallel seed
        sys.path.insert(0, str(HERE))
        import common
        from mlx_ssp.config import apply_overrides
        from mlx_ssp.models import resolve_model

        cfg = apply_overrides(dict(common.PROFILES[args.profile]), [o for o in args.overrides if o.startswith("model=")])
        resolve_model(cfg["model"])
    todo = list(seeds)
    running: list[tuple[subprocess.Popen, int]] = []
    t0 = time.perf_counter()
    while todo or running:
        while todo and len(running) < args.jobs:
            s = todo.pop(0)
            log = open(out / f"seed-{s}.log", "a")
            running.append((subprocess.Popen(cmd(s), stdout=log, stderr=subprocess.STDOUT,
                                             env={**os.environ, "PYTHONWARNINGS": "ignore"}), s))
            print(f"[{time.perf_counter() - t0:.0f} s] seed {s} started (log: {out / f'seed-{s}.log'})", file=sys.stderr, flush=True)
        time.sleep(1)
        for p, s in list(running):
            if p.poll() is None:
                continue
            running.remove((p, s))
            if p.returncode != 0:
                for q, _ in running:
                    q.kill()
                    q.wait()
                raise SystemExit(f"seed {s} failed (exit {p.returncode}); see {out / f'seed-{s}.log'}; rerun to resume")
            print(f"[{time.perf_counter() - t0:.0f} s] seed {s} done", file=sys.stderr, flush=True)
    mod = importlib.import_module(name) if str(HERE) in sys.path else None
    if mod is None:
        sys.path.insert(0, str(HERE))
        mod = importlib.import_module(name)
    per_seed = {s: mod.headline(json.loads((out / f"seed-{s}" / result_dir / "results.json").read_text())) for s in seeds}
    agg = aggregate(per_seed)
    command = " ".join(["python", "scripts/experiments/seeds.py", *sys.argv[1:]])
    text = summary_md(args.exp, agg, seeds, command)
    from mlx_ssp.io import write_json_atomic, write_text_atomic

    write_json_atomic(out / "summary.json", {"exp": args.exp, "profile": args.profile, "seeds": seeds, "command": command,
                                             "seconds": round(time.perf_counter() - t0, 1), "metrics": agg})
    write_text_atomic(out / "summary.md", text + "\n")
    print(text)


if __name__ == "__main__":
    main()
