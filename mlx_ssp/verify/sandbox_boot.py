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
closes before it starts, the file unlinked), so it cannot report a pass. The data protocol and the
tests' side of harness mode are in :mod:`mlx_ssp.verify.sandbox_rpc`, which the bootstrap loads from its
path when it starts (:func:`load_beside`), before any isolation step.
"""

import ctypes
import json
import os
import resource
import signal
import sys
import types

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 4096, 8192, 16384, 1 << 18
NEWNS, NEWNET, NEWPID, NEWUSER = 0x20000, 0x40000000, 0x20000000, 0x10000000
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
INSIDE = "/sandbox"  # the work dir's path inside the filesystem view
DEV_NODES = ("null", "zero", "full", "random", "urandom")

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
# prctl is Linux's: on macOS the symbol does not exist, and the options it sets (death signal, no new
# privileges, not dumpable) have no equivalent there, so the call is skipped (see docs/tasks.md)
_prctl = getattr(libc, "prctl", None)
if _prctl is not None:
    _prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


def load_beside(name):
    """A trusted module of this directory, run from its path into a module object of its own. No
    import by name: -I leaves this directory off sys.path, and a name the program's work dir could
    shadow is never looked up; not in sys.modules. Called as the bootstrap starts, before any
    isolation step, so the filesystem view need not hold it."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
    with open(path, "rb") as f:
        source = f.read()
    # named as the bootstrap is (__main__): its classes and tracebacks read as the bootstrap's own
    mod = types.ModuleType(__name__)
    mod.__file__ = path
    exec(compile(source, path, "exec"), mod.__dict__)
    return mod


# the harness's data protocol, the program's side and the tests' side
_rpc = load_beside("sandbox_rpc.py")
read_all, write_all, serve, run_tests = _rpc.read_all, _rpc.write_all, _rpc.serve, _rpc.run_tests


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


# -- harness mode: the two processes and the verdict ---------------------------------------------

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
