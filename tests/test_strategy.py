"""Strategy-level distances: identity 0, symmetry, a paraphrase of the same steps closer
than a different method (the check that word n-grams failed), per domain, on hand-made examples."""

from __future__ import annotations

import numpy as np
import pytest

from mlx_ssp.select import strategy as S
from mlx_ssp.select import DISTANCES, ngram_distance_fn

MATH = {  # (3 + 5) * 2
    "method": "First add: 3 + 5 = 8. Then multiply: 8 * 2 = 16.\nAnswer: 16",
    "paraphrase": "We sum the two numbers, 5+3=8, and the total times two is 8×2 = 16. So the result is 16.\nAnswer: 16",
    "other": "First multiply: 3 * 2 = 6. Then multiply: 5 * 2 = 10. Then add: 6 + 10 = 16.\nAnswer: 16",
    "bare": "Answer: 16",
}
CODE = {
    "method": "```python\ndef total(xs):\n    s = 0\n    for x in xs:\n        s += x\n    return s\n```",
    "paraphrase": "Here you go:\n```python\ndef total(values):\n    \"\"\"Sum them.\"\"\"\n    acc = 0\n    for v in values:\n        acc += v\n    return acc\n```",
    "other": "```python\ndef total(xs):\n    return sum(xs)\n```",
    "bare": "I cannot write code for this.",
}
CALLS = {
    "method": '<tool_call>{"name": "cd", "arguments": {"folder": "docs"}}</tool_call>'
              '<tool_call>{"name": "ls", "arguments": {}}</tool_call>',
    "paraphrase": 'Sure! <tool_call>{"name": "cd", "arguments": {"folder": "src"}}</tool_call> and then '
                  '<tool_call>{"name": "ls", "arguments": {}}</tool_call>',
    "other": '<tool_call>{"name": "find", "arguments": {"path": ".", "name": "docs"}}</tool_call>',
    "bare": "There is nothing to call.",
}


@pytest.mark.parametrize("kind,ex", [("steps", MATH), ("ast", CODE), ("calls", CALLS)])
def test_paraphrase_is_closer_than_another_method(kind, ex):
    texts = [ex["method"], ex["paraphrase"], ex["other"], ex["bare"]]
    d = S.distance_fn(kind)(3)(texts)
    assert np.allclose(d, d.T) and np.allclose(np.diag(d), 0)
    assert d[0, 1] == 0.0  # same strategy, other words (and, for code/calls, other names/values)
    assert d[0, 2] > 0.5  # another method
    assert d[0, 3] == S.EMPTY_VS_SOME < d[0, 2]  # a bare answer is not "the most different" solution
    assert all(0.0 <= x <= 1.0 for x in d.ravel())
    assert S.distinct_strategies(texts[:2], kind) == 1 and S.distinct_strategies(texts[:3], kind) == 2


def test_word_ngrams_get_the_math_example_wrong_and_steps_get_it_right():
    """The motivating check: n-grams rank the paraphrase farther than the other method."""
    texts = [MATH["method"], MATH["paraphrase"], MATH["other"]]
    ng = ngram_distance_fn(3)(texts)
    st = S.distance_fn("steps")(3)(texts)
    assert ng[0, 1] > ng[0, 2]
    assert st[0, 1] < st[0, 2]


def test_steps_normalise_numbers_and_operand_order():
    assert S.math_steps("1,000 + 2 = 1002") == S.math_steps("2+1000 = 1,002.0")
    assert S.math_steps("8 - 3 = 5") != S.math_steps("3 - 8 = -5")  # order matters where it changes the value
    assert S.math_steps("the answer is 7") == frozenset()


def test_distances_are_registered_and_auto_maps_verifiers():
    for k in ("steps", "ast", "calls"):
        assert k in DISTANCES
    assert S.AUTO["code"] == "ast" and S.AUTO["math"] == "steps" and S.AUTO["toolcall"] == "calls"


def _recs(texts):
    return [{"task_id": "t", "domain": "m", "sample": i, "prompt": "p", "completion": t, "reward": 1.0,
             "finish_reason": "stop"} for i, t in enumerate(texts)]


def test_auto_selection_keeps_the_other_method_not_the_paraphrase():
    """select with distance: auto on the motivating example: with room for two solutions, the method
    and the other method are kept; n-grams keep the paraphrase instead (the defect strategy distances fix)."""
    from mlx_ssp.select import SelectConfig, select_prompt, strategy_kind

    texts = [MATH["method"], MATH["paraphrase"], MATH["other"]]
    auto, row = select_prompt(_recs(texts), SelectConfig(distance="auto", per_prompt=2, near_duplicate=0.0))
    assert [r["sample"] for r in auto] == [0, 2] and row["strategy_kind"] == "steps" and row["n_strategies"] == 2
    ngram, row_ng = select_prompt(_recs(texts), SelectConfig(distance="ngram", per_prompt=2, near_duplicate=0.0))
    assert [r["sample"] for r in ngram] == [0, 1]
    assert row_ng["n_strategies"] == 2  # the report counts strategies whatever distance selects
    assert strategy_kind(_recs([CODE["method"]])) == "ast" and strategy_kind(_recs([CALLS["method"]])) == "calls"
    assert strategy_kind(_recs(["just words"])) == "ngram"


def _counted_steps(text):
    from mlx_ssp.text.work import counted

    with counted() as work:
        eqs = S.math_steps(text)
    return eqs, work.steps


def test_equations_match_the_regex_and_take_linear_time():
    """The equation scan gives the regex's (lhs, rhs) pairs, and a long digit run without an equation
    (a degenerate trace) is scanned at once: the regex form backtracked in cubic time (5000 digits:
    minutes), and select computes steps for every prompt's report row. The scan's steps are counted
    (one pass, each character scanned back at most once); the CPU limit catches a regex that
    backtracks, which no counter sees."""
    import re

    from mlx_ssp.testing import run_cpu_bounded

    old = re.compile(rf"([\d\s.,+\-*/×÷·x^()]*\d[\d\s.,+\-*/×÷·x^()]*)=\s*({S._NUM})")
    for t in ["3+5=8, then 8*2=16", "a=5=3", "x = 4", "(2 + 3) × 4 = 20. so 1,000 = 1000", "= 5", "1 2 3 = 4 = 5"]:
        assert S._equations(t) == old.findall(t)
    for text, want in [("1" * 5000 + " 1" * 5000, frozenset()), ("1+" * 5000 + "1=5001", {"1+" * 5000 + "1=5001"}),
                       ("1 = 1 " * 3000, {"1=1"}), ("x" * 10000 + "= 1", set())]:
        eqs, steps = run_cpu_bounded(_counted_steps, text)
        assert eqs == want and steps <= 3 * len(text)


def test_a_number_too_large_for_a_float_is_a_feature_not_an_error():
    """A trace may write a 400-digit number (model output): float() gives inf and int(inf) raised
    OverflowError, which stopped the whole select stage."""
    big = "9" * 400
    assert S.math_steps(f"2+3 = {big}") == frozenset({f"2+3={big}"})
    assert S.math_steps(f"{big} + 1 = 5") == frozenset({f"1+{big}=5"})  # operands sorted


def test_featureless_solutions_are_compared_by_wording():
    texts = ["we reason in words only and find sixteen", "a completely different argument in prose gives sixteen",
             "we reason in words only and find sixteen !"]
    d = S.distance_fn("steps")(3)(texts)
    assert d[0, 1] > 0.5 and d[0, 2] < d[0, 1]
