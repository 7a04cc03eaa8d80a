"""Run untrusted Python (model-written code) in a sandboxed subprocess.

Every run gets: a fresh temporary working directory (named ``mlx_ssp_sbx_<pid>_*`` after its owner, so
the first run of a later process removes those of dead owners, e.g. after a SIGKILL); a scrubbed
environment (a fixed PATH, HOME and TMPDIR pointing at the work dir, nothing from the parent, so no
secrets); resource limits set before the program starts: CPU seconds (``RLIMIT_CPU``), address space
(``RLIMIT_AS``, the memory limit), processes (``RLIMIT_NPROC``, fork bombs), file size
(``RLIMIT_FSIZE``), open files and no core dumps; a wall-clock limit enforced by the parent, with a
backstop alarm in the bootstrap (wall_s + 3 s) for a parent that stalls; death with the parent
(``PR_SET_PDEATHSIG`` on the bootstrap and every process it forks); captured stdout/stderr capped at
``output_kb`` (a program that prints more is killed at once, so a flood never fills the parent's
memory or blocks on a pipe); and, at the end, the whole process group killed.

The bootstrap is :mod:`mlx_ssp.verify.sandbox_boot` (its docstring draws the process tree). On Linux
as root (the CI and cluster case) it also: unshares new network, PID and mount namespaces (no network:
only a loopback that is down, and abstract Unix sockets are per network namespace; every descendant
dies with the namespace, even one that called ``setsid``); builds a filesystem view whose only
writable place is a size-limited tmpfs work dir (``tmpfs_mb``, so the total disk use is capped), with
the system and interpreter directories bound read-only and nothing else of the host: no ``/tmp``,
``/dev/shm``, ``/run``, home directories or socket files; then drops to an unprivileged uid/gid unique
to this worker (so ``RLIMIT_NPROC`` is enforced, rlimits cannot be raised and no other process can be
traced) with ``no_new_privs``.

With a :class:`Harness` (the code verifier's test code) the tests run in their own process against
proxies of the program's names; ``RunResult.passed`` is true only if that process finished the test
code and wrote a nonce the program never sees (see :mod:`mlx_ssp.verify.sandbox_boot`).

Elsewhere the same rlimits apply and the parent still enforces wall time and output; on Linux without
root, a user+network namespace is used for "no network" when the kernel allows unprivileged user
namespaces. What is NOT enforced there: the program runs as the calling user, so it can read, change
and delete that user's files outside the work dir (the interpreter's own files included), write to
``/tmp``, reach Unix sockets, read ``/proc/<parent>/environ`` and the parent's memory; so a harness
verdict there holds against a program that only plays within Python, not against one that attacks
the parent. On macOS ``RLIMIT_AS`` is not enforced and there is no network isolation.
:func:`capabilities` reports what this machine enforces; ``mlx_ssp verify`` prints it when it runs code.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable

from mlx_ssp.io import pid_alive
from mlx_ssp.sandbox_policy import Limits

IS_LINUX = sys.platform.startswith("linux")
# uids for sandboxed programs: a block per parent process (pid-derived) and one uid per worker slot,
# so that RLIMIT_NPROC counts only that worker's processes.
_UID_BASE = 1_000_000
_UID_SLOTS = 64


@dataclass
class RunResult:
    status: str  # ok | error | timeout | cpu_limit | memory_limit | file_size_limit | output_limit | killed | sandbox_error
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float
    enforced: dict = field(default_factory=dict)
    passed: bool | None = None  # with a Harness: the test code ran to its end (never the exit status)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


_BOOT = str(Path(__file__).with_name("sandbox_boot.py"))
#: system directories bound read-only into the filesystem view (root), when they exist
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
_STALE_PREFIX = "mlx_ssp_sbx_"


@dataclass(frozen=True)
class Harness:
    """Test code for :func:`run_python` (see :mod:`mlx_ssp.verify.sandbox_boot`): it runs in its own
    process after the program's top level, with ``trusted`` (e.g. HumanEval's ``prompt_code``) and
    proxies for the program's names; the run passes only if it returns normally."""

    tests: str
    trusted: str = ""
    entry: str | None = None


def _python() -> str:
    return os.path.realpath(sys.executable)


def _under(path: str, dirs: list[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in dirs)


@lru_cache(maxsize=1)
def _binds() -> list[tuple[str, str, str]]:
    """(kind, path, link target) of what the filesystem view holds: the system directories (as
    symlinks where they are, e.g. /bin -> usr/bin) and the interpreter's own directories."""
    out: list[tuple[str, str, str]] = []
    dirs: list[str] = []
    for d in _SYSTEM_DIRS:
        if os.path.islink(d):
            out.append(("link", d, os.readlink(d)))
        elif os.path.isdir(d):
            out.append(("dir", d, ""))
            dirs.append(d)
    paths = {os.path.dirname(_python()), sys.base_prefix, sys.base_exec_prefix}
    base = sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_exec_prefix})  # not a venv's
    paths.update(base.get(k, "") for k in ("stdlib", "platstdlib", "purelib", "platlib"))
    for p in sorted(os.path.realpath(p) for p in paths if p):
        if os.path.isdir(p) and not _under(p, dirs):
            out.append(("dir", p, ""))
            dirs.append(p)
    return out


def _env(work: str) -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": work,
        "TMPDIR": work,
        "LANG": "C.UTF-8",
        "PYTHONHASHSEED": "0",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONIOENCODING": "utf-8",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


@dataclass(frozen=True)
class SandboxMode:
    """One way to run the bootstrap; ``sandbox_boot.MODES`` holds what the bootstrap does for it.
    Adding a mode is one entry here and one there."""

    applies: Callable[[], bool]  # whether this machine runs in this mode (the first entry that applies wins)
    isolated: bool  # uid drop, PID namespace, tmpfs work dir and filesystem view (needs root)
    netns: Callable[[], bool]  # whether a network namespace is made ("no network" enforced)
    binds: Callable[[], list]  # the filesystem view's read-only binds


# lambdas look the helpers up when called (defined below; tests may replace them)
MODES = {
    "root": SandboxMode(lambda: IS_LINUX and os.geteuid() == 0, isolated=True, netns=lambda: True,
                        binds=lambda: _binds()),
    "userns": SandboxMode(lambda: IS_LINUX, isolated=False, netns=lambda: userns_available(), binds=list),
    "plain": SandboxMode(lambda: True, isolated=False, netns=lambda: False, binds=list),
}


def _mode() -> str:
    return next(name for name, m in MODES.items() if m.applies())


_slot_lock = threading.Lock()
_free_slots: list[int] = list(range(_UID_SLOTS))
_slot_cond = threading.Condition(_slot_lock)


class _Slot:
    """A worker slot: one uid per concurrent run (RLIMIT_NPROC is per uid)."""

    def __enter__(self) -> int:
        with _slot_cond:
            while not _free_slots:
                _slot_cond.wait()
            self.slot = _free_slots.pop(0)
        return _UID_BASE + (os.getpid() % 100_000) * _UID_SLOTS + self.slot

    def __exit__(self, *exc) -> None:
        with _slot_cond:
            _free_slots.append(self.slot)
            _free_slots.sort()
            _slot_cond.notify()


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _classify(rc: int | None, stderr: str, limits: Limits) -> str:
    if rc == 0:
        return "ok"
    if rc is not None and rc < 0:
        sig = -rc
        if sig == signal.SIGXCPU:
            return "cpu_limit"
        if sig == signal.SIGXFSZ:
            return "file_size_limit"
        if sig == signal.SIGKILL:
            return "killed"
        return "error"
    if rc == 125 and "sandbox-bootstrap:" in stderr:
        return "sandbox_error"
    tail = stderr[-2000:]
    if "MemoryError" in tail:
        return "memory_limit"
    if "File too large" in tail or "EFBIG" in tail:
        return "file_size_limit"
    return "error"


def clean_stale(base: str) -> int:
    """Remove work dirs in ``base`` left by dead processes (a SIGKILLed verify or rollout): the
    name holds the owner's pid; only dirs owned by this user whose owner is gone. Returns the count."""
    n = 0
    try:
        entries = list(os.scandir(base))
    except OSError:
        return 0
    for e in entries:
        if not e.name.startswith(_STALE_PREFIX):
            continue
        pid = e.name[len(_STALE_PREFIX):].split("_", 1)[0]
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        if pid.isdigit() and stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not pid_alive(int(pid)):
            shutil.rmtree(e.path, ignore_errors=True)
            n += 1
    return n


_cleaned: set[str] = set()
_clean_lock = threading.Lock()


def _work_dir() -> str:
    base = tempfile.gettempdir()
    with _clean_lock:
        if base not in _cleaned:  # once per process: the first run cleans up after dead ones
            _cleaned.add(base)
            clean_stale(base)
    return tempfile.mkdtemp(prefix=f"{_STALE_PREFIX}{os.getpid()}_", dir=base)


def _read_verdict(fd: int) -> dict:
    os.set_blocking(fd, False)  # a leftover descendant may hold the write end: take what is there
    data = b""
    try:
        while chunk := os.read(fd, 65536):
            data += chunk
    except BlockingIOError:
        pass
    finally:
        os.close(fd)
    try:
        v = json.loads(data)
        return v if isinstance(v, dict) else {}
    except ValueError:
        return {}


def run_python(code: str, limits: Limits = Limits(), stdin: str = "", harness: Harness | None = None) -> RunResult:
    """Run ``code`` as a Python program in the sandbox; never raises on the program's behaviour.
    With ``harness``, ``passed`` says whether its test code ran to the end against the program."""
    mode = _mode()
    t0 = time.monotonic()
    work = _work_dir()
    proc = None
    vr = vw = -1
    with _Slot() as uid:
        try:
            _write_inputs(work, code, stdin, harness)
            vr, vw = os.pipe()
            proc = _start_boot(_boot_config(work, mode, uid, vw, limits, harness), work, vw)
            os.close(vw)
            vw = -1
            out, err, over, timed_out = _collect(proc, limits)
            _kill_group(proc)
            rc = proc.wait()
            verdict = _read_verdict(vr)
            vr = -1
        except OSError as e:
            if proc is not None:
                _kill_group(proc)
                proc.wait()
            return RunResult("sandbox_error", None, "", f"{type(e).__name__}: {e}", time.monotonic() - t0)
        finally:
            if proc is not None:
                _kill_group(proc)
            for fd in (vr, vw):
                if fd >= 0:
                    os.close(fd)
            shutil.rmtree(work, ignore_errors=True)
    stdout = out.decode("utf-8", "replace")
    stderr = err.decode("utf-8", "replace")
    status = "timeout" if timed_out else "output_limit" if over else _classify(rc, stderr, limits)
    passed = None
    if harness is not None:
        passed = verdict.get("passed") is True and not (timed_out or over)
    return RunResult(status, rc, stdout, stderr, time.monotonic() - t0, enforced=capabilities_for(mode), passed=passed)


def _write_inputs(work: str, code: str, stdin: str, harness: Harness | None) -> None:
    Path(work, "prog.py").write_text(code, encoding="utf-8")
    Path(work, "stdin.txt").write_text(stdin or "", encoding="utf-8")
    if harness is not None:
        Path(work, "tests.json").write_text(json.dumps({"tests": harness.tests, "trusted": harness.trusted,
                                                         "entry": harness.entry}), encoding="utf-8")


def _boot_config(work: str, mode: str, uid: int, vw: int, limits: Limits, harness: Harness | None) -> dict:
    """What the bootstrap reads from its argv (see :mod:`mlx_ssp.verify.sandbox_boot`)."""
    return {
        "work": work,
        "mode": mode,
        "uid": uid,
        "ppid": os.getpid(),
        "vfd": vw,
        "alarm_s": int(limits.wall_s) + 3,
        "harness": harness is not None,
        "network": limits.network,
        "tmpfs_mb": limits.tmpfs_mb,
        "binds": MODES[mode].binds(),
        "netns": MODES[mode].netns(),
        "limits": asdict(limits),
        "env": _env(work),
    }


def _start_boot(cfg: dict, work: str, vw: int) -> subprocess.Popen:
    return subprocess.Popen(
        [_python(), "-I", "-S", _BOOT, json.dumps(cfg)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=work,
        env=cfg["env"],
        start_new_session=True,  # its own process group, killed as a whole at the end
        close_fds=True,
        pass_fds=(vw,),
    )


def _collect(proc: subprocess.Popen, limits: Limits) -> tuple[bytes, bytes, bool, bool]:
    """Read stdout/stderr until EOF, the wall limit or the output cap (then kill the group)."""
    cap = limits.output_kb << 10
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    deadline = time.monotonic() + limits.wall_s
    sel = selectors.DefaultSelector()
    for f in bufs:
        os.set_blocking(f.fileno(), False)
        sel.register(f, selectors.EVENT_READ)
    over = timed_out = False
    try:
        over, timed_out = _pump(sel, bufs, cap, deadline)
        if not timed_out and not over:
            # pipes closed; the bootstrap may still be exiting
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
    finally:
        if timed_out or over:
            _kill_group(proc)
        sel.close()
        for f in bufs:
            f.close()
    return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), over, timed_out


def _pump(sel: selectors.BaseSelector, bufs: dict, cap: int, deadline: float) -> tuple[bool, bool]:
    """Read both pipes into ``bufs`` (at most ``cap`` bytes in all) until both close; returns
    (over the cap, past the deadline)."""
    total = 0
    over = timed_out = False
    open_pipes = 2
    while open_pipes:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        for key, _ in sel.select(timeout=min(left, 0.5)):
            try:
                chunk = os.read(key.fd, 65536)
            except BlockingIOError:
                continue
            if not chunk:
                sel.unregister(key.fileobj)
                open_pipes -= 1
                continue
            buf = bufs[key.fileobj]
            room = cap - total
            buf += chunk[:max(0, room)]
            total += len(chunk)
            if total > cap:
                over = True
                break
        if over:
            break
    return over, timed_out


@lru_cache(maxsize=1)
def userns_available() -> bool:
    """Whether this (non-root) user may create a user + network namespace (kernel setting)."""
    if not IS_LINUX:
        return False
    probe = "import ctypes, sys; sys.exit(0 if ctypes.CDLL(None).unshare(0x10000000 | 0x40000000) == 0 else 1)"
    try:
        return subprocess.run([_python(), "-I", "-S", "-c", probe], timeout=30, capture_output=True).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def capabilities_for(mode: str) -> dict:
    m = MODES[mode]
    return {
        "mode": mode,
        "rlimits": ["cpu", "nproc", "fsize", "nofile", "core"] + (["as"] if IS_LINUX else []),
        "network_isolated": m.netns(),
        "uid_drop": m.isolated,
        "pid_namespace": m.isolated,
        "tmpfs_workdir": m.isolated,
        "filesystem_view": m.isolated,  # only the work dir writable, no host /tmp, /dev/shm, /run or sockets
        "scrubbed_env": True,
        "wall_limit": True,
        "output_cap": True,
    }


@lru_cache(maxsize=1)
def capabilities() -> dict:
    """What this machine enforces, verified by running a probe program once."""
    mode = _mode()
    caps = capabilities_for(mode)
    probe = (
        "import os, socket\n"
        "s = socket.socket(); s.settimeout(1)\n"
        "try:\n    s.connect(('1.1.1.1', 53)); print('net')\nexcept OSError:\n    print('nonet')\n"
        "print(os.getuid())\n"
        "print(os.getcwd())\n"
    )
    res = run_python(probe, Limits(wall_s=20))
    caps["probe_status"] = res.status
    if res.ok:
        lines = res.stdout.split()
        caps["network_isolated"] = bool(lines) and lines[0] == "nonet"
        caps["uid_drop"] = len(lines) > 1 and lines[1] != str(os.getuid())
        caps["filesystem_view"] = len(lines) > 2 and lines[2] == "/sandbox"
    else:
        caps["probe_error"] = res.stderr.strip()[-300:]
    return caps


def describe() -> str:
    c = capabilities()
    return (
        f"sandbox ({c['mode']}): rlimits {'/'.join(c['rlimits'])}, wall and output caps, scrubbed env; "
        f"network {'isolated' if c['network_isolated'] else 'NOT isolated'}; "
        f"{'unprivileged uid, PID namespace, read-only view with a capped tmpfs work dir' if c['uid_drop'] else 'runs as the calling user (files outside the work dir are NOT protected)'}"
        + (f"; probe failed: {c.get('probe_error', '')}" if c.get("probe_status") != "ok" else "")
    )
