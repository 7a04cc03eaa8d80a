"""File IO that loses nothing: atomic writes, crash-safe JSONL appends, line-numbered read errors.

Atomic writes build the output in a temporary sibling named ``.NAME.tmp-PID@HOST.*`` and rename it
into place; the next atomic write of the same target removes the siblings whose creator (that pid
on this host) is dead, so a killed job leaves nothing behind for long. Outputs get the permissions
a plain write would give them (0666/0777 less the umask; an overwritten file keeps its mode), not
the private modes of ``mkstemp``/``mkdtemp``. :func:`exclusive_lock` keeps two runs from writing
one output at once; :func:`output_lock` is that lock for an output file or directory (the lock file
``.NAME.lock`` beside it), which every stage command holds on what it writes.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import stat
import sys
import tempfile
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Iterable, Iterator

from mlx_ssp.errors import UserError

log = logging.getLogger(__name__)

#: this host's name as it appears in temporary names (only our own host's pids can be checked)
_HOST = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname()) or "host"


def cache_dir() -> Path:
    """Where converted and downloaded models live: $MLX_SSP_CACHE, else $XDG_CACHE_HOME/mlx_ssp."""
    env = os.environ.get("MLX_SSP_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mlx_ssp"


def current_umask() -> int:
    """The process umask. Read from /proc where possible: ``os.umask`` can only read it by setting
    it, and a file another thread creates in between would get the temporary value."""
    with suppress(OSError, ValueError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    old = os.umask(0o022)
    os.umask(old)
    return old


def plain_file_mode(path: Path) -> int:
    """The mode ``open(path, "w")`` would leave: the existing file's, else 0666 less the umask."""
    with suppress(OSError):
        st = path.stat()
        if stat.S_ISREG(st.st_mode):
            return stat.S_IMODE(st.st_mode)
    return 0o666 & ~current_umask()


def pid_alive(pid: int) -> bool:
    """Whether a process of this host has ``pid`` (another user's counts as alive)."""
    if pid <= 0:
        return True  # not a pid we can check: keep its files
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, another user's
        return True
    return True


def _tmp_tag() -> str:
    return f"{os.getpid()}@{_HOST}"


def clean_stale_temps(path: Path) -> list[Path]:
    """Remove the temporary siblings of ``path`` (``.NAME.tmp-PID@HOST.*``, and ``.NAME.old-PID@HOST``
    once ``path`` exists again) left by processes of this host that are no longer alive. Returns
    what was removed. Siblings of other hosts, of live processes or without a pid are kept."""
    pat = re.compile(rf"\.{re.escape(path.name)}\.(tmp|old)-(\d+)@{re.escape(_HOST)}(?:\.|$)")
    try:
        entries = list(os.scandir(path.parent))
    except OSError:
        return []
    removed = []
    for e in entries:
        m = pat.match(e.name)
        if m is None or pid_alive(int(m.group(2))):
            continue
        if m.group(1) == "old" and not path.exists():
            continue  # killed between the two renames: this is the only copy of the previous output
        if e.is_dir(follow_symlinks=False):
            shutil.rmtree(e.path, ignore_errors=True)
        else:
            with suppress(FileNotFoundError):
                os.unlink(e.path)
        removed.append(Path(e.path))
    if removed:
        log.info("removed %d stale temporary sibling(s) of %s left by killed runs", len(removed), path)
    return removed


#: kernel interfaces, not storage: an output there is refused (``/dev/shm`` is a tmpfs for files)
_SPECIAL_ROOTS = ("/proc", "/sys", "/dev")
_FILE_ROOTS = ("/dev/shm",)


def check_output_path(path: str | Path, what: str = "output", *, kind: str | None = "file") -> Path:
    """``path`` if it may be written as an output; else a UserError naming ``what``: a path (after
    symlinks) inside /proc, /sys or /dev, or an existing entry that is not a ``kind`` (``"file"``,
    ``"dir"``; None: either) such as a device, pipe or socket."""
    p = Path(path).expanduser()
    real = os.path.realpath(p)
    for root in _SPECIAL_ROOTS:
        inside = real == root or real.startswith(root + "/")
        if inside and not any(real == r or real.startswith(r + "/") for r in _FILE_ROOTS):
            raise UserError(f"{what} {p} is in {root}, a special filesystem, not a place for outputs; choose another path")
    try:
        mode = os.stat(real).st_mode
    except FileNotFoundError:
        return p
    except OSError as e:
        raise UserError(f"{what} {p}: cannot use it ({e.strerror})") from None
    is_file, is_dir = stat.S_ISREG(mode), stat.S_ISDIR(mode)
    if (kind == "file" and not is_file) or (kind == "dir" and not is_dir) or not (is_file or is_dir):
        found = "a directory" if is_dir else "a regular file" if is_file else "a device, pipe or socket"
        want = {"file": "a regular file", "dir": "a directory"}.get(kind, "a regular file or directory")
        raise UserError(f"{what} {p} is {found}, not {want}; choose another path")
    return p


@contextmanager
def atomic_path(path: str | Path, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it into place only if the block succeeds."""
    path = check_output_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_temps(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-{_tmp_tag()}.", suffix=suffix + ".tmp", dir=path.parent)
    try:
        os.fchmod(fd, plain_file_mode(path))  # mkstemp makes it 0600
    finally:
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

    A killed job leaves only a ``.NAME.tmp-PID@HOST.*`` sibling, never a half-written ``path``, and
    the next ``atomic_dir`` of the same ``path`` removes it. An existing ``path`` is refused unless
    ``overwrite``."""
    path = check_output_path(path, kind="dir")
    if path.exists() and not overwrite:
        raise UserError(f"{path} already exists; pass --overwrite to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_temps(path)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-{_tmp_tag()}.", dir=path.parent))
    try:
        tmp.chmod(0o777 & ~current_umask())  # mkdtemp makes it 0700; a plain mkdir would not
        yield tmp
        if path.exists():
            old = path.with_name(f".{path.name}.old-{_tmp_tag()}")
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
        self.path = check_output_path(path)
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
            if isinstance(err, OSError) and err.errno is not None:  # keep the errno (disk full, ...)
                raise OSError(err.errno, f"writing {self.path} failed: {err.strerror}", str(self.path)) from err
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
    bad JSON, bytes that are not UTF-8 or a non-object line is a UserError naming file:line."""
    import gzip
    import zlib

    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"{what} file not found: {p}")
    opener = gzip.open if p.suffix == ".gz" else open
    # surrogateescape turns each undecodable byte into one lone surrogate (valid UTF-8 never
    # yields those), so a bad byte is found on its own line instead of failing the whole read
    try:
        with opener(p, "rt", encoding="utf-8", errors="surrogateescape") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                bad = _BAD_BYTE.search(line)
                if bad is not None:
                    byte = ord(bad.group()) - 0xDC00
                    raise UserError(f"{p}:{lineno}: not valid UTF-8 (byte 0x{byte:02x} at column {bad.start() + 1})")
                rec = parse_json(line, f"{p}:{lineno}", in_line=True)
                if not isinstance(rec, dict):
                    raise UserError(f"{p}:{lineno}: expected a JSON object, got {type(rec).__name__}")
                yield lineno, rec
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise UserError(f"{p}: not a readable gzip file ({e})") from None


#: what surrogateescape makes of a byte that is not UTF-8
_BAD_BYTE = re.compile("[\udc80-\udcff]")

#: the largest JSON file :func:`read_json` reads (model configs and tokenizers are far smaller)
MAX_JSON_BYTES = 1 << 30


def decode_utf8(data: bytes, where: str) -> str:
    """``data`` as UTF-8 text; a byte that is not UTF-8 is a UserError naming ``where`` and its offset."""
    try:
        return bytes(data).decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{where}: not valid UTF-8 (byte 0x{e.object[e.start]:02x} at offset {e.start})") from None


def parse_json(data: str | bytes, where: str, *, in_line: bool = False) -> Any:
    """``json.loads`` of untrusted text (bytes: UTF-8): bad bytes, bad JSON and nesting deeper than
    the parser can recurse are each a UserError naming ``where`` (a file; with ``in_line``, one
    line of a file, ``file:line``, so an error gives only the column)."""
    text = data if isinstance(data, str) else decode_utf8(data, where)
    try:
        return json.loads(text)
    except RecursionError:  # the C parser stops at the interpreter's recursion limit
        raise UserError(f"{where}: JSON nested too deeply (about {sys.getrecursionlimit()} levels at most)") from None
    except json.JSONDecodeError as e:
        at = f"column {e.colno}" if in_line else f"line {e.lineno}, column {e.colno}"
        raise UserError(f"{where}: not valid JSON ({e.msg}, {at})") from None
    except ValueError as e:  # an integer literal too long to convert
        raise UserError(f"{where}: not valid JSON ({e})") from None


def read_json(path: str | Path, where: str | None = None) -> Any:
    """The JSON value in the file ``path``; unreadable, oversized, not UTF-8, bad or too deeply
    nested JSON is a UserError naming ``where`` (default: the file)."""
    p = Path(path)
    where = where or str(p)
    try:
        with open(p, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_JSON_BYTES:
                raise UserError(f"{where}: {size} bytes is more than a JSON file read here may hold ({MAX_JSON_BYTES})")
            data = f.read()
    except OSError as e:
        raise UserError(f"{where}: cannot read ({e.strerror})") from None
    return parse_json(data, where)


@contextmanager
def exclusive_lock(path: str | Path, what: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the lock file ``path`` for the block, or fail at once with a
    UserError naming ``what`` and the holder's pid. The file holds ``PID@HOST`` while held and is
    removed on release; a lock won on a file its last holder has just removed is retried."""
    import fcntl

    path = check_output_path(path, "lock file")
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            pid, _, host = holder.partition("@")
            raise UserError(
                f"{what} is being written by another run (pid {pid}" + (f" on {host}" if host else "")
                + f", lock {path}); wait for it to finish or write elsewhere"
            ) from None
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # we locked a file that is no longer at ``path``: try again
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{_tmp_tag()}\n".encode(), 0)
        yield
    finally:
        with suppress(OSError):
            os.unlink(path)  # still ours: unlinked while held, so no one else can hold it
        os.close(fd)


def lock_path(out: str | Path) -> Path:
    """The lock file of an output file or directory: ``.NAME.lock`` beside it (an output replaced by
    an atomic rename cannot carry its own lock). The path is made absolute first, so that ``out``,
    ``./out`` and ``a/../out`` share one lock."""
    p = Path(os.path.abspath(Path(out).expanduser()))
    return p / ".lock" if not p.name else p.with_name(f".{p.name}.lock")


@contextmanager
def output_lock(out: str | Path, what: str | None = None) -> Iterator[None]:
    """:func:`exclusive_lock` on the output ``out`` (a file or a directory) for the block: a second
    process writing the same output fails at once, naming ``what`` (default ``out``) and the
    holder's pid. The OS drops the lock when its holder dies, so a kill leaves no stale lock."""
    with exclusive_lock(lock_path(out), what or str(out)):
        yield
