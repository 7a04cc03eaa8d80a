"""Run untrusted Python (model-written code) in a sandboxed subprocess.

Every run gets: a fresh temporary working directory; a scrubbed environment (a fixed PATH, HOME and
TMPDIR pointing at the work dir, nothing from the parent, so no secrets); resource limits set before
the program starts: CPU seconds (``RLIMIT_CPU``), address space (``RLIMIT_AS``, the memory limit),
processes (``RLIMIT_NPROC``, fork bombs), file size (``RLIMIT_FSIZE``), open files and no core dumps; a
wall-clock limit enforced by the parent; captured stdout/stderr capped at ``output_kb`` (a program that
prints more is killed at once, so a flood never fills the parent's memory or blocks on a pipe); and,
at the end, the whole process group killed.

On Linux as root (the CI and cluster case) a small trusted bootstrap additionally, before running the
program: unshares new network, mount and PID namespaces (no network: only a loopback that is down;
every descendant dies with the namespace, even one that called ``setsid``); mounts a size-limited
tmpfs as the work dir (a disk-filling loop hits ``tmpfs_mb``); makes the interpreter's directories
visible when a parent such as ``/root`` is private (a bind-mount view that hides everything else in
it); then drops to an unprivileged uid/gid unique to this worker (so ``RLIMIT_NPROC`` is enforced,
files outside the sandbox cannot be changed, rlimits cannot be raised and other processes'
``/proc/*/environ`` cannot be read) with ``no_new_privs`` set, and kills the program if the bootstrap
dies (``PR_SET_PDEATHSIG``).

Elsewhere the same rlimits apply and the parent still enforces wall time and output; on Linux without
root, a user+network namespace is used for "no network" when the kernel allows unprivileged user
namespaces. What is NOT enforced there: the program runs as the calling user, so it can read and
delete that user's files outside the work dir and read ``/proc/<parent>/environ``; on macOS
``RLIMIT_AS`` is not enforced and there is no network isolation. :func:`capabilities` reports what
this machine enforces; ``mlx_ssp verify`` prints it when it runs code.
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

IS_LINUX = sys.platform.startswith("linux")
# uids for sandboxed programs: a block per parent process (pid-derived) and one uid per worker slot,
# so that RLIMIT_NPROC counts only that worker's processes.
_UID_BASE = 1_000_000
_UID_SLOTS = 64


@dataclass(frozen=True)
class Limits:
    wall_s: float = 10.0  # wall-clock seconds, enforced by the parent
    cpu_s: int = 5  # CPU seconds (RLIMIT_CPU; SIGXCPU then SIGKILL)
    memory_mb: int = 1024  # address space per process (RLIMIT_AS)
    nproc: int = 32  # processes/threads of the sandbox uid (RLIMIT_NPROC)
    fsize_mb: int = 16  # largest file the program may write (RLIMIT_FSIZE)
    nofile: int = 128  # open file descriptors
    output_kb: int = 256  # captured stdout+stderr; more and the program is killed
    tmpfs_mb: int = 64  # size of the work dir (Linux root only)
    network: bool = False  # allow network access
    site_packages: bool = False  # make installed packages (numpy...) importable; ~30 ms more per run


@dataclass
class RunResult:
    status: str  # ok | error | timeout | cpu_limit | memory_limit | file_size_limit | output_limit | killed | sandbox_error
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float
    enforced: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# The bootstrap runs as its own interpreter (-I -S: no site, no environment), single-threaded, so it
# may unshare, mount and change credentials safely before exec'ing the program's interpreter.
_BOOTSTRAP = r'''
import ctypes, json, os, resource, signal, sys
cfg = json.loads(sys.argv[1])
work = cfg["work"]
prog = open(os.path.join(work, "prog.py"), "rb").read()
stdin_data = open(os.path.join(work, "stdin.txt"), "rb").read()
import resource
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
def fail(msg):
    os.write(2, ("sandbox-bootstrap: " + msg + "\n").encode()); os._exit(125)
def mount(src, dst, fstype, flags, data):
    enc = lambda s: None if s is None else s.encode()
    if libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)) != 0:
        fail("mount %s -> %s: %s" % (src, dst, os.strerror(ctypes.get_errno())))
MS_BIND, MS_REC, MS_PRIVATE, MS_NOSUID, MS_NODEV = 4096, 16384, 1 << 18, 2, 4
NEWNS, NEWNET, NEWPID, NEWUSER = 0x20000, 0x40000000, 0x20000000, 0x10000000
uid = cfg["uid"]
if cfg["mode"] == "root":
    flags = NEWNS | NEWPID | (0 if cfg["network"] else NEWNET)
    if libc.unshare(flags) != 0:
        fail("unshare: " + os.strerror(ctypes.get_errno()))
    mount(None, "/", None, MS_REC | MS_PRIVATE, None)
    for parent, stage, children in cfg["views"]:
        for c in children:
            mount(os.path.join(parent, c), os.path.join(stage, c), None, MS_BIND | MS_REC, None)
        mount(stage, parent, None, MS_BIND | MS_REC, None)
    mount("tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV,
          "size=%dm,mode=0700,uid=%d,gid=%d" % (cfg["tmpfs_mb"], uid, uid))
elif cfg["mode"] == "userns" and cfg["netns"] and not cfg["network"]:
    if libc.unshare(NEWUSER | NEWNET) != 0:
        fail("unshare: " + os.strerror(ctypes.get_errno()))
for name, data in (("prog.py", prog), ("stdin.txt", stdin_data)):
    with open(os.path.join(work, name), "wb") as f:
        f.write(data)
    if cfg["mode"] == "root":
        os.chown(os.path.join(work, name), uid, uid)
def wait_status(pid):
    """Exit status of ``pid``; as a PID-namespace init, also reap every orphan until it is done."""
    while True:
        try:
            got, status = os.waitpid(-1 if os.getpid() == 1 else pid, 0)
        except ChildProcessError:
            return 1 << 8
        except InterruptedError:
            continue
        if got == pid:
            return status
def die_like(status):
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
        os.kill(os.getpid(), sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)
if cfg["mode"] == "root":
    rfd, wfd = os.pipe()
    pid = os.fork()  # the child is PID 1 (a minimal init) of the new PID namespace
    if pid:
        os.close(wfd)
        wait_status(pid)
        data = os.read(rfd, 64)
        die_like(int(data) if data else 1 << 8)
    os.close(rfd)
lim = cfg["limits"]
def setlim(res, v):
    try:
        resource.setrlimit(res, (v, v))
    except (ValueError, OSError):
        pass
resource.setrlimit(resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"] + 1))
setlim(resource.RLIMIT_AS, lim["memory_mb"] << 20)
setlim(resource.RLIMIT_FSIZE, lim["fsize_mb"] << 20)
setlim(resource.RLIMIT_NOFILE, lim["nofile"])
if cfg["mode"] == "root":
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    if os.getuid() != uid or os.geteuid() != uid:
        fail("could not drop privileges")
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG (after setuid, which clears it)
setlim(resource.RLIMIT_NPROC, lim["nproc"])
if cfg["mode"] == "root":
    # PID 1 ignores signals it has no handler for (SIGXCPU would not kill it): run the program as
    # PID 2 and stay as its reaper.
    prog_pid = os.fork()
    if prog_pid:
        status = wait_status(prog_pid)
        os.write(wfd, str(status).encode())
        os._exit(0)
    os.close(wfd)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)
os.chdir(work)
fd = os.open("stdin.txt", os.O_RDONLY)
os.dup2(fd, 0)
os.close(fd)
# Run the program in this interpreter (no second interpreter start): a fresh __main__ module, the
# scrubbed environment, the work dir first on sys.path, installed packages only if asked for.
import types, traceback
os.environ.clear()
os.environ.update(cfg["env"])
sys.argv = ["prog.py"]
sys.path.insert(0, work)
if cfg["limits"]["site_packages"]:
    import site
    site.main()
main = types.ModuleType("__main__")
main.__file__ = os.path.join(work, "prog.py")
sys.modules["__main__"] = main
del cfg, prog, stdin_data, lim
try:
    code = compile(open("prog.py", "rb").read(), main.__file__, "exec")
    exec(code, main.__dict__)
except SystemExit:
    raise
except BaseException:
    traceback.print_exc()
    sys.stderr.flush()
    sys.exit(1)
'''


def _python() -> str:
    return os.path.realpath(sys.executable)


@lru_cache(maxsize=1)
def _views() -> list[tuple[str, list[str]]]:
    """Directories above the interpreter that others cannot traverse (e.g. /root is 0700), with the
    child directories that must be visible through them."""
    paths = {os.path.dirname(_python()), sys.prefix, sys.base_prefix}
    paths.update(os.path.realpath(p) for k, p in sysconfig.get_paths().items() if k in ("stdlib", "platstdlib", "purelib", "platlib"))
    blocked: dict[str, set[str]] = {}
    for p in sorted(paths):
        parts = Path(os.path.realpath(p)).parts
        cur = Path(parts[0])
        for part in parts[1:]:
            try:
                st = os.stat(cur)
            except OSError:
                break
            if not st.st_mode & 0o001:
                blocked.setdefault(str(cur), set()).add(part)
                break
            cur = cur / part
    return [(k, sorted(v)) for k, v in sorted(blocked.items())]


_STAGE_LOCK = threading.Lock()
_STAGE_DIR: str | None = None


def _staged_views(base: str) -> list[tuple[str, str, list[str]]]:
    """(blocked dir, world-readable stage dir with mount points, children) for the bootstrap."""
    global _STAGE_DIR
    views = _views()
    if not views:
        return []
    with _STAGE_LOCK:
        if _STAGE_DIR is None or not os.path.isdir(_STAGE_DIR):
            stage_root = tempfile.mkdtemp(prefix="mlx_ssp_view_", dir=base)
            os.chmod(stage_root, 0o755)
            for i, (_, children) in enumerate(views):
                for c in children:
                    os.makedirs(os.path.join(stage_root, str(i), c), exist_ok=True)
                os.chmod(os.path.join(stage_root, str(i)), 0o755)
            _STAGE_DIR = stage_root
            atexit.register(shutil.rmtree, stage_root, True)
    return [(parent, os.path.join(_STAGE_DIR, str(i)), children) for i, (parent, children) in enumerate(views)]


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


def _mode() -> str:
    if IS_LINUX and os.geteuid() == 0:
        return "root"
    if IS_LINUX:
        return "userns"
    return "plain"


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


def _traversable(path: str) -> bool:
    p = Path(os.path.realpath(path))
    return all(os.stat(a).st_mode & 0o001 for a in [p, *p.parents])


@lru_cache(maxsize=2)
def _base_dir(mode: str) -> str:
    """Where work dirs go: the temp dir, unless the sandbox uid could not reach it (TMPDIR under a
    private home), then /tmp."""
    base = tempfile.gettempdir()
    if mode == "root" and not _traversable(base) and os.path.isdir("/tmp"):
        return "/tmp"
    return base


def run_python(code: str, limits: Limits = Limits(), stdin: str = "") -> RunResult:
    """Run ``code`` as a Python program in the sandbox; never raises on the program's behaviour."""
    mode = _mode()
    base = _base_dir(mode)
    t0 = time.monotonic()
    work = tempfile.mkdtemp(prefix="mlx_ssp_sbx_", dir=base)
    proc = None
    with _Slot() as uid:
        try:
            Path(work, "prog.py").write_text(code, encoding="utf-8")
            Path(work, "stdin.txt").write_text(stdin or "", encoding="utf-8")
            cfg = {
                "work": work,
                "mode": mode,
                "uid": uid,
                "network": limits.network,
                "tmpfs_mb": limits.tmpfs_mb,
                "views": _staged_views(base) if mode == "root" else [],
                "netns": mode == "root" or (mode == "userns" and userns_available()),
                "limits": asdict(limits),
                "python": _python(),
                "env": _env(work),
            }
            if mode == "root":
                os.chmod(work, 0o755)  # the tmpfs mounted over it is 0700 and owned by the uid
            proc = subprocess.Popen(
                [_python(), "-I", "-S", "-c", _BOOTSTRAP, json.dumps(cfg)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=work,
                env=_env(work),
                start_new_session=True,  # its own process group, killed as a whole at the end
                close_fds=True,
            )
            out, err, over, timed_out = _collect(proc, limits)
            _kill_group(proc)
            rc = proc.wait()
        except OSError as e:
            if proc is not None:
                _kill_group(proc)
                proc.wait()
            return RunResult("sandbox_error", None, "", f"{type(e).__name__}: {e}", time.monotonic() - t0)
        finally:
            if proc is not None:
                _kill_group(proc)
            shutil.rmtree(work, ignore_errors=True)
    stdout = out.decode("utf-8", "replace")
    stderr = err.decode("utf-8", "replace")
    if timed_out:
        status = "timeout"
    elif over:
        status = "output_limit"
    else:
        status = _classify(rc, stderr, limits)
    return RunResult(status, rc, stdout, stderr, time.monotonic() - t0, enforced=capabilities_for(mode))


def _collect(proc: subprocess.Popen, limits: Limits) -> tuple[bytes, bytes, bool, bool]:
    """Read stdout/stderr until EOF, the wall limit or the output cap (then kill the group)."""
    cap = limits.output_kb << 10
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    total = 0
    deadline = time.monotonic() + limits.wall_s
    sel = selectors.DefaultSelector()
    for f in bufs:
        os.set_blocking(f.fileno(), False)
        sel.register(f, selectors.EVENT_READ)
    over = timed_out = False
    try:
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
    root = mode == "root"
    return {
        "mode": mode,
        "rlimits": ["cpu", "nproc", "fsize", "nofile", "core"] + (["as"] if IS_LINUX else []),
        "network_isolated": root or (mode == "userns" and userns_available()),
        "uid_drop": root,
        "pid_namespace": root,
        "tmpfs_workdir": root,
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
    )
    res = run_python(probe, Limits(wall_s=20))
    caps["probe_status"] = res.status
    if res.ok:
        lines = res.stdout.split()
        caps["network_isolated"] = bool(lines) and lines[0] == "nonet"
        caps["uid_drop"] = len(lines) > 1 and lines[1] != str(os.getuid())
    else:
        caps["probe_error"] = res.stderr.strip()[-300:]
    return caps


def describe() -> str:
    c = capabilities()
    return (
        f"sandbox ({c['mode']}): rlimits {'/'.join(c['rlimits'])}, wall and output caps, scrubbed env; "
        f"network {'isolated' if c['network_isolated'] else 'NOT isolated'}; "
        f"{'unprivileged uid, PID namespace, tmpfs work dir' if c['uid_drop'] else 'runs as the calling user (files outside the work dir are NOT protected)'}"
        + (f"; probe failed: {c.get('probe_error', '')}" if c.get("probe_status") != "ok" else "")
    )
