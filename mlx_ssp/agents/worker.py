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
import ctypes
import importlib
import inspect
import json
import os
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
    """The worker was killed (over its time limit) or died; the message says which."""


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


def _limit_self(max_memory_mb: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    if IS_LINUX:
        if max_memory_mb > 0:
            cap = max_memory_mb << 20
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


def _serve(conn, max_memory_mb: int) -> None:
    """A worker's life: take its build request, build the instances, report their methods, then answer
    requests until the pipe closes."""
    _limit_self(max_memory_mb)
    try:
        build, build_args, fmt, cwd = conn.recv()
        os.chdir(cwd)  # the zygote's directory is the parent's at the zygote's start, not now
        built: Built = build(*build_args)
    except UserError as e:
        conn.send(("user_error", str(e)))
        return
    except BaseException as e:  # noqa: BLE001 - a backend that fails to load is reported, not raised here
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    tools = {name: fn for name, fn in built.tools.items() if not name.startswith("_")}
    conn.send(("ready", {name: _signature_data(fn) for name, fn in tools.items()}, built.reward is not None))
    while True:
        try:
            req = conn.recv()
        except (EOFError, OSError):
            return
        conn.send(_answer(req, built._replace(tools=tools), fmt, max_memory_mb))


def _answer(req: tuple, built: Built, fmt: Callable[[Any], str], max_memory_mb: int) -> tuple:
    op = req[0]
    if op == "call":
        _, name, args, kwargs = req
        try:
            return "ok", fmt(built.tools[name](*args, **kwargs))
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


def zygote_main(ctrl_fd: int, preload: list[str]) -> None:
    """The zygote: a fresh interpreter that imports ``preload`` once, then forks one worker per request
    on its control socket (``fork`` with the worker's socket as the one fd: replies the pid;
    ``reap PID``: collects that child after the parent killed it). It exits when the parent closes
    the socket (or dies: ``PR_SET_PDEATHSIG``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    for name in preload:
        try:
            importlib.import_module(name)
        except ImportError:  # an optional backend package that is not installed
            pass
    ctrl = socket.socket(fileno=ctrl_fd)
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(ctrl, 64, 1)
        except OSError:
            return
        if not msg:
            return
        if msg.startswith(b"reap "):
            try:
                os.waitpid(int(msg[5:]), 0)
            except ChildProcessError:
                pass
            ctrl.sendall(struct.pack("!q", 0))
            continue
        pid = os.fork()
        if pid == 0:  # the worker
            ctrl.close()
            try:
                _serve(Connection(fds[0]), int(msg.split()[1]))
            finally:
                os._exit(0)
        os.close(fds[0])
        ctrl.sendall(struct.pack("!q", pid))


# ------------------------------------------------------------------ the parent's side


class _Zygote:
    """The parent's handle on its zygote process (started on first use, one per process)."""

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
        atexit.register(self.close)

    def close(self) -> None:
        """End the zygote (it exits when its socket closes); at exit, after the workers' finalizers."""
        if self.pid != os.getpid():
            return
        self.ctrl.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _reply(self) -> int:
        reply = b""
        while len(reply) < 8:
            chunk = self.ctrl.recv(8 - len(reply))
            if not chunk:
                raise OSError("the environment zygote process exited")
            reply += chunk
        return struct.unpack("!q", reply)[0]

    def fork(self, max_memory_mb: int) -> tuple[int, Connection]:
        mine, worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with self.lock:
            try:
                socket.send_fds(self.ctrl, [f"fork {max_memory_mb}".encode()], [worker_end.fileno()])
                pid = self._reply()
            except OSError as e:
                raise UserError(f"could not start an environment process: {e}") from None
            finally:
                worker_end.close()
        return pid, Connection(mine.detach())

    def reap(self, pid: int) -> None:
        """Collect a killed worker; returns once it is gone."""
        with self.lock:
            try:
                self.ctrl.sendall(f"reap {pid}".encode())
                self._reply()
            except OSError:
                pass


_ZYGOTE_LOCK = threading.Lock()
_ZYGOTE: list[_Zygote] = []


def _zygote(preload: list[str]) -> _Zygote:
    with _ZYGOTE_LOCK:
        if not _ZYGOTE or _ZYGOTE[0].pid != os.getpid() or _ZYGOTE[0].proc.poll() is not None:
            _ZYGOTE[:] = [_Zygote([__name__, *preload])]
        return _ZYGOTE[0]


def _stop(zygote: _Zygote, pid: int, conn: Connection) -> None:
    conn.close()
    try:
        os.kill(pid, signal.SIGKILL)  # safe: the zygote keeps it (alive or a zombie) until told to reap it
    except ProcessLookupError:
        pass
    zygote.reap(pid)


class Worker:
    """One worker process holding the instances ``build(*build_args)`` returns ({name: instance}).
    ``build`` and ``fmt`` (a result -> the text the model sees) must be importable functions."""

    def __init__(self, build: Callable[..., dict[str, Any]], build_args: tuple, fmt: Callable[[Any], str], *,
                 max_memory_mb: int, preload: Sequence[str] = ()):
        self._zygote = _zygote(list(preload))
        self.pid, self._conn = self._zygote.fork(max_memory_mb)
        self.max_memory_mb = max_memory_mb
        self._finalizer = weakref.finalize(self, _stop, self._zygote, self.pid, self._conn)
        kind, payload, *rest = self.request((build, build_args, fmt, os.getcwd()), _READY_TIMEOUT_S,
                                            "setting up the environment")
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
            raise WorkerGone(f"{what} did not finish within {timeout_s:g}s")
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
        return self._receive(timeout_s, what)

    def close(self) -> None:
        """Stop the worker (idempotent; also done when the Worker is garbage-collected)."""
        self._finalizer()

    @property
    def alive(self) -> bool:
        return self._finalizer.alive
