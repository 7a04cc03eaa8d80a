"""File IO that loses nothing: atomic writes, crash-safe JSONL appends, line-numbered read errors."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator

from mlx_ssp.errors import UserError


@contextmanager
def atomic_path(path: str | Path, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it into place only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix + ".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.replace(tmp_path, path)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json_atomic(path: str | Path, obj: Any, indent: int = 2) -> None:
    write_text_atomic(path, json.dumps(obj, indent=indent, ensure_ascii=False) + "\n")


def write_jsonl_atomic(path: str | Path, records: Iterable[dict]) -> None:
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


@contextmanager
def atomic_dir(path: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Build a directory in a temporary sibling and rename it into place at the end.

    A killed job leaves only a ``.NAME.tmp-*`` sibling, never a half-written ``path``. An existing
    ``path`` is refused unless ``overwrite``."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise UserError(f"{path} already exists; pass --overwrite to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        yield tmp
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class JsonlAppender:
    """Append JSON records one line at a time, flushed and fsynced, so a crash loses at most the
    record being written. On open, a torn last line (no trailing newline) is truncated away.

    ``background=True`` hands each ``write_many`` to one writer thread (serialise, write, fsync),
    so that a producer such as the rollout loop does not wait on the disk; records keep their
    order, ``close()`` waits for all of them, and a write error is raised by the next
    ``write_many`` or by ``close()``. A crash then loses at most the records still queued."""

    def __init__(self, path: str | Path, fsync: bool = True, background: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        repair_jsonl_tail(self.path)
        self._f = open(self.path, "a")
        self._fsync = fsync
        self._queue = None
        self._error: BaseException | None = None
        if background:
            import queue
            import threading

            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._drain, name="jsonl-writer", daemon=True)
            self._thread.start()

    def write(self, record: dict) -> None:
        self.write_many([record])

    def write_many(self, records: Iterable[dict]) -> None:
        if self._queue is None:
            self._write(records)
            return
        self._raise_error()
        self._queue.put(list(records))

    def _write(self, records: Iterable[dict]) -> None:
        data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        if not data:
            return
        self._f.write(data)
        self._f.flush()
        if self._fsync:
            os.fsync(self._f.fileno())

    def _drain(self) -> None:
        while (records := self._queue.get()) is not None:
            if self._error is None:  # after a failure, keep consuming so that nobody blocks
                try:
                    self._write(records)
                except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                    self._error = e

    def _raise_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise OSError(f"writing {self.path} failed: {err}") from err

    def close(self) -> None:
        if self._queue is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._f.close()
        self._raise_error()

    def __enter__(self) -> "JsonlAppender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def repair_jsonl_tail(path: Path) -> int:
    """Drop a trailing partial line (from a crash mid-write). Returns bytes removed."""
    if not path.exists() or path.stat().st_size == 0:
        return 0
    with open(path, "rb+") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - 1))
        if f.read(1) == b"\n":
            return 0
        # find the last newline
        pos = size - 1
        chunk = 4096
        while pos > 0:
            start = max(0, pos - chunk)
            f.seek(start)
            buf = f.read(pos - start)
            i = buf.rfind(b"\n")
            if i >= 0:
                cut = start + i + 1
                f.truncate(cut)
                return size - cut
            pos = start
        f.truncate(0)
        return size


def read_jsonl(path: str | Path, *, what: str = "records") -> list[dict]:
    """All records of a JSONL file; a bad line is a UserError with the file and line number."""
    return list(iter_jsonl(path, what=what))


def iter_jsonl(path: str | Path, *, what: str = "records") -> Iterator[dict]:
    for _, rec in iter_jsonl_numbered(path, what=what):
        yield rec


def iter_jsonl_numbered(path: str | Path, *, what: str = "records") -> Iterator[tuple[int, dict]]:
    """(line number, record) for each non-blank line of a JSONL file (``.gz`` too); a missing file,
    bad JSON or a non-object line is a UserError naming file:line."""
    import gzip

    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"{what} file not found: {p}")
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{p}:{lineno}: not valid JSON ({e.msg}, column {e.colno})") from None
            if not isinstance(rec, dict):
                raise UserError(f"{p}:{lineno}: expected a JSON object, got {type(rec).__name__}")
            yield lineno, rec
