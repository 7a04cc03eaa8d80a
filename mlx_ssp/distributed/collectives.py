"""Collectives on the group: JSON records, objects and trees gathered or broadcast, gradient and
float sums, rank 0's work with the others waiting, and rank 0's books (appender, output lock)."""

from __future__ import annotations

import contextlib
import json
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence, TypeVar

import mlx.core as mx
import numpy as np
from mlx.nn.utils import average_gradients as _avg
from mlx.utils import tree_map

import mlx_ssp  # noqa: F401  (OpenBLAS before mlx.core)
from mlx_ssp.distributed.watchdog import collective
from mlx_ssp.distributed.world import DistributedError, is_main, world
from mlx_ssp.io import JsonlAppender
from mlx_ssp.io import output_lock as _output_lock

T = TypeVar("T")

# -- collectives ------------------------------------------------------------------------------------


def _gather_bytes(payload: bytes, what: str) -> list[bytes]:
    w = world()
    if w.size == 1:
        return [payload]
    with collective(what):
        n = mx.distributed.all_gather(mx.array([len(payload)], dtype=mx.int64), group=w.group, stream=mx.cpu)
        mx.eval(n)
        lengths = [int(v) for v in n.tolist()]
        width = max(max(lengths), 1)
        buf = bytearray(payload) + bytes(width - len(payload))
        local = mx.array(np.frombuffer(bytes(buf), dtype=np.uint8))
        allb = mx.distributed.all_gather(local, group=w.group, stream=mx.cpu)
        mx.eval(allb)
    raw = memoryview(bytes(allb))
    return [bytes(raw[i * width: i * width + lengths[i]]) for i in range(w.size)]


def all_gather_records(records: Sequence[Any], *, what: str = "all_gather_records") -> list[Any]:
    """Every rank's JSON-serialisable records, concatenated in rank order, on every rank."""
    payload = json.dumps(list(records), ensure_ascii=False, separators=(",", ":")).encode()
    out: list[Any] = []
    for part in _gather_bytes(payload, what):
        out.extend(json.loads(part.decode()))
    return out


def gather_per_rank(obj: Any, *, what: str = "gather_per_rank") -> list[Any]:
    """One JSON object from each rank -> the list indexed by rank, on every rank."""
    return all_gather_records([obj], what=what)


def broadcast_object(obj: Any = None, root: int = 0, *, what: str = "broadcast_object") -> Any:
    """``root``'s JSON-serialisable ``obj`` on every rank (other ranks' argument is ignored)."""
    w = world()
    if w.size == 1:
        return obj
    return all_gather_records([obj] if w.rank == root else [], what=what)[0]


def barrier(what: str = "barrier", timeout: float | None = None) -> None:
    """Wait until every rank reaches this point."""
    w = world()
    if w.size == 1:
        return
    with collective(what, timeout):
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=w.group, stream=mx.cpu))


def all_sum(x, *, what: str = "all_sum"):
    """Sum of an array (or a number) over the ranks, evaluated."""
    w = world()
    arr = x if isinstance(x, mx.array) else mx.array(x)
    if w.size == 1:
        return arr
    mx.eval(arr)
    with collective(what):
        out = mx.distributed.all_sum(arr, group=w.group, stream=mx.cpu)
        mx.eval(out)
    return out


def average_gradients(grads: Any, *, what: str = "average_gradients") -> Any:
    """Mean of a gradient tree over the ranks (mlx's bucketed all_sum / size), evaluated."""
    w = world()
    if w.size == 1:
        return grads
    mx.eval(grads)  # compute locally first: the guard should time the exchange, not the backward
    with collective(what):
        out = _avg(grads, group=w.group)
        mx.eval(out)
    return out


def sum_gradients(grads: Any, *, what: str = "sum_gradients") -> Any:
    """Sum of a gradient tree over the ranks (for losses already divided by a global count)."""
    w = world()
    if w.size == 1:
        return grads
    mx.eval(grads)
    with collective(what):
        out = tree_map(lambda g: g * w.size, _avg(grads, group=w.group))
        mx.eval(out)
    return out


def broadcast_tree(tree: Any, root: int = 0, *, what: str = "broadcast_tree") -> Any:
    """``root``'s array tree on every rank (all_sum with zeros elsewhere; same structure/shapes
    required). Use it so that every rank starts from rank 0's weights, e.g. after a resume on
    machines that do not share a disk."""
    w = world()
    if w.size == 1:
        return tree
    local = tree if w.rank == root else tree_map(mx.zeros_like, tree)
    mx.eval(local)
    with collective(what):
        out = tree_map(lambda x: mx.distributed.all_sum(x, group=w.group), local)
        mx.eval(out)
    return out


def run_on_main(fn: Callable[[], T], *, what: str = "rank 0 work", timeout: float | None = None) -> T | None:
    """Run ``fn`` on rank 0 only while the others wait; return its JSON-serialisable result on
    every rank (``None`` if it is not serialisable). An exception on rank 0 is re-raised there and
    reported as :class:`DistributedError` on the other ranks instead of leaving them waiting."""
    w = world()
    if w.size == 1:
        return fn()
    status: dict[str, Any] = {"ok": True, "result": None}
    result: Any = None
    error: BaseException | None = None
    if w.is_main:
        try:
            result = fn()
            try:
                json.dumps(result)
                status["result"] = result
            except (TypeError, ValueError):
                status["result"] = None
        except BaseException as e:  # noqa: BLE001 (re-raised below, after telling the others)
            error = e
            status = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    else:
        status = {}
    # the wait for rank 0 can be long (probing, fusing): it gets its own timeout
    per_rank = _gather_with_timeout(status, what, timeout)
    main = per_rank[0]
    if error is not None:
        raise error
    if not main.get("ok"):
        raise DistributedError(f"rank {w.rank}/{w.size}: {what} failed on rank 0: {main.get('error')}")
    return result if w.is_main else main.get("result")


def _gather_with_timeout(obj: Any, what: str, timeout: float | None) -> list[Any]:
    barrier(what, timeout)  # the long wait (for rank 0's work) happens here, under its own timeout
    return gather_per_rank(obj, what=what)


@contextmanager
def main_first(what: str = "rank 0 work", timeout: float | None = None) -> Iterator[bool]:
    """``with main_first() as do_it: if do_it: ...``: the block's body runs on rank 0, the others
    wait at the end of the block (errors handled as in :func:`run_on_main`)."""
    w = world()
    if w.size == 1:
        yield True
        return
    error: BaseException | None = None
    try:
        yield w.is_main
    except BaseException as e:  # noqa: BLE001
        error = e
    status = {"ok": error is None, "error": None if error is None else f"{type(error).__name__}: {error}"}
    per_rank = _gather_with_timeout(status, what, timeout)
    if error is not None:
        raise error
    bad = [(r, s["error"]) for r, s in enumerate(per_rank) if not s["ok"]]
    if bad:
        r, err = bad[0]
        raise DistributedError(f"rank {w.rank}/{w.size}: {what} failed on rank {r}: {err}")


def sum_floats(values: dict[str, float], *, what: str = "sum_floats") -> dict[str, float]:
    """Key-wise sum of per-rank statistics (a key missing on a rank counts as 0)."""
    w = world()
    if w.size == 1:
        return dict(values)
    out: dict[str, float] = {}
    for d in gather_per_rank({k: float(v) for k, v in values.items()}, what=what):
        for k, v in d.items():
            out[k] = out.get(k, 0.0) + v
    return out


def check_same(value: Any, *, what: str) -> None:
    """Every rank must hold the same JSON value (e.g. the checkpoint it resumes from): otherwise a
    :class:`DistributedError` naming what each rank has, before the ranks silently diverge."""
    w = world()
    if w.size == 1:
        return
    per_rank = gather_per_rank(value, what=f"check: {what}")
    if any(v != per_rank[0] for v in per_rank):
        shown = "; ".join(f"rank {r}: {v!r}" for r, v in enumerate(per_rank))
        raise DistributedError(f"the ranks disagree on {what} ({shown})")


class NullAppender:
    """Stands in for a :class:`mlx_ssp.io.JsonlAppender` on the ranks that do not write."""

    def __enter__(self) -> "NullAppender":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def write(self, record: Any) -> None:
        pass

    def write_many(self, records: Any) -> None:
        pass

    def close(self) -> None:
        pass


def appender(path) -> Any:
    """``JsonlAppender(path)`` on rank 0, a :class:`NullAppender` elsewhere."""
    if is_main():
        return JsonlAppender(path)
    return NullAppender()


def output_lock(out, what: str | None = None) -> Any:
    """:func:`mlx_ssp.io.output_lock` on rank 0 (which writes the outputs), nothing elsewhere: the
    ranks of one launch are one job, a second job on the same output fails at once."""
    return _output_lock(out, what) if is_main() else contextlib.nullcontext()

