"""The testbed's task family: every strategy's trace is correct and the strategies differ,
the verifier never evaluates model text, the source draws disjoint graded splits, and a build is
deterministic from its seed (a few steps only: the real budget is a script's job)."""

from __future__ import annotations

import json
import random

import pytest

import mlx_ssp  # noqa: F401  (OpenBLAS before mlx.core)
from mlx_ssp.testbed import problems as P


@pytest.mark.parametrize("domain", P.DOMAINS)
def test_every_strategy_solves_and_strategies_differ(domain):
    rng = random.Random(1)
    lo, hi = P.LEVELS[domain]
    multi = 0
    for level in range(lo, hi + 1):
        for _ in range(6):
            p = P.draw(domain, rng, level)
            st = P.strategies(p)
            traces = [P.trace(p, n) for n in st]
            assert all(P.solve(p, t) == (True, "correct") for t in traces)
            assert len(set(traces)) == len(traces)  # distinct strategies write distinct traces
            multi += len([n for n in st if n != "direct"]) > 1  # `direct` (no working) is every problem's
            wrong = traces[0].rsplit("answer ", 1)[0] + "answer 1000"
            assert P.solve(p, wrong)[0] is False
    assert multi >= 6 * (hi - lo)  # above the easiest level, problems have several strategies


def test_countdown_answers_are_parsed_never_evaluated(tmp_path):
    p = P.Problem("countdown", (3, 4, 2), 14)
    assert P.solve(p, "3*4=12 ; 12+2=14\nanswer 3*4+2") == (True, "correct")
    assert P.solve(p, "answer (2+4)*3-4") == (False, "numbers_not_given")  # 4 used twice
    assert P.solve(p, "answer 2*7") == (False, "numbers_not_given")
    assert P.solve(p, "answer 3+4") == (False, "wrong_answer")
    marker = tmp_path / "x"
    for hostile in (f"__import__('os').system('touch {marker}')", "3+4;import os", "9**9**9", "2" * 100):
        assert P.solve(p, f"answer {hostile}")[0] is False
    assert not marker.exists()
    assert P.parse_expression("(3+4)*2") == (14, [3, 4, 2]) and P.parse_expression("3+") is None
    assert P.solve(p, "no answer line") == (False, "no_answer")


def test_source_splits_are_disjoint_graded_and_verified():
    from mlx_ssp.config import validate
    from mlx_ssp.tasks.build import build_split
    from mlx_ssp.tasks.config import TasksConfig
    from mlx_ssp.verify import verify

    cfg = validate(TasksConfig, {"seed": 5, "domains": {"s": {"source": "testbed:sum", "params": {"levels": [2, 4]},
                                                               "sizes": {"train": 30, "probe": 10, "eval": 10}}}})
    splits = {s: build_split(cfg, s) for s in ("train", "probe", "eval")}
    prompts = {k: {t.prompt for t in v} for k, v in splits.items()}
    assert not (prompts["train"] & prompts["eval"]) and not (prompts["probe"] & prompts["eval"])
    assert {t.metadata["level"] for t in splits["train"]} == {2, 3, 4}
    # eval and probe: only the held-out quarter, which the pretraining corpus never contains
    from mlx_ssp.testbed.build import corpus

    held = lambda t: P.held_out(P.problem_from_meta("sum", t.metadata))  # noqa: E731
    assert all(held(t) for t in splits["eval"] + splits["probe"]) and not any(held(t) for t in splits["train"])
    seen = {r["messages"][0]["content"] for r in corpus(120, seed=0)}
    assert not seen & (prompts["eval"] | prompts["probe"])
    # train_space: held_out: train prompts unseen in pretraining too, still disjoint from eval / probe
    ho = validate(TasksConfig, {"seed": 5, "domains": {"s": {"source": "testbed:sum", "params": {
        "levels": [2, 4], "train_space": "held_out"}, "sizes": {"train": 30, "probe": 10, "eval": 10}}}})
    ho_train = build_split(ho, "train")
    assert all(held(t) for t in ho_train)
    ho_held_out = {t.prompt for s_ in ("probe", "eval") for t in build_split(ho, s_)}
    assert len(ho_held_out) == 20 and not {t.prompt for t in ho_train} & ho_held_out
    t = splits["eval"][0]
    nums = t.metadata["numbers"]
    assert verify(f"answer {sum(nums)}", t).reward == 1.0 and verify("answer -1", t).reason == "wrong_answer"
    from mlx_ssp.errors import UserError

    with pytest.raises(UserError, match="levels"):
        build_split(validate(TasksConfig, {"domains": {"s": {"source": "testbed:sum", "params": {"levels": [1, 9]}}}}), "eval")


def test_corpus_mix_follows_the_design():
    from mlx_ssp.testbed import build as B

    recs = B.corpus(240, seed=0)
    assert recs == B.corpus(240, seed=0) and recs[:50] != B.corpus(50, seed=1)[:50]
    sums = [r for r in recs if r["domain"] == "sum" and r["level"] > 2]
    share = {n: sum(r["strategy"] == n for r in sums) / len(sums) for n in ("chain", "pairs", "sorted")}
    assert share["chain"] > share["pairs"] > share["sorted"] > 0.03
    lv = [r["level"] for r in recs if r["domain"] == "diff"]
    assert lv.count(2) > lv.count(4) > lv.count(6) > 0  # easy levels are frequent, hard ones present


def test_build_is_deterministic(tmp_path):
    from mlx_ssp.testbed import build as B

    a = B.build("tiny", 3, tmp_path / "a", steps=2, corpus_size=30, progress=False)
    b = B.build("tiny", 3, tmp_path / "b", steps=2, corpus_size=30, progress=False)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    info = json.loads((a / "build.json").read_text())
    assert info["steps"] == 2 and info["seed"] == 3 and set(info["mix"]) == set(P.DOMAINS)
    from mlx_ssp.models import load_model

    model, tok, _ = load_model(str(a))
    assert tok.apply_chat_template([{"role": "user", "content": "add 1 2"}], add_generation_prompt=True)
    from mlx_ssp.testbed.calibrate import calibrate

    # calibration draws only the domains and levels it is given (a size's own: scripts/testbed.py)
    res = calibrate(model, tok, n_per_domain=3, k=2, max_tokens=4, levels={"sum": (3, 3)})
    assert list(res["domains"]) == ["sum"] and list(res["domains"]["sum"]["by_level"]) == [3]


def test_model_spec_names_a_cached_testbed(tmp_path, monkeypatch):
    from mlx_ssp.errors import UserError
    from mlx_ssp.models import resolve_model
    from mlx_ssp.testbed import build as B

    monkeypatch.setenv("MLX_SSP_CACHE", str(tmp_path))
    built = B.build("tiny", 0, B.testbed_dir("tiny", 0), steps=1, corpus_size=30, progress=False)
    assert resolve_model("testbed:tiny:0") == built  # cached: not built again
    assert B.parse_spec("testbed") == ("small", 0)
    with pytest.raises(UserError, match="SIZE one of"):
        resolve_model("testbed:huge")
    # a cached build whose settings differ from the size's now is refused, not silently reused
    info = json.loads((built / "build.json").read_text())
    (built / "build.json").write_text(json.dumps({**info, "hidden_size": 999}))
    with pytest.raises(UserError, match="hidden_size differ"):
        resolve_model("testbed:tiny:0")


def test_micro_narrows_the_mix_and_small_is_unchanged():
    import hashlib

    from mlx_ssp.testbed import build as B

    # the corpus the v2 `small` models were built from (digest taken before `micro` existed):
    # adding a size must not shift the default draws
    digest = hashlib.sha256(json.dumps(B.corpus(40, seed=0)).encode()).hexdigest()
    assert digest == "95aeaa96920a44966d04db770a2b1a9b9b586c3d288913b075e82c784bab9381"
    s = B.SIZES["micro"]
    recs = B.corpus(60, 0, s["domains"], s["levels"])
    assert {r["domain"] for r in recs} == {"sum"} and {r["level"] for r in recs} == {2, 3}
    assert not any(P.held_out(P.Problem("sum", tuple(int(x) for x in r["messages"][0]["content"].split()[1:]))) for r in recs)
    assert B.parse_spec("testbed:micro:4") == ("micro", 4)


def test_ci_size_holds_unreliable_guesses_and_direct_answers_are_a_strategy():
    from mlx_ssp.testbed import build as B
    from mlx_ssp.testbed.calibrate import strategy_of

    s = B.SIZES["ci"]
    recs = B.corpus(400, 0, s["domains"], s["levels"], s["guess"])
    assert [r["strategy"] == "guess" for r in recs] != [r["strategy"] == "guess" for r in B.corpus(400, 1, s["domains"], s["levels"], s["guess"])]
    guesses = [r for r in recs if r["strategy"] == "guess"]
    assert 0.4 < len(guesses) / len(recs) < 0.6
    wrong = 0
    for r in guesses:
        p = P.Problem("sum", tuple(int(x) for x in r["messages"][0]["content"].split()[1:]))
        text = r["messages"][1]["content"]
        assert text.startswith("answer ") and abs(int(text.split()[1]) - p.answer) <= B.GUESS_SPREAD
        wrong += not P.solve(p, text)[0]
    assert 0.7 < wrong / len(guesses) < 0.95  # 6 of the 7 offsets are wrong
    rest = [r for r in recs if r["strategy"] != "guess"]
    assert all(P.solve(P.Problem("sum", tuple(int(x) for x in r["messages"][0]["content"].split()[1:])),
                       r["messages"][1]["content"])[0] for r in rest)
    assert B.corpus(60, 0, s["domains"], s["levels"]) == B.corpus(60, 0, s["domains"], s["levels"], 0.0)
    p = P.Problem("sum", (3, 5, 2))
    meta = {"numbers": [3, 5, 2]}
    assert P.trace(p, "direct") == "answer 10" and strategy_of("sum", meta, "answer 10") == "direct"
    assert strategy_of("sum", meta, P.trace(p, "chain")) == "chain" and strategy_of("sum", meta, "3+5=8\nanswer 10") == "other"


def test_multi_size_holds_three_domains_with_guesses_only_where_an_answer_is_a_number():
    from mlx_ssp.testbed import build as B

    s = B.SIZES["multi"]
    recs = B.corpus(120, 0, tuple(s["domains"]), s["levels"], s["guess"])
    by = {d: [r for r in recs if r["domain"] == d] for d in P.DOMAINS}
    assert len(by["sum"]) == len(by["diff"]) == 2 * len(by["countdown"]) == 120  # countdown draws half
    assert {r["level"] for r in recs} == {2, 3}
    for d in ("sum", "diff"):  # about half unreliable guesses, as in `ci`
        assert 0.35 < sum(r["strategy"] == "guess" for r in by[d]) / len(by[d]) < 0.65
    assert not any(r["strategy"] == "guess" for r in by["countdown"])  # any expression may be right: no guess
