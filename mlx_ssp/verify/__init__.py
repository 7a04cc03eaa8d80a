"""Verifiers: the reward. A registry of name -> ``fn(completion, task) -> VerifyResult``.

A verifier never raises on model output: malformed output is reward 0 with a reason. A bad
task (unknown verifier, missing answer) is caught by :func:`check_task` before generation.
Verifier modules register themselves with :func:`register`; importing this package imports
them all (``math``, ``reasoning_gym``, ``code``, ``toolcall``; a verifier whose optional third-party
package is missing is listed in ``UNAVAILABLE`` with the reason). :func:`verify_many` scores a batch,
running verifiers marked ``parallel`` (the code sandbox) on worker threads. See docs/tasks.md.
"""

from __future__ import annotations

import importlib
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


def verify(completion: str, task: "Task") -> VerifyResult:
    """Score one completion; any exception inside a verifier becomes reward 0, never a crash."""
    fn = get_verifier(task.verifier)
    try:
        res = fn(completion, task)
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
    items: "list[tuple[str, Task]]", workers: int = 1, progress: Callable[[int], None] | None = None
) -> list[VerifyResult]:
    """Score many ``(completion, task)`` pairs, in order. Verifiers registered with ``parallel=True``
    (the code sandbox) run on ``workers`` threads; the rest run here in the calling thread.
    ``progress(n)`` is called as results arrive."""
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
                if progress:
                    progress(1)
        if futures:
            from concurrent.futures import as_completed

            for fut in as_completed(futures):
                results[futures[fut]] = fut.result()
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
}
for _name, (_m, _pip) in _MODULES.items():
    try:
        importlib.import_module(_m)
    except ModuleNotFoundError as _e:
        if not _e.name or _e.name == "mlx_ssp" or _e.name.startswith("mlx_ssp."):
            raise
        UNAVAILABLE[_name] = f"it needs the Python package '{_e.name}'" + (f" (pip install {_pip})" if _pip else "")
