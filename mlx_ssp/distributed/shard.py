"""Contiguous balanced shards (:func:`shard`) and sharded generation (:func:`iter_sharded_groups`):
concatenating the ranks' blocks in rank order restores the global order."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Sequence, TypeVar

import mlx_ssp  # noqa: F401  (OpenBLAS before mlx.core)
from mlx_ssp.distributed.collectives import all_gather_records, gather_per_rank
from mlx_ssp.distributed.world import world

T = TypeVar("T")

# -- sharding ---------------------------------------------------------------------------------------


def shard_bounds(n: int, rank: int, size: int) -> tuple[int, int]:
    """[start, stop) of rank ``rank``'s contiguous block of ``n`` items over ``size`` ranks."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"bad rank/size {rank}/{size}")
    if n < 0:
        raise ValueError(f"bad item count {n}")
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def shard(items: Sequence[T], rank: int | None = None, size: int | None = None) -> list[T]:
    """This rank's contiguous, balanced block of ``items`` (defaults: the world's rank and size).
    Concatenating every rank's block in rank order gives back ``items``."""
    if rank is None or size is None:
        w = world()
        rank = w.rank if rank is None else rank
        size = w.size if size is None else size
    start, stop = shard_bounds(len(items), rank, size)
    return list(items[start:stop])



# -- sharded generation (rollouts, eval, RL sampling) ------------------------------------------------


def iter_sharded_groups(
    run: Callable[[dict[str, list[int]], dict], Iterable[list[dict]]],
    samples: dict[str, list[int]],
    *,
    stats: dict | None = None,
    round_size: int | None = None,
    what: str = "rollouts",
) -> Iterator[list[dict]]:
    """Generate ``samples`` (task id -> sample indices, in global task order) across the ranks.

    ``run(subset, stats)`` generates the samples of ``subset`` on this rank and yields lists of
    records (each with ``task_id`` and ``sample``), filling ``stats``. One process: exactly
    ``run(samples, stats)``. Several: the (task, sample) pairs, flattened in order, are cut into
    rounds of ``round_size`` pairs (default: all in one round); each rank generates its
    contiguous block of the round (:func:`shard`), the records are all-gathered and every rank
    receives, per task in global order, the round's records sorted by sample index. Since every
    sample's random stream depends only on (seed, task id, sample index), the records equal those
    of one process. ``stats`` ends up combined over ranks and rounds (counts summed, ``gen_s`` the
    slowest rank's wall time, ``skipped`` the union)."""
    w = world()
    if w.size == 1:
        yield from run(samples, stats if stats is not None else {})
        return
    pairs = [(tid, s) for tid, ss in samples.items() for s in ss]
    order = {tid: i for i, tid in enumerate(samples)}
    step = len(pairs) if not round_size else max(int(round_size), w.size)
    mine_total: dict[str, Any] = {}
    for r0 in range(0, max(len(pairs), 1), max(step, 1)):
        block = shard(pairs[r0: r0 + step], w.rank, w.size)
        subset: dict[str, list[int]] = {}
        for tid, s in block:
            subset.setdefault(tid, []).append(s)
        st: dict = {}
        recs = [r for group in (run(subset, st) if subset else ()) for r in group]
        _accumulate(mine_total, st)
        allrecs = all_gather_records(recs, what=f"gather {what}")
        by_task: dict[str, list[dict]] = {}
        for r in allrecs:
            by_task.setdefault(r["task_id"], []).append(r)
        for tid in sorted(by_task, key=lambda t: order.get(t, len(order))):
            yield sorted(by_task[tid], key=lambda r: r["sample"])
    if stats is not None:
        per_rank = gather_per_rank(mine_total, what=f"gather {what} stats")
        stats.clear()
        for st in per_rank:
            _accumulate(stats, st, wall_max=True)


def _accumulate(into: dict, st: dict, wall_max: bool = False) -> None:
    """Sum numeric counters, union lists; ``gen_s`` summed over rounds, max over ranks."""
    for k, v in st.items():
        if isinstance(v, bool) or v is None:
            into.setdefault(k, v)
        elif isinstance(v, (int, float)):
            if wall_max and k == "gen_s":
                into[k] = max(into.get(k, 0.0), v)
            else:
                into[k] = into.get(k, 0) + v
        elif isinstance(v, list):
            seen = into.setdefault(k, [])
            seen.extend(x for x in v if x not in seen)
        else:
            into.setdefault(k, v)

