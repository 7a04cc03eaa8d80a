"""An episode's backend instances in a process of their own, so that a call's limits hold whatever it does.

Why a process: a backend call may hold the interpreter lock for minutes (BFCL's MathAPI
``power(base=10, exponent=10**9)`` is one big-integer multiplication; ``square_root(2,
precision=10**6)`` is mpmath work), and a thread that holds the lock can neither be interrupted nor
killed, so a join timeout or a watchdog in this process never gets to run. Bounding the arguments'
cost before the call was the alternative, rejected: it needs a cost model per tool of every backend
(and of every user-written environment), and one missed tool brings the stall back. A process is
killed by the operating system whatever runs in it, so the parent only waits on a pipe (which
releases the lock) and kills the worker when the call is over its time limit. The same process also
keeps process-wide state inside the episode: ``mpmath.mp.dps``, module globals or a backend's
leftover threads die with it instead of leaking into every later episode.

One worker per :class:`~mlx_ssp.agents.environment.Environment` (an episode's world, or the checker's
ground-truth twin). Workers are forked from a zygote: a fresh interpreter started once per process
(``python -c``, so neither MLX's threads nor the caller's ``__main__`` are in it) that imports the
backends' modules once and forks a worker per request, handing it one end of a socket pair. The
parent never forks itself (unsafe once MLX has started its threads), and ``multiprocessing``'s
start methods were not used because they re-run the caller's main module in every child. Each
worker ignores ``SIGINT`` (the parent owns shutdown), dies with the zygote (``PR_SET_PDEATHSIG`` on
Linux; the zygote exits when the parent closes its socket or dies) and has its address space capped
(``RLIMIT_AS``, Linux only, as for the code sandbox), so an argument that asks for a 100 GB answer
fails as a ``MemoryError`` in the call instead of taking the machine. A stopped worker is killed by
pid; the zygote reaps it only when told to, so that pid cannot be reused before the kill.

The protocol is pickled requests over the socket (``multiprocessing.connection.Connection``): the
build request first, then ``("call", name, args,
kwargs)`` -> ``("ok", text)`` | ``("err", message)``; ``("state",)`` -> ``("ok", {class: {public
attribute: value}})``. Arguments are JSON-like data parsed from model text; results come back
already formatted as the text the model sees.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import hashlib
import importlib
import inspect
import itertools
import json
import os
import pickle
import resource
import signal
import socket
import struct
import subprocess
import sys
import threading
import weakref
from multiprocessing.connection import Connection
from typing import Any, Callable, NamedTuple, Sequence

from mlx_ssp.errors import UserError

IS_LINUX = sys.platform.startswith("linux")
_PR_SET_PDEATHSIG = 1
_READY_TIMEOUT_S = 60.0  # building an episode's instances (imports, scenario load) in the worker

#: ``inspect.Parameter`` kinds, by name, for the signatures a worker reports.
_KINDS = {k.name: k for k in type(inspect.Parameter.POSITIONAL_ONLY)}


class Built(NamedTuple):
    """What a worker's build function returns: the instances (whose public attributes are the state),
    the tools by name (bound methods), and the environment's ``reward()`` if it has one."""

    instances: dict[str, Any]
    tools: dict[str, Callable]
    reward: Callable[[], float] | None = None


class WorkerGone(Exception):
    """The worker was killed (over its time limit: ``timed_out``) or died; the message says which."""

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


def _signature_data(fn: Callable) -> list[tuple[str, str, bool]]:
    """A method's parameters as plain data: (name, kind, has a default). Enough to bind a call's
    arguments in the parent; defaults and annotations themselves never cross the pipe."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return [("args", "VAR_POSITIONAL", False), ("kwargs", "VAR_KEYWORD", False)]
    return [(p.name, p.kind.name, p.default is not inspect.Parameter.empty) for p in sig.parameters.values()]


def signature_from_data(params: list[tuple[str, str, bool]]) -> inspect.Signature:
    """The signature :func:`_signature_data` described (defaults stand in as ``None``)."""
    return inspect.Signature([
        inspect.Parameter(name, _KINDS[kind], default=None if has_default else inspect.Parameter.empty)
        for name, kind, has_default in params
    ])


# ------------------------------------------------------------------ the worker's side


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent exits. (The code sandbox's bootstrap has its own
    prctl: importing it here would pull the verifiers' imports into every zygote.)"""
    if IS_LINUX:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _limit_self(max_memory_mb: int) -> str:
    """Ignore SIGINT (the parent owns shutdown), die with the zygote, cap the address space (Linux;
    clamped to the hard limit already in force). Returns what could not be done ("" if all)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    if not (IS_LINUX and max_memory_mb > 0):
        return ""
    cap = max_memory_mb << 20
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    try:
        resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    except (ValueError, OSError) as e:
        return f"the memory cap could not be set ({e})"
    return ""


def _send(conn, reply: tuple) -> None:
    """Pickle here, so a value that cannot be pickled is the request's error, not the worker's death."""
    try:
        data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # noqa: BLE001 - whatever a tool or its state holds (RecursionError included)
        data = pickle.dumps(("err", f"the reply could not be sent back: {type(e).__name__}: {e}"))
    conn.send_bytes(data)


def _serve(conn, max_memory_mb: int) -> None:
    """A worker's life: take its build request, build the instances, report their tools, then answer
    requests until the socket closes."""
    problem = _limit_self(max_memory_mb)
    try:
        build, build_args, fmt, cwd, max_chars = conn.recv()
        os.chdir(cwd)  # the zygote's directory is the parent's at the zygote's start, not now
        built: Built = build(*build_args)
    except UserError as e:
        _send(conn, ("user_error", str(e)))
        return
    except BaseException as e:  # noqa: BLE001 - a backend that fails to load is reported, not raised here
        _send(conn, ("error", f"{type(e).__name__}: {e}" + (f"; {problem}" if problem else "")))
        return
    tools = {name: fn for name, fn in built.tools.items() if not name.startswith("_")}
    _send(conn, ("ready", {name: _signature_data(fn) for name, fn in tools.items()}, built.reward is not None))
    while True:
        try:
            req = conn.recv()
        except (EOFError, OSError):
            return
        _send(conn, _answer(req, built._replace(tools=tools), fmt, max_memory_mb, max_chars))


def cut_full(text: str, max_chars: int) -> str:
    """``text`` cut at ``max_chars`` with the rest's length and digest: two equal texts stay equal and
    two different ones (almost surely) different, so the checker still compares exactly, while
    neither process holds a result of hundreds of megabytes."""
    if len(text) <= max_chars:
        return text
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return text[:max_chars] + f"\n... [{len(text) - max_chars} more characters, sha256 {digest}]"


def _answer(req: tuple, built: Built, fmt: Callable[[Any], str], max_memory_mb: int, max_chars: int) -> tuple:
    op = req[0]
    if op == "call":
        _, name, args, kwargs = req
        try:
            return "ok", cut_full(fmt(built.tools[name](*args, **kwargs)), max_chars)
        except MemoryError:
            return "err", f"out of memory (the environment's limit is {max_memory_mb} MB)"
        except BaseException as e:  # noqa: BLE001 - a backend bug is the call's error text, as in BFCL
            return "err", str(e)
    if op == "state":
        return "ok", {cls: {k: v for k, v in vars(inst).items() if not k.startswith("_")}
                      for cls, inst in built.instances.items()}
    if op == "reward":
        try:
            return "ok", float(built.reward())
        except BaseException as e:  # noqa: BLE001 - the environment's own bug, reported as the reason
            return "err", f"reward() failed: {type(e).__name__}: {e}"
    return "err", f"unknown request {op!r}"


# ------------------------------------------------------------------ the zygote


#: a control request: operation (b"fork" | b"reap"), request id, argument (the memory cap | a pid)
_REQUEST = struct.Struct("!4sqq")
#: a control reply: the request's id, then the worker's pid (fork; negative: -errno) or 0 (reap)
_REPLY = struct.Struct("!qq")


def _recv_exact(sock: socket.socket, n: int) -> tuple[bytes, list[int]]:
    """``n`` bytes from a stream socket and the descriptors that came with them."""
    data, fds = b"", []
    while len(data) < n:
        chunk, more, _, _ = socket.recv_fds(sock, n - len(data), 1)
        if not chunk:
            return data, fds
        data += chunk
        fds += more
    return data, fds


def zygote_main(ctrl_fd: int, preload: list[str]) -> None:
    """The zygote: a fresh interpreter that imports ``preload`` once, then answers fixed-size requests
    on its control socket: ``fork`` (with the worker's socket as the one descriptor) forks a worker
    and replies its pid; ``reap`` collects a worker the parent killed (a worker is only ever collected
    so, hence its pid cannot be reused before the parent's kill). Each reply carries its request's id,
    so the parent can drop the reply of a request it stopped waiting for. It exits when the parent
    closes the socket, which happens when the parent dies too (no death signal here: Linux ties it
    to the thread that started the zygote, not to the process)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for name in preload:
        try:
            importlib.import_module(name)
        except ImportError:  # an optional backend package that is not installed
            pass
    ctrl = socket.socket(fileno=ctrl_fd)
    children: set[int] = set()  # only these are ever waited for
    while True:
        try:
            msg, fds = _recv_exact(ctrl, _REQUEST.size)
        except OSError:
            return
        if len(msg) < _REQUEST.size:
            return
        op, rid, arg = _REQUEST.unpack(msg)
        if op == b"reap":
            for fd in fds:
                os.close(fd)
            if arg in children:  # never a pid <= 0 (waitpid would wait for any child) or a stranger
                children.discard(arg)
                with contextlib.suppress(ChildProcessError, OSError):
                    os.waitpid(arg, 0)
            ctrl.sendall(_REPLY.pack(rid, 0 if arg > 0 else -errno.EINVAL))
            continue
        if op != b"fork" or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            ctrl.sendall(_REPLY.pack(rid, -errno.EINVAL))
            continue
        try:
            pid = os.fork()
        except OSError as e:
            os.close(fds[0])
            ctrl.sendall(_REPLY.pack(rid, -(e.errno or errno.EAGAIN)))
            continue
        if pid == 0:  # the worker
            ctrl.close()
            try:
                _serve(Connection(fds[0]), arg)
            finally:
                os._exit(0)
        os.close(fds[0])
        children.add(pid)
        ctrl.sendall(_REPLY.pack(rid, pid))


# ------------------------------------------------------------------ the parent's side


class _Zygote:
    """The parent's handle on its zygote process (started on first use, one per process).

    Nothing here runs from a finalizer: a garbage collection can run a finalizer in the middle of a
    request on the same thread, so a stopped worker is only killed there (:meth:`stop`) and reaped
    at the next request or at exit, under the lock."""

    def __init__(self, preload: list[str]):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        code = ("import sys, json; sys.path[:0] = json.loads(sys.argv[1]); "
                "from mlx_ssp.agents.worker import zygote_main; zygote_main(int(sys.argv[2]), json.loads(sys.argv[3]))")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, json.dumps(sys.path), str(theirs.fileno()), json.dumps(preload)],
            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, close_fds=True)
        theirs.close()
        self.ctrl = ours
        self.pid = os.getpid()  # a forked child of the parent must start its own zygote
        self.lock = threading.Lock()
        self.rid = itertools.count(1)
        self.live: set[int] = set()  # forked, not yet killed
        self.unreaped: list[int] = []  # killed, not yet reaped
        self.closed = False
        atexit.register(self.close)

    def usable(self) -> bool:
        return not self.closed and self.pid == os.getpid() and self.proc.poll() is None

    def _request(self, op: bytes, arg: int, fd: int | None = None) -> int:
        """One request and its reply (the lock held); replies to earlier, abandoned requests are dropped."""
        rid = next(self.rid)
        msg = _REQUEST.pack(op, rid, arg)
        if fd is None:
            self.ctrl.sendall(msg)
        else:
            socket.send_fds(self.ctrl, [msg], [fd])
        while True:
            data, _ = _recv_exact(self.ctrl, _REPLY.size)
            if len(data) < _REPLY.size:
                raise OSError("the environment zygote process exited")
            got, value = _REPLY.unpack(data)
            if got == rid:
                return value

    def _reap_pending(self) -> None:
        while self.unreaped:
            self._request(b"reap", self.unreaped[-1])
            self.unreaped.pop()

    def fork(self, max_memory_mb: int) -> tuple[int, Connection]:
        mine, worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with self.lock:
            try:
                self._reap_pending()
                pid = self._request(b"fork", max_memory_mb, worker_end.fileno())
            except OSError as e:
                mine.close()
                raise UserError(f"could not start an environment process: {e}") from None
            finally:
                worker_end.close()
            if pid <= 0:
                mine.close()
                raise UserError(f"could not start an environment process: {os.strerror(-pid or errno.EAGAIN)}")
            self.live.add(pid)
        return pid, Connection(mine.detach())

    def stop(self, pid: int) -> None:
        """Kill a worker (safe: the zygote keeps it, alive or a zombie, until it is reaped here); it is
        reaped at the next request. No lock and no I/O: this runs from finalizers."""
        if pid not in self.live or self.pid != os.getpid():
            return
        self.live.discard(pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        self.unreaped.append(pid)

    def reap(self) -> None:
        """Collect every stopped worker now (so a caller can rely on them being gone)."""
        with self.lock, contextlib.suppress(OSError):
            self._reap_pending()

    def close(self) -> None:
        """Kill every live worker, collect them, and end the zygote (it exits when its socket closes)."""
        if self.closed or self.pid != os.getpid():
            return
        self.closed = True
        for pid in list(self.live):
            self.stop(pid)
        self.reap()
        self.ctrl.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_ZYGOTE_LOCK = threading.Lock()
_ZYGOTE: list[_Zygote] = []


def _zygote(preload: list[str]) -> _Zygote:
    with _ZYGOTE_LOCK:
        if not _ZYGOTE or not _ZYGOTE[0].usable():
            if _ZYGOTE and _ZYGOTE[0].pid == os.getpid():
                _ZYGOTE[0].close()  # a dead zygote's socket (its workers died with it)
            _ZYGOTE[:] = [_Zygote([__name__, *preload])]
        return _ZYGOTE[0]


def _stop(zygote: _Zygote, pid: int, conn: Connection) -> None:
    conn.close()
    zygote.stop(pid)


class Worker:
    """One worker process holding the world ``build(*build_args)`` returns (a :class:`Built`).
    ``build`` and ``fmt`` (a result -> the text the model sees) must be importable functions."""

    def __init__(self, build: Callable[..., Built], build_args: tuple, fmt: Callable[[Any], str], *,
                 max_memory_mb: int, max_result_chars: int = 1 << 20, preload: Sequence[str] = ()):
        self._zygote = _zygote(list(preload))
        self.pid, self._conn = self._zygote.fork(max_memory_mb)
        self.max_memory_mb = max_memory_mb
        self._finalizer = weakref.finalize(self, _stop, self._zygote, self.pid, self._conn)
        try:
            kind, payload, *rest = self.request((build, build_args, fmt, os.getcwd(), max_result_chars),
                                                _READY_TIMEOUT_S, "setting up the environment")
        except WorkerGone as e:
            raise UserError(f"the environment could not be built: {e}") from None
        if kind == "user_error":
            self.close()
            raise UserError(payload)
        if kind != "ready":
            self.close()
            raise UserError(f"the environment could not be built: {payload}")
        #: tool name -> its signature (parameter names and kinds only)
        self.signatures = {name: signature_from_data(p) for name, p in payload.items()}
        self.has_reward = bool(rest and rest[0])

    def _receive(self, timeout_s: float, what: str) -> tuple:
        """The worker's reply, or :class:`WorkerGone` (the worker killed) after ``timeout_s``."""
        try:
            ready = self._conn.poll(timeout_s)
        except (OSError, ValueError):
            ready = False
        if not ready:
            self.close()
            raise WorkerGone(f"{what} did not finish within {timeout_s:g}s", timed_out=True)
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            self.close()
            raise WorkerGone(f"the environment's process exited while {what}") from None

    def request(self, req: tuple, timeout_s: float, what: str) -> tuple:
        """Send one request and wait at most ``timeout_s`` for its reply (kill the worker after that)."""
        if not self._finalizer.alive:
            raise WorkerGone("the environment's process was stopped")
        try:
            self._conn.send(req)
        except Exception as e:  # noqa: BLE001 - a half-sent request leaves the pipe unusable
            self.close()
            raise WorkerGone(f"the environment's process could not be reached ({type(e).__name__}: {e})") from None
        try:
            return self._receive(timeout_s, what)
        except BaseException:  # interrupted (a watchdog, Ctrl-C): its reply would answer the next request
            self.close()
            raise

    def close(self) -> None:
        """Stop the worker and collect it (idempotent; a garbage-collected Worker is stopped too, and
        collected at the next request)."""
        self._finalizer()
        self._zygote.reap()

    @property
    def alive(self) -> bool:
        return self._finalizer.alive
