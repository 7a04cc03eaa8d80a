"""math verifier and answer extraction: real GSM8K references in several writings."""

from __future__ import annotations

import json

import pytest

from mlx_ssp.tasks import Task
from mlx_ssp.verify import verify
from mlx_ssp.verify.extract import extract


def _task(answer, mode="strict"):
    return Task(id="t", domain="d", prompt="p", answer=answer, verifier="math", metadata={"answer_extraction": mode})


@pytest.mark.parametrize(
    "text,mode,want",
    [
        ("blah\nAnswer: 42", "strict", "42"),
        ("**Answer:** 42.", "strict", "42"),
        ("x #### 1,234", "strict", "1,234"),
        ("so \\boxed{\\frac{1}{2}} and more", "strict", "\\frac{1}{2}"),
        ("Answer: 3\nlater #### 5", "strict", "5"),  # the last marker wins
        ("<think>Answer: 3</think>Answer: 4", "strict", "4"),
        ("Answer: $\\boxed{7}$", "strict", "7"),
        ("The answer is 12. Done", "strict", None),
        ("The answer is 12. Done", "lenient", "12"),
        ("5 + 3 = 8", "lenient", "8"),
        ("I got 7 apples", "lenient", "7"),
    ],
)
def test_extraction(text, mode, want):
    ex = extract(text, mode)
    assert (ex.text if ex else None) == want


def test_gsm8k_all_references_score_one_in_several_writings(shared_data):
    from mlx_ssp.tasks.build import export_source

    tasks = export_source(f"gsm8k:{shared_data / 'gsm8k' / 'test.jsonl'}", answer_extraction="lenient")
    assert len(tasks) == 1319
    raw = [json.loads(l) for l in open(shared_data / "gsm8k" / "test.jsonl")]
    assert sorted(t.answer for t in tasks) == sorted(r["answer"].rsplit("####", 1)[1].strip().replace(",", "") for r in raw)
    failures = []
    for t in tasks:
        a = t.answer
        commas = f"{int(a):,}" if a.lstrip("-").isdigit() else a
        for c in (f"Answer: {a}", f"Answer: {commas}", f"Hence \\boxed{{{commas}}}.", f"So the answer is {commas} dollars."):
            if verify(c, t).reward != 1.0:
                failures.append((t.id, c))
        wrong = verify(f"Answer: {float(a) + 1:g}", t)
        if wrong.reward != 0.0 or wrong.reason != "wrong_answer":
            failures.append((t.id, "wrong", wrong))
    assert not failures, failures[:10]


def test_strict_vs_lenient_and_reasons():
    assert verify("The answer is 18.", _task("18")).reason == "no_answer"
    assert verify("The answer is 18.", _task("18", "lenient")).reward == 1.0
    assert verify("Answer: 19", _task("18")).reason == "wrong_answer"
    assert verify("", _task("18")).reason == "no_answer"
    assert verify("Answer: 0.5", _task("\\frac{1}{2}")).reward == 1.0
    assert verify("Answer: 50%", _task("0.5")).reward == 1.0
    assert verify("Answer: 2x+1", _task("2")).reward == 0.0  # an expression is not its leading number
    assert verify("Answer: 1+2x", _task("2x+1")).reward == 1.0
    # an intermediate number never wins in strict mode
    assert verify("3 + 4 = 7, times 2 is 14\nAnswer: 14", _task("7")).reward == 0.0


def test_bad_math_task_is_an_error_before_generation():
    from mlx_ssp.errors import UserError
    from mlx_ssp.tasks import check_tasks

    with pytest.raises(UserError, match="missing 'answer'"):
        check_tasks([_task(None)])
    with pytest.raises(UserError, match="answer_extraction"):
        check_tasks([_task("1", "fuzzy")])


def test_math_verify_parses_each_distinct_answer_once(monkeypatch):
    """math-verify's parse is most of a verification's cost: 200 verifications of 10 distinct
    answers parse each answer once and the reference once (the caches), and plain integers never."""
    import mlx_ssp.verify.math as M

    parsed = []
    mv, _ = M._math_verify()  # the math-verify module, imported on first use
    real = mv.parse
    monkeypatch.setattr(mv, "parse", lambda text, **kw: parsed.append(text) or real(text, **kw))
    for cached in (M._parse_gold, M._guard, M._judge):
        cached.cache_clear()
    t = _task("1234")
    for i in range(200):
        assert verify(f"The total is 1,23{i % 10}\nAnswer: 1,23{i % 10}", t).reward == float(i % 10 == 4)
    assert len(parsed) == 11
    for i in range(200):
        assert verify(f"Answer: {1000 + i % 10}", _task("1004")).reward == float(i % 10 == 4)
    assert len(parsed) == 11


def test_integer_fast_path_agrees_with_math_verify():
    """Plain integers skip math-verify; its verdict on them must be the one math-verify gives."""
    import random

    from mlx_ssp.verify.math import _judge, _judge_math_verify

    rng = random.Random(0)
    pairs = [("7", "007"), ("-3", "3"), ("+5", "5"), ("0", "-0"), ("999999999999999", "999999999999998"),
             ("123456789012345", "123456789012345"), ("18", "18")]
    for _ in range(60):
        a = rng.choice([rng.randrange(-50, 50), rng.randrange(10**15)])
        b = rng.choice([a, a + rng.choice([-1, 1]), -a, rng.randrange(10**6)])
        pairs.append((str(a), str(b)))
    for gold, pred in pairs:
        assert _judge(gold, pred) is (_judge_math_verify(gold, pred) is True), (gold, pred)
    # not plain integers: math-verify decides
    assert _judge("1000", "1,000") is _judge_math_verify("1000", "1,000")
    assert _judge("0.5", "1/2") is True
    # the verdict through the verifier
    assert verify("so the answer is 0018", _task("18", "lenient")).reward == 1.0
    assert verify("so the answer is 17", _task("18", "lenient")).reason == "wrong_answer"
