"""A count of work: the steps of the scans whose length a model's text controls.

A policy under RL writes whatever makes its verifier slow, so every verifier bounds its work (see
each module); select's strategy features scan every trace too. Those scans charge what they do here (a regex pass or ``str.find`` the characters it
covers, a loop its iterations), so that a test can bound the work itself: a bound on the time
depends on the machine's load. Nothing is counted unless a caller asks (one context-variable read
per charge)::

    with counted() as work:
        extract(text)
    assert work.steps <= 8 * len(text)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass
class Work:
    steps: int = 0


_current: ContextVar[Work | None] = ContextVar("mlx_ssp_verify_work", default=None)


@contextlib.contextmanager
def counted() -> Iterator[Work]:
    """Count the verifier work done in this context (this thread, or this task)."""
    work = Work()
    token = _current.set(work)
    try:
        yield work
    finally:
        _current.reset(token)


def charge(steps: int) -> None:
    work = _current.get()
    if work is not None:
        work.steps += steps


def find(text: str, sub: str, start: int = 0, end: int | None = None) -> int:
    """``text.find(sub, start, end)``, charging the characters it passed over."""
    i = text.find(sub, start, end)
    stop = len(text) if end is None else min(end, len(text))
    charge((i + len(sub) if i >= 0 else stop) - start)
    return i
