"""Verifiers: the reward. A registry of name -> ``fn(completion, task) -> VerifyResult``.

A verifier never raises on model output: malformed output is reward 0 with a reason. A bad
task (unknown verifier, missing answer) is caught by :func:`check_task` before generation.
Verifier modules register themselves with :func:`register`; importing this package imports
them all.
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


def register(name: str, check: Callable[["Task"], None] | None = None):
    """Decorator: add a verifier to the registry (``check`` validates tasks up front)."""

    def deco(fn: Verifier) -> Verifier:
        VERIFIERS[name] = fn
        if check is not None:
            TASK_CHECKS[name] = check
        return fn

    return deco


def get_verifier(name: str) -> Verifier:
    try:
        return VERIFIERS[name]
    except KeyError:
        raise UserError(f"unknown verifier '{name}'; valid: {', '.join(sorted(VERIFIERS))}") from None


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


# Verifier modules that register themselves on import. A module that is missing in this version
# (or whose optional dependency is not installed) is skipped, so the registry holds what works.
_MODULES = ("mlx_ssp.verify.math", "mlx_ssp.verify.rgym", "mlx_ssp.verify.code", "mlx_ssp.verify.toolcall")
for _m in _MODULES:
    try:
        importlib.import_module(_m)
    except ImportError:
        pass
