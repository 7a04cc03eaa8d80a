"""The code sandbox's lifetime: it dies with its caller (also a SIGKILLed or stalled one), and the
stale work dirs of dead callers are cleaned."""

from __future__ import annotations

import os
import time

import pytest

from mlx_ssp.verify.sandbox import IS_LINUX

from sandbox_helpers import _view_enforced

#: Wall-time slack for starting and stopping processes: seconds on an idle machine, more on a busy one
#: (a Python start-up took 20 s at load 14). A bound is only as tight as what it must tell apart.
SLACK_S = 60


# -- the sandbox dies with its caller; leftovers are cleaned ------------------------

def _descendants(root: int) -> set[int]:
    parent = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    parent[int(p)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    out, frontier = set(), {root}
    while frontier:
        frontier = {c for c, pp in parent.items() if pp in frontier} - out
        out |= frontier
    return out


def _alive(pids) -> set[int]:
    out = set()
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    out.add(p)
        except OSError:
            pass
    return out


def _wait(cond, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def _caller(call: str):
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-c", f"from mlx_ssp.verify.sandbox import *\n{call}"])


@pytest.mark.skipif(not IS_LINUX, reason="PR_SET_PDEATHSIG is Linux only")
@pytest.mark.parametrize("harness", [False, True])
def test_sigkilled_caller_takes_the_sandbox_with_it(harness):
    import signal
    import subprocess
    import sys
    import tempfile

    prog = "import time\ntime.sleep(60)\ndef f():\n    pass"
    call = f"run_python({prog!r}, Limits(wall_s=30, cpu_s=30)" + (", harness=Harness('f()')" if harness else "") + ")"
    caller = _caller(call)
    base = os.path.realpath(tempfile.gettempdir())
    try:
        # the sandbox is up: bootstrap + program (+ init, + tests) under the caller
        want = (3 if _view_enforced() else 1) + (1 if harness else 0)
        assert _wait(lambda: len(_descendants(caller.pid)) >= want, SLACK_S), "sandbox never started"
        time.sleep(0.3)
        kids = _descendants(caller.pid)
        dirs = set()
        for p in kids:
            try:
                d = os.readlink(f"/proc/{p}/cwd")
            except OSError:
                continue
            if os.path.dirname(d) == base and os.path.basename(d).startswith("mlx_ssp_"):
                dirs.add(d)
        assert dirs
        caller.send_signal(signal.SIGKILL)
        caller.wait()
        # the program sleeps 60 s: dead well before that, it went with its caller
        assert _wait(lambda: not _alive(kids), 30), f"still running: {_alive(kids)}"
        assert all(os.path.isdir(d) for d in dirs)  # SIGKILL cleans nothing...
        nxt = subprocess.run([sys.executable, "-c", "from mlx_ssp.verify.sandbox import *\nprint(run_python('print(1)').stdout)"],
                             capture_output=True, text=True, timeout=60)
        assert nxt.stdout.strip() == "1", nxt
        assert not any(os.path.exists(d) for d in dirs)  # ...the next start does
    finally:
        if caller.poll() is None:
            caller.kill()


def test_stale_dirs_of_live_processes_are_kept(tmp_path):
    from mlx_ssp.verify.sandbox import _STALE_PREFIX, clean_stale

    mine = tmp_path / f"{_STALE_PREFIX}{os.getpid()}_abc"
    dead = tmp_path / f"{_STALE_PREFIX}999999999_abc"
    other = tmp_path / "mlx_ssp_sbx_unrelated"
    for d in (mine, dead, other):
        d.mkdir()
    assert clean_stale(str(tmp_path)) == 1
    assert mine.exists() and other.exists() and not dead.exists()


@pytest.mark.skipif(not IS_LINUX, reason="Linux only")
def test_the_sandbox_ends_at_its_alarm_when_the_caller_stalls():
    """The wall limit holds from inside too: a caller that is stopped (not dead) cannot keep a
    sandboxed program running past wall_s + 3 s (the bootstrap's backstop alarm)."""
    import signal

    caller = _caller("run_python('import time\\ntime.sleep(60)', Limits(wall_s=1, cpu_s=30))")
    try:
        assert _wait(lambda: bool(_descendants(caller.pid)), SLACK_S)
        time.sleep(0.3)
        kids = _descendants(caller.pid)
        caller.send_signal(signal.SIGSTOP)
        # the program sleeps 60 s and its caller is stopped: dead well before that, the alarm ended it
        assert _wait(lambda: not _alive(kids), 30), _alive(kids)
    finally:
        caller.kill()
        caller.wait()
        import tempfile

        from mlx_ssp.verify import sandbox

        if hasattr(sandbox, "clean_stale"):
            sandbox.clean_stale(tempfile.gettempdir())  # the killed caller's work dir
