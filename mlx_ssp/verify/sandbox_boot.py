"""The sandbox bootstrap: trusted code that isolates, then runs, an untrusted Python program.

:mod:`mlx_ssp.verify.sandbox` starts it as ``python -I -S sandbox_boot.py CFG_JSON`` (no site, no
environment, not importable by the program: -I leaves this directory off ``sys.path``). It is one
single-threaded interpreter, so it may unshare, mount and change credentials safely.

Process tree on Linux as root::

    bootstrap       root, host namespaces: dies with the caller (PR_SET_PDEATHSIG) and after a
    |               backstop alarm; new PID + network namespaces; reports init's verdict on fd vfd
    +- init         PID 1 there: new mount namespace, the filesystem view, rlimits, the sandbox uid;
       |            reaps everything; when it exits the kernel kills every process left inside
       +- program   the untrusted code (PID 2): init ignores signals it has no handler for
       +- tests     harness mode only: the task's test code, in its own process

Elsewhere (no root) the bootstrap is init itself, without the namespaces (a user + network namespace
where the kernel allows, for no network).

Filesystem view (root): a fresh tmpfs becomes ``/``, holding read-only binds of the system and
interpreter directories and ``/etc``, a few ``/dev`` nodes, a fresh ``/proc`` of the PID namespace
and the size-capped tmpfs work dir at ``/sandbox``; ``/`` itself is then made read-only. Nothing
else of the host exists inside: no ``/tmp``, ``/dev/shm``, ``/run``, ``/home``, no socket files.

Harness mode (the code verifier's test code): the program and the tests run in two processes
linked by two pipes. The tests' namespace holds the task's trusted ``prompt_code`` and, for the names
the program defined, proxies: a call sends its arguments to the program's process as data and gets
back data (numbers, strings, bytes, lists, tuples, dicts, sets) or an opaque handle that can only be
called, iterated or asked for attributes, never compared or truth-tested. A pass is the tests'
process writing a nonce, made after the program's process was forked, to a pipe created after it,
once the test code returned; the program can end, patch its interpreter or fake exit statuses, but it
never holds that pipe, the nonce or the test code (read from a descriptor the program's process
closes before it starts, the file unlinked), so it cannot report a pass.
"""

import ctypes
import json
import os
import resource
import signal
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 4096, 8192, 16384, 1 << 18
NEWNS, NEWNET, NEWPID, NEWUSER = 0x20000, 0x40000000, 0x20000000, 0x10000000
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
INSIDE = "/sandbox"  # the work dir's path inside the filesystem view
DEV_NODES = ("null", "zero", "full", "random", "urandom")
INT_RANGE = 1 << 63

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
# prctl is Linux's: on macOS the symbol does not exist, and the options it sets (death signal, no new
# privileges, not dumpable) have no equivalent there, so the call is skipped (see docs/tasks.md)
_prctl = getattr(libc, "prctl", None)
if _prctl is not None:
    _prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


def prctl(option, arg):
    if _prctl is not None:
        _prctl(option, arg, 0, 0, 0)


def fail(msg):
    os.write(2, ("sandbox-bootstrap: " + msg + "\n").encode())
    os._exit(125)


def check(ok, what):
    if not ok:
        fail("%s: %s" % (what, os.strerror(ctypes.get_errno())))


def mount(src, dst, fstype=None, flags=0, data=None):
    enc = lambda s: None if s is None else s.encode()
    check(libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)) == 0, "mount %s" % dst)


def die_with_parent(parent):
    """SIGKILL this process when its parent dies; exit now if that already happened."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(125)


def read_all(fd):
    chunks = []
    while True:
        b = os.read(fd, 1 << 16)
        if not b:
            return b"".join(chunks)
        chunks.append(b)


def write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


# -- process bookkeeping -----------------------------------------------------------------------

def spawn(fn, close=()):
    """Fork a child that closes ``close``, dies with this process and runs ``fn`` (never returns)."""
    parent = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    for fd in close:
        os.close(fd)
    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # init ignores it; the child need not
    code = 0
    try:
        fn()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:  # the program's own error: its traceback, as Python prints it
        import traceback
        traceback.print_exc()
        code = 1
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:
            pass
    os._exit(code)


def reap(wanted):
    """Wait until every pid in ``wanted`` has ended (reaping any orphan, as init must); returns
    {pid: wait status} and the pid that ended first."""
    got, first = {}, None
    while len(got) < len(wanted):
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        if pid in wanted:
            got[pid] = status
            first = first or pid
    for pid in wanted:
        got.setdefault(pid, 1 << 8)
    return got, first


def die_like(status):
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
        os.kill(os.getpid(), sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


# -- the filesystem view (root) ----------------------------------------------------------------

def build_view(root, cfg):
    """Make a tmpfs at ``root`` the new ``/`` (see the module docstring) and enter it."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=0755")
    ro = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID
    for kind, path, target in cfg["binds"]:
        dst = root + path
        if kind == "link":
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.symlink(target, dst)
            continue
        os.makedirs(dst, exist_ok=True)
        mount(path, dst, None, MS_BIND)
        mount(None, dst, None, ro | MS_NODEV)
    os.makedirs(root + "/dev")
    for name in DEV_NODES:
        dst = root + "/dev/" + name
        open(dst, "w").close()
        mount("/dev/" + name, dst, None, MS_BIND)
        mount(None, dst, None, ro)  # read-only mount, yet a device node stays writable (/dev/null)
    for i, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink("/proc/self/fd/%d" % i, root + "/dev/" + name)
    os.symlink("/proc/self/fd", root + "/dev/fd")
    os.makedirs(root + "/proc")
    # this PID namespace's own /proc; where the kernel refuses one (a rootless container that masks
    # parts of /proc) the program runs without /proc rather than not at all
    libc.mount(b"proc", (root + "/proc").encode(), b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    os.makedirs(root + "/tmp", exist_ok=True)  # exists, read-only: writes fail with EROFS rather than ENOENT
    os.makedirs(root + INSIDE)
    mount("tmpfs", root + INSIDE, "tmpfs", MS_NOSUID | MS_NODEV,
          "size=%dm,mode=0700,uid=%d,gid=%d" % (cfg["tmpfs_mb"], cfg["uid"], cfg["uid"]))
    mount(None, root, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(root)
    mount(root, "/", None, MS_MOVE)
    check(libc.chroot(b".") == 0, "chroot")
    os.chdir("/")


# -- the untrusted program ---------------------------------------------------------------------

def run_program(prog, cfg, work):
    """Run ``prog`` in this interpreter as ``__main__`` (no second interpreter start): the scrubbed
    environment, the work dir first on sys.path, installed packages only if asked for."""
    import types
    fd = os.open(os.path.join(work, "stdin.txt"), os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
    os.environ.clear()
    os.environ.update(cfg["env"], HOME=work, TMPDIR=work)
    sys.argv = ["prog.py"]
    sys.path.insert(0, work)
    if cfg["limits"]["site_packages"]:
        import site
        site.main()
    main = types.ModuleType("__main__")
    main.__file__ = os.path.join(work, "prog.py")
    sys.modules["__main__"] = main
    code = compile(prog, main.__file__, "exec")
    exec(code, main.__dict__)
    return main.__dict__


# -- data across the process boundary ----------------------------------------------------------

def enc(x, other):
    """``x`` as a JSON value, with one-key tags for what JSON lacks; a value that is not plain data
    goes to ``other`` (the program's side: a handle; the tests' side: refused)."""
    t = type(x)
    if t is str or t is bool or x is None:
        return x
    if t is int:
        return x if -INT_RANGE <= x < INT_RANGE else {"i": hex(x)}  # hex: no digit limit
    if t is float:
        return x if x - x == 0.0 else {"f": repr(x)}  # inf, nan
    if t is list:
        return [enc(v, other) for v in x]
    if t is tuple:
        return {"t": [enc(v, other) for v in x]}
    if t is dict:
        return {"d": [[enc(k, other), enc(v, other)] for k, v in x.items()]}
    if t is set or t is frozenset:
        return {"s" if t is set else "z": [enc(v, other) for v in x]}
    if t is complex:
        return {"c": [enc(x.real, other), enc(x.imag, other)]}
    if t is bytes or t is bytearray:
        return {"b" if t is bytes else "y": x.hex()}
    return other(x)


def revive(handle):
    """json object_hook undoing :func:`enc`'s tags; ``handle`` maps a handle tag's value."""
    def hook(o):
        if len(o) != 1:
            raise ValueError("malformed data")
        (k, v), = o.items()
        if k == "t":
            return tuple(v)
        if k == "d":
            return dict(v)
        if k == "s":
            return set(v)
        if k == "z":
            return frozenset(v)
        if k == "c" and all(type(p) in (int, float) for p in v):
            return complex(*v)
        if k in ("b", "y", "i", "f") and type(v) is str:
            if k == "f" and v not in ("inf", "-inf", "nan"):
                raise ValueError("malformed data")
            return {"b": bytes.fromhex, "y": bytearray.fromhex, "i": lambda s: int(s, 16), "f": float}[k](v)
        if k == "h":
            return handle(v)
        raise ValueError("malformed data")
    return hook


# the plain value of a subclass of a plain type (each returns the exact base type)
PLAIN = (
    (int, int.__int__), (float, float.__float__), (str, str.__str__),
    (complex, lambda x: complex(float.__float__(x.real), float.__float__(x.imag))),
    (bytes, lambda x: bytes(memoryview(x))), (bytearray, lambda x: bytearray(memoryview(x))),
    (list, list), (tuple, tuple), (dict, dict), (set, set), (frozenset, frozenset),
)


class Channel:
    """Length-prefixed JSON messages over a pair of pipes."""

    def __init__(self, rfd, wfd, hook):
        self.rfd, self.wfd, self.hook = rfd, wfd, hook

    def send(self, msg):
        data = json.dumps(msg, allow_nan=False, separators=(",", ":")).encode()
        write_all(self.wfd, len(data).to_bytes(4, "big") + data)

    def _exact(self, n):
        buf = bytearray()
        while len(buf) < n:
            b = os.read(self.rfd, min(n - len(buf), 1 << 20))
            if not b:
                return None
            buf += b
        return bytes(buf)

    def recv(self):
        head = self._exact(4)
        body = head and self._exact(int.from_bytes(head, "big"))
        return None if body is None else json.loads(body, object_hook=self.hook)


def serve(chan_fds, g):
    """The program's process after its top level ran: export its names, then answer the tests'
    calls. Whatever it sends is data or a handle; it runs nothing the tests' process would trust."""
    handles = []

    def other(x):
        for base, plain in PLAIN:
            if isinstance(x, base):  # a subclass: its plain value (an always-equal str is just a str)
                return enc(plain(x), other)
        tolist = getattr(type(x), "tolist", None)  # numpy scalars and arrays
        if callable(tolist):
            v = tolist(x)
            if type(v) is not type(x):
                return enc(v, other)
        handles.append(x)
        return {"h": [len(handles) - 1, type(x).__name__[:80]]}

    chan = Channel(chan_fds[0], chan_fds[1], revive(lambda v: handles[v[0]]))
    names = []
    for name, v in list(g.items()):
        if name.startswith("__") or type(v) is type(sys):
            continue
        try:
            big = type(v) in (list, tuple, dict, set, frozenset, str, bytes) and len(v) > 10000
            names.append([name, other(v) if big else enc(v, other)])
        except Exception:
            pass
    chan.send(names)
    while True:
        req = chan.recv()
        if req is None:
            return
        try:
            chan.send(["v", *answer(req, handles, other)])
        except Exception as e:
            try:
                msg = str(e)[:300]
            except Exception:
                msg = ""
            chan.send(["e", type(e).__name__[:80], msg])


def answer(req, handles, other):
    op, h = req[0], handles[req[1]]
    if op == "call":
        args, kwargs = req[2], dict(req[3])
        mutable = [i for i, a in enumerate(args) if type(a) in (list, dict, set, bytearray)]
        before = {i: enc(args[i], other) for i in mutable}
        value = enc(h(*args, **kwargs), other)
        # in-place changes to list/dict/set arguments go back, so in-place solutions can be tested
        after = [[i, enc(args[i], other)] for i in mutable]
        return value, [m for m in after if m[1] != before[m[0]]]
    if op == "getattr":
        return enc(getattr(h, req[2]), other), []
    if op == "iter":
        return enc(iter(h), other), []
    if op == "next":
        return enc(next(h), other), []
    raise ValueError("unknown request")


# -- the tests' process ------------------------------------------------------------------------

def run_tests(spec, chan_fds, env):
    """Build the tests' namespace (trusted prompt code, then proxies for the program's names) and run
    the test code in it; returns normally only if the test code did."""
    os.environ.clear()
    os.environ.update(env)
    sys.argv = ["tests.py"]  # sys.path has no work dir: nothing the program writes is importable here

    class RemoteError(RuntimeError):
        pass

    def handle(v):
        if type(v) is not list or len(v) != 2 or type(v[0]) is not int:
            raise ValueError("malformed data")
        return Remote(v[0], str(v[1]))

    chan = Channel(chan_fds[0], chan_fds[1], revive(handle))
    Remote = remote_class(rpc_client(chan, RemoteError))
    ns = tests_namespace(spec, chan, RemoteError)
    exec(compile(spec["tests"], "tests.py", "exec"), ns)


def rpc_client(chan, RemoteError):
    """One request to the program's process; its reply as data, or its exception raised here (a
    builtin exception type by name, anything else as RemoteError)."""
    import builtins

    def rpc(*req):
        chan.send(list(req))
        r = chan.recv()
        if r is None:
            raise RemoteError("the solution's process ended before the tests finished")
        if type(r) is not list or len(r) != 3:
            raise RemoteError("malformed reply")
        if r[0] == "v":
            return r[1], r[2]
        exc = getattr(builtins, str(r[1]), None)
        if isinstance(exc, type) and issubclass(exc, Exception):
            try:
                err = exc(str(r[2]))
            except Exception:
                err = RemoteError("%s: %s" % (r[1], r[2]))
        else:
            err = RemoteError("%s: %s" % (r[1], r[2]))
        raise err
    return rpc


def remote_class(rpc):
    """The proxy of an object in the program's process: it can be called, iterated or asked for
    attributes, never compared or truth-tested."""

    def refuse(x):
        if isinstance(x, Remote):
            return {"h": [object.__getattribute__(x, "_h"), ""]}
        raise TypeError("cannot pass a %s to the solution's process: only plain data" % type(x).__name__)

    def not_data(self, *a):
        raise TypeError("the solution gave a non-data object (%s): it can be called, iterated or asked "
                        "for attributes, not compared or tested" % object.__getattribute__(self, "_what"))

    class Remote:
        __slots__ = ("_h", "_what")

        def __init__(self, h, what):
            object.__setattr__(self, "_h", h)
            object.__setattr__(self, "_what", what)

        def __call__(self, *args, **kwargs):
            value, changed = rpc("call", self._h, [enc(a, refuse) for a in args],
                                 [[k, enc(v, refuse)] for k, v in kwargs.items()])
            for i, new in changed:
                old = args[i] if type(i) is int and 0 <= i < len(args) else None
                if type(old) is type(new) and type(old) in (list, bytearray):
                    old[:] = new
                elif type(old) is type(new) and type(old) in (dict, set):
                    old.clear()
                    old.update(new)
            return value

        def __getattr__(self, name):
            if name.startswith("__") and name not in ("__name__", "__qualname__", "__doc__"):
                raise AttributeError(name)
            return rpc("getattr", self._h, name)[0]

        def __iter__(self):
            return rpc("iter", self._h)[0]

        def __next__(self):
            return rpc("next", self._h)[0]

        def __repr__(self):
            return "<solution %s>" % self._what

        __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __bool__ = __len__ = not_data
        __hash__ = object.__hash__

    return Remote


def tests_namespace(spec, chan, RemoteError):
    """The trusted prompt code (run while the program's top level runs), then the program's names."""
    import builtins

    ns = {"__name__": "__main__", "__builtins__": builtins}
    if spec["trusted"]:  # while the program's top level runs
        exec(compile(spec["trusted"], "prompt_code.py", "exec"), ns)
    names = chan.recv()
    if type(names) is not list:
        raise RemoteError("the solution's process ended before the tests started")
    entry = spec["entry"]
    for name, value in names:
        # the entry point always comes from the solution; other names only where the trusted code
        # and the builtins have none (a solution's own `abs` or `poly` must not change the tests)
        if name == entry or (name not in ns and not hasattr(builtins, name)):
            ns[name] = value
    return ns


def harness(cfg, prog, work, tests_fd, report_fd):
    """Init's job in harness mode: the program's and the tests' processes; the verdict."""
    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()

    def program():
        g = run_program(prog, cfg, work)
        sys.stdout.flush()
        serve((req_r, resp_w), g)

    prog_pid = spawn(program, close=(req_w, resp_r, tests_fd, report_fd))
    os.close(req_r)
    os.close(resp_w)
    nonce = os.urandom(16).hex().encode()  # made after the program's process exists: never in its memory
    res_r, res_w = os.pipe()

    def tests():
        run_tests_process(cfg, work, tests_fd, (resp_r, req_w), res_w, nonce)

    tests_pid = spawn(tests, close=(res_r, report_fd))
    for fd in (req_w, resp_r, res_w, tests_fd):
        os.close(fd)
    ended = wait_for_tests(tests_pid, prog_pid)
    got = read_all(res_r)
    if not any(pid == prog_pid for pid, _ in ended):
        try:
            os.kill(prog_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        reap({prog_pid})
    return verdict(ended, tests_pid, prog_pid, got == nonce)


def run_tests_process(cfg, work, tests_fd, chan_fds, res_w, nonce):
    """The tests' process: read the test code, run it, and only if it returned write the nonce."""
    spec = json.loads(read_all(tests_fd))
    os.close(tests_fd)
    if cfg["limits"]["site_packages"]:
        import site
        site.main()
    try:
        run_tests(spec, chan_fds, dict(cfg["env"], HOME=work, TMPDIR=work))
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    sys.stdout.flush()
    sys.stderr.flush()
    write_all(res_w, nonce)


def wait_for_tests(tests_pid, prog_pid):
    """Reap until the tests' process ended; (pid, status) of the two, in the order they ended."""
    ended = []
    while not any(pid == tests_pid for pid, _ in ended):
        try:
            pid, st = os.waitpid(-1, 0)
        except ChildProcessError:
            ended.append((tests_pid, 1 << 8))
            break
        except InterruptedError:
            continue
        if pid in (tests_pid, prog_pid):
            ended.append((pid, st))
    return ended


def verdict(ended, tests_pid, prog_pid, nonce_ok):
    """(passed, status): a pass needs the tests' clean exit and the nonce."""
    tests_status = dict(ended)[tests_pid]
    if os.WIFEXITED(tests_status) and os.WEXITSTATUS(tests_status) == 0 and nonce_ok:
        return True, 0
    # why it failed: the program's own end when it ended first (a crash, a limit), else the tests'
    if ended[0][0] == prog_pid and ended[0][1] != 0:
        return False, ended[0][1]
    return False, tests_status or 1 << 8


def read_inputs(cfg):
    """The program's source, and the test code's descriptor (harness mode; its file unlinked)."""
    with open(os.path.join(cfg["work"], "prog.py"), "rb") as f:
        prog = f.read()
    tests_fd = -1
    if cfg["harness"]:
        tests_path = os.path.join(cfg["work"], "tests.json")
        tests_fd = os.open(tests_path, os.O_RDONLY)
        os.unlink(tests_path)
    return prog, tests_fd


def isolate_root(cfg, prog, tests_fd):
    """Root: new PID + network namespaces; the bootstrap stays outside as the reporter, and the forked
    init (PID 1) enters its mount namespace and filesystem view. Returns init's (work, report_fd)."""
    host_work, vfd = cfg["work"], cfg["vfd"]
    with open(os.path.join(host_work, "stdin.txt"), "rb") as f:
        stdin_data = f.read()
    check(libc.unshare(NEWPID | (0 if cfg["network"] else NEWNET)) == 0, "unshare")
    rfd, wfd = os.pipe()
    pid = os.fork()  # the child is PID 1 (init) of the new PID namespace
    if pid:
        report_init(pid, rfd, wfd, vfd, tests_fd)
    os.close(rfd)
    os.close(vfd)
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    import select
    poll = select.poll()
    poll.register(wfd, select.POLLOUT)
    if any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poll.poll(0)):
        os._exit(125)  # the bootstrap died before the prctl
    check(libc.unshare(NEWNS) == 0, "unshare")
    build_view(host_work, cfg)
    work = INSIDE
    for name, data in (("prog.py", prog), ("stdin.txt", stdin_data)):
        with open(os.path.join(work, name), "wb") as f:
            f.write(data)
        os.chown(os.path.join(work, name), cfg["uid"], cfg["uid"])
    return work, wfd


def report_init(pid, rfd, wfd, vfd, tests_fd):
    """The bootstrap outside the namespaces: wait for init, pass on its verdict, end as it did."""
    os.close(wfd)
    if tests_fd >= 0:
        os.close(tests_fd)
    status, _ = reap({pid})
    report = read_all(rfd)
    write_all(vfd, report)
    try:
        die_like(json.loads(report)["status"])
    except ValueError:
        die_like(status[pid])


def isolate_plain(cfg, prog, tests_fd):
    """No root: the bootstrap is init itself, in the host's namespaces. Returns (work, report_fd)."""
    return cfg["work"], cfg["vfd"]


def isolate_userns(cfg, prog, tests_fd):
    """No root on Linux: as :func:`isolate_plain`, in a user + network namespace for no network
    where the kernel allows."""
    if cfg["netns"] and not cfg["network"]:
        check(libc.unshare(NEWUSER | NEWNET) == 0, "unshare")
    return isolate_plain(cfg, prog, tests_fd)


def setlim(res, v):
    try:
        resource.setrlimit(res, (v, v))
    except (ValueError, OSError):
        pass


def set_rlimits(lim):
    resource.setrlimit(resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"] + 1))
    setlim(resource.RLIMIT_AS, lim["memory_mb"] << 20)
    setlim(resource.RLIMIT_FSIZE, lim["fsize_mb"] << 20)
    setlim(resource.RLIMIT_NOFILE, lim["nofile"])


def become(uid):
    """Root: the sandbox uid/gid, no supplementary groups."""
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    if os.getuid() != uid or os.geteuid() != uid:
        fail("could not drop privileges")
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # setuid cleared it


def drop_privileges(mode, uid):
    if mode.become is not None:
        mode.become(uid)
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    prctl(PR_SET_DUMPABLE, 0)  # the program (same uid) cannot ptrace init or the tests


def run_harness_mode(mode, cfg, prog, work, tests_fd, report_fd):
    passed, status = harness(cfg, prog, work, tests_fd, report_fd)
    write_all(report_fd, json.dumps({"status": status, "passed": passed}).encode())
    # a reporter outside ends as the verdict says; an init that is the bootstrap ends so itself
    os._exit(0) if mode.reporter_outside else die_like(status)


def run_as_pid2(prog, cfg, work, report_fd):
    # init ignores signals it has no handler for (SIGXCPU would not kill it): run the program as
    # PID 2 and stay as its reaper
    prog_pid = spawn(lambda: run_program(prog, cfg, work), close=(report_fd,))
    status, _ = reap({prog_pid})
    write_all(report_fd, json.dumps({"status": status[prog_pid]}).encode())
    os._exit(0)


def run_in_process(prog, cfg, work, report_fd):
    os.close(report_fd)  # elsewhere the program runs in this process: nothing of the verdict channel
    try:
        run_program(prog, cfg, work)
    except SystemExit:
        raise
    except BaseException:
        import traceback
        traceback.print_exc()
        sys.stderr.flush()
        sys.exit(1)


class Mode:
    """What the bootstrap does for one of ``mlx_ssp.verify.sandbox.MODES`` (same names)."""

    def __init__(self, isolate, become, run, reporter_outside):
        self.isolate = isolate  # (cfg, prog, tests_fd) -> (work, report_fd)
        self.become = become  # uid -> None: change credentials (root only), or None
        self.run = run  # (prog, cfg, work, report_fd): run the program without a harness
        self.reporter_outside = reporter_outside  # init is PID 1 with the bootstrap outside reporting


MODES = {
    "root": Mode(isolate_root, become, run_as_pid2, reporter_outside=True),
    "userns": Mode(isolate_userns, None, run_in_process, reporter_outside=False),
    "plain": Mode(isolate_plain, None, run_in_process, reporter_outside=False),
}


def main():
    cfg = json.loads(sys.argv[1])
    die_with_parent(cfg["ppid"])
    signal.alarm(cfg["alarm_s"])  # a backstop for the caller's wall limit: SIGALRM ends the sandbox
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    mode = MODES[cfg["mode"]]
    prog, tests_fd = read_inputs(cfg)
    work, report_fd = mode.isolate(cfg, prog, tests_fd)
    set_rlimits(cfg["limits"])
    drop_privileges(mode, cfg["uid"])
    setlim(resource.RLIMIT_NPROC, cfg["limits"]["nproc"])
    os.chdir(work)
    # init has Python's SIGINT handler, so the program (same uid) could interrupt it: ignore it there
    # (the non-root program runs in this process when there are no tests: it keeps the handler)
    if mode.reporter_outside or cfg["harness"]:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if cfg["harness"]:
        run_harness_mode(mode, cfg, prog, work, tests_fd, report_fd)
    mode.run(prog, cfg, work, report_fd)

if __name__ == "__main__":
    main()
