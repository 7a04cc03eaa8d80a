"""Scoring beside generation: each finished record is verified (:func:`mlx_ssp.verify.verify`)
inline, or, for verifiers registered as parallel (the code sandbox, which waits on subprocesses),
on a thread pool while decoding goes on. Math-verify's timeouts need the main thread, hence inline."""

from __future__ import annotations

import time
from typing import Optional

from mlx_ssp.rollout.records import TaskGroups
from mlx_ssp.tasks import Task
from mlx_ssp.verify import PARALLEL, verify


def timed_verify(text: str, task: Task):
    t0 = time.perf_counter()
    res = verify(text, task)
    return res, time.perf_counter() - t0


class Scorer:
    """Verifies records and hands each task's group out (through ``groups``) once all are scored."""

    def __init__(self, tasks: list[Task], groups: TaskGroups, stats: dict, *, verify: bool, workers: int,
                 unlabelled: frozenset[str] = frozenset()):
        self.parallel = PARALLEL
        self.verify = verify
        self.unlabelled = unlabelled  # task ids sampled without verification (no answer to check)
        self.groups = groups
        self.stats = stats
        self.pending: list = []  # (task index, record, future) of background verifications
        self.pool = None
        if verify and workers > 1 and any(t.verifier in PARALLEL for t in tasks):
            from concurrent.futures import ThreadPoolExecutor

            self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="verify")

    def score(self, task_idx: int, task: Task, rec: dict, text: str) -> Optional[list[dict]]:
        """Score ``rec`` now or in the background; the task's records if this completed them."""
        if task.id in self.unlabelled:
            rec.update(reward=None, reason="unlabelled", detail="no answer to verify against", verify_s=0.0)
            return self.groups.add(task_idx, rec)
        if self.verify and self.pool is not None and task.verifier in self.parallel:
            self.pending.append((task_idx, rec, self.pool.submit(timed_verify, text, task)))
            return None
        if self.verify:
            self._set_reward(rec, *timed_verify(text, task))
        return self.groups.add(task_idx, rec)

    def _set_reward(self, rec: dict, res, dt: float) -> None:
        self.stats["verify_s"] += dt
        rec.update(reward=float(res.reward), reason=res.reason, detail=res.detail, verify_s=round(dt, 5))

    def collect(self, wait: bool) -> list[list[dict]]:
        """Groups completed by background verifications that have finished (all of them when ``wait``)."""
        groups, still = [], []
        for ti, rec, fut in self.pending:
            if wait or fut.done():
                self._set_reward(rec, *fut.result())
                grp = self.groups.add(ti, rec)
                if grp is not None:
                    groups.append(grp)
            else:
                still.append((ti, rec, fut))
        self.pending[:] = still
        return groups

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
