"""The ``instruct`` verifier: each constraint kind passes and fails on hand-made responses."""

from __future__ import annotations

import pytest

from mlx_ssp.config import validate
from mlx_ssp.errors import UserError
from mlx_ssp.tasks import Task, check_tasks
from mlx_ssp.tasks.build import build_split, export_source
from mlx_ssp.tasks.config import TasksConfig
from mlx_ssp.verify import verify
from mlx_ssp.verify.instruct import CONSTRAINTS, check_all, parse_constraints


def task(*constraints):
    return Task(id="t", domain="instruct", prompt="Do it.", verifier="instruct", metadata={"constraints": list(constraints)})


# (constraint, a response that satisfies it, one that does not)
CASES = [
    ({"kind": "json"}, '{"a": 1}', "{'a': 1}"),
    ({"kind": "json", "type": "array"}, "```json\n[1, 2]\n```", '{"a": 1}'),
    ({"kind": "json", "type": "object", "keys": ["name", "reason"]}, '{"name": "x", "reason": "y"}', '{"name": "x"}'),
    ({"kind": "bullet_list"}, "- apple\n* pear\n\n• plum", "- apple\npear"),
    ({"kind": "bullet_list", "marker": "-"}, "- apple\n- pear", "- apple\n* pear"),
    ({"kind": "numbered_list"}, "1. one\n2) two\n3. three", "1. one\n3. three"),
    ({"kind": "item_count", "min": 2, "max": 3}, "- a\n- b\n- c", "- a\n- b\n- c\n- d"),
    ({"kind": "item_count", "min": 1}, "intro\n1. only", "no list here"),
    ({"kind": "order", "keywords": ["first", "then", "last"]}, "First we go, then we stop, last we rest.",
     "Then first, last."),
    ({"kind": "order", "keywords": ["a", "b"]}, "a b", "a only"),  # a missing keyword fails the order
    ({"kind": "include", "keywords": ["river", "stone"]}, "A Stone by the river.", "A stone by the sea."),
    ({"kind": "include", "keywords": ["cat"], "min_count": 2}, "cat, cat", "cat concatenate"),  # whole words
    ({"kind": "include", "keywords": ["Gold"], "case_sensitive": True}, "Gold", "gold"),
    ({"kind": "forbid", "keywords": ["banana"]}, "apple and bananas", "apple and Banana"),
    ({"kind": "length", "max": 5}, "one two three", "one two three four five six"),
    ({"kind": "length", "unit": "chars", "min": 5}, "hello", "hey"),
    ({"kind": "length", "unit": "lines", "max": 1}, "one line", "two\nlines"),
    ({"kind": "starts_with", "text": "Sure:"}, "  sure: ok", "Ok, sure:"),
    ({"kind": "starts_with", "text": "Sure:", "case_sensitive": True}, "Sure: ok", "sure: ok"),
    ({"kind": "ends_with", "text": "Done."}, "all good. done.", "done. all good."),
    ({"kind": "case", "case": "lower"}, "all lower, 123.", "Not lower"),
    ({"kind": "case", "case": "upper"}, "ALL UPPER!", "ALL UPPEr"),
]


def test_every_kind_is_exercised():
    assert {c["kind"] for c, _, _ in CASES} == set(CONSTRAINTS)


@pytest.mark.parametrize("constraint,good,bad", CASES, ids=[f"{i}-{c['kind']}" for i, (c, _, _) in enumerate(CASES)])
def test_constraint_passes_and_fails(constraint, good, bad):
    t = task(constraint)
    check_tasks([t])
    ok, no = verify(good, t), verify(bad, t)
    assert (ok.reward, ok.reason) == (1.0, "correct"), ok
    assert (no.reward, no.reason) == (0.0, "constraint_failed"), no
    assert no.detail.startswith("satisfied 0/1 (0.00); failed: " + constraint["kind"])


def test_reward_is_all_satisfied_and_detail_the_fraction():
    t = task({"kind": "bullet_list"}, {"kind": "item_count", "min": 3, "max": 3}, {"kind": "forbid", "keywords": ["banana"]},
             {"kind": "include", "keywords": ["apple"]})
    assert verify("- apple\n- pear\n- plum", t).reward == 1.0
    res = verify("- apple\n- banana", t)
    assert res.reward == 0.0 and res.detail.startswith("satisfied 2/4 (0.50)")
    assert "item_count" in res.detail and "forbid" in res.detail
    # the reasoning before </think> is not the response
    assert verify("<think>banana banana</think>\n- apple\n- pear\n- plum", t).reward == 1.0
    assert check_all("- apple", parse_constraints(t.metadata["constraints"])) == [
        None, "1 items, want 3..3", None, None]


@pytest.mark.parametrize("constraints,match", [
    (None, "non-empty list"),
    ([], "non-empty list"),
    ([{"kind": "yaml"}], "valid|not one of"),
    ([{"kind": "item_count"}], "needs min or max"),
    ([{"kind": "length", "min": 5, "max": 2}], "min 5 > max 2"),
    ([{"kind": "order", "keywords": ["one"]}], "at least two"),
    ([{"kind": "include", "keywords": []}], "keywords"),
    ([{"kind": "forbid", "keywords": ["x"], "wrods": 1}], "wrods"),
    ([{"kind": "case", "case": "title"}], "case"),
])
def test_bad_constraints_fail_at_load_naming_the_problem(constraints, match):
    t = Task(id="t", domain="instruct", prompt="x", verifier="instruct", metadata={"constraints": constraints})
    with pytest.raises(UserError, match=match):
        check_tasks([t])


def test_instruct_source_makes_valid_disjoint_tasks():
    cfg = validate(TasksConfig, {"seed": 3, "domains": {"inst": {"source": "instruct", "sizes": {
        "train": 40, "probe": 20, "eval": 20}}}}, source="t", prefix="tasks")
    splits = {s: build_split(cfg, s) for s in ("train", "probe", "eval")}
    prompts = {s: {t.prompt for t in ts} for s, ts in splits.items()}
    assert [len(p) for p in prompts.values()] == [40, 20, 20]
    assert not (prompts["train"] & prompts["eval"]) and not (prompts["train"] & prompts["probe"])
    assert not (prompts["probe"] & prompts["eval"])
    for t in splits["train"]:
        assert t.verifier == "instruct" and t.answer is None
    assert [t.prompt for t in build_split(cfg, "train")] == [t.prompt for t in splits["train"]]  # seeded
    bullets = export_source("instruct:bullets", size=5)
    for t in bullets:  # a response written to the prompt's words passes its constraints
        n = t.metadata["constraints"][1]["max"]
        assert verify("\n".join(f"- item {i}" for i in range(n)), t).reward == 1.0
        assert verify("\n".join(f"- item {i}" for i in range(n + 1)), t).reward == 0.0
    with pytest.raises(UserError, match="unknown template"):
        export_source("instruct:poems", size=2)
