"""Tensors merged side by side on threads, largest first within a memory budget.

mlx's CPU kernels and the NumPy selects are single-threaded and release the GIL, so a second core
nearly halves a merge. Each thread has its own mlx stream (mlx evaluates a stream's graphs only on
the thread that created it). Threads take the largest pending tensor first (the classic
longest-processing-time rule: the run then ends on small tensors, not with one thread alone on the
lm_head), but never two of the largest at once: peak memory is about inputs x (largest tensor +
(workers - 1) x largest ordinary tensor) + constant, plus the full-size copies some methods make of
a tensor in flight (float32 nuslerp per column about 5; multislerp one unit vector per input, and
in float32 its n dot products and a concatenated copy, but in bf16 on the native passes only the
mean and the tangent; docs/merge.md).
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Optional

import mlx_ssp  # noqa: F401
import mlx.core as mx

from mlx_ssp.errors import UserError

#: mlx releases with per-thread streams (safe to evaluate independent graphs from several threads)
_THREADED_MLX = (0, 31, 2)


def resolve_workers(workers: Optional[int] = None) -> int:
    """Tensors merged side by side: ``workers`` if given, else 2 when merging on the CPU (1 on a
    1-CPU machine) and 1 on a GPU (threads there are untested: no Metal/CUDA run yet); always 1
    on an mlx older than 0.31.2, whose streams are not per-thread."""
    try:
        version = tuple(int(x) for x in mx.__version__.split(".")[:3])
    except ValueError:
        version = _THREADED_MLX
    if version < _THREADED_MLX:
        return 1
    if workers is None:
        if mx.default_device() != mx.cpu:
            return 1
        return min(2, os.cpu_count() or 1)
    if workers < 1:
        raise UserError(f"workers must be >= 1, got {workers}")
    return workers


def inflight_budget(sizes: list[int], workers: int) -> int:
    """How many elements may be in flight at once: the largest tensor plus ``workers - 1`` of the
    largest ordinary ones (at most half the largest), so that two vocabulary-sized tensors are
    never merged side by side (peak memory stays one large working set plus small ones); when all
    tensors are about the same size, every worker may hold one."""
    big = max(sizes, default=0)
    ordinary = [s for s in sizes if s <= big // 2]
    return big + (workers - 1) * (max(ordinary) if ordinary else big)


class Schedule:
    """The pending items, largest first (stable: equal sizes keep their order), handed out within
    :func:`inflight_budget` (a thread with no item that fits waits for one to finish)."""

    def __init__(self, sizes: list[int], workers: int):
        self.sizes = sizes
        self.budget = inflight_budget(sizes, workers)
        self.pending = sorted(range(len(sizes)), key=lambda i: -sizes[i])
        self.inflight = 0  # elements of the items being merged now
        self.cond = threading.Condition()
        self.stopped = threading.Event()

    def take(self) -> Optional[int]:
        """The next item to run (None: nothing left, or stopped)."""
        with self.cond:
            while not self.stopped.is_set() and self.pending:
                for k, i in enumerate(self.pending):
                    if self.sizes[i] <= self.budget - self.inflight or self.inflight == 0:
                        del self.pending[k]
                        self.inflight += self.sizes[i]
                        return i
                self.cond.wait()
            return None

    def done(self, i: int) -> None:
        with self.cond:
            self.inflight -= self.sizes[i]
            self.cond.notify_all()

    def stop(self) -> None:
        self.stopped.set()
        with self.cond:
            self.cond.notify_all()


def _worker(schedule: Schedule, items: list, fn, results: queue.SimpleQueue) -> None:
    """One thread: items one at a time on its own mlx stream; ``None`` per item done, or the error
    (which stops the others after their current item). The thread destroys its streams before it
    ends (``mx.clear_streams``): mlx requires it, or the process may abort at exit."""
    try:
        with mx.stream(mx.new_stream(mx.default_device())):
            while (i := schedule.take()) is not None:
                try:
                    fn(items[i])
                finally:
                    schedule.done(i)
                results.put(None)
    except BaseException as e:  # noqa: BLE001 - handed to the caller's thread, never lost
        schedule.stop()
        results.put(e)
    finally:
        if hasattr(mx, "clear_streams"):
            mx.clear_streams()


def run_parallel(items: list, fn, workers: int, on_done, sizes: Optional[list[int]] = None) -> None:
    """``fn(item)`` for every item on ``workers`` threads (:class:`Schedule` by ``sizes``), calling
    ``on_done()`` here after each; the first error is raised here."""
    sizes = list(sizes) if sizes is not None else [1] * len(items)
    schedule = Schedule(sizes, workers)
    results: queue.SimpleQueue = queue.SimpleQueue()
    threads = [threading.Thread(target=_worker, args=(schedule, items, fn, results), name=f"merge-{i}", daemon=True)
               for i in range(workers)]
    for t in threads:
        t.start()
    try:
        for _ in range(len(items)):
            err = results.get()
            if err is not None:
                raise err
            on_done()
    finally:
        schedule.stop()
        for t in threads:
            t.join()
