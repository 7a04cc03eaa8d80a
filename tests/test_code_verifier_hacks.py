"""The code verifier cannot be gamed: a wrong solution that exits early, patches its interpreter or
forges the verdict scores 0; legitimate solutions (in-place, classes, generators, exceptions,
every plain data type) still pass."""

from __future__ import annotations

import pytest

from mlx_ssp.tasks import Task
from mlx_ssp.verify import verify

TESTS = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n\ncheck(add)\n"
SANDBOX = {"wall_s": 4, "cpu_s": 2}


def _task(answer=TESTS, **md) -> Task:
    return Task(id="t", domain="d", prompt="p", verifier="code", answer=answer,
                metadata={"entry_point": "add", "sandbox": SANDBOX, **md})


def _code(body: str) -> str:
    return f"```python\n{body}\n```"


WRONG = "def add(a, b):\n    return 0\n"
# Each is a wrong `add` plus a way to fake success. All passed before the fix (exit status 0 was a
# pass), except where the comment says it is a regression guard.
HACKS = {
    "SystemExit(0)": WRONG + "raise SystemExit(0)",
    "os._exit(0)": WRONG + "import os\nos._exit(0)",
    "sys.exit patched": WRONG + "import sys\nsys.exit = lambda *a: None",
    "atexit os._exit": WRONG + "import atexit, os\natexit.register(os._exit, 0)",
    "__del__ at shutdown": WRONG + "import os\nclass D:\n    def __del__(self):\n        os._exit(0)\nd = D()",
    "traceback patched": WRONG + "import os, traceback\ntraceback.print_exc = lambda *a, **k: os._exit(0)",
    "settrace exits on the assertion": WRONG + (
        "import os, sys\n"
        "def t(frame, event, arg):\n"
        "    if event == 'exception' and arg[0] is AssertionError:\n"
        "        os._exit(0)\n"
        "    return t\n"
        "sys.settrace(t)"),
    "always-equal result": "class E:\n    def __eq__(self, o):\n        return True\n    __hash__ = object.__hash__\n"
                           "def add(a, b):\n    return E()",
    "always-equal str subclass": "class S(str):\n    def __eq__(self, o):\n        return True\n"
                                 "    __hash__ = str.__hash__\ndef add(a, b):\n    return S('x')",
    "thread exits early": WRONG + "import os, threading, time\n"
                                  "threading.Thread(target=lambda: (time.sleep(0.3), os._exit(0))).start()",
    # regression guards: these failed before too, and must keep failing
    "BaseException subclass": "class Q(BaseException):\n    pass\ndef add(a, b):\n    raise Q()",
    "kill every other process": WRONG + (
        "import os, signal\n"
        "for p in os.listdir('/proc'):\n"
        "    if p.isdigit() and int(p) != os.getpid():\n"
        "        try:\n            os.kill(int(p), signal.SIGKILL)\n        except OSError:\n            pass"),
    "close every descriptor": WRONG + "import os\nos.closerange(0, 4096)",
    "write a verdict on every descriptor": WRONG + (
        "import os\n"
        "for fd in range(3, 256):\n"
        "    try:\n        os.write(fd, b'passed' * 8)\n    except OSError:\n        pass\n"
        "for p in os.listdir('/proc') if os.path.isdir('/proc') else []:\n"
        "    d = f'/proc/{p}/fd'\n"
        "    try:\n        names = os.listdir(d)\n    except OSError:\n        continue\n"
        "    for n in names:\n"
        "        try:\n            fd = os.open(f'{d}/{n}', os.O_WRONLY)\n            os.write(fd, b'passed' * 8)\n"
        "        except OSError:\n            pass"),
}


@pytest.mark.parametrize("name", list(HACKS))
def test_a_faked_success_scores_zero(name):
    r = verify(_code(HACKS[name]), _task())
    assert r.reward == 0.0, (name, r)


@pytest.mark.parametrize("tests, patch", [
    ("assert abs(add(2, 3) - 5) < 1e-9\n", "import builtins\nbuiltins.abs = lambda x: 0"),
    ("import math\nassert math.isclose(add(1, 1), 2)\n", "import math\nmath.isclose = lambda *a, **k: True"),
    ("assert sorted([add(0, 1)]) == [1]\n", "def sorted(x):\n    return [1]"),
    ("assert abs(add(2, 3) - 5) < 1e-9\n", "def abs(x):\n    return 0"),
])
def test_patched_builtins_and_modules_do_not_reach_the_tests(tests, patch):
    assert verify(_code("def add(a, b):\n    return a + b"), _task(tests)).reward == 1.0
    r = verify(_code(WRONG + patch), _task(tests))
    assert r.reward == 0.0, (patch, r)


def test_a_redefined_prompt_helper_does_not_change_the_tests():
    """HumanEval/32-style: the tests call a helper from the prompt; a completion that redefines the
    helper (so any answer checks out) must not change what the tests call."""
    prompt = "def poly(xs, x):\n    return sum(c * x ** i for i, c in enumerate(xs))\n\ndef root(xs):\n    \"\"\"A root.\"\"\"\n"
    tests = "def check(candidate):\n    assert abs(poly([-6, 1], candidate([-6, 1]))) < 1e-6\n\ncheck(root)\n"
    t = Task(id="p", domain="d", prompt="p", verifier="code", answer=tests,
             metadata={"entry_point": "root", "prompt_code": prompt, "sandbox": SANDBOX})
    hack = "def poly(xs, x):\n    return 0\ndef root(xs):\n    return 123.0"
    assert verify(_code(hack), t).reward == 0.0
    assert verify("    return -xs[0] / xs[1]\n", t).reward == 1.0  # a body continuation
    # a full function that relies on the prompt's helper being there for the tests
    assert verify(_code("def root(xs):\n    return -xs[0] / xs[1]"), t).reward == 1.0


def test_the_program_cannot_see_the_tests():
    """The test code (it holds the expected answers) is nowhere the program can read: not in its
    files, its memory, its arguments, its environment or other processes' /proc entries."""
    secret = "EXPECTED_ANSWER_4242"
    tests = f"# {secret}\nassert add(2, 3) == 5\n"
    probe = (
        "import gc, os\n"
        f"s = {secret[:8]!r} + {secret[8:]!r}\n"
        "found = []\n"
        "if any(isinstance(o, str) and s in o for o in gc.get_objects()):\n    found.append('memory')\n"
        "for root, dirs, files in os.walk('.'):\n"
        "    for f in files:\n"
        "        try:\n            found += [f] if s in open(os.path.join(root, f), errors='replace').read() else []\n"
        "        except OSError:\n            pass\n"
        "for p in os.listdir('/proc'):\n"
        "    for what in ('cmdline', 'environ'):\n"
        "        try:\n            found += [p + what] if s.encode() in open(f'/proc/{p}/{what}', 'rb').read() else []\n"
        "        except OSError:\n            pass\n"
        "if found:\n    def add(a, b):\n        return a + b\n"
        "else:\n    def add(a, b):\n        return 0\n"
    )
    r = verify(_code(probe), _task(tests))
    assert r.reward == 0.0, r


LEGIT = [
    # (solution, tests)
    ("def add(a, b):\n    return a + b", TESTS),
    ("class Solution:\n    def twoSum(self, xs, t):\n        seen = {}\n        for i, x in enumerate(xs):\n"
     "            if t - x in seen:\n                return [seen[t - x], i]\n            seen[x] = i\n"
     "def add(a, b):\n    return a + b",
     "assert Solution().twoSum([2, 7, 11], 9) == [0, 1]\n"),
    ("def add(xs, x):\n    xs.append(x)\n    xs.sort()",  # in place: the tests see the change
     "l = [3, 1]\nadd(l, 2)\nassert l == [1, 2, 3]\nd = {}\n"),
    ("def add(n, m):\n    for i in range(n):\n        yield i * m",
     "assert list(add(3, 2)) == [0, 2, 4]\nassert sum(add(4, 1)) == 6\n"),
    ("def add(a, b):\n    if b == 0:\n        raise ValueError('zero')\n    return a / b",
     "try:\n    add(1, 0)\n    raise AssertionError('no error')\nexcept ValueError:\n    pass\nassert add(1, 4) == 0.25\n"),
    ("def add(a, b):\n    return (a, [b], {a: b}, {a}, frozenset([b]), b'x', bytearray(b'y'), 1 + 2j, 10 ** 40,"
     " float('inf'), None, True, 0.1 + 0.2, 'é\\ud800')",
     "r = add(1, 2)\nassert r == (1, [2], {1: 2}, {1}, frozenset([2]), b'x', bytearray(b'y'), 1 + 2j, 10 ** 40,"
     " float('inf'), None, True, 0.1 + 0.2, 'é\\ud800'), r\nassert type(r[0]) is int and type(r[10]) is type(None)\n"
     "assert add(1, 2)[11] is True\nimport math\nassert math.isnan(add.__call__(1, 2)[9] - float('inf'))\n"),
    ("import math\nLIMIT = 7\ndef add(a, b):\n    return math.floor(a + b)",
     "assert add(1.5, 2) == 3 and LIMIT == 7\n"),
]


@pytest.mark.parametrize("i", range(len(LEGIT)))
def test_legitimate_solutions_pass(i):
    sol, tests = LEGIT[i]
    r = verify(_code(sol), _task(tests))
    assert r.reward == 1.0, r


def test_a_non_data_result_cannot_be_compared():
    r = verify(_code("class R:\n    pass\ndef add(a, b):\n    return R()"), _task("assert add(1, 2) != 3\n"))
    assert r.reward == 0.0 and "non-data" in r.detail, r


def test_stdin_cases_are_judged_on_stdout_only():
    """Case-list tasks compare stdout; an early exit with status 0 prints nothing and scores 0."""
    io = Task(id="io", domain="d", prompt="p", verifier="code", metadata={"sandbox": SANDBOX},
              answer=[{"input": "2 3\n", "output": "5\n"}, {"input": "1 1", "output": "2"}])
    assert verify(_code("a, b = map(int, input().split())\nprint(a + b)"), io).reward == 1.0
    for hack in ("raise SystemExit(0)", "import os\nos._exit(0)", "print(5)\nimport os\nos._exit(0)",
                 "import atexit, os\natexit.register(os._exit, 0)\nprint(5)\nraise ValueError"):
        r = verify(_code(hack), io)
        assert r.reward == 0.0, (hack, r)
