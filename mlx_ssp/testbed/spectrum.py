"""The testbed generator's own spectrum: every correct strategy of a problem as a solution trace.

VibeThinker-1.5B (arXiv:2511.06221) section 3.2 claims that SFT data holding several *distinct*
correct solutions per problem (the spectrum) leave RL more to sharpen than the one solution a
first-win filter keeps. Testing that with the model's own K samples fails when the model rarely
writes two different correct solutions: the arms then train on nearly the same data. The testbed's
generator knows every strategy that solves a problem (:func:`mlx_ssp.testbed.problems.strategies`),
so the spectrum can be given rather than hoped for.

:func:`solution_records` writes a train split's problems as rollout records (one per strategy,
reward 1, the pretraining mix's dominant strategy as sample 0), so the selection stage chooses from
them exactly as from sampled rollouts: ``first`` keeps the dominant strategy, ``diverse`` up to
``per_prompt`` distinct ones by farthest-point. ``direct`` (the bare answer) is left out: it is not
a solution *method* a small model can use on a problem it cannot add up at a glance. On ``sum`` and
``diff`` the strategies are reorderings of the same additions; ``countdown``'s are different
expressions (distinct sets of intermediate results), so countdown is where the arms differ most.
"""

from __future__ import annotations

from typing import Any, Iterable

from mlx_ssp.testbed.build import STRATEGY_WEIGHTS
from mlx_ssp.testbed.problems import problem_from_meta, solve, strategies, trace

#: at most this many strategies per problem are offered to selection (countdown problems can have dozens)
MAX_PER_PROBLEM = 8


def ranked(domain: str, names: Iterable[str]) -> list[str]:
    """Strategy names by their weight in the pretraining mix, dominant first (``countdown``: its
    canonical order, whose weights fall as 0.5 ** i); ``direct`` left out."""
    names = [n for n in names if n != "direct"]
    w = STRATEGY_WEIGHTS.get(domain)
    if not w:
        return names
    return sorted(names, key=lambda n: -w.get(n, 0.0))  # stable: ties keep the generator's order


def solution_records(tasks: Iterable[Any], max_per_problem: int = MAX_PER_PROBLEM) -> list[dict]:
    """Rollout records (``task_id``, ``domain``, ``sample``, ``prompt``, ``completion``, ``reward``,
    ``finish_reason``, ``strategy``) of every testbed task: its strategies' traces, dominant first,
    each checked by the verifier's own rule. A task that is not a testbed problem is an error."""
    out = []
    for t in tasks:
        meta = t.metadata or {}
        if "testbed" not in meta:
            raise ValueError(f"task {t.id}: not a testbed problem (metadata has no 'testbed')")
        p = problem_from_meta(meta["testbed"], meta)
        for i, name in enumerate(ranked(p.domain, strategies(p))[:max_per_problem]):
            text = trace(p, name)
            ok, why = solve(p, text)
            if not ok:  # the generator's own trace must pass its own check
                raise ValueError(f"task {t.id}: strategy {name} does not verify ({why})")
            out.append({"task_id": t.id, "domain": t.domain, "sample": i, "prompt": t.prompt, "completion": text,
                        "reward": 1.0, "finish_reason": "stop", "strategy": name})
    return out
