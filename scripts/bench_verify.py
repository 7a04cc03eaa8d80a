"""Verifier throughput: math / reasoning_gym / toolcall verifications per second, and sandboxed code
runs per second with 1, 2 and 4 workers, measured side by side in one run.

    python scripts/bench_verify.py [--n-math 2000] [--n-code 48] [--workers 1,2,4]

Prints a Markdown table (figure, command, date, machine) to paste into BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time
from pathlib import Path

import mlx_ssp  # noqa: F401  (OpenBLAS before mlx.core, like every entry point)
from mlx_ssp.tasks import export_source
from mlx_ssp.verify import verify, verify_many

ROOT = Path(__file__).resolve().parents[1]
GSM8K = Path(os.environ.get("MLX_SSP_SHARED", ROOT.parent / "shared")) / "data" / "gsm8k" / "test.jsonl"


def _rate(items, workers=1):
    t0 = time.perf_counter()
    res = verify_many(items, workers=workers)
    dt = time.perf_counter() - t0
    return len(items) / dt, dt, res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n-math", type=int, default=2000)
    ap.add_argument("--n-code", type=int, default=48)
    ap.add_argument("--workers", default="1,2,4")
    args = ap.parse_args()
    rng = random.Random(0)
    rows = []

    # math: GSM8K references, half right half wrong, in the writings a model produces
    tasks = export_source(f"gsm8k:{GSM8K}", answer_extraction="lenient")
    items = []
    for i in range(args.n_math):
        t = tasks[i % len(tasks)]
        a = t.answer if i % 2 == 0 else str(int(t.answer) + 1)
        style = i % 4
        c = [f"Step... so\nAnswer: {a}", f"... \\boxed{{{a}}}", f"The answer is {a} dollars.", f"3 + 4 = 7, so we get {a}"][style]
        items.append((c, t))
    verify(*items[0])  # warm-up: imports, sympy caches
    r, dt, res = _rate(items)
    assert sum(x.reward for x in res) == len(items) // 2
    rows.append(("math (GSM8K, lenient, 4 writings, half wrong)", f"{r:.0f} verifications/s", f"{len(items)} in {dt:.1f}s"))

    # reasoning_gym: the dataset's own scorer
    rg = export_source("reasoning_gym:basic_arithmetic", size=200, params={"min_terms": 2, "max_terms": 3, "max_digits": 2})
    items = [(f"Answer: {t.answer if i % 2 == 0 else 'x'}", t) for i, t in enumerate(rg * 5)]
    verify(*items[0])
    r, dt, _ = _rate(items)
    rows.append(("reasoning_gym (basic_arithmetic)", f"{r:.0f} verifications/s", f"{len(items)} in {dt:.1f}s"))

    # toolcall: BFCL parallel possible answers
    bf = export_source("bfcl:parallel")
    items = []
    for t in bf:
        calls = "".join(
            '<tool_call>{"name": "%s", "arguments": %s}</tool_call>'
            % (name, __import__("json").dumps({k: v[0] for k, v in p.items() if v and v[0] != ""}))
            for e in t.answer for name, p in e.items()
        )
        items.append((calls, t))
    r, dt, _ = _rate(items * 5)
    rows.append(("toolcall (BFCL parallel)", f"{r:.0f} verifications/s", f"{len(items) * 5} in {dt:.1f}s"))

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
