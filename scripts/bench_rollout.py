"""Benchmark: batched K-rollouts vs one-at-a-time generation vs raw ``batch_generate``.

Measured side by side in one process, after a warm-up, on the same prompts and sampling settings:

- ``sequential``: each sample generated alone with mlx-lm's single-sequence loop
  (``mlx_lm.stream_generate``, the loop ``mlx_lm.generate`` runs; used to count tokens), on a subset
  of the samples (``--seq-samples``) to keep the run short; tokens/s is what matters.
- ``raw``: ``mlx_lm.batch_generate`` over all N*K prompts (batch ``--batch-size``), nothing else.
- ``ours``: :func:`mlx_ssp.rollout.iter_rollouts` with verification, behaviour log-probs and the
  records appended to a JSONL file (fsync per task, writer thread), i.e. what ``mlx_ssp rollout``
  does; with ``--engine-only``, without verification and writes (the engine's own cost).

raw and ours alternate ``--repeats`` times and the best of each is kept (the machine is shared).
Prints tokens/s, the speedup of ours over sequential, ours' overhead over raw (best against best,
and the median of the back-to-back pairs), and the share of the wall time spent verifying.

    python scripts/bench_rollout.py --model tiny
    python scripts/bench_rollout.py --model demo --tasks 8 --k 8 --max-tokens 64
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


def gsm8k_tasks(n: int):
    from mlx_ssp.tasks import Task

    shared = Path(os.environ.get("MLX_SSP_SHARED", Path(__file__).resolve().parents[2] / "shared"))
    path = shared / "data" / "gsm8k" / "test.jsonl"
    tasks = []
    if path.is_file():
        with open(path) as f:
            for i, line in enumerate(f):
                if i >= n:
                    break
                rec = json.loads(line)
                ans = rec["answer"].rsplit("####", 1)[-1].strip()
                # the math verifier (math-verify) is the realistic cost; lenient extraction always parses
                tasks.append(Task(id=f"gsm{i}", domain="gsm8k", prompt=rec["question"], answer=ans, verifier="math",
                                  metadata={"answer_extraction": "lenient"}))
    while len(tasks) < n:  # no shared data: synthetic prompts
        i = len(tasks)
        tasks.append(Task(id=f"s{i}", domain="synthetic", prompt=f"What is {i} + {2 * i}? Think step by step.",
                          answer=str(3 * i), verifier="exact"))
    return tasks


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="'tiny' (random float32 Qwen3), 'demo', or a model dir")
    ap.add_argument("--tasks", type=int, default=16)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus mass for every route (1 = off)")
    ap.add_argument("--seq-samples", type=int, default=8, help="samples timed one at a time")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--engine-only", action="store_true",
                    help="ours without verification and without the JSONL writes: the rollout engine alone")
    return ap


def timers(model, tok, args, tasks, sc, all_prompts, sampler, tmp: Path):
    """The three timed arms: one sample at a time, mlx-lm's batch_generate, and our rollout engine."""
    from mlx_lm import batch_generate, stream_generate

    from mlx_ssp.io import JsonlAppender
    from mlx_ssp.rollout import iter_rollouts

    # Each timer returns (tokens, wall s, CPU s of this process). On a shared machine the wall time
    # swings with other people's load; CPU time (all threads) is the steadier figure.
    def sequential(n):
        toks = 0
        t0, c0 = time.perf_counter(), time.process_time()
        for p in all_prompts[:n]:
            for _ in stream_generate(model, tok, p, max_tokens=args.max_tokens, sampler=sampler):
                toks += 1
        return toks, time.perf_counter() - t0, time.process_time() - c0

    def raw():
        t0, c0 = time.perf_counter(), time.process_time()
        r = batch_generate(model, tok, all_prompts, max_tokens=args.max_tokens, sampler=sampler,
                           completion_batch_size=args.batch_size, prefill_batch_size=min(8, args.batch_size))
        return r.stats.generation_tokens, time.perf_counter() - t0, time.process_time() - c0

    def ours(i):
        out = tmp / f"rollouts{i}.jsonl"
        stats = {}
        t0, c0 = time.perf_counter(), time.process_time()
        with JsonlAppender(out, background=True) as app:  # as `mlx_ssp rollout` writes
            for group in iter_rollouts(model, tok, tasks, k=args.k, sampling=sc, seed=i, batch_size=args.batch_size,
                                       progress=False, stats=stats, verify=not args.engine_only):
                if not args.engine_only:
                    app.write_many(group)
        return stats["gen_tokens"], time.perf_counter() - t0, time.process_time() - c0, stats["verify_s"]

    return sequential, raw, ours


def warm_up(model, tok, tasks, sc, all_prompts, sampler, args, sequential) -> None:
    """Compile paths, fill the allocator and build math-verify's grammar before anything is timed."""
    import mlx.core as mx
    from mlx_lm import batch_generate

    from mlx_ssp.rollout import iter_rollouts

    # warm-up: compile paths and allocator
    mx.random.seed(0)
    sequential(1)
    batch_generate(model, tok, all_prompts[: args.batch_size], max_tokens=4, sampler=sampler)
    list(iter_rollouts(model, tok, tasks[:2], k=2, sampling=sc.model_copy(update={"max_tokens": 4}), progress=False))
    from mlx_ssp.verify import verify
    from mlx_ssp.verify.math import equivalent

    # math-verify's first LaTeX parse builds its grammar (~0.2 s): a one-off, not a per-rollout cost
    equivalent("\\frac{1}{2}", "0.5")
    for t in tasks:
        verify(f"So the answer is {t.answer}.", t)


def rate(x):  # (tokens/wall s, tokens/CPU s)
    return x[0] / x[1], x[0] / x[2]


def note(name, r):  # partial figures as they come (a long run on a busy machine may be cut short)
    print(f"# {name}: {r[0]} tokens, {r[1]:.2f} s wall, {r[2]:.2f} s CPU, {r[0] / r[1]:.1f} tok/s", file=sys.stderr, flush=True)
    return r


def result(args, path, tasks, seq, raws, ourss) -> dict:
    """The record: tokens/s of each arm (best repeat), speedup over sequential, overhead over raw, verify share."""
    best = lambda runs, j: max(rate(r)[j] for r in runs)  # noqa: E731
    seq_w, seq_c = rate(seq)
    raw_w, raw_c = best(raws, 0), best(raws, 1)
    our_w, our_c = best(ourss, 0), best(ourss, 1)
    verify_share = sorted(r[3] / r[1] for r in ourss)[len(ourss) // 2]  # median run
    # each repeat runs raw then ours back to back: the ratio of a pair shares the machine's load
    paired = sorted(100 * (rate(r)[0] / rate(o)[0] - 1) for r, o in zip(raws, ourss))
    res = {
        "model": args.model,
        "engine_only": args.engine_only,
        "model_path": str(path),
        "tasks": len(tasks),
        "k": args.k,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "batch_size": args.batch_size,
        "tok_per_wall_s": {"sequential": round(seq_w, 1), "raw_batch_generate": round(raw_w, 1), "ours": round(our_w, 1)},
        "tok_per_cpu_s": {"sequential": round(seq_c, 1), "raw_batch_generate": round(raw_c, 1), "ours": round(our_c, 1)},
        "speedup_vs_sequential": {"wall": round(our_w / seq_w, 2), "cpu": round(our_c / seq_c, 2)},
        "overhead_vs_raw_pct": {"wall": round(100 * (raw_w / our_w - 1), 1), "cpu": round(100 * (raw_c / our_c - 1), 1)},
        "overhead_vs_raw_pct_paired_median": round(paired[len(paired) // 2], 1),
        "verify_share_of_wall_pct": round(100 * verify_share, 2),
        "cpu_utilisation_pct": round(100 * sum(r[2] for r in raws + ourss) / sum(r[1] for r in raws + ourss), 0),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, {platform.system()}",
    }
    return res


def main() -> None:
    args = build_parser().parse_args()

    from mlx_lm.sample_utils import make_sampler

    from mlx_ssp.models import load_model
    from mlx_ssp.rollout import SamplingConfig
    from mlx_ssp.tasks import render_prompt

    tmp = Path(tempfile.mkdtemp(prefix="bench_rollout."))
    if args.model == "tiny":
        from mlx_ssp.testing import make_tiny_model

        spec = str(make_tiny_model(tmp / "tiny", "qwen3"))
    else:
        spec = args.model
    model, tok, path = load_model(spec)
    tasks = gsm8k_tasks(args.tasks)
    sc = SamplingConfig(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens)
    prompts = [render_prompt(tok, t) for t in tasks]
    all_prompts = [p for p in prompts for _ in range(args.k)]
    sampler = make_sampler(args.temperature, top_p=args.top_p)

    sequential, raw, ours = timers(model, tok, args, tasks, sc, all_prompts, sampler, tmp)
    warm_up(model, tok, tasks, sc, all_prompts, sampler, args, sequential)
    seq = note("sequential", sequential(args.seq_samples))
    raws, ourss = [], []
    for i in range(args.repeats):
        raws.append(note("raw batch_generate", raw()))
        ourss.append(note("ours", ours(i)))
    res = result(args, path, tasks, seq, raws, ourss)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
