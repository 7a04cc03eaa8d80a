"""Data parallelism over ``mx.distributed``: one process per rank, launched by ``mlx.launch``.

The recipe's expensive stages (K-rollouts, eval, SFT, MGPO-GRPO) are data parallel: every rank
holds the whole model, works on its share of the prompts and the ranks meet only to exchange
small things (records, gradients, counts). This module is the thin layer the stages use; the
transport is MLX's own (ring over TCP, MPI, JACCL over Thunderbolt RDMA, NCCL on CUDA).

Primitives
- :func:`world` initialises the global group once (size 1 when the program was not launched by
  ``mlx.launch``/``mpirun``, so every stage runs unchanged on one process).
- :func:`shard` gives rank ``r`` the ``r``-th of ``size`` contiguous, balanced blocks (sizes differ by
  at most one, the first ``n % size`` ranks take one more). Because blocks are contiguous and
  taken in rank order, concatenating the ranks' results (what :func:`all_gather_records` returns)
  restores the global order exactly.
- :func:`all_gather_records` sends arbitrary JSON records from every rank to every rank: each
  rank serialises its list to UTF-8 JSON, the lengths are all-gathered, the byte buffers are
  padded to the longest and all-gathered as ``uint8`` arrays, then decoded in rank order.
  :func:`broadcast_object` is the same with only the root contributing; :func:`run_on_main` runs a
  function on rank 0 (saving, probing, fusing) while the other ranks wait, and re-raises rank 0's
  error on every rank instead of leaving them waiting.
- :func:`average_gradients` is ``mlx.nn.utils.average_gradients`` (the one mlx-lm's trainer uses:
  concatenate small arrays into ~32 MB buffers, one ``all_sum`` each, divide by the size) on our
  group, evaluated inside the failure guard. :func:`sum_gradients` / :func:`all_sum` /
  :func:`sum_floats` are the plain sums, for losses normalised by a global count (RL: each rank
  trains on its block of the batch with the loss divided by the *global* aggregation units, so the
  summed gradients are the full batch's).
- :func:`iter_sharded_groups` is sharded generation (rollouts, eval, probes, RL sampling): the
  (task, sample) pairs are cut into rounds, each rank generates its contiguous block, the records
  are gathered and handed to every rank in global order. Every sample's PRNG stream depends only
  on (seed, task id, sample index) (:mod:`mlx_ssp.sampling`), so the records equal one process's.
- :func:`check_same` stops ranks that would otherwise diverge (e.g. resuming from different
  checkpoints because the run directory is not shared between hosts).

Failure handling (measured with mlx 0.32.4, ring backend, two local ranks)
- A peer whose process ends (crash, exception, SIGKILL) closes its sockets and a collective on the
  survivors fails at once with ``RuntimeError: [ring] connection to a peer was lost``. We turn that
  into :class:`DistributedError` (a :class:`UserError`: the CLI prints one line and exits 2) and arm
  a short exit deadline so a rank can never hang while unwinding.
- A peer that is alive but frozen (SIGSTOP, a hung machine, a cable pulled with no TCP reset) makes
  the survivors wait forever: every collective runs under a watchdog thread (``mx.eval`` releases
  the GIL while it blocks) which, after ``distributed.timeout_s`` seconds, prints which collective
  on which rank timed out and ends the process with exit status :data:`EXIT_TIMEOUT`.
- Collectives we do not wrap (mlx-lm's trainer) run inside :func:`watch`: a liveness deadline
  re-armed by :func:`heartbeat` (each training report) and by every successful wrapped collective.
- ``mx.distributed.init`` blocks forever while a peer never shows up, and does *not* release the
  GIL, so a thread cannot help: when the process was launched for several ranks, init runs under a
  small watchdog *process* that kills us with a clear message after ``distributed.init_timeout_s``.
- ``mlx.launch`` itself stops the other ranks (SIGTERM) when one exits non-zero, but it exits 0
  whatever its ranks did (mlx 0.32.4): read the ranks' messages, or check the stage's output file.
- ``mlx.launch -n 1`` exports an empty ``MLX_HOSTFILE`` that makes ``mx.distributed.init`` fail
  (mlx 0.32.4); :func:`world` treats it as the one-process run it is.

Deviations / limits: no elastic membership (a lost rank ends the run; restart it and the stages
resume from their last checkpoint); records are JSON (no arrays; use :func:`broadcast_tree`);
a legitimate wait longer than ``timeout_s`` (a straggler rank, rank 0 probing a checkpoint) is
indistinguishable from a frozen peer, so ``timeout_s`` must exceed the longest such wait.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Literal, Sequence, TypeVar

from pydantic import Field

import mlx_ssp  # noqa: F401  (OpenBLAS before mlx.core)
import mlx.core as mx

from mlx_ssp.config import StrictModel
from mlx_ssp.errors import UserError

T = TypeVar("T")

#: exit status of a rank stopped by the watchdog (BSD EX_TEMPFAIL: retrying may work)
EXIT_TIMEOUT = 75
#: seconds a rank may take to exit after it lost a peer before the watchdog ends it
EXIT_GRACE_S = 30.0
#: environment variables set by mlx.launch / mpirun for a multi-process run
_LAUNCH_ENV = (
    "MLX_HOSTFILE", "MLX_RANK", "MLX_WORLD_SIZE", "MLX_JACCL_COORDINATOR", "MLX_IBV_DEVICES",
    "OMPI_COMM_WORLD_SIZE", "PMI_SIZE",
)
_ENV_TIMEOUT = "MLX_SSP_DIST_TIMEOUT"
_ENV_INIT_TIMEOUT = "MLX_SSP_DIST_INIT_TIMEOUT"


class DistributedConfig(StrictModel):
    """The ``distributed:`` section of a run file (read by every data-parallel stage)."""

    backend: Literal["any", "ring", "mpi", "nccl", "jaccl"] = Field(
        "any", description="mx.distributed backend; 'any' takes the one mlx.launch set up"
    )
    timeout_s: float = Field(
        1800.0, gt=0, description="longest wait in one collective before a rank gives up (peer frozen)"
    )
    init_timeout_s: float = Field(
        300.0, gt=0, description="longest wait for all ranks to connect at start-up"
    )


class DistributedError(UserError):
    """A collective failed: a peer rank died, froze or failed. The run cannot continue on this
    group; restart it (stages resume from their last checkpoint)."""


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    group: Any  # mx.distributed.Group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


_lock = threading.Lock()
_config: DistributedConfig | None = None
_world: World | None = None


def _env_float(name: str) -> float | None:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    try:
        v = float(raw)
    except ValueError:
        raise UserError(f"environment variable {name} must be a number of seconds, got {raw!r}") from None
    if v <= 0:
        raise UserError(f"environment variable {name} must be > 0, got {raw!r}")
    return v


def configure(cfg: DistributedConfig | dict | None = None) -> DistributedConfig:
    """Set the timeouts/backend (environment variables ``MLX_SSP_DIST_TIMEOUT`` and
    ``MLX_SSP_DIST_INIT_TIMEOUT`` beat the config). Call before the first :func:`world`; every
    stage loads its config through :func:`mlx_ssp.stage_config.load_stage`, which calls this once."""
    global _config
    if cfg is None:
        cfg = DistributedConfig()
    elif isinstance(cfg, dict):
        from mlx_ssp.config import validate

        cfg = validate(DistributedConfig, cfg, prefix="distributed")
    updates = {}
    if (t := _env_float(_ENV_TIMEOUT)) is not None:
        updates["timeout_s"] = t
    if (t := _env_float(_ENV_INIT_TIMEOUT)) is not None:
        updates["init_timeout_s"] = t
    _config = cfg.model_copy(update=updates) if updates else cfg
    return _config


def settings() -> DistributedConfig:
    return _config if _config is not None else configure(None)


def launched() -> bool:
    """True when this process was started by a multi-process launcher (mlx.launch, mpirun)."""
    return any(os.environ.get(k) for k in _LAUNCH_ENV)


def world() -> World:
    """The global group, initialised on first call (size 1 when not launched)."""
    global _world
    if _world is not None:
        return _world
    with _lock:
        if _world is None:
            cfg = settings()
            _drop_empty_hostfile()
            if launched():
                group = _init_guarded(cfg.backend, cfg.init_timeout_s)
            else:
                group = mx.distributed.init(backend=cfg.backend)
            _world = World(rank=group.rank(), size=group.size(), group=group)
    return _world


def rank() -> int:
    return world().rank


def size() -> int:
    return world().size


def is_main() -> bool:
    return world().rank == 0


def _drop_empty_hostfile() -> None:
    # `mlx.launch -n 1` (ring) exports MLX_HOSTFILE pointing at an empty file, on which
    # mx.distributed.init fails with a JSON parse error (mlx 0.32.4): that is a one-process run.
    path = os.environ.get("MLX_HOSTFILE")
    if path:
        try:
            empty = not open(path).read().strip()
        except OSError:
            return  # let init report the missing file
        if empty:
            os.environ.pop("MLX_HOSTFILE")
            os.environ.pop("MLX_RANK", None)


_INIT_WATCHDOG = r"""
import os, select, signal, sys, time
pid, timeout, msg = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
ready, _, _ = select.select([sys.stdin], [], [], timeout)
if ready:
    sys.exit(0)
sys.stderr.write(msg + "\n"); sys.stderr.flush()
for sig in (signal.SIGTERM, signal.SIGKILL):
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        sys.exit(0)
    time.sleep(3)
"""


def _init_guarded(backend: str, timeout: float):
    # mx.distributed.init holds the GIL while it waits for peers: a thread could not fire, so a
    # tiny separate process (no mlx import) kills us if init has not returned in time.
    who = os.environ.get("MLX_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or "?"
    msg = (
        f"mlx_ssp distributed: rank {who}: the ranks did not all connect within {timeout:.0f}s "
        f"(distributed.init_timeout_s); a peer failed to start or is unreachable (check the hostfile, "
        f"the IPs and that the port range is free). Stopping this rank."
    )
    child = subprocess.Popen(
        [sys.executable, "-c", _INIT_WATCHDOG, str(os.getpid()), str(timeout), msg],
        stdin=subprocess.PIPE,
    )
    try:
        return mx.distributed.init(strict=backend != "any", backend=backend)
    except RuntimeError as e:
        raise DistributedError(f"rank {who}: could not initialise the '{backend}' backend: {e}") from None
    finally:
        try:
            child.stdin.write(b"ok\n")
            child.stdin.close()
        except OSError:
            pass
        child.wait()


# -- the watchdog ---------------------------------------------------------------------------------


class _Watchdog:
    """One daemon thread watching named deadlines (a collective's guard nests inside a stage's
    liveness watch); the first deadline to pass ends the process with its message."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._deadlines: dict[int, tuple[float, str]] = {}
        self._next = 0
        self._thread: threading.Thread | None = None

    def arm(self, what: str, timeout: float, token: int | None = None) -> int:
        """Set (or with ``token``, reset) a deadline ``timeout`` seconds from now."""
        with self._cv:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mlx_ssp-dist-watchdog", daemon=True)
                self._thread.start()
            if token is None:
                token, self._next = self._next, self._next + 1
            self._deadlines[token] = (time.monotonic() + timeout, what)
            self._cv.notify()
            return token

    def disarm(self, token: int) -> None:
        with self._cv:
            self._deadlines.pop(token, None)
            self._cv.notify()

    @contextmanager
    def guard(self, what: str, timeout: float) -> Iterator[int]:
        token = self.arm(what, timeout)
        try:
            yield token
        finally:
            self.disarm(token)

    def _run(self) -> None:
        with self._cv:
            while True:
                if not self._deadlines:
                    self._cv.wait()
                    continue
                deadline, what = min(self._deadlines.values())
                left = deadline - time.monotonic()
                if left > 0:
                    self._cv.wait(left)
                    continue
                _die(what)


def _die(message: str) -> None:
    try:
        sys.stderr.write(f"mlx_ssp distributed: {message}\n")
        sys.stderr.flush()
    finally:
        os._exit(EXIT_TIMEOUT)


_watchdog = _Watchdog()


@contextmanager
def collective(what: str, timeout: float | None = None) -> Iterator[World]:
    """Run the block (which must ``mx.eval`` its collectives) under the failure guard: a peer
    frozen for ``timeout`` seconds ends this process with :data:`EXIT_TIMEOUT`; a lost peer
    becomes :class:`DistributedError`."""
    w = world()
    if w.size == 1:
        yield w
        return
    t = settings().timeout_s if timeout is None else timeout
    where = f"rank {w.rank}/{w.size}: {what}"
    msg = (
        f"{where} waited {t:.0f}s for the other ranks (distributed.timeout_s); a peer rank is dead, "
        f"frozen or unreachable. Stopping this rank (exit {EXIT_TIMEOUT}); restart the run to resume "
        f"from the last checkpoint."
    )
    try:
        with _watchdog.guard(msg, t):
            yield w
        _touch_watches()  # every rank got here: the peers are alive
    except RuntimeError as e:
        # the group is broken: never let this rank linger while it unwinds
        _arm_exit_grace(where)
        raise DistributedError(
            f"{where} failed: {e}. Another rank died or failed (see its messages above); "
            f"restart the run to resume from the last checkpoint."
        ) from None


def _arm_exit_grace(where: str) -> None:
    # the group is broken: never let this rank linger while it unwinds
    _watchdog.arm(f"{where}: did not exit within {EXIT_GRACE_S:.0f}s after losing a peer", EXIT_GRACE_S)


_PEER_ERRORS = ("[ring]", "[mpi]", "[nccl]", "[jaccl]", "peer", "connection")


@contextmanager
def watch(what: str, timeout: float | None = None) -> Iterator[Callable[[], None]]:
    """Liveness guard around code that runs collectives we do not wrap ourselves (mlx-lm's
    trainer): yields ``heartbeat()``; if it is not called for ``timeout`` seconds (default
    ``distributed.timeout_s``) the rank stops with a clear message, and a lost peer inside the
    block becomes :class:`DistributedError`. One process: a no-op."""
    w = world()
    if w.size == 1:
        yield lambda: None
        return
    t = settings().timeout_s if timeout is None else timeout
    where = f"rank {w.rank}/{w.size}: {what}"
    msg = (
        f"{where} made no progress for {t:.0f}s (distributed.timeout_s); a peer rank is dead, frozen or "
        f"unreachable. Stopping this rank (exit {EXIT_TIMEOUT}); restart the run to resume from the last checkpoint."
    )
    token = _watchdog.arm(msg, t)
    _watches[token] = (msg, t)
    try:
        yield lambda: _watchdog.arm(msg, t, token)
    except RuntimeError as e:
        if not any(k in str(e) for k in _PEER_ERRORS):
            raise
        _arm_exit_grace(where)
        raise DistributedError(
            f"{where} failed: {e}. Another rank died or failed (see its messages above); "
            f"restart the run to resume from the last checkpoint."
        ) from None
    finally:
        _watches.pop(token, None)
        _watchdog.disarm(token)


_watches: dict[int, tuple[str, float]] = {}


def _touch_watches() -> None:
    for token, (msg, t) in list(_watches.items()):
        _watchdog.arm(msg, t, token)


def heartbeat() -> None:
    """Progress was made (e.g. a training report): re-arm every active :func:`watch`."""
    _touch_watches()


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
        import numpy as np

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
    from mlx.nn.utils import average_gradients as _avg

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
    from mlx.nn.utils import average_gradients as _avg
    from mlx.utils import tree_map

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
    from mlx.utils import tree_map

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
        from mlx_ssp.io import JsonlAppender

        return JsonlAppender(path)
    return NullAppender()


def output_lock(out, what: str | None = None) -> Any:
    """:func:`mlx_ssp.io.output_lock` on rank 0 (which writes the outputs), nothing elsewhere: the
    ranks of one launch are one job, a second job on the same output fails at once."""
    import contextlib

    from mlx_ssp.io import output_lock as lock

    return lock(out, what) if is_main() else contextlib.nullcontext()


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


# -- `python -m mlx_ssp.distributed`: check a cluster before a long run -------------------------------


def check(mb: float = 10.0, reps: int = 5) -> dict:
    """Every rank reports its host; an all_sum is checked for correctness and timed."""
    import platform

    w = world()
    hosts = gather_per_rank({"rank": w.rank, "host": platform.node(), "device": str(mx.default_device())},
                            what="check: gather hosts")
    x = mx.full((max(1, int(mb * 1e6 / 4)),), float(w.rank + 1))
    expect = w.size * (w.size + 1) / 2
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        y = all_sum(x, what="check: all_sum")
        times.append(time.perf_counter() - t)
    ok = bool(mx.all(y == expect).item())
    best = min(times)
    return {"size": w.size, "hosts": hosts, "all_sum_ok": ok, "all_sum_mb": x.nbytes / 1e6,
            "all_sum_ms": round(best * 1000, 2), "algbw_gb_s": round(x.nbytes / best / 1e9, 3) if w.size > 1 else None}


if __name__ == "__main__":  # pragma: no cover (exercised by the tests through mlx.launch)
    try:
        report = check()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if is_main():
        for h in report["hosts"]:
            print(f"rank {h['rank']}: {h['host']} ({h['device']})")
        print(f"{report['size']} rank(s); all_sum of {report['all_sum_mb']:.0f} MB: "
              f"{'correct' if report['all_sum_ok'] else 'WRONG'}, {report['all_sum_ms']} ms"
              + (f" ({report['algbw_gb_s']} GB/s)" if report["algbw_gb_s"] else ""))
    sys.exit(0 if report["all_sum_ok"] else 1)
