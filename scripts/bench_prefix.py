"""Benchmark: shared prompt prefixes. The G samples of a prompt prefilled once vs each
sample prefilling its own prompt, side by side in one process, same tasks, seeds and sampling.

Prompts: GSM8K test questions behind a system prompt padded to ``--prompt-tokens`` tokens (the RL
step's target shape: a 256-token prompt, G = 8). Reported per arm (best of ``--repeats``,
alternating): wall seconds, mlx-lm's own prefill and decode timers (``BatchGenerator`` counters),
prompt tokens actually prefilled, and whether both arms drew the same tokens.

    python scripts/bench_prefix.py --model tiny
    python scripts/bench_prefix.py --model demo --tasks 4 --k 8 --max-tokens 16
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import mlx_ssp  # noqa: F401  (OpenBLAS before mlx.core)

# mlx-lm's own prefill/decode timers of each generator, read when it closes (scripts/ is on sys.path)
from bench_episodes import GEN_COUNTERS as COUNTERS  # noqa: E402
from bench_episodes import profile_generator as track_generator  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="'tiny', 'demo' or a model dir")
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    from mlx_ssp.models import load_model
    from mlx_ssp.rollout import RolloutRequest, SamplingConfig, generate
    from mlx_ssp.tasks import Task, render_prompt

    track_generator()
    if args.model == "tiny":
        from mlx_ssp.testing import make_tiny_model

        spec = str(make_tiny_model(Path(tempfile.mkdtemp()) / "tiny", "qwen3"))
    else:
        spec = args.model
    model, tok, path = load_model(spec)
    shared = Path(os.environ.get("MLX_SSP_SHARED", Path(__file__).resolve().parents[2] / "shared"))
    rows = [json.loads(x) for x in (shared / "data" / "gsm8k" / "test.jsonl").read_text().splitlines()[: args.tasks]]
    filler = "You are a careful assistant. Solve the problem step by step and state the answer. "
    system = filler
    probe = [Task(id=f"x{i}", domain="m", prompt=r["question"], answer="0", verifier="math") for i, r in enumerate(rows)]
    while min(len(render_prompt(tok, t, system=system)) for t in probe) < args.prompt_tokens:
        system += filler
    tasks = [Task(id=f"g{i}", domain="gsm8k", prompt=r["question"], answer=r["answer"].split("####")[-1].strip(),
                  verifier="math") for i, r in enumerate(rows)]
    lens = [len(render_prompt(tok, t, system=system)) for t in tasks]
    sc = SamplingConfig(temperature=1.0, max_tokens=args.max_tokens)

    def run(share: bool):
        st: dict = {}
        req = RolloutRequest(tasks=tasks, k=args.k, sampling=sc, seed=0, batch_size=args.batch_size, progress=False,
                             share_prefix=share, verify=False, system=system)
        t0 = time.perf_counter()
        recs = generate(model, tok, req, stats=st)
        # the shared prefixes are prefilled outside the generator: their time counts as prefill too
        res = {"wall_s": time.perf_counter() - t0, **COUNTERS, "saved": st.get("prefill_saved_tokens", 0)}
        res["prefill_s"] += st.get("prefix_prefill_s", 0.0)
        res["prefill_tokens"] += st.get("prefix_prefill_tokens", 0)
        return res, \
            [r["token_ids"] for r in recs]

    run(True)  # warm-up
    best: dict = {}
    toks = {}
    for _ in range(args.repeats):
        for share in (False, True):
            res, toks[share] = run(share)
            print(f"# share={share}: {json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()})}",
                  file=sys.stderr, flush=True)
            if share not in best or res["wall_s"] < best[share]["wall_s"]:
                best[share] = res
    out = {
        "model": args.model, "model_path": str(path), "tasks": args.tasks, "k": args.k,
        "prompt_tokens": {"min": min(lens), "max": max(lens)}, "max_tokens": args.max_tokens,
        "unshared": {k: round(v, 3) if isinstance(v, float) else v for k, v in best[False].items()},
        "shared": {k: round(v, 3) if isinstance(v, float) else v for k, v in best[True].items()},
        "prefill_time_ratio": round(best[False]["prefill_s"] / max(best[True]["prefill_s"] + 1e-9, 1e-9), 2),
        "wall_ratio": round(best[False]["wall_s"] / best[True]["wall_s"], 2),
        "same_tokens": toks[False] == toks[True],
        "machine": f"{platform.machine()} {os.cpu_count()} cpus", "load_avg": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
