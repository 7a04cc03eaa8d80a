"""Every verifier bounds its work, and the pathological answers score as they should.

The bound is on the work, not the time (which depends on the machine's load): each case counts the
steps the verifier's scans charge (:mod:`mlx_ssp.text.work`) and checks them against a few passes
over the text. Each runs in a forked child under a CPU-time limit, so that code that spins where no
counter sees (catastrophic backtracking inside a regex) fails the test instead of hanging the suite."""

from __future__ import annotations

import random
import re
import threading
import time

import pytest

from mlx_ssp.tasks import Task
from mlx_ssp.testing import run_cpu_bounded
from mlx_ssp.text.work import counted
from mlx_ssp.verify import ITEM_TIME_LIMIT_S, VerifyResult, register, verify
from mlx_ssp.verify.extract import MAX_SCAN_CHARS, extract

#: CPU seconds a case may use: each takes milliseconds; the slow forms these cases guard against
#: took 5 s to hours.
CPU_LIMIT_S = 2


def _counted(fn, *args):
    with counted() as work:
        value = fn(*args)
    return value, work.steps


def bounded(fn, *args):
    """``fn(*args)`` in a forked child under a CPU-time limit: its result and the work it charged."""
    return run_cpu_bounded(_counted, fn, *args, cpu_s=CPU_LIMIT_S)


def linear(text: str, cut: bool = True) -> int:
    """The work a verifier may charge for ``text``: one look for ``</think>`` over all of it, then
    at most ten linear passes over the part it searches (the last MAX_SCAN_CHARS characters, or
    all of it where ``cut`` is False). The quadratic forms were thousands of passes."""
    return len(text) + 10 * (min(len(text), MAX_SCAN_CHARS) if cut else len(text))


def _math(answer="42", mode="strict"):
    return Task(id="t", domain="d", prompt="p", answer=answer, verifier="math", metadata={"answer_extraction": mode})


_F = Task(id="x", domain="d", prompt="p", verifier="toolcall", answer=[{"f": {"x": [1]}}])


def _tool_text(calls):
    return "".join('<tool_call>{"name": "f", "arguments": {"x": %d}}</tool_call>' % x for x in calls)


# -- item 5: extraction is linear and capped ---------------------------------------------------------

@pytest.mark.parametrize(
    "text,mode,want",
    [
        ("Answer:\n" * 8000, "strict", ""),  # reported: 18.7 s
        ("####\n" * 20000, "strict", ""),  # the same scan through the "####" marker
        ("\\boxed{" * 4000, "strict", None),  # reported: 4.9 s
        ("\\boxed{" * 100000, "strict", None),  # reported: did not finish in 7 minutes
        ("so the answer" + " " * 60000 + "is 7", "strict", None),  # two adjacent [ \t]* in the marker regex
        ("so the answer" + " " * 60000 + "is 7", "lenient", "7"),
        ("Answer: 5 " + "*" * 40 + " (units)", "strict", "5 " + "*" * 40 + " (units)"),  # exponential _clean
    ],
)
def test_pathological_extraction_is_linear(text, mode, want):
    ex, steps = bounded(extract, text, mode)
    assert (ex.text if ex else None) == want
    assert steps <= linear(text)


def test_boxed_answer_still_found_after_unclosed_boxes():
    text = "\\boxed{" * 50000 + " so \\boxed{\\frac{1}{2}} and \\boxed{ never closed"
    ex, steps = bounded(extract, text, "strict")
    assert (ex.method, ex.text) == ("boxed", "\\frac{1}{2}")
    assert steps <= linear(text)


def test_only_the_tail_is_scanned_and_the_answer_there_is_found():
    from mlx_ssp.verify.extract import MAX_SCAN_CHARS

    long = "Answer: 1\n" + "x" * MAX_SCAN_CHARS + "\nAnswer: 2"
    assert extract(long).text == "2"
    assert extract("Answer: 1\n" + "x" * MAX_SCAN_CHARS) is None  # the early marker is out of reach
    assert extract("Answer: 1\n" + "x" * (MAX_SCAN_CHARS - 20)).text == "1"


def _old_strip(ans: str) -> str:
    return re.sub(r"^(?:\*\*|__|\*|`)+|(?:\*\*|__|\*|`)+$", "", ans)


def test_emphasis_stripping_equals_the_regex_it_replaced():
    from mlx_ssp.verify.extract import _strip_emphasis

    rng = random.Random(0)
    for _ in range(20000):
        s = "".join(rng.choice("*_`x $") for _ in range(rng.randrange(0, 12))).strip()
        assert _strip_emphasis(s) == _old_strip(s), s


def test_pathological_code_fences_are_linear():
    from mlx_ssp.verify.code import extract_code

    for text in ("```" + "a" * 200000, "`" * 300000, "```\n" * 100000):
        _, steps = bounded(extract_code, text)
        assert steps <= linear(text, cut=False)
    assert extract_code("x\n```python\ndef f():\n  return 1\n```\nmore ```py\nprint(2)") == "print(2)"
    assert extract_code("```py\nA\n```\n```python\ndef g(): pass\n```\n```\nB", "g") == "def g(): pass\n"


@pytest.mark.parametrize(
    "text,reason",
    [
        ("{" * 200000, "no_tool_call"),  # reported: 10.9 s
        ('{"' * 100000, "malformed_tool_call"),
        ("[]" * 100000, "no_tool_call"),
        ("<tool_call>x" + " " * 60000 + "y", "malformed_tool_call"),  # lazy body + \s* backtracking
        ("[" + '{"a": 1}, ' * 20000, "no_tool_call"),  # one unclosed list of 20000 objects
        ('[{"a": 1}, ' * 20000, "malformed_tool_call"),  # 20000 nested lists
    ],
)
def test_pathological_toolcall_text_is_linear(text, reason):
    res, steps = bounded(verify, text, _F)
    assert res.reason == reason
    assert steps <= linear(text)


# -- item 6: math -----------------------------------------------------------------------------------

@pytest.mark.parametrize("answer", ["9^{9^{9^{9}}}", "1000000000!", "9^{9999999}", "(10!)!", "x^{9^{9^{9}}}"])
def test_huge_numbers_are_refused_before_math_verify(answer):
    # the reason is given before math-verify is called (which spent 5 s on each), and the
    # estimate of the size is bounded by the CPU limit
    res, steps = bounded(verify, f"Answer: {answer}", _math())
    assert res.reason == "answer_too_complex" and res.reward == 0.0
    assert steps <= linear(f"Answer: {answer}")


def test_ordinary_powers_and_factorials_still_reach_math_verify():
    from mlx_ssp.verify.math import too_complex

    for a in ("2^{10}", "2^{2^{10}}", "10^{100}", "100!", "\\binom{1000}{500}", "e^{-x^2}", "(1+x)^{100}",
              "\\left(\\frac{3}{2}, \\frac{\\sqrt{3}}{2}\\right)", "1,234,567", "9^{99999}"):
        assert too_complex(a) is None, a
    assert verify("Answer: 2^{10}", _math("1024")).reward == 1.0
    assert verify("Answer: 5!", _math("120")).reward == 1.0


def test_answer_in_190_parentheses_scores_correct():
    res, _ = bounded(verify, "Answer: " + "(" * 190 + "42" + ")" * 190, _math())
    assert res.reason == "correct"
    res, _ = bounded(verify, "Answer: " + "{" * 100 + "41" + "}" * 100, _math())
    assert res.reason == "wrong_answer"


def test_deep_non_redundant_nesting_is_too_complex():
    res, _ = bounded(verify, "Answer: " + "\\frac{1}{" * 30 + "2" + "}" * 30, _math())
    assert res.reason == "answer_too_complex"  # decided before math-verify is called


# -- item 6: toolcall -------------------------------------------------------------------------------

@pytest.mark.parametrize("same", [False, True])
def test_two_thousand_correct_calls_score_one(same):
    xs = [1] * 2000 if same else list(range(2000))
    task = Task(id="x", domain="d", prompt="p", verifier="toolcall", answer=[{"f": {"x": [x]}} for x in xs])
    order = xs[:] if same else random.Random(0).sample(xs, len(xs))
    res, steps = bounded(verify, _tool_text(order), task)
    assert (res.reward, res.reason) == (1.0, "correct")
    assert steps <= linear(_tool_text(order))  # pairing every call with every expected one: 4 million
    wrong = order[:-1] + [5000]
    res, steps = bounded(verify, _tool_text(wrong), task)
    assert (res.reward, res.reason) == (0.0, "wrong_argument")
    assert steps <= linear(_tool_text(wrong))


@pytest.mark.parametrize("text", [
    "<tool_call>" + "[" * 100000 + "]" * 100000 + "</tool_call>",
    "[" * 100000 + "]" * 100000,
    '<tool_call>{"name": "f", "arguments": {"x": ' + "[" * 100000 + "1" + "]" * 100000 + "}}</tool_call>",
])
def test_deep_nesting_is_a_malformed_call(text):
    res, steps = bounded(verify, text, _F)
    assert res.reason == "malformed_tool_call", res
    assert "nested deeper" in res.detail
    assert steps <= linear(text)


def test_first_json_search_keeps_its_order():
    t = _F
    # an outer non-call object holding a call: the nested call is found
    assert verify('Calling: {"calls": [{"name": "f", "arguments": {"x": 1}}]}', t).reward == 1.0
    # an invalid outer value does not hide a valid call inside it
    assert verify('{"note": oops, "c": {"name": "f", "arguments": {"x": 1}}', t).reward == 1.0
    # the first call-like value wins over a later one
    assert verify('{"name": "g", "arguments": {}} then {"name": "f", "arguments": {"x": 1}}', t).reason == "wrong_function"
    # braces inside strings do not confuse the extent
    assert verify('{"name": "f", "arguments": {"x": 1, "s": "}]{["}}', t).reason == "unexpected_argument"


# -- the per-item time limit ------------------------------------------------------------------------

@register("_bounds_slow")
def _slow(completion: str, task: Task) -> VerifyResult:
    while True:  # a scorer stuck in Python code that even swallows ordinary exceptions
        try:
            sum(range(1000))
        except Exception:
            pass


def test_time_limit_scores_zero_with_a_reason_in_any_thread():
    t = Task(id="s", domain="d", prompt="p", verifier="_bounds_slow", answer="1")
    t0 = time.monotonic()
    res = verify("x", t, time_limit=0.2)
    assert (res.reward, res.reason) == (0.0, "verifier_timeout")
    assert res.detail == "no verdict within 0.2 s"
    out = []
    th = threading.Thread(target=lambda: out.append(verify("x", t, time_limit=0.2)))
    th.start()
    th.join(60)  # returns as soon as the thread ends; 60 s only if the limit never fires
    assert out and out[0].reason == "verifier_timeout"
    # the outcome is what counts; this only tells the 0.2 s limit from the default one, whatever
    # the load (the watchdog polls every 50 ms)
    assert time.monotonic() - t0 < ITEM_TIME_LIMIT_S
    # nothing is left pending: fast verifications right after a timeout are unaffected
    for _ in range(200):
        assert verify("Answer: 7", _math("7")).reason == "correct"
