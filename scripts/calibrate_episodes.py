"""What a model does on BFCL multi-turn episodes: one held-out-style episode per backend, K samples,
through the product's own rollout engine, reported as how often it writes a parseable call, how
many turns pass, and how long prefill and decoding take (for sizing CPU configs; docs/agents.md).

    python scripts/calibrate_episodes.py [--model demo] [--per-backend 1] [--k 2] [--max-tokens 64] [--tools used]
                                         [--render native|compact]

A message counts as a call when it parses as one; a parsed call names a *known* function when the
episode offers it. Turns pass as the checker judges them (BFCL's state and response checks).
"""

from __future__ import annotations

import json
import time

import click

import mlx_ssp  # noqa: F401  (loads OpenBLAS before mlx.core)
from mlx_ssp.agents.render import RENDERS

BACKENDS = ("file_system", "vehicle_control", "trading", "travel")


@click.command()
@click.option("--model", default="demo")
@click.option("--per-backend", default=1, type=int, help="Episodes (tasks) per backend.")
@click.option("--k", default=2, type=int)
@click.option("--max-tokens", default=64, type=int, help="Per assistant message.")
@click.option("--tools", type=click.Choice(["all", "used"]), default="used")
@click.option("--max-steps", default=2, type=int, help="Call attempts per turn before the episode ends.")
@click.option("--render", type=click.Choice(RENDERS), default="native", show_default=True,
              help="How tools and calls are shown (compact: one signature line per tool, python calls).")
@click.option("--seed", default=0, type=int)
def main(model, per_backend, k, max_tokens, tools, max_steps, render, seed):
    from mlx_ssp.agents.calls import CallSyntaxError, calls_from_message
    from mlx_ssp.models import load_model
    from mlx_ssp.rollout.config import SamplingConfig
    from mlx_ssp.rollout.engine import generate
    from mlx_ssp.rollout.request import RolloutRequest
    from mlx_ssp.tasks.build import export_source

    tasks = []
    for b in BACKENDS:
        ts = export_source("bfcl_multi_turn:base", split="eval", size=per_backend, seed=1234,
                           params={"backend": b, "tools": tools, "max_steps": max_steps, "reward": "partial",
                                   "render": render},
                           domain=b)
        tasks += ts
    m, tok, path = load_model(model)
    req = RolloutRequest(tasks=tasks, k=k, sampling=SamplingConfig(temperature=0.7, max_tokens=max_tokens),
                         seed=seed, batch_size=len(tasks) * k, progress=False)
    stats: dict = {}
    t0 = time.perf_counter()
    recs = generate(m, tok, req, stats=stats)
    wall = time.perf_counter() - t0
    msgs = [x for r in recs for x in r["messages"] if x["role"] == "assistant"]
    parsed = unparsable = known = n_calls = 0
    offered_by_task = {t.id: {f["name"] for f in t.metadata["functions"]} for t in tasks}
    for r in recs:
        offered = offered_by_task[r["task_id"]]
        for x in (msg for msg in r["messages"] if msg["role"] == "assistant"):
            try:
                calls = calls_from_message(x)
            except CallSyntaxError:
                unparsable += 1
                continue
            parsed += bool(calls)
            n_calls += len(calls)
            known += sum(c.name in offered for c in calls)
    out = {
        "model": str(path), "tools": tools, "episodes": len(recs), "assistant_messages": len(msgs),
        "render": render, "messages_with_calls": parsed, "messages_with_unparsable_calls": unparsable,
        "calls": n_calls, "calls_naming_an_offered_function": known,
        "mean_partial": sum(r["partial"] for r in recs) / len(recs),
        "accuracy": sum(r["accuracy"] for r in recs) / len(recs),
        "turns_passed": sum(t["passed"] for r in recs for t in r["turns"]),
        "turns": sum(len(r["turns"]) for r in recs),
        "finish": {f: sum(r["finish_reason"] == f for r in recs) for f in ("done", "step_limit", "context")},
        "mean_prompt_tokens": sum(len(r["prompt_token_ids"]) for r in recs) / len(recs),
        "prefill_tokens": stats["prompt_tokens"], "model_tokens": stats["gen_tokens"], "wall_s": round(wall, 1),
        "example_message": msgs[0]["content"][:300] if msgs else None,
    }
    click.echo(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
