"""Diversity-exploring selection: pure distances and policies, the chat output and the report."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from mlx_ssp.errors import UserError
from mlx_ssp.select import (
    DISTANCES,
    SelectConfig,
    dedupe,
    edit_distance,
    farthest_point,
    jaccard_distance,
    levenshtein,
    ngrams,
    run_select,
    select,
)


def rec(tid, sample, text, reward=1.0, domain="math", finish="stop", prompt=None):
    return {"task_id": tid, "domain": domain, "sample": sample, "prompt": prompt or f"Question {tid}?",
            "completion": text, "reward": reward, "finish_reason": finish}


def test_levenshtein_matches_reference():
    def ref(a, b):
        d = list(range(len(b) + 1))
        for i, x in enumerate(a, 1):
            prev, d[0] = d[0], i
            for j, y in enumerate(b, 1):
                prev, d[j] = d[j], min(d[j] + 1, d[j - 1] + 1, prev + (x != y))
        return d[-1]

    rng = np.random.default_rng(0)
    for _ in range(50):
        a = list(rng.integers(0, 4, rng.integers(0, 12)))
        b = list(rng.integers(0, 4, rng.integers(0, 12)))
        assert levenshtein(a, b) == ref(a, b)
    assert levenshtein(list("kitten"), list("sitting")) == 3
    assert edit_distance("a b c d", "a b c d") == 0.0
    assert edit_distance("a b c d", "w x y z") == 1.0


def test_ngram_distance_properties():
    a = ngrams("so 2 + 3 = 5 and the answer is 5")
    assert jaccard_distance(a, a) == 0.0
    assert jaccard_distance(a, ngrams("completely different words here now")) == 1.0
    near = ngrams("so 2 + 3 = 5 and the answer is 5 .")
    assert 0 < jaccard_distance(a, near) < 0.2
    m = DISTANCES["ngram"](3)(["x y z", "x y z w", "q r s"])
    assert m.shape == (3, 3) and np.allclose(m, m.T) and np.all(np.diag(m) == 0)


@pytest.mark.parametrize("metric", ["ngram", "edit"])  # wording distances (strategy ones: test_strategy.py)
def test_dedupe_drops_exact_and_near_duplicates(metric):
    base = "First add 2 and 3 to get 5 , then multiply by 4 to get 20 . Answer : 20"
    texts = [
        base,
        "  " + base.replace(" , ", " ,\n") + " ",  # exact after whitespace normalisation
        base.replace("First", "Firstly"),  # near duplicate
        "Multiply 5 by 4 : 5 * 4 = 20 , since 2 + 3 = 5 . Answer : 20",
    ]
    dist = DISTANCES[metric](3)(texts)
    kept = dedupe(texts, dist, threshold=0.3)
    assert kept == [0, 3]
    assert dedupe(texts, dist, threshold=0.0) == [0, 2, 3]  # only the exact duplicate goes


def test_farthest_point_picks_the_outlier_and_respects_m():
    texts = ["a b c d e f", "a b c d e g", "a b c d e h", "x y z u v w", "a b c d e i"]
    dist = DISTANCES["ngram"](2)(texts)
    cands = list(range(len(texts)))
    assert farthest_point(dist, cands, 2) == [0, 3]
    sel = farthest_point(dist, cands, 3)
    assert len(sel) == 3 and sel[:2] == [0, 3]
    assert len(farthest_point(dist, cands, 10)) == 5
    assert farthest_point(dist, [], 3) == []


def test_policies_and_spectrum_report():
    recs = []
    sols = ["a b c d e f", "a b c d e f", "a b c d e g", "x y z u v w", "p q r s t u", "wrong"]
    for i, s in enumerate(sols):
        recs.append(rec("t1", i, s, reward=0.0 if s == "wrong" else 1.0))
    recs += [rec("t2", i, f"bad {i}", reward=0.0) for i in range(3)]
    recs += [rec("t3", i, f"only way {i % 1}", reward=1.0) for i in range(2)]
    recs.append(rec("t3", 2, "cut off but right", finish="length"))

    data, report = select(recs, SelectConfig(policy="diverse", per_prompt=3, ngram=2, near_duplicate=0.5, valid_fraction=0.0))
    d = report["domains"]["math"]
    rows = {r["task_id"]: r for r in d["prompts"]}
    assert rows["t1"]["n_correct"] == 5 and rows["t1"]["n_distinct_correct"] == 3
    assert rows["t1"]["selected_samples"] == [0, 3, 4]
    assert rows["t1"]["mean_pairwise_distance"] == pytest.approx(1.0)
    assert rows["t2"]["n_correct"] == 0 and d["no_correct_ids"] == ["t2"] and d["prompts_no_correct"] == 1
    assert rows["t3"]["n_correct"] == 2 and rows["t3"]["n_distinct_correct"] == 1  # truncated one dropped
    assert d["n_train"] == 4 and d["valid_is_train"]

    _, rep_first = select(recs, SelectConfig(policy="first", valid_fraction=0.0))
    assert {r["task_id"]: r["selected_samples"] for r in rep_first["domains"]["math"]["prompts"]} == {
        "t1": [0], "t2": [], "t3": [0]}
    _, rep_all = select(recs, SelectConfig(policy="all", drop_truncated=False, valid_fraction=0.0))
    sel = {r["task_id"]: r["selected_samples"] for r in rep_all["domains"]["math"]["prompts"]}
    assert sel["t1"] == [0, 1, 2, 3, 4] and sel["t3"] == [0, 1, 2]


def test_chat_format_and_valid_split_by_prompt():
    recs = [rec(f"t{j}", i, f"solution {j} variant {'x ' * i}", domain="code") for j in range(10) for i in range(2)]
    recs.append(rec("m", 0, "ok", domain="chat", prompt=[{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]))
    data, report = select(recs, SelectConfig(per_prompt=2, near_duplicate=0.0, valid_fraction=0.2), system="SYS")
    tr, va = data["code"]["train"], data["code"]["valid"]
    assert len(tr) + len(va) == 20 and len(va) == 4  # 2 of 10 prompts held out, both samples each
    users = lambda ex: ex["messages"][-2]["content"]  # noqa: E731
    assert not {users(e) for e in tr} & {users(e) for e in va}
    ex = tr[0]["messages"]
    assert ex[0] == {"role": "system", "content": "SYS"} and ex[1]["role"] == "user" and ex[-1]["role"] == "assistant"
    chat = data["chat"]["train"][0]["messages"]
    assert chat[0] == {"role": "system", "content": "S"} and chat[-1] == {"role": "assistant", "content": "ok"}
    assert report["domains"]["chat"]["valid_is_train"]


def test_run_select_writes_mlx_lm_dir(tmp_path, tiny_qwen3):
    from types import SimpleNamespace

    from mlx_lm import load
    from mlx_lm.tuner.datasets import CacheDataset, load_local_dataset

    from mlx_ssp.io import write_jsonl_atomic

    recs = [rec(f"t{j}", i, f"answer {j} by route {i} " + "z " * i, domain="gsm/8k") for j in range(4) for i in range(3)]
    src = tmp_path / "rollouts.jsonl"
    write_jsonl_atomic(src, recs)
    out = tmp_path / "sft"
    res = CliRunner().invoke(__import__("mlx_ssp.cli", fromlist=["main"]).main,
                             ["select", str(src), "--per-prompt", "2", "-o", str(out)])
    assert res.exit_code == 0, res.output
    d = out / "gsm_8k"
    train = [json.loads(x) for x in (d / "train.jsonl").read_text().splitlines()]
    valid = [json.loads(x) for x in (d / "valid.jsonl").read_text().splitlines()]
    assert len(train) + len(valid) == 8 and valid
    spec = json.loads((out / "spectrum.json").read_text())
    assert spec["domains"]["gsm/8k"]["dir"] == "gsm_8k"
    # mlx-lm's tuner reads the directory as a chat dataset, and tokenizes the examples
    _, tok = load(str(tiny_qwen3))
    tr, va, _ = load_local_dataset(d, tok, SimpleNamespace(mask_prompt=True))
    assert len(tr) == len(train) and len(va) == len(valid)
    ids, offset = CacheDataset(tr)[0]
    assert 0 < offset < len(ids)
    # refuses to overwrite, then does with --overwrite
    with pytest.raises(UserError, match="already exists"):
        run_select(src, SelectConfig(), out)
    run_select(src, SelectConfig(policy="first"), out, overwrite=True)
    assert len((d / "train.jsonl").read_text().splitlines()) + len((d / "valid.jsonl").read_text().splitlines()) == 4


def test_bad_inputs(tmp_path):
    from mlx_ssp.io import write_jsonl_atomic

    p = tmp_path / "r.jsonl"
    write_jsonl_atomic(p, [{"task_id": "a"}])
    with pytest.raises(UserError, match="lacks"):
        run_select(p, SelectConfig(), tmp_path / "o")
    write_jsonl_atomic(p, [rec("a", 0, "x", reward=None)])
    with pytest.raises(UserError, match="no record has a reward"):
        run_select(p, SelectConfig(), tmp_path / "o")
    res = CliRunner().invoke(__import__("mlx_ssp.cli", fromlist=["main"]).main,
                             ["select", str(p), "--set", "select.per_prompt=0", "-o", str(tmp_path / "o")])
    assert res.exit_code == 2 and "per_prompt" in res.output


def test_cli_distance_choices_are_the_config_choices(tmp_path):
    """``--distance`` offers exactly what ``select.distance`` accepts, ``auto`` included."""
    from typing import get_args

    from mlx_ssp.cli import main
    from mlx_ssp.commands.select import cli
    from mlx_ssp.io import write_jsonl_atomic

    flag = next(p for p in cli.params if p.name == "distance")
    config_choices = get_args(SelectConfig.model_fields["distance"].annotation)
    assert tuple(flag.type.choices) == config_choices
    assert set(DISTANCES) < set(config_choices) and "auto" in config_choices

    src = tmp_path / "rollouts.jsonl"
    write_jsonl_atomic(src, [rec("t0", i, f"2 + {i} = {2 + i}. The answer is {2 + i}") for i in range(3)])
    res = CliRunner().invoke(main, ["select", str(src), "--distance", "auto", "-o", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
