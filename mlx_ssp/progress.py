"""Progress display for every stage, in one place: a tqdm bar on a terminal, plain lines in a log.

:func:`bar` is what every stage calls. On a terminal it is a tqdm bar (redrawn in place); when the
stream is a file or a pipe it prints one plain line at every tenth of the work and when it closes
(no carriage returns, no colour codes); when progress is off it prints nothing. Progress is off
when the caller asks (``enabled=False``: a stage's ``progress`` setting) or inside
:func:`turned_off`, which ``--no-progress`` enters for the whole command, so one flag silences
every stage's bars. :func:`mlx_lm_train_ui` puts the same bar in place of mlx-lm's training
display (rich, with colour codes forced even into files) while an SFT or pretraining run trains.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Iterator, Optional, TextIO

_off = 0  # how many turned_off() contexts are open: a count, so nested ones undo correctly

#: plain lines are printed each time the work crosses another 1/STEPS of the total
STEPS = 10


@contextmanager
def turned_off() -> Iterator[None]:
    """No progress display from any stage while inside."""
    global _off
    _off += 1
    try:
        yield
    finally:
        _off -= 1


def is_on(enabled: bool = True) -> bool:
    return enabled and not _off


def is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class Silent:
    """A bar that shows nothing (progress off)."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, **kw) -> None:
        pass

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass


class Lines(Silent):
    """A bar for logs: ``desc: n/total unit (p%) [elapsed] postfix``, one line per tenth of the
    total and one at close (unless the last line already said it)."""

    def __init__(self, total: Optional[int], desc: str, unit: str, initial: int, stream: TextIO):
        self.total, self.desc, self.unit, self.n, self.stream = total, desc, unit, initial, stream
        self.postfix = ""
        self.t0 = time.perf_counter()
        self.shown_step, self.shown_n, self.closed = self._step(), None, False

    def _step(self) -> int:
        return self.n * STEPS // self.total if self.total else 0

    def _line(self) -> None:
        from tqdm import tqdm

        pct = f" ({100 * self.n // self.total}%)" if self.total else ""
        of = f"/{self.total}" if self.total else ""
        tail = f" {self.postfix}" if self.postfix else ""
        elapsed = tqdm.format_interval(time.perf_counter() - self.t0)
        print(f"{self.desc}: {self.n}{of} {self.unit}{pct} [{elapsed}]{tail}", file=self.stream, flush=True)
        self.shown_n = self.n

    def update(self, n: int = 1) -> None:
        self.n += n
        step = self._step()
        if step > self.shown_step:
            self.shown_step = step
            self._line()

    def set_postfix(self, **kw) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in kw.items())

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s

    def close(self) -> None:
        if not self.closed and self.shown_n != self.n:
            self._line()
        self.closed = True


def bar(total: Optional[int], *, desc: str, unit: str = "it", initial: int = 0, enabled: bool = True,
        stream: Optional[TextIO] = None):
    """A progress bar on ``stream`` (default stderr) with tqdm's ``update``, ``set_postfix``,
    ``set_postfix_str`` and ``close``: tqdm on a terminal, :class:`Lines` elsewhere, :class:`Silent`
    when off."""
    if not is_on(enabled):
        return Silent()
    stream = stream if stream is not None else sys.stderr
    if is_terminal(stream):
        from tqdm import tqdm

        return tqdm(total=total, initial=initial, desc=desc, unit=unit, file=stream, dynamic_ncols=True)
    return Lines(total, desc, unit, initial, stream)


def _train_ui(desc: str, enabled: bool):
    """A stand-in for ``mlx_lm.tuner.trainer.TrainUI`` (same methods) that draws :func:`bar`."""

    class TrainUI:
        def __init__(self, total_iters: int, rank: int = 0):
            self.bar = bar(total_iters, desc=desc, unit="step", enabled=enabled and rank == 0)

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> bool:
            self.bar.close()
            return False

        def advance(self) -> None:
            self.bar.update(1)

        def report_train(self, it, train_loss, tokens_sec, trained_tokens) -> None:
            self.bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{tokens_sec:.0f}")

        @contextmanager
        def val_task(self, total: int):
            yield lambda: None

        def report_val(self, it, val_loss, val_time) -> None:
            self.bar.set_postfix(val_loss=f"{val_loss:.3f}")

        def report_save(self, checkpoint) -> None:
            pass

    return TrainUI


@contextmanager
def mlx_lm_train_ui(desc: str, *, enabled: bool = True) -> Iterator[None]:
    """While inside, ``mlx_lm.tuner.trainer.train`` shows :func:`bar` (labelled ``desc``) instead of
    its own display. An mlx-lm without ``TrainUI`` keeps whatever it prints."""
    from mlx_lm.tuner import trainer

    old = getattr(trainer, "TrainUI", None)
    if old is None:
        yield
        return
    trainer.TrainUI = _train_ui(desc, enabled)
    try:
        yield
    finally:
        trainer.TrainUI = old
