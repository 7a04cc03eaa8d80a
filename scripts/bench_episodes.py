"""Benchmark: multi-turn tool-use episodes, batched vs one at a time, cache reuse vs re-prefill.

Measured side by side in one run, per model, on the same tasks, samples and seeds
(:func:`mlx_ssp.agents.engine.run_episodes`, verification included, as ``mlx_ssp rollout`` runs it):

- ``batched``: all episodes through one ``BatchGenerator`` (``--batch-size``, default 16) vs
  ``one at a time``: batch 1, on the first ``--seq-episodes`` of the same episodes (to keep the run
  short). Episodes/s and generated tokens/s; the token ids of every episode run both ways are
  compared (the engine promises batched == one at a time).
- ``--ceiling``: the bare forward pass at batch 1 and 16 (decode step, 64-token prefill over a
  1,000-token cache) and one float32 exp: per-row gains that bound what any engine can get here.
- ``prefill batch``: the batched run at the request's automatic prefill batch (episodes: 1 on the CPU) vs
  mlx-lm's default of 8 sequences prefilled together (padded to the longest), same tokens.
- ``prefill``: the batched run with KV-cache reuse (``reuse_cache=True``) vs re-prefilling the whole
  conversation for every message (``reuse_cache=False``): prompt tokens prefilled per generated
  token, and the ratio.

Tasks: ``bfcl_multi_turn:base`` entries of one backend (``--backend``) whose ground truth has
exactly ``--turns`` turns (default 4). Policy: SCRIPTED. A random or tiny model never writes a
parseable call, so the first message of every turn "calls" that turn's ground truth (what a capable
model would call; the tests' scripted policy) and the next message ends the turn. The tokens are the
model's own samples (``--max-tokens`` per message); the calls, their execution and the tool results
fed back into the conversation are real. So every episode has 2 messages per turn.

Tool schemas in the prompt (``--tools``): ``all`` (every function offered, ~10k tokens with the
tiny model's byte-level tokenizer), ``gt`` (only the functions the episode's ground truth uses;
default) or ``none``.

    python scripts/bench_episodes.py
    python scripts/bench_episodes.py --models tiny --tasks 8 --k 2 --tools all
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


def scripted_policy() -> None:
    """The first message of each turn calls the turn's ground truth; the next one ends the turn."""
    from mlx_ssp.agents.calls import parse_ground_truth
    from mlx_ssp.agents.episode import Episode

    def parse_calls(self, text):
        gt = self.task.metadata["episode"]["ground_truth"][self.turn]
        return [parse_ground_truth(c) for c in gt] if self.steps == 0 else []

    Episode.parse_calls = parse_calls


#: the BatchGenerator counters of the last closed generator (decode/prefill time), for the profile line
GEN_COUNTERS: dict = {}


def profile_generator() -> None:
    """Record mlx-lm's own decode/prefill timers when the engine closes its generator."""
    from mlx_lm.generate import BatchGenerator

    close = BatchGenerator.close

    def closing(self):
        c = self._counters
        GEN_COUNTERS.update(decode_s=c.decode_time, prefill_s=c.prompt_time, decode_steps=c.generation_steps,
                            gen_tokens=c.generation_tokens, prefill_tokens=c.prompt_tokens)
        return close(self)

    BatchGenerator.close = closing


def forward_ceiling(model, history: int = 1000, delta: int = 64, batches=(1, 16)) -> dict:
    """What batching can buy on this machine, from the model's forward pass alone (no engine):
    one decode step and one ``delta``-token prefill over a ``history``-token cache, at each batch
    size (ms per call and per row), and the cost of one float32 exp (MLX's CPU exp dominates
    attention's softmax on small models). Batched/alone per-row ratios bound the engine's gain."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

    def timed(fn, n=10):
        mx.eval(fn())
        t0 = time.perf_counter()
        for _ in range(n):
            mx.eval(fn())
        return (time.perf_counter() - t0) / n * 1000

    out = {"history": history, "delta": delta}
    for b in batches:
        x = mx.random.randint(0, 256, (b, history))
        cache = [BatchKVCache([0] * b) for _ in make_prompt_cache(model)]
        model(x, cache=cache)
        mx.eval([c.state for c in cache])
        state = [(c.offset, c._idx) for c in cache]

        def run(tokens):
            def f():
                y = model(tokens, cache=cache)[:, -1]
                for c, (off, idx) in zip(cache, state):  # rewind: every call sees the same history
                    c.offset, c._idx = off, idx
                return y
            return f

        dec = timed(run(mx.random.randint(0, 256, (b, 1))))
        pre = timed(run(mx.random.randint(0, 256, (b, delta))), n=3)
        out[f"batch_{b}"] = {"decode_ms": round(dec, 2), "decode_ms_per_row": round(dec / b, 3),
                             "prefill_ms": round(pre, 1), "prefill_ms_per_row": round(pre / b, 2)}
    lo, hi = out[f"batch_{batches[0]}"], out[f"batch_{batches[-1]}"]
    out["decode_gain_per_row"] = round(lo["decode_ms_per_row"] / hi["decode_ms_per_row"], 2)
    out["prefill_gain_per_row"] = round(lo["prefill_ms_per_row"] / hi["prefill_ms_per_row"], 2)
    e = mx.random.normal((1 << 20,))
    out["exp_ns_per_element"] = round(timed(lambda: mx.exp(e)) * 1e6 / (1 << 20), 2)
    out["add_ns_per_element"] = round(timed(lambda: e + 1.0) * 1e6 / (1 << 20), 2)
    return out


def episode_tasks(backend: str, turns: int, n: int, tools: str):
    from mlx_ssp.agents.calls import parse_ground_truth
    from mlx_ssp.tasks.build import export_source

    ts = [t for t in export_source("bfcl_multi_turn:base", params={"backend": backend})
          if len(t.metadata["episode"]["ground_truth"]) == turns][:n]
    if len(ts) < n:
        sys.exit(f"only {len(ts)} {backend} base entries with {turns} turns (asked for {n})")
    for t in ts:
        if tools == "none":
            t.metadata["tools"] = []
        elif tools == "gt":
            used = {parse_ground_truth(c).name for turn in t.metadata["episode"]["ground_truth"] for c in turn}
            t.metadata["tools"] = [s for s in t.metadata["tools"] if s["function"]["name"] in used]
    return ts


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["tiny", "demo"], help="'tiny', 'demo' or model dirs")
    ap.add_argument("--backend", default="trading")
    ap.add_argument("--turns", type=int, default=4, help="base entries whose ground truth has this many turns")
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-episodes", type=int, default=None, help="episodes timed one at a time (default all)")
    ap.add_argument("--max-tokens", type=int, default=16, help="per assistant message")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--tools", choices=["all", "gt", "none"], default="gt")
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--ceiling", action="store_true",
                    help="also time the bare forward pass (decode / 64-token prefill over a 1000-token cache, batch 1 vs 16)")
    ap.add_argument("--skip-no-reuse", action="store_true", help="skip the re-prefill arm (slow on big models)")
    return ap


def note(name, recs, st):
    print(f"# {name}: {len(recs)} episodes, {st['gen_tokens']} gen tokens, {st['prompt_tokens']} prefilled, "
          f"{st['wall_s']:.1f} s wall, {st['cpu_s']:.1f} s CPU; generator: decode {st['gen']['decode_s']:.1f} s "
          f"in {st['gen']['decode_steps']} steps, prefill {st['gen']['prefill_s']:.1f} s", file=sys.stderr, flush=True)


def seq_sample_plan(tasks, k: int, seq_episodes: int | None) -> dict[str, list[int]]:
    """The samples timed one at a time: the first ``seq_episodes`` episodes in (task, sample) order."""
    n_eps = len(tasks) * k
    n_seq = min(seq_episodes or n_eps, n_eps)
    seq_samples: dict[str, list[int]] = {}
    for t in tasks:  # the first n_seq episodes in (task, sample) order
        for s in range(k):
            if sum(map(len, seq_samples.values())) < n_seq:
                seq_samples.setdefault(t.id, []).append(s)
    return seq_samples


def model_result(spec, path, args, tasks, sc, prompt_lens, ceiling, b_recs, b_st, s_recs, s_st, p_recs, p_st,
                 n_recs, n_st) -> dict:
    """One model's record: the arms' token equality, episodes/s, speedups and prefill per generated token."""
    from mlx_ssp.rollout.request import RolloutRequest

    by_key = {(r["task_id"], r["sample"]): r for r in b_recs}
    same_seq = all(r["token_ids"] == by_key[(r["task_id"], r["sample"])]["token_ids"] for r in s_recs)
    same_nocache = None if n_recs is None else [r["token_ids"] for r in n_recs] == [r["token_ids"] for r in b_recs]
    same_prefill8 = [r["token_ids"] for r in p_recs] == [r["token_ids"] for r in b_recs]
    b_eps, s_eps = len(b_recs) / b_st["wall_s"], len(s_recs) / s_st["wall_s"]
    b_eps_c, s_eps_c = len(b_recs) / b_st["cpu_s"], len(s_recs) / s_st["cpu_s"]
    pf_reuse = b_st["prompt_tokens"] / b_st["gen_tokens"]
    pf_none = None if n_st is None else n_st["prompt_tokens"] / n_st["gen_tokens"]
    res = {
        "model": spec,
        "model_path": str(path),
        "tools": args.tools,
        "backend": args.backend,
        "turns": args.turns,
        "tasks": len(tasks),
        "k": args.k,
        "episodes_batched": len(b_recs),
        "episodes_one_at_a_time": len(s_recs),
        "batch_size": args.batch_size,
        "max_tokens_per_message": args.max_tokens,
        "prompt_tokens_first_turn": {"min": min(prompt_lens), "max": max(prompt_lens)},
        "messages_per_episode": sorted({r["num_messages"] for r in b_recs}),
        "conversation_tokens_mean": round(sum(len(r["prompt_token_ids"]) + len(r["token_ids"]) for r in b_recs)
                                          / len(b_recs), 1),
        "rewards": sorted({r["reward"] for r in b_recs}),
        "episodes_per_wall_s": {"batched": round(b_eps, 3), "one_at_a_time": round(s_eps, 3)},
        "gen_tok_per_wall_s": {"batched": round(b_st["gen_tokens"] / b_st["wall_s"], 1),
                               "one_at_a_time": round(s_st["gen_tokens"] / s_st["wall_s"], 1)},
        "speedup_batched": {"wall": round(b_eps / s_eps, 2), "cpu": round(b_eps_c / s_eps_c, 2)},
        "batched_equals_one_at_a_time": same_seq,
        "prefill_batch": {"auto": RolloutRequest(tasks=tasks, k=1, sampling=sc, batch_size=args.batch_size).prefill_batch(episodes=True),
                          "episodes_per_wall_s_at_8": round(len(p_recs) / p_st["wall_s"], 3),
                          "speedup_auto_over_8": round(b_eps / (len(p_recs) / p_st["wall_s"]), 2),
                          "same_tokens": same_prefill8},
        "no_reuse_equals_reuse": same_nocache,
        "prefill_per_gen_token": {"reuse": round(pf_reuse, 2), "no_reuse": pf_none and round(pf_none, 2)},
        "prefill_reduction": pf_none and round(pf_none / pf_reuse, 2),
        "profile_s": {name: {"wall": round(st["wall_s"], 2), "decode": round(st["gen"]["decode_s"], 2),
                             "prefill": round(st["gen"]["prefill_s"], 2), "decode_steps": st["gen"]["decode_steps"]}
                      for name, st in (("batched", b_st), ("one_at_a_time", s_st), ("prefill_batch_8", p_st),
                                       ("no_reuse", n_st)) if st is not None},
        "wall_s_no_reuse_over_reuse": n_st and round(n_st["wall_s"] / b_st["wall_s"], 2),
        "forward_ceiling": ceiling,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, {platform.system()}",
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }
    return res


def bench_model(spec: str, args, tasks, sc, seq_samples, tmp: Path) -> dict:
    """Load one model, warm it up, time the arms (batched, alone, prefill batch 8, no reuse) and compare them."""
    import mlx.core as mx

    from mlx_ssp.agents.engine import run_episodes
    from mlx_ssp.models import load_model
    from mlx_ssp.rollout.request import RolloutRequest
    from mlx_ssp.tasks import render_prompt

    def run(model, tok, batch, *, reuse=True, samples=None, task_list=tasks, sampling=sc, prefill=None):
        req = RolloutRequest(tasks=task_list, k=args.k, sampling=sampling, seed=args.seed, batch_size=batch,
                             progress=False, prefill_batch_size=prefill)
        st = {}
        t0, c0 = time.perf_counter(), time.process_time()
        recs = [r for g in run_episodes(model, tok, req, samples=samples, stats=st, reuse_cache=reuse) for r in g]
        st["wall_s"], st["cpu_s"] = time.perf_counter() - t0, time.process_time() - c0
        st["gen"] = dict(GEN_COUNTERS)
        recs.sort(key=lambda r: (r["task_id"], r["sample"]))
        return recs, st

    if spec == "tiny":
        from mlx_ssp.testing import make_tiny_model

        mspec = str(make_tiny_model(tmp / "tiny", "qwen3"))
    else:
        mspec = spec
    model, tok, path = load_model(mspec)
    ceiling = forward_ceiling(model) if args.ceiling else None
    if ceiling:
        print("# forward-pass ceiling:", json.dumps(ceiling), file=sys.stderr, flush=True)
    prompt_lens = [len(render_prompt(tok, t)) for t in tasks]
    # warm-up: one short episode, batched and alone
    warm = sc.model_copy(update={"max_tokens": 2})
    run(model, tok, 2, task_list=tasks[:1], sampling=warm)
    mx.random.seed(0)

    b_recs, b_st = run(model, tok, args.batch_size)
    note(f"{spec} batched (batch {args.batch_size}, cache reuse)", b_recs, b_st)
    s_recs, s_st = run(model, tok, 1, samples=seq_samples)
    note(f"{spec} one at a time", s_recs, s_st)
    p_recs, p_st = run(model, tok, args.batch_size, prefill=8)
    note(f"{spec} batched, prefill batch 8", p_recs, p_st)
    n_recs = n_st = None
    if not args.skip_no_reuse:
        n_recs, n_st = run(model, tok, args.batch_size, reuse=False)
        note(f"{spec} batched, no cache reuse", n_recs, n_st)

    return model_result(spec, path, args, tasks, sc, prompt_lens, ceiling, b_recs, b_st, s_recs, s_st, p_recs, p_st,
                        n_recs, n_st)


def print_table(rows: list[dict]) -> None:
    print("\n| model | tools | episodes (batched / alone) | first prompt tokens | episodes/s batched | episodes/s alone "
          "| speedup (wall / CPU) | batched == alone | prefill/gen token, reuse | no reuse | reduction |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        p = r["prompt_tokens_first_turn"]
        print(f"| {r['model']} | {r['tools']} | {r['episodes_batched']} / {r['episodes_one_at_a_time']} "
              f"| {p['min']}-{p['max']} | {r['episodes_per_wall_s']['batched']} | {r['episodes_per_wall_s']['one_at_a_time']} "
              f"| **{r['speedup_batched']['wall']}x** / {r['speedup_batched']['cpu']}x "
              f"| {'yes' if r['batched_equals_one_at_a_time'] else 'NO'} "
              f"| {r['prefill_per_gen_token']['reuse']} | {r['prefill_per_gen_token']['no_reuse']} "
              f"| **{r['prefill_reduction']}x** |")


def main() -> None:
    args = build_parser().parse_args()

    from mlx_ssp.rollout.config import SamplingConfig

    scripted_policy()
    profile_generator()
    tmp = Path(tempfile.mkdtemp(prefix="bench_episodes."))
    tasks = episode_tasks(args.backend, args.turns, args.tasks, args.tools)
    sc = SamplingConfig(temperature=args.temperature, max_tokens=args.max_tokens)
    seq_samples = seq_sample_plan(tasks, args.k, args.seq_episodes)
    rows = []
    for spec in args.models:
        res = bench_model(spec, args, tasks, sc, seq_samples, tmp)
        print(json.dumps(res, indent=2), flush=True)
        rows.append(res)

    print_table(rows)


if __name__ == "__main__":
    main()
