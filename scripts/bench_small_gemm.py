"""Benchmark: the few-row matmul kernel against OpenBLAS, side by side in one process.

Two measurements, each alternating kernel on / off (``mlx_ssp._small_gemm.enabled``) round by round:

- the products alone: ``rows`` x 576 times every Linear weight of the demo model's shape (the 30
  layers' q, k, v, o, gate, up, down and the tied head: 538 MB of float32), in GB/s of weights read;
- one decoding step of the demo model (mlx-lm's forward of one token per row after a
  ``--context``-token prompt, the KV cache in place), in ms.

Reports the median of ``--rounds`` and the ratio off / on, with the load average. Linux x86_64
with OpenBLAS and a C compiler only (elsewhere there is nothing to compare).

    python scripts/bench_small_gemm.py --rows 1 2 4 8 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import mlx_ssp  # noqa: F401  (OpenBLAS and the kernel before mlx.core)

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from mlx_ssp import _blas, _small_gemm  # noqa: E402


def timed(fn, repeats: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def products(model, rows: int):
    """One product per Linear weight (and the head) with ``rows`` input rows; returns (fn, bytes)."""
    ws = [m.weight for _, m in model.named_modules() if isinstance(m, nn.Linear)]
    ws.append(model.model.embed_tokens.weight)
    xs = {w.shape[1]: mx.random.normal((rows, w.shape[1])) for w in ws}
    mx.eval(list(xs.values()))
    return (lambda: mx.eval([xs[w.shape[1]] @ w.T for w in ws])), sum(w.nbytes for w in ws)


def decode_step(model, rows: int, context: int):
    """A function that runs one decoding step of ``rows`` rows (the cache is trimmed back after each)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.ones((rows, context), dtype=mx.int32), cache=cache))
    tok = mx.full((rows, 1), 2, dtype=mx.int32)

    def step():
        mx.eval(model(tok, cache=cache))
        for c in cache:
            c.offset -= 1  # the next step overwrites this one's keys and values

    return step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=10, help="calls timed per round and arm")
    ap.add_argument("--context", type=int, default=200, help="prompt tokens before the decoding step")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if not _small_gemm.active():
        print(f"# the kernel is not active here ({_small_gemm.status}); nothing to compare")
        return 1
    from mlx_lm import load

    from mlx_ssp.demo import ensure_demo_model

    model, _ = load(str(ensure_demo_model("float32", progress=False)))
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores, "
          f"{_blas.status}; kernel {_small_gemm.status}")
    print("what                 rows   kernel   OpenBLAS  off/on   load")
    out = []
    for what in ("products", "decode step"):
        for rows in a.rows:
            fn, nbytes = products(model, rows) if what == "products" else (decode_step(model, rows, a.context), None)
            times = {True: [], False: []}
            load0 = os.getloadavg()[0]
            for _ in range(a.rounds):
                for on in (True, False):
                    with _small_gemm.enabled(on):
                        times[on].append(timed(fn, a.repeats))
            on_s, off_s = statistics.median(times[True]), statistics.median(times[False])
            unit = (lambda s: f"{nbytes / s / 1e9:6.1f} GB/s") if nbytes else (lambda s: f"{s * 1e3:6.1f} ms  ")
            print(f"{what:20s} {rows:4d} {unit(on_s)} {unit(off_s)} {off_s / on_s:6.2f}x  "
                  f"{load0:.1f}-{os.getloadavg()[0]:.1f}", flush=True)
            out.append({"what": what, "rows": rows, "kernel_s": on_s, "openblas_s": off_s, "bytes": nbytes,
                        "rounds": times, "load": [load0, os.getloadavg()[0]]})
    if a.json:
        with open(a.json, "w") as f:
            json.dump([{**r, "rounds": {"kernel": r["rounds"][True], "openblas": r["rounds"][False]}} for r in out],
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
