"""Benchmark: one MGPO-GRPO step on BFCL multi-turn episodes, with and without KV-cache
reuse across turns.

Each step is :meth:`mlx_ssp.rl.trainer.Trainer.step` on ``bfcl_multi_turn:base`` file-system tasks
(tool schemas left out of the prompt: with them a prompt is ~10k tokens, far too long for a CPU
benchmark of a random model). A random model calls no tools, so a scripted policy (as in the
tests: samples 0..G-2 "call" each turn's ground truth, sample G-1 calls nothing) makes the tool path
run and the groups mixed; the tokens are still the model's own samples. Time is split into

- ``gen``: the rollout engine (decoding and prefill), minus the two below;
- ``tools``: time inside ``Environment.execute`` while episodes run (not the verifier's re-runs);
- ``verify``: scoring finished episodes (``mlx_ssp.rollout.scoring.timed_verify``);
- ``logprobs``: one no-grad forward of the chunked log-prob op over the batch (whole conversations),
  measured separately after the step (the update recomputes it with gradients);
- ``update``: the trainer's ``mu`` inner updates (forward + backward + optimizer).

Model-token throughput: sampled tokens / rollout time, and loss tokens / update time. Peak memory:
MLX's peak during generation and during the update, and the process's max RSS. ``reuse_cache=False``
is forced by wrapping :func:`mlx_ssp.agents.engine.run_episodes` (the trainer has no switch for it).
Each (model, cache mode) runs ``--steps`` steps after one warm-up step; we report the median.

    python scripts/bench_rl_episodes.py                  # tiny random models
    python scripts/bench_rl_episodes.py --models tiny,demo --steps 2
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import platform
import resource
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import mlx_ssp  # noqa: F401  (OpenBLAS before mlx.core)

IDS = ("multi_turn_base_0", "multi_turn_base_1", "multi_turn_base_2", "multi_turn_base_3")


def episode_tasks(n: int):
    from mlx_ssp.tasks.build import export_source

    ts = [t for t in export_source("bfcl_multi_turn:base") if t.metadata["bfcl_id"] in IDS[:n]]
    for t in ts:
        t.metadata["tools"] = []
    return ts


@contextmanager
def instrumented(group_size: int, reuse_cache: bool):
    """Scripted policy, timers around tool execution and verification, and the cache switch."""
    from mlx_ssp.agents import engine
    from mlx_ssp.agents.calls import parse_ground_truth
    from mlx_ssp.agents.environment import Environment
    from mlx_ssp.agents.episode import Episode
    from mlx_ssp.rollout import scoring

    clock = {"tools_s": 0.0, "verify_s": 0.0, "in_verify": False}
    saved = (Episode.parse_calls, Environment.execute, scoring.timed_verify, engine.run_episodes)

    def parse_calls(self, text):
        if self.sample == group_size - 1 or self.steps:
            return []
        return [parse_ground_truth(c) for c in self.task.metadata["episode"]["ground_truth"][self.turn]]

    def execute(self, *a, **kw):
        t = time.perf_counter()
        try:
            return saved[1](self, *a, **kw)
        finally:
            if not clock["in_verify"]:
                clock["tools_s"] += time.perf_counter() - t

    def timed_verify(*a, **kw):
        t, clock["in_verify"] = time.perf_counter(), True
        try:
            return saved[2](*a, **kw)
        finally:
            clock["in_verify"] = False
            clock["verify_s"] += time.perf_counter() - t

    Episode.parse_calls, Environment.execute, scoring.timed_verify = parse_calls, execute, timed_verify
    engine.run_episodes = functools.partial(saved[3], reuse_cache=reuse_cache)
    try:
        yield clock
    finally:
        Episode.parse_calls, Environment.execute, scoring.timed_verify, engine.run_episodes = saved


def one_config(path: str, tasks, *, reuse_cache: bool, steps: int, batch_size: int, group_size: int,
               max_tokens: int, work: Path) -> dict:
    import mlx.core as mx
    import numpy as np

    from mlx_ssp.models import load_model
    from mlx_ssp.rl.config import RLConfig
    from mlx_ssp.rl.pieces import sequence_logprobs
    from mlx_ssp.rl.policy import setup_model
    from mlx_ssp.rl.trainer import Trainer

    cfg = RLConfig(steps=steps + 1, batch_size=batch_size, group_size=group_size, learning_rate=1e-5,
                   sampling={"temperature": 1.0, "max_tokens": max_tokens}, progress=False, checkpoint_every=1000,
                   micro_batch_size=group_size, gen_batch_size=batch_size * group_size)
    model, tok, _ = load_model(path)
    setup_model(model, cfg)
    tr = Trainer(model, tok, tasks, cfg, work, seed=0)
    rows = []
    captured = {}
    orig = tr.updater.update

    def keep_batch(batch):  # the step's batch, for the separate log-prob timing
        captured["batch"] = batch
        return orig(batch)

    tr.updater.update = keep_batch
    for i in range(steps + 1):
        with instrumented(group_size, reuse_cache) as clock:
            rec = tr.step()
        b = captured.pop("batch")
        t = time.perf_counter()
        for s in range(0, b["inputs"].shape[0], cfg.micro_batch_size):
            mx.eval(sequence_logprobs(model, b["inputs"][s:s + cfg.micro_batch_size],
                                      b["targets"][s:s + cfg.micro_batch_size], 1.0, cfg.chunk_size))
        rec["logprobs_s"] = time.perf_counter() - t
        rec.update(clock)
        rec["conv_tokens"] = b["tokens"]
        if i:  # the first step warms up (compilation, allocator)
            rows.append(rec)
    med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    gen = med("gen_s")
    return {
        "step_s": med("step_s"), "rollout_s": gen, "gen_s": gen - med("tools_s") - med("verify_s"),
        "tools_s": med("tools_s"), "verify_s": med("verify_s"), "logprobs_s": med("logprobs_s"),
        "update_s": med("train_s"), "model_tokens": med("gen_tokens"), "conv_tokens": med("conv_tokens"),
        "gen_tok_s": statistics.median(r["gen_tokens"] / r["gen_s"] for r in rows),
        "train_tok_s": statistics.median(r["train_model_tokens"] / r["train_s"] for r in rows),
        "peak_gen_mb": max(r["peak_memory_gen_mb"] for r in rows),
        "peak_train_mb": max(r["peak_memory_train_mb"] for r in rows),
        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "reward": statistics.mean(r["reward_mean"] for r in rows),
        "absdiff": max(r["behaviour_logp_absdiff"] for r in rows),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny", help="comma list of: tiny (3.3M random Qwen3), demo (SmolLM2-135M)")
    ap.add_argument("--steps", type=int, default=3, help="measured steps per configuration (after 1 warm-up)")
    ap.add_argument("--tasks", type=int, default=2, help="episode tasks (= groups) per step")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens per assistant message")
    ap.add_argument("--cache", default="reuse,none", help="comma list of: reuse (KV cache kept across turns), none")
    a = ap.parse_args()
    from mlx_ssp.testing import make_tiny_model

    tasks = episode_tasks(a.tasks)
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.machine()} {platform.system()}, "
          f"{os.cpu_count()} cores (shared, load avg {os.getloadavg()[0]:.1f}); {len(tasks)} episode tasks x G "
          f"{a.group_size}, {a.max_tokens} tokens/message, LoRA r8, mu 1; median of {a.steps} steps after 1 warm-up")
    cols = ("step_s", "gen_s", "tools_s", "verify_s", "logprobs_s", "update_s", "model_tokens", "conv_tokens",
            "gen_tok_s", "train_tok_s", "peak_gen_mb", "peak_train_mb", "rss_mb")
    print(f"{'model':6s} {'cache':6s} " + " ".join(f"{c:>12s}" for c in cols) + "  reward absdiff")
    with tempfile.TemporaryDirectory(prefix="bench_rl_ep_") as tmp:
        for name in a.models.split(","):
            if name == "tiny":
                path = str(make_tiny_model(Path(tmp) / "tiny", "qwen3", seed=0, hidden_size=256, num_layers=4,
                                           num_heads=4, num_kv_heads=2, intermediate_size=768))
            else:
                path = "demo"
            for reuse in [m == "reuse" for m in a.cache.split(",")]:
                r = one_config(path, tasks, reuse_cache=reuse, steps=a.steps, batch_size=len(tasks),
                               group_size=a.group_size, max_tokens=a.max_tokens, work=Path(tmp) / f"{name}{reuse}")
                print(f"{name:6s} {'reuse' if reuse else 'none':6s} " + " ".join(
                    f"{r[c]:12.3f}" if isinstance(r[c], float) else f"{r[c]:12d}" for c in cols)
                    + f"  {r['reward']:.2f} {r['absdiff']:.1e}", flush=True)


if __name__ == "__main__":
    main()
