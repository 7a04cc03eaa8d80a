"""Data-quality filters of select (repetition, decontamination) and majority-vote pseudo-labels."""

from __future__ import annotations

import json
import random

import pytest

from mlx_ssp.config import validate
from mlx_ssp.errors import UserError
from mlx_ssp.select.quality import (
    find_contaminated,
    majority_vote,
    overlap_ngrams,
    repetition_stats,
    vote_task,
)
from mlx_ssp.select import SelectConfig, run_select, select
from mlx_ssp.tasks import Task, write_tasks

INSTR = "Give your final answer on the last line in the form:\nAnswer: <your answer>"

NORMAL = (
    "We need the total cost. Each notebook costs 3 dollars and she buys 7 of them, so the notebooks cost "
    "3 * 7 = 21 dollars. The pens cost 2 dollars each and she buys 4, which is 8 dollars. Together that is "
    "21 + 8 = 29 dollars. She pays with a 50 dollar bill, so her change is 50 - 29 = 21 dollars.\nAnswer: 21"
)
LOOP = "We need the total cost. " + "So the notebooks cost 3 * 7 = 21 dollars and then we add the pens. " * 40


def rec(tid, sample, text, reward=1.0, domain="math", prompt=None):
    return {"task_id": tid, "domain": domain, "sample": sample, "prompt": prompt or f"Question {tid}?",
            "completion": text, "reward": reward, "finish_reason": "stop"}


# -- repetition ---------------------------------------------------------------------------------


def test_repetition_flags_a_loop_not_a_normal_trace():
    normal, loop = repetition_stats(NORMAL, 8), repetition_stats(LOOP, 8)
    assert normal.repeated_fraction == 0.0 and normal.longest_repeated_span == 0
    assert loop.repeated_fraction > 0.9 and loop.longest_repeated_span > 400
    cfg = SelectConfig(repetition={})
    data, report = select([rec("a", 0, NORMAL), rec("a", 1, LOOP), rec("b", 0, LOOP)], cfg)
    kept = [ex["messages"][-1]["content"] for part in data["math"].values() for ex in part]
    assert LOOP not in kept and NORMAL in kept
    assert report["domains"]["math"]["dropped"] == {"incorrect": 0, "truncated": 0, "repetition": 2, "decontaminated": 0}


def test_repetition_stats_match_a_brute_force_reference():
    rng = random.Random(0)
    for _ in range(200):
        w = [rng.choice("abc") for _ in range(rng.randint(0, 30))]
        n = rng.randint(1, 4)
        grams = [tuple(w[i:i + n]) for i in range(len(w) - n + 1)]
        rep = [g in grams[:i] for i, g in enumerate(grams)]  # quadratic, independent of the set walk
        runs, run = [0], 0
        for r in rep:
            run = run + 1 if r else 0
            runs.append(run)
        st = repetition_stats(" ".join(w), n)
        assert st.repeated_fraction == (sum(rep) / len(grams) if grams else 0.0)
        assert st.repeated_fraction == pytest.approx(1 - len(set(grams)) / len(grams) if grams else 0.0)  # identity
        assert st.longest_repeated_span == (max(runs) + n - 1 if max(runs) else 0)


def test_default_report_has_no_quality_keys_and_filters_validate():
    _, report = select([rec("a", 0, NORMAL)], SelectConfig())
    assert "dropped" not in report["domains"]["math"] and "repetition" not in report["config"]
    with pytest.raises(UserError, match="max_repeated_fraction"):
        validate(SelectConfig, {"repetition": {"max_repeated_fraction": 2}}, source="t", prefix="select")
    with pytest.raises(UserError, match="ngram_size"):
        validate(SelectConfig, {"decontaminate": {"ngram_size": 13}}, source="t", prefix="select")


# -- decontamination ----------------------------------------------------------------------------

EVAL = [
    "A train travels 270 miles in 3 hours. At the same rate, how many additional hours would it take to "
    "travel an additional 180 miles?",
    "Bella bought stamps at the post office. Some of the stamps had a snowflake design, some had a truck "
    "design, and some had a rose design. How many stamps did she buy?",
    "Calculate 7 + 2.",
]
TRAIN = {
    "clean-0": "Tom has 12 apples and gives away 5 of them to his sister, then buys 9 more at the market. How many now?",
    "clean-1": "A rectangle is 8 meters long and 3 meters wide. What is its area in square meters, rounded down?",
    "clean-2": "Calculate 5 + 2.",  # ends like an eval prompt: only the template and "2" are shared
    "clean-3": "Sara reads 20 pages a day for a week and then 35 pages a day for four more days. Total pages?",
    # the first eval problem, re-spaced, re-cased and re-punctuated, with other numbers at its end
    "dirty-0": "a TRAIN travels 270 miles in 3 hours -- at the same rate how many additional hours would it take "
               "to travel an additional 90 miles?",
    "dirty-1": "Calculate 7 + 2",  # a short problem copied whole
}


def _with_instr(text):
    return f"{text}\n\n{INSTR}"


def test_decontamination_removes_exactly_the_overlapping_prompts():
    train = {k: _with_instr(v) for k, v in TRAIN.items()}
    found = find_contaminated(train, [_with_instr(e) for e in EVAL], n=13)
    assert set(found) == {"dirty-0", "dirty-1"}
    # without the shared instruction the verdict is the same: the template is cut, not matched
    assert set(find_contaminated(dict(TRAIN), EVAL, n=13)) == {"dirty-0", "dirty-1"}
    # the template alone would have matched every prompt
    tmpl = overlap_ngrams(INSTR, 13)
    assert all(tmpl & overlap_ngrams(t, 13) for t in train.values())


def test_run_select_decontaminates_against_held_out_and_benchmark_files(tmp_path):
    recs = [rec(t, s, f"solution {s} of {t} with some words\nAnswer: 1", prompt=_with_instr(p))
            for t, p in TRAIN.items() for s in range(2)]
    src = tmp_path / "r.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in recs))
    held = tmp_path / "eval.jsonl"
    write_tasks(held, [Task(id=f"e{i}", domain="math", prompt=_with_instr(e), answer="1", verifier="exact")
                       for i, e in enumerate(EVAL[:1])])
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"question": EVAL[2]}) + "\n")
    cfg = SelectConfig(decontaminate={"against": [str(bench)]}, valid_fraction=0)
    report = run_select(src, cfg, tmp_path / "out", held_out=[held])
    dom = report["domains"]["math"]
    assert set(dom["decontaminated_ids"]) == {"dirty-0", "dirty-1"} and dom["dropped"]["decontaminated"] == 4
    assert report["decontamination"]["reference_prompts"] == 2
    trained = (tmp_path / "out" / "math" / "train.jsonl").read_text()
    assert "dirty" not in trained and "270 miles" not in trained and all(k in trained for k in TRAIN if "clean" in k)
    # held_out: false compares with the benchmark only; a row without a prompt field is an error
    cfg2 = SelectConfig(decontaminate={"against": [str(bench)], "held_out": False})
    assert set(run_select(src, cfg2, tmp_path / "o2", held_out=[held])["domains"]["math"]["decontaminated_ids"]) == {"dirty-1"}
    bench.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(UserError, match="no prompt field"):
        run_select(src, cfg, tmp_path / "o3")
    with pytest.raises(UserError, match="nothing to compare"):
        run_select(src, SelectConfig(decontaminate={}), tmp_path / "o4")


# -- majority vote --------------------------------------------------------------------------------


def test_majority_vote_picks_the_plurality_with_its_agreement():
    v = majority_vote(["3", "5", None, "3", "4", "3", None, "5"])
    assert (v.answer, v.votes, v.k, v.agreement, v.n_distinct) == ("3", 3, 8, 3 / 8, 3)
    assert majority_vote(["b", "a", "a", "b"]).answer == "b"  # tie: the earliest answer
    assert majority_vote([None, None]) == majority_vote([None, None]).__class__(None, 0, 2, 0.0, 0)
    ci = majority_vote(["Yes", "no", "YES", "yes"], same=lambda a, b: a.lower() == b.lower())
    assert (ci.answer, ci.votes) == ("Yes", 3)
    rng = random.Random(1)
    for _ in range(100):  # against a Counter: the top count, and the earliest of the tied top
        xs = [rng.choice(["1", "2", "3", None]) for _ in range(rng.randint(1, 9))]
        counts = {a: xs.count(a) for a in xs if a is not None}
        v = majority_vote(xs)
        if counts:
            top = max(counts.values())
            assert v.votes == top and v.answer == next(a for a in xs if counts.get(a) == top)
            assert v.agreement == top / len(xs)


def test_math_votes_use_the_verifier_extraction_and_equivalence():
    outs = ["so it is half.\nAnswer: 1/2", "Answer: \\frac{1}{2}", "Answer: 0.5", "Answer: 3", "no idea"]
    v = vote_task(outs, "math")
    assert v.votes == 3 and v.agreement == 3 / 5 and v.answer == "1/2"
    assert vote_task(["Answer: 1,000", "the answer is 1000"], "math", {"answer_extraction": "lenient"}).votes == 2


def test_pseudo_labels_are_written_with_agreement(tmp_path):
    tasks = [Task(id=f"q{i}", domain="math", prompt=f"Question {i}?", answer=None, verifier="math") for i in range(3)]
    tasks.append(Task(id="g", domain="math", prompt="Gold?", answer="7", verifier="math"))
    write_tasks(tmp_path / "tasks.jsonl", tasks)
    outs = {"q0": ["Answer: 4", "Answer: 4", "Answer: 4", "Answer: 5"],  # 3/4: written
            "q1": ["Answer: 1", "Answer: 2", "Answer: 3", "Answer: 1"],  # 2/4 = 0.5 < 0.6: not written
            "q2": ["Answer: 9", "x", "y", "z"],  # 1 vote < min_votes
            "g": ["Answer: 7", "Answer: 7", "Answer: 8", "Answer: 7"]}
    recs = [rec(t, s, o, reward=None) for t, os in outs.items() for s, o in enumerate(os)]
    src = tmp_path / "r.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in recs))
    report = run_select(src, SelectConfig(pseudo_label={"min_agreement": 0.6}), tmp_path / "out",
                        tasks_path=tmp_path / "tasks.jsonl")
    rows = [json.loads(x) for x in (tmp_path / "out" / "pseudo_labels.jsonl").read_text().splitlines()]
    assert [(r["id"], r["answer"]) for r in rows] == [("q0", "4")]
    assert rows[0]["metadata"]["pseudo_label"] == {"agreement": 0.75, "votes": 3, "k": 4, "n_distinct": 2}
    st = report["pseudo_labels"]["domains"]["math"]
    assert (st["voted"], st["written"], st["below_threshold"], st["with_answer"], st["vote_accuracy"]) == (4, 1, 2, 1, 1.0)
    # every task relabelled: the gold one too, its answer kept beside the label
    run_select(src, SelectConfig(pseudo_label={"min_agreement": 0.6, "only_unlabelled": False}), tmp_path / "o2",
               tasks_path=tmp_path / "tasks.jsonl")
    rows = {json.loads(x)["id"]: json.loads(x) for x in (tmp_path / "o2" / "pseudo_labels.jsonl").read_text().splitlines()}
    assert set(rows) == {"q0", "g"} and rows["g"]["metadata"]["pseudo_label"]["replaced_answer"] == "7"
    with pytest.raises(UserError, match="--tasks"):
        run_select(src, SelectConfig(pseudo_label={}), tmp_path / "o3")


def test_decontamination_keeps_operators():
    """Short arithmetic prompts differ only in their operator: they are different problems."""
    from mlx_ssp.select.quality import overlap_ngrams

    assert overlap_ngrams("Calculate 6 + 3.", 8) != overlap_ngrams("Calculate 6 - 3.", 8)
    assert overlap_ngrams("Calculate 6 + 3.", 8) == overlap_ngrams("calculate  6+3", 8)


def test_unlabelled_tasks_are_sampled_unverified_then_voted_on(tmp_path, tiny_qwen3):
    """Synthetic queries without an answer: the rollout stage refuses them unless rollout.unlabelled,
    then samples them with reward null (the labelled task beside them is verified as usual), and
    select.pseudo_label votes on those samples."""
    from mlx_ssp.rollout import RolloutConfig, run_rollouts

    tasks = [Task(id=f"q{i}", domain="math", prompt=f"What is {i} + 1?", answer=None, verifier="math") for i in range(2)]
    tasks.append(Task(id="g", domain="math", prompt="What is 2 + 2?", answer="4", verifier="math"))
    write_tasks(tmp_path / "t.jsonl", tasks)
    sampling = {"temperature": 1.0, "max_tokens": 6}
    with pytest.raises(UserError, match="not valid for verifier 'math'"):
        run_rollouts(str(tiny_qwen3), tmp_path / "t.jsonl", RolloutConfig(k=3, sampling=sampling), tmp_path / "r0.jsonl",
                     progress=False)
    cfg = RolloutConfig(k=3, sampling=sampling, unlabelled=True)
    run_rollouts(str(tiny_qwen3), tmp_path / "t.jsonl", cfg, tmp_path / "r.jsonl", progress=False)
    recs = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert {(r["task_id"], r["reward"] is None, r["reason"] == "unlabelled") for r in recs} == {
        ("q0", True, True), ("q1", True, True), ("g", False, False)}
    assert "unlabelled" not in RolloutConfig().model_dump()  # old fingerprints hold
    rep = run_select(tmp_path / "r.jsonl", SelectConfig(pseudo_label={"min_agreement": 0.3, "min_votes": 1}),
                     tmp_path / "sel", tasks_path=tmp_path / "t.jsonl")
    # select takes the unverified samples (reward null) and votes on them: the random model's answers
    # rarely parse, so only that the vote ran over this file's tasks is checked here (the vote itself:
    # test_pseudo_labels_are_written_with_agreement)
    assert "math" in rep["pseudo_labels"]["domains"] and rep["domains"]["math"]["n_prompts"] == 3
