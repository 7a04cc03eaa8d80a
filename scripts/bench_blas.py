#!/usr/bin/env python
"""Float32 matmul GFLOP/s with the system OpenBLAS vs mlx's bundled reference BLAS, side by side.

The OpenBLAS preload must happen before ``mlx.core`` is imported, so each case runs in its own
subprocess: one with the default preload, one with ``MLX_SSP_NO_OPENBLAS=1``. The cases alternate
round by round (``--rounds``) so that load from other processes on a shared machine hits both alike;
each size reports the best time over all repeats and the ratio of the two.

    python scripts/bench_blas.py                       # sizes 1024 and 2048
    python scripts/bench_blas.py --sizes 512 1024 --repeats 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time


def worker(sizes: list[int], repeats: int) -> dict:
    import mlx_ssp  # noqa: F401  (OpenBLAS preload, unless disabled by the environment)
    import mlx.core as mx

    from mlx_ssp import _blas
    from mlx_ssp.doctor import blas_in_use

    mx.set_default_device(mx.cpu)
    w = mx.random.normal((256, 256))
    mx.eval(w @ w)  # library initialisation, cheap on either BLAS
    out = {"blas": blas_in_use(), "openblas_status": _blas.status, "gflops": {}, "best_s": {}}
    for n in sizes:
        a = mx.random.normal((n, n))
        b = mx.random.normal((n, n))
        mx.eval(a, b)
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            mx.eval(a @ b)
            best = min(best, time.perf_counter() - t)
        out["best_s"][str(n)] = best
        out["gflops"][str(n)] = 2 * n**3 / best / 1e9
    return out


def run_case(openblas: bool, sizes: list[int], repeats: int) -> dict:
    env = dict(os.environ)
    env.pop("MLX_SSP_NO_OPENBLAS", None)
    if not openblas:
        env["MLX_SSP_NO_OPENBLAS"] = "1"
    cmd = [sys.executable, __file__, "--worker", "--sizes", *map(str, sizes), "--repeats", str(repeats)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"worker failed ({'openblas' if openblas else 'reference'}):\n{r.stderr}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--repeats", type=int, default=3, help="timed matmuls per size per round")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of the two cases")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.sizes, args.repeats)))
        return

    best = {"openblas": {}, "reference": {}}
    blas = {}
    t0 = time.time()
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    for _ in range(args.rounds):
        for name, flag in (("openblas", True), ("reference", False)):
            res = run_case(flag, args.sizes, args.repeats)
            blas[name] = res["blas"]
            for n, g in res["gflops"].items():
                best[name][n] = max(best[name].get(n, 0.0), g)
    load_after = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")

    if blas["openblas"] == blas["reference"]:
        print(f"warning: both cases used the same BLAS ({blas['openblas']}); is libopenblas0-pthread installed?")
    print(f"machine: {platform.system()} {platform.machine()}, {os.cpu_count()} CPUs; "
          f"load average {load_before:.1f} before, {load_after:.1f} after; {time.time() - t0:.0f} s")
    print(f"with OpenBLAS:    {blas['openblas']}")
    print(f"without OpenBLAS: {blas['reference']}")
    print()
    print("| n (float32 n x n @ n x n) | OpenBLAS GFLOP/s | reference BLAS GFLOP/s | ratio |")
    print("|---|---|---|---|")
    rows = []
    for n in map(str, args.sizes):
        o, r = best["openblas"][n], best["reference"][n]
        rows.append({"n": int(n), "openblas_gflops": o, "reference_gflops": r, "ratio": o / r})
        print(f"| {n} | {o:.1f} | {r:.2f} | {o / r:.0f}x |")
    print(f"\ncommand: python scripts/bench_blas.py --sizes {' '.join(map(str, args.sizes))} "
          f"--repeats {args.repeats} --rounds {args.rounds}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "blas": blas, "load": [load_before, load_after]}, f, indent=2)


if __name__ == "__main__":
    main()
