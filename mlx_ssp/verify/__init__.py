"""Verifiers: the reward. A registry of name -> ``fn(completion, task) -> VerifyResult``.

A verifier never raises on model output: malformed output is reward 0 with a reason. A bad
task (unknown verifier, missing answer) is caught by :func:`check_task` before generation.
Verifier modules register themselves with :func:`register`; importing this package imports
them all (``math``, ``reasoning_gym``, ``code``, ``toolcall``, ``bfcl_multi_turn``, ``episode``, ``instruct``; a verifier whose optional third-party
package is missing is listed in ``UNAVAILABLE`` with the reason). :func:`verify_many` scores a batch,
running verifiers marked ``parallel`` (the code sandbox) on worker threads. See docs/tasks.md.

Every verifier bounds its own work (linear-time extraction, capped scan lengths; see each module).
As the last resort, :func:`verify` gives each in-process verifier call a time limit
(:data:`ITEM_TIME_LIMIT_S`) in whatever thread it runs: a watchdog thread raises
:class:`VerifierTimeout` in the verifying thread (``PyThreadState_SetAsyncExc``), which scores 0 with
reason ``verifier_timeout``. No signals are used, so it works off the main thread and does not
disturb math-verify's own ``signal.alarm`` there. Like a signal, it interrupts Python code only: one
long call into C (a huge integer power, a regex) ends first. Verifiers registered ``parallel`` (the
code sandbox) are not wrapped: they wait on a sandboxed process that has its own wall-time limit.
"""

from __future__ import annotations

import ctypes
import importlib
import itertools
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from mlx_ssp.errors import UserError

if TYPE_CHECKING:
    from mlx_ssp.tasks import Task


@dataclass(frozen=True)
class VerifyResult:
    reward: float  # in [0, 1]
    reason: str  # short machine-countable tag, e.g. "correct", "wrong_answer", "no_answer"
    detail: str = ""  # free text for humans (extracted answer, error message)
    #: verifier-specific fields a record gains beside reward/reason/detail (an episode's per-turn verdicts)
    extra: dict | None = None

    @property
    def correct(self) -> bool:
        return self.reward >= 0.999


Verifier = Callable[[str, "Task"], VerifyResult]

VERIFIERS: dict[str, Verifier] = {}
#: name -> fn(task) raising ValueError when the task lacks what the verifier needs.
TASK_CHECKS: dict[str, Callable[["Task"], None]] = {}


#: Verifiers that may run concurrently in worker threads (they wait on subprocesses, e.g. ``code``).
#: Others run in the calling thread (math-verify's timeouts need the main thread).
PARALLEL: set[str] = set()
#: name -> why a known verifier is unavailable in this environment (a missing optional package).
UNAVAILABLE: dict[str, str] = {}


def register(name: str, check: Callable[["Task"], None] | None = None, parallel: bool = False):
    """Decorator: add a verifier to the registry (``check`` validates tasks up front; ``parallel``
    marks a verifier that :func:`verify_many` may run in worker threads)."""

    def deco(fn: Verifier) -> Verifier:
        VERIFIERS[name] = fn
        if check is not None:
            TASK_CHECKS[name] = check
        if parallel:
            PARALLEL.add(name)
        return fn

    return deco


def unknown_verifier_message(name: str) -> str:
    """Why ``name`` cannot be used: a missing optional package, or not a verifier at all."""
    if name in UNAVAILABLE:
        return f"verifier '{name}' is unavailable here: {UNAVAILABLE[name]}"
    return f"unknown verifier '{name}'; valid: {', '.join(sorted(VERIFIERS))}"


def get_verifier(name: str) -> Verifier:
    try:
        return VERIFIERS[name]
    except KeyError:
        raise UserError(unknown_verifier_message(name)) from None


def check_task(task: "Task") -> None:
    check = TASK_CHECKS.get(task.verifier)
    if check is None:
        return
    try:
        check(task)
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"task '{task.id}' is not valid for verifier '{task.verifier}': {e}") from None


#: Seconds one in-process verifier call may take before it scores 0 (``verifier_timeout``). Ordinary
#: verifications take milliseconds; math-verify's own timeouts (main thread only) are 5 s per step.
ITEM_TIME_LIMIT_S = 10.0
_WATCH_POLL_S = 0.05


class VerifierTimeout(BaseException):
    """Raised inside a verifier that ran past its time limit. A BaseException, so that a scorer's
    ``except Exception`` cannot swallow it."""


class _Watchdog:
    """One daemon thread that polls the armed slots and raises :class:`VerifierTimeout` in the
    thread of any slot past its deadline. Arming and disarming are a dict store and a dict pop
    (atomic under the GIL): whichever of the target and the watchdog pops a slot owns it, so the
    exception is raised only while the target has not disarmed, and a target that finds its slot
    taken waits until the exception is scheduled and then cancels it if it was not delivered."""

    def __init__(self) -> None:
        self.active: dict[int, tuple[int, float]] = {}  # key -> (thread id, deadline)
        self.fired: dict[int, int] = {}  # key -> thread id, once its exception is scheduled
        self.seq = itertools.count()
        self.thread: threading.Thread | None = None
        self.start_lock = threading.Lock()

    def arm(self, seconds: float) -> int:
        if self.thread is None:
            self._start()
        key = next(self.seq)
        self.active[key] = (threading.get_ident(), time.monotonic() + seconds)
        return key

    def disarm(self, key: int) -> None:
        """Stop watching; raises VerifierTimeout if the watchdog fired for this slot."""
        if self.active.pop(key, None) is not None:
            return
        while key not in self.fired:  # the watchdog owns it: wait until it has scheduled the exception
            time.sleep(0.001)
        _set_async_exc(self.fired.pop(key), None)  # cancel it if still pending (no-op if already raised)
        raise VerifierTimeout

    def _start(self) -> None:
        with self.start_lock:
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="verify-watchdog", daemon=True)
                self.thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(_WATCH_POLL_S)
            now = time.monotonic()
            for key, (tid, deadline) in list(self.active.items()):
                if deadline <= now and self.active.pop(key, None) is not None:
                    _set_async_exc(tid, VerifierTimeout)
                    self.fired[key] = tid


def _set_async_exc(tid: int, exc: type | None) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(tid), ctypes.py_object(exc) if exc is not None else ctypes.c_void_p(0)
    )


_WATCHDOG = _Watchdog()


def _fresh_watchdog() -> None:  # the watchdog thread does not survive a fork
    global _WATCHDOG
    _WATCHDOG = _Watchdog()


os.register_at_fork(after_in_child=_fresh_watchdog)


def verify(completion: str, task: "Task", time_limit: float | None = ITEM_TIME_LIMIT_S) -> VerifyResult:
    """Score one completion; any exception inside a verifier becomes reward 0, never a crash. An
    in-process verifier that runs past ``time_limit`` seconds (None: no limit) scores 0 with reason
    ``verifier_timeout``."""
    fn = get_verifier(task.verifier)
    try:
        if time_limit is not None and task.verifier not in PARALLEL:
            watchdog = _WATCHDOG
            key = watchdog.arm(time_limit)
            try:
                res = fn(completion, task)
            finally:
                watchdog.disarm(key)
        else:
            res = fn(completion, task)
    except VerifierTimeout:
        return VerifyResult(0.0, "verifier_timeout", f"no verdict within {time_limit:g} s")
    except Exception as e:  # a verifier bug must not kill a training run
        return VerifyResult(0.0, "verifier_error", f"{type(e).__name__}: {e}")
    r = float(res.reward)
    if not (0.0 <= r <= 1.0) or r != r:
        return VerifyResult(0.0, "verifier_error", f"reward {r} outside [0, 1]")
    return res


def _require_answer(task: "Task") -> None:
    if task.answer is None or (isinstance(task.answer, str) and not task.answer.strip()):
        raise ValueError("missing 'answer'")


@register("exact", check=_require_answer)
def exact_match(completion: str, task: "Task") -> VerifyResult:
    """The text after the last ``Answer:`` (or the whole completion) equals the answer, stripped."""
    text = completion.rsplit("Answer:", 1)[-1].strip() if "Answer:" in completion else completion.strip()
    ok = text == str(task.answer).strip()
    return VerifyResult(1.0 if ok else 0.0, "correct" if ok else "wrong_answer", text[:200])


def verify_many(
    items: "list[tuple[str, Task]]", workers: int = 1, progress: Callable[[int], None] | None = None,
    on_result: Callable[[int, VerifyResult], None] | None = None,
) -> list[VerifyResult]:
    """Score many ``(completion, task)`` pairs, in order. Verifiers registered with ``parallel=True``
    (the code sandbox) run on ``workers`` threads; the rest run here in the calling thread.
    ``progress(n)`` is called as results arrive, and ``on_result(index, result)`` with each one, in
    the calling thread (``mlx_ssp verify`` saves each there, so that a kill loses none)."""
    results: list[VerifyResult | None] = [None] * len(items)
    par = [i for i, (_, t) in enumerate(items) if t.verifier in PARALLEL] if workers > 1 else []
    pool = None
    futures = {}
    if par:
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="verify")
        futures = {pool.submit(verify, items[i][0], items[i][1]): i for i in par}
    try:
        in_pool = set(par)
        for i, (completion, task) in enumerate(items):
            if i not in in_pool:
                results[i] = verify(completion, task)
                if on_result:
                    on_result(i, results[i])
                if progress:
                    progress(1)
        if futures:
            from concurrent.futures import as_completed

            for fut in as_completed(futures):
                i = futures[fut]
                results[i] = fut.result()
                if on_result:
                    on_result(i, results[i])
                if progress:
                    progress(1)
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    return results  # type: ignore[return-value]


# Verifier modules that register themselves on import. Only a missing *third-party* package may be
# skipped (the verifier is then listed in UNAVAILABLE with the reason, shown when a task names it);
# any other error in our own module is a bug and propagates.
_MODULES = {
    "math": ("mlx_ssp.verify.math", "math-verify"),
    "reasoning_gym": ("mlx_ssp.verify.rgym", "reasoning-gym"),
    "code": ("mlx_ssp.verify.code", None),
    "toolcall": ("mlx_ssp.verify.toolcall", None),
    "bfcl_multi_turn": ("mlx_ssp.agents.score", None),
    "episode": ("mlx_ssp.agents.score", None),
    "instruct": ("mlx_ssp.verify.instruct", None),
    "testbed": ("mlx_ssp.testbed.source", None),
}
for _name, (_m, _pip) in _MODULES.items():
    try:
        importlib.import_module(_m)
    except ModuleNotFoundError as _e:
        if not _e.name or _e.name == "mlx_ssp" or _e.name.startswith("mlx_ssp."):
            raise
        UNAVAILABLE[_name] = f"it needs the Python package '{_e.name}'" + (f" (pip install {_pip})" if _pip else "")
