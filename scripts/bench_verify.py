"""Verifier throughput: math / reasoning_gym / toolcall verifications per second, and sandboxed code
runs per second with 1, 2 and 4 workers, measured side by side in one run.

    python scripts/bench_verify.py [--n-math 2000] [--n-code 48] [--workers 1,2,4]
    python scripts/bench_verify.py --compare OTHER_TREE [--rounds 6]

Prints a Markdown table (figure, command, date, machine) to paste into BENCHMARKS.md.

``--compare`` measures the in-process verifiers (math, reasoning_gym, toolcall; no sandbox) of this
checkout and of another checkout of the project side by side: worker processes alternate between
the two trees (``PYTHONPATH``), round after round, each timing the same items (best of 3 passes),
and the table gives the medians over the rounds and their ratio (this tree / the other).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import mlx_ssp  # noqa: F401  (OpenBLAS before mlx.core, like every entry point)
from mlx_ssp.tasks.build import export_source
from mlx_ssp.verify import verify, verify_many

ROOT = Path(__file__).resolve().parents[1]
GSM8K = Path(os.environ.get("MLX_SSP_SHARED", ROOT.parent / "shared")) / "data" / "gsm8k" / "test.jsonl"


def _rate(items, workers=1):
    t0 = time.perf_counter()
    res = verify_many(items, workers=workers)
    dt = time.perf_counter() - t0
    return len(items) / dt, dt, res


def _inprocess_items(n_math: int) -> dict[str, list]:
    """The items of the in-process verifier rows, by row name."""
    tasks = export_source(f"gsm8k:{GSM8K}", answer_extraction="lenient")
    items = []
    for i in range(n_math):  # GSM8K references, half right half wrong, in the writings a model produces
        t = tasks[i % len(tasks)]
        a = t.answer if i % 2 == 0 else str(int(t.answer) + 1)
        style = i % 4
        c = [f"Step... so\nAnswer: {a}", f"... \\boxed{{{a}}}", f"The answer is {a} dollars.", f"3 + 4 = 7, so we get {a}"][style]
        items.append((c, t))
    rows = {"math (GSM8K, lenient, 4 writings, half wrong)": items}
    # GSM8K worked solutions as completions: ordinary length (a few hundred characters), "####" marker
    train = GSM8K.with_name("train.jsonl")
    sols = [json.loads(l)["answer"] for _, l in zip(range(len(tasks)), open(train))]
    rows["math (GSM8K worked solutions as completions, lenient)"] = [
        (sols[i % len(sols)], tasks[i % len(tasks)]) for i in range(n_math)]
    rg = export_source("reasoning_gym:basic_arithmetic", size=200, params={"min_terms": 2, "max_terms": 3, "max_digits": 2})
    rows["reasoning_gym (basic_arithmetic)"] = [(f"Answer: {t.answer if i % 2 == 0 else 'x'}", t) for i, t in enumerate(rg * 5)]
    bf = export_source("bfcl:parallel")
    tool = []
    for t in bf:
        calls = "".join(
            '<tool_call>{"name": "%s", "arguments": %s}</tool_call>'
            % (name, json.dumps({k: v[0] for k, v in p.items() if v and v[0] != ""}))
            for e in t.answer for name, p in e.items()
        )
        tool.append((calls, t))
    rows["toolcall (BFCL parallel)"] = tool * 5
    return rows


def _measure_inprocess(n_math: int, passes: int = 1) -> dict[str, float]:
    """Verifications per second of each in-process row (best of ``passes``)."""
    out = {}
    for name, items in _inprocess_items(n_math).items():
        verify(*items[0])  # warm-up: imports, sympy caches
        out[name] = max(_rate(items)[0] for _ in range(passes))
    return out


def _compare(other: str, rounds: int, n_math: int) -> None:
    trees = {"this": str(ROOT), "other": str(Path(other).resolve())}
    got: dict[str, dict[str, list[float]]] = {k: {} for k in trees}
    for r in range(rounds):
        for side in (("this", "other") if r % 2 == 0 else ("other", "this")):
            env = {**os.environ, "PYTHONPATH": trees[side]}
            res = subprocess.run([sys.executable, __file__, "--worker", "--n-math", str(n_math)], env=env,
                                 cwd=trees[side], capture_output=True, text=True, check=True)
            for name, rate in json.loads(res.stdout.strip().splitlines()[-1]).items():
                got[side].setdefault(name, []).append(rate)
    load = os.getloadavg()
    print(f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; machine: {platform.machine()} {platform.system()}, "
          f"{os.cpu_count()} CPUs, load average {load[0]:.1f} (shared with other jobs)")
    print(f"command: python {' '.join(sys.argv)}")
    print(f"this tree: {trees['this']}; other tree: {trees['other']}; {rounds} alternating rounds, best of 3 passes each")
    print("\n| verifier | this tree | other tree | ratio (median of per-round ratios) |\n|---|---|---|---|")
    for name in got["this"]:
        a, b = got["this"][name], got["other"][name]
        ratio = statistics.median(x / y for x, y in zip(a, b))
        print(f"| {name} | {statistics.median(a):,.0f}/s | {statistics.median(b):,.0f}/s | {ratio:.3f} "
              f"(range {min(x / y for x, y in zip(a, b)):.3f}-{max(x / y for x, y in zip(a, b)):.3f}) |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n-math", type=int, default=2000)
    ap.add_argument("--n-code", type=int, default=48)
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--compare", metavar="OTHER_TREE", help="side by side with another checkout (in-process verifiers)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(_measure_inprocess(args.n_math, passes=3)))
        return
    if args.compare:
        _compare(args.compare, args.rounds, args.n_math)
        return
    rows = []
    for name, items in _inprocess_items(args.n_math).items():
        verify(*items[0])  # warm-up: imports, sympy caches
        r, dt, res = _rate(items)
        if name.startswith("math (GSM8K, lenient"):
            assert sum(x.reward for x in res) == len(items) // 2
        rows.append((name, f"{r:.0f} verifications/s", f"{len(items)} in {dt:.1f}s"))

    # code: HumanEval canonical solutions in the sandbox, N workers side by side
    from mlx_ssp.verify.sandbox import describe

    he = export_source("humaneval")[: args.n_code]
    items = [(f"```python\n{t.metadata['prompt_code']}{t.metadata['canonical_solution']}```", t) for t in he]
    verify(*items[0])  # warm-up (sandbox capability probe)
    base = None
    for w in [int(x) for x in args.workers.split(",")]:
        r, dt, res = _rate(items, workers=w)
        assert all(x.reward == 1.0 for x in res), [x for x in res if x.reward != 1.0][:3]
        base = base or r
        rows.append((f"code sandbox, HumanEval canonical, {w} worker(s)", f"{r:.1f} runs/s ({r / base:.2f}x)", f"{len(items)} in {dt:.1f}s"))

    load = os.getloadavg()
    print(f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; machine: {platform.machine()} {platform.system()}, "
          f"{os.cpu_count()} CPUs, load average {load[0]:.1f} (shared with other jobs)")
    print(f"command: python {' '.join(sys.argv)}")
    print(describe())
    print("\n| verifier | throughput | detail |\n|---|---|---|")
    for a, b, c in rows:
        print(f"| {a} | {b} | {c} |")


if __name__ == "__main__":
    main()
