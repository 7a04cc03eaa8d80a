"""The testbed generator's spectrum (mlx_ssp.testbed.spectrum): every record verifies, the dominant
strategy comes first, and the strategies of one problem are distinct traces."""

from __future__ import annotations

import random

from mlx_ssp.tasks import Task
from mlx_ssp.testbed.problems import draw, problem_from_meta, solve
from mlx_ssp.testbed.spectrum import MAX_PER_PROBLEM, ranked, solution_records


def _task(domain: str, seed: int, level: int) -> Task:
    p = draw(domain, random.Random(seed), level)
    meta = {"numbers": list(p.numbers), "target": p.target, "level": p.level, "testbed": domain}
    return Task(id=f"{domain}-{seed}", domain=domain, prompt=p.prompt, answer=None if p.answer is None else str(p.answer),
                verifier="testbed", metadata=meta)


def test_every_record_verifies_and_the_dominant_strategy_is_sample_0():
    tasks = [_task(d, s, lv) for d, lv in (("sum", 4), ("diff", 3), ("countdown", 4)) for s in range(6)]
    recs = solution_records(tasks)
    by_task: dict[str, list[dict]] = {}
    for r in recs:
        by_task.setdefault(r["task_id"], []).append(r)
    assert set(by_task) == {t.id for t in tasks}
    for t in tasks:
        rows = by_task[t.id]
        p = problem_from_meta(t.metadata["testbed"], t.metadata)
        assert all(solve(p, r["completion"])[0] and r["reward"] == 1.0 for r in rows)
        assert [r["sample"] for r in rows] == list(range(len(rows))) and len(rows) <= MAX_PER_PROBLEM
        assert len({r["completion"] for r in rows}) == len(rows)  # distinct traces
        assert "direct" not in {r["strategy"] for r in rows}
    assert {by_task[t.id][0]["strategy"] for t in tasks if t.domain in ("sum", "diff")} == {"chain"}
    assert all(by_task[t.id][0]["strategy"] == "s0" for t in tasks if t.domain == "countdown")
    assert max(len(by_task[t.id]) for t in tasks if t.domain == "countdown") > 2  # a spectrum to select from


def test_ranked_orders_by_the_pretraining_weights():
    assert ranked("sum", ["sorted", "direct", "pairs", "chain"]) == ["chain", "pairs", "sorted"]
    assert ranked("diff", ["group", "chain"]) == ["chain", "group"]
    assert ranked("countdown", ["s0", "s1", "s2"]) == ["s0", "s1", "s2"]
