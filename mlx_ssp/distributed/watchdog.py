"""The failure guards of collectives: a watchdog thread per wrapped collective (:func:`collective`), a
liveness deadline around collectives we do not wrap (:func:`watch`, :func:`heartbeat`), and the short
exit deadline armed when a peer is lost."""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import mlx_ssp  # noqa: F401  (OpenBLAS before mlx.core)
from mlx_ssp.distributed.world import EXIT_GRACE_S, EXIT_TIMEOUT, DistributedError, World, settings, world

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

