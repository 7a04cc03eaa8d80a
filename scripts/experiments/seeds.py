"""Run one SSP experiment over several training seeds and average it (at least 5 seeds,
mean and standard error across seeds, paired differences on the same held-out tasks).

    python scripts/experiments/seeds.py EXP[,EXP...] [--profile testbed] [--seeds 0-4] [--jobs 2] [--out DIR] [--set KEY=VALUE ...]

EXP is one of ``exp1`` (spectrum: diverse vs first-win, after SFT and after RL), ``exp2`` (merge vs
blend vs specialists), ``exp3`` (MGPO vs GRPO), ``exp4`` (the agents experiment: specialists per tool
backend vs blend vs merge, breadth; ``--profile tools``) or ``exp5`` (the checkpoint rule, judged after RL).
Each seed S runs the experiment's own script in its own work directory ``OUT/seed-S`` with
``--set seed=S --set sft_seeds=[S]``: S drives everything that is drawn in training (the rollouts
that SFT data are selected from, the LoRA init and batch order, the RL sampling) and the eval
sampling; the model, the tasks and the settings are the same for every seed. Within a seed every
model is evaluated on the same held-out tasks with the same sampling seed, so each paired difference
the script reports (``A - B``) is paired per task; across seeds, this driver reports every number of
the script's ``headline`` as mean ± standard error (sd / sqrt(seeds)) and the per-seed values.

Several experiments (``exp1,exp2``) run one after another within a seed and share its cached steps
(experiment 2 merges experiment 1's diverse specialists). Resumable: each seed's steps are cached (a
rerun redoes only what is missing). ``--jobs`` runs seeds in parallel processes (a 2-core machine:
2). Results: OUT/summary-EXP.{json,md} (OUT/summary-EXP-TAG.* with ``--tag TAG``); each seed's own
tables: OUT/seed-S/EXP/results.md. One driver at a time per OUT (a lock file, OUT/.seeds.lock): the
summaries read OUT/seed-S/EXP/results.json, which a second driver with other settings would replace.
"""

from __future__ import annotations

import argparse
import fcntl
import importlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import common  # noqa: E402  (the experiments' shared module: profiles, statistics, tables)

EXPERIMENTS = {"exp1": "exp1_spectrum", "exp2": "exp2_merge_vs_blend", "exp3": "exp3_signal",
               "exp4": "exp4_agents_transfer", "exp5": "exp5_checkpoint_rule"}


def parse_seeds(text: str) -> list[int]:
    if "-" in text:
        a, b = text.split("-", 1)
        return list(range(int(a), int(b) + 1))
    return [int(x) for x in text.split(",") if x.strip()]


def is_difference(key: str) -> bool:
    """Whether a headline metric is a paired difference (tested against 0) rather than a level (a
    regret, best - chosen, is >= 0 by construction: no test)."""
    return " - " in key


def aggregate(per_seed: dict[int, dict[str, float | None]],
              per_task: dict[int, dict[str, dict[str, float]]] | None = None) -> dict[str, dict]:
    """metric -> {mean, se, n, values by seed} over the seeds that have it (None values skipped);
    a paired difference also gets ``test`` (a one-sample t-test of the seed values against 0, with
    the count of positive and negative seeds) and, where ``per_task`` (seed -> metric -> task ->
    difference) has it, ``two_way`` (its SE over seeds and over tasks: common.two_way_se)."""
    keys = dict.fromkeys(k for h in per_seed.values() for k in h)  # first-seen order
    out = {}
    for key in keys:
        vals = {s: h[key] for s, h in per_seed.items() if h.get(key) is not None}
        m, se = common.mean_se(list(vals.values()))
        out[key] = {"mean": m, "se": se, "n": len(vals), "values": vals}
        if is_difference(key):
            out[key]["test"] = common.t_test(list(vals.values()))
            tasks = {s: t[key] for s, t in (per_task or {}).items() if key in t}
            if tasks:
                out[key]["two_way"] = common.two_way_se(tasks)
    return out


def lock_out(out: Path):
    """Hold OUT/.seeds.lock for this process's life (returns the open file); a second driver on the
    same OUT fails at once instead of mixing its per-seed results into this one's summaries."""
    f = open(out / ".seeds.lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise SystemExit(f"another seeds.py is running in {out} (its summaries read {out}/seed-S/EXP/results.json, "
                         "which this run would replace): wait for it, or use another --out") from None
    return f


def _test_cell(t: dict | None) -> str:
    if not t:
        return "-"
    return f"{t['positive']}+ {t['negative']}- ; t({t['df']}) = {t['t']:.2f}, p = {t['p']:.3g}"


def summary_md(exp: str, agg: dict[str, dict], seeds: list[int], command: str) -> str:
    rows, two = [], []
    for key, a in agg.items():
        signed = is_difference(key) or "regret" in key or "spearman" in key
        rows.append([key, str(a["n"]), common.fmt(a["mean"], a["se"], signed=signed), _test_cell(a.get("test")),
                     " ".join("-" if a["values"].get(s) is None else f"{a['values'][s]:.3f}" for s in seeds)])
        w = a.get("two_way")
        if w:
            two.append([key, f"{w['seeds']} x {w['tasks']}", common.fmt(w["mean"], signed=True), f"{w['se_seeds']:.4f}",
                        f"{w['se_tasks']:.4f}", f"{w['se']:.4f}"])
    text = [f"## {exp} over seeds {seeds[0]}-{seeds[-1]} (mean ± SE across seeds)", "", f"`{command}`", "",
            common.md_table(["metric", "seeds", "mean ± SE", "signs; t-test of the seed values vs 0", "per seed"], rows)]
    if two:
        text += ["", "Paired differences over seeds x held-out tasks: the SE across seeds (another training run) and "
                     "across tasks (another draw of tasks), and both (root sum of squares)", "",
                 common.md_table(["metric", "seeds x tasks", "mean", "SE seeds", "SE tasks", "SE both"], two)]
    return "\n".join(text)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("exps", metavar="EXP[,EXP...]", help=f"one or more of {', '.join(sorted(EXPERIMENTS))}, run in this order per seed")
    ap.add_argument("--profile", default="demo", choices=sorted(common.PROFILES))
    ap.add_argument("--seeds", default="0-4")
    ap.add_argument("--jobs", type=int, default=1, help="seeds run in parallel")
    ap.add_argument("--out", default=None, help="default runs/seeds-PROFILE (experiments of one seed share its cached steps)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="passed to every seed's run (not seed or sft_seeds)")
    ap.add_argument("--tag", default=None, help="names this setting's summaries (OUT/summary-EXP-TAG.*), so runs of "
                    "other --set values in the same OUT (which share its cached steps) keep theirs")
    ap.add_argument("--tiny", action="store_true", help="the scripts' --tiny (plumbing check)")
    return ap


def checked_exps(args: argparse.Namespace) -> list[str]:
    """The experiments to run, after refusing unknown ones, seed overrides and a tag that cannot name a file."""
    exps = [e.strip() for e in args.exps.split(",") if e.strip()]
    unknown = [e for e in exps if e not in EXPERIMENTS]
    if unknown or not exps:
        raise SystemExit(f"unknown experiment {', '.join(unknown) or '(none)'}; valid: {', '.join(sorted(EXPERIMENTS))}")
    bad = [o for o in args.overrides if o.split("=", 1)[0] in ("seed", "sft_seeds")]
    if bad:
        raise SystemExit(f"--set {bad[0]}: the seed is this driver's (--seeds)")
    if args.tag is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+", args.tag):
        raise SystemExit(f"--tag {args.tag!r}: letters, digits, '.', '_' and '-' only (it names files)")
    return exps


def run_seeds(args: argparse.Namespace, exps: list[str], seeds: list[int], out: Path, t0: float) -> None:
    """Run each seed's experiments in order (seeds in parallel with --jobs); stop all at the first failure."""
    def cmd(exp: str, seed: int) -> list[str]:
        c = [sys.executable, str(HERE / f"{EXPERIMENTS[exp]}.py"), "--profile", args.profile, "--work-dir",
             str(out / f"seed-{seed}"), "--no-progress", "--set", f"seed={seed}", "--set", f"sft_seeds=[{seed}]"]
        for o in args.overrides:
            c += ["--set", o]
        return c + (["--tiny"] if args.tiny else [])

    failed: list[str] = []
    procs: dict[int, subprocess.Popen] = {}
    lock = threading.Lock()

    def one_seed(seed: int) -> None:
        # this seed's experiments in order: they share its cached steps, so never two at once
        with open(out / f"seed-{seed}.log", "a") as log:
            for exp in exps:
                with lock:
                    if failed:
                        return
                    p = procs[seed] = subprocess.Popen(cmd(exp, seed), stdout=log, stderr=subprocess.STDOUT,
                                                       env={**os.environ, "PYTHONWARNINGS": "ignore"})
                print(f"[{time.perf_counter() - t0:.0f} s] seed {seed}: {exp} started", file=sys.stderr, flush=True)
                if p.wait() != 0:
                    with lock:
                        failed.append(f"seed {seed} {exp} (exit {p.returncode})")
                        for q in procs.values():  # stop the others: a rerun resumes from the cache
                            if q.poll() is None:
                                q.kill()
                    return
                print(f"[{time.perf_counter() - t0:.0f} s] seed {seed}: {exp} done", file=sys.stderr, flush=True)

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        list(pool.map(one_seed, seeds))
    if failed:
        raise SystemExit(f"{failed[0]} failed; see {out}/seed-*.log; rerun the same command to resume")


def summarize(args: argparse.Namespace, exps: list[str], seeds: list[int], out: Path, suffix: str, t0: float) -> None:
    """Aggregate each experiment over the seeds: OUT/summary-EXP.json/.md and the RL curves' report."""
    from mlx_ssp.io import write_json_atomic, write_text_atomic

    command = " ".join(["python", "scripts/experiments/seeds.py", *sys.argv[1:]])
    for exp in exps:
        mod = importlib.import_module(EXPERIMENTS[exp])
        result = EXPERIMENTS[exp].split("_")[0]
        res = {s: json.loads((out / f"seed-{s}" / result / "results.json").read_text()) for s in seeds}
        per_seed = {s: mod.headline(r) for s, r in res.items()}
        per_task = {s: mod.task_diffs(r) for s, r in res.items()} if hasattr(mod, "task_diffs") else None
        agg = aggregate(per_seed, per_task)
        text = summary_md(exp, agg, seeds, command)
        write_json_atomic(out / f"summary-{exp}{suffix}.json", {"exp": exp, "profile": args.profile, "seeds": seeds,
                                                        "command": command, "overrides": args.overrides,
                                                        "seconds": round(time.perf_counter() - t0, 1), "metrics": agg})
        write_text_atomic(out / f"summary-{exp}{suffix}.md", text + "\n")
        if hasattr(mod, "curves"):  # per-step RL curves with a band across seeds (mlx_ssp report)
            from mlx_ssp.report import build_comparison

            specs = [f"{label}={p}" for s in seeds for label, ps in mod.curves(out / f"seed-{s}", s).items() for p in ps]
            if specs:
                build_comparison(specs, out / f"report-{exp}{suffix}")
        print(text + "\n")


def main() -> None:
    args = build_parser().parse_args()
    exps = checked_exps(args)
    suffix = f"-{args.tag}" if args.tag else ""
    seeds = parse_seeds(args.seeds)
    out = Path(args.out or f"runs/seeds-{args.profile}{'-tiny' if args.tiny else ''}")
    out.mkdir(parents=True, exist_ok=True)
    out_lock = lock_out(out)  # noqa: F841  (held until exit)
    if not args.tiny:  # the model is built (or converted) once here, not by each parallel seed
        from mlx_ssp.config import apply_overrides
        from mlx_ssp.models import resolve_model

        cfg = apply_overrides(dict(common.PROFILES[args.profile]), [o for o in args.overrides if o.startswith("model=")])
        resolve_model(cfg["model"])
    t0 = time.perf_counter()
    run_seeds(args, exps, seeds, out, t0)
    summarize(args, exps, seeds, out, suffix, t0)


if __name__ == "__main__":
    main()
