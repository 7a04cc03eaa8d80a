"""Offline self-distillation (VibeThinker-3B section 2.3): the bucket selection's properties,
the learning-potential score against an independent computation, and the stage on a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import mlx_ssp  # noqa: F401  (OpenBLAS before mlx.core)
from mlx_ssp import distill as D


def test_buckets_and_rank_quantiles():
    assert [D.bucket_of(n, [10, 20]) for n in (0, 9, 10, 19, 20, 99)] == [0, 0, 1, 1, 2, 2]
    assert D.rank_quantiles([3.0, 1.0, 2.0, 1.0]) == [0.875, 0.125, 0.625, 0.375]  # ties: earlier ranks lower


def test_selection_never_compares_across_buckets():
    rng = np.random.default_rng(0)
    doms = ["m"] * 20 + ["c"] * 10
    lens = [int(x) for x in rng.integers(1, 40, 30)]
    scores = [float(x) for x in rng.normal(size=30)]
    kw = dict(edges=[10, 20], min_tokens=3, keep=(0.5, 0.9))
    keep, rep = D.select_by_potential(doms, lens, scores, **kw)
    # per group: exactly the traces whose within-group rank quantile is in [lo, hi)
    for key, g in rep["groups"].items():
        d, b = key.split("/")
        idx = [i for i in range(30) if doms[i] == d and lens[i] >= 3 and D.bucket_of(lens[i], [10, 20]) == int(b)]
        q = D.rank_quantiles([scores[i] for i in idx])
        assert sorted(i for i, qi in zip(idx, q) if 0.5 <= qi < 0.9) == sorted(i for i in keep if i in idx)
        assert g["n"] == len(idx) == g["kept"] + g["below"] + g["outliers"]
    assert rep["short"] == sum(n < 3 for n in lens) and not any(lens[i] < 3 for i in keep)
    # traces added to another bucket (or another domain) with extreme scores change nothing here
    more = D.select_by_potential(doms + ["m"] * 5 + ["x"] * 5, lens + [35] * 5 + [5] * 5,
                                 scores + [1e9] * 5 + [-1e9] * 5, **kw)[0]
    in_old = [i for i in more if i < 30]
    m_last = [i for i in keep if doms[i] == "m" and D.bucket_of(lens[i], [10, 20]) == 2]
    assert [i for i in in_old if not (doms[i] == "m" and D.bucket_of(lens[i], [10, 20]) == 2)] == \
        [i for i in keep if i not in m_last]


def test_mix_is_a_seeded_fraction_per_domain():
    doms = ["a"] * 10 + ["b"] * 4
    idx = list(range(14))
    got = D.mix_domains(idx, doms, {"a": 0.3}, seed=1)
    assert sum(doms[i] == "a" for i in got) == 3 and [i for i in got if doms[i] == "b"] == [10, 11, 12, 13]
    assert got == D.mix_domains(idx, doms, {"a": 0.3}, seed=1) and D.mix_domains(idx, doms, None, 0) == idx


def test_config_is_validated():
    from mlx_ssp.config import validate
    from mlx_ssp.errors import UserError

    for bad, key in (({"keep_quantiles": [0.9, 0.5]}, "keep_quantiles"), ({"buckets": [10, 5]}, "buckets"),
                     ({"mix": {"a": 2}}, "mix"), ({"nope": 1}, "nope")):
        with pytest.raises(UserError, match=key):
            validate(D.DistillConfig, bad, prefix="distill")


def test_learning_potential_is_the_mean_nll_of_the_model_tokens(tiny_qwen3):
    import mlx.core as mx
    import mlx.nn as nn

    from mlx_ssp.models import load_model

    model, tok, _ = load_model(str(tiny_qwen3))
    rng = np.random.default_rng(3)
    recs = []
    for n_p, n_c in ((5, 3), (9, 12), (4, 7), (6, 1), (11, 5)):
        recs.append({"prompt_token_ids": [int(x) for x in rng.integers(5, 200, n_p)],
                     "token_ids": [int(x) for x in rng.integers(5, 200, n_c)], "logprobs": [0.0] * n_c})
    recs[2]["model_mask"] = [1, 1, 0, 0, 1, 1, 1]  # an episode: tool-result tokens do not count

    def naive(r):
        seq = r["prompt_token_ids"] + r["token_ids"]
        lsm = nn.log_softmax(model(mx.array([seq[:-1]]))[0].astype(mx.float32), axis=-1)
        lp = np.array(mx.take_along_axis(lsm, mx.array(seq[1:])[:, None], axis=-1)[:, 0])[len(r["prompt_token_ids"]) - 1:]
        m = np.array(r.get("model_mask", [1] * len(r["token_ids"])), np.float32)
        return float(-(lp * m).sum() / m.sum())

    one = D.learning_potential(model, recs, batch_size=1)
    four = D.learning_potential(model, recs, batch_size=4)
    assert np.allclose(one, [naive(r) for r in recs], atol=1e-4)
    assert np.allclose(one, four, atol=1e-5)  # batched (padded) equals one at a time


def test_stage_collects_scores_selects_and_trains(tmp_path, tiny_qwen3):
    tasks = tmp_path / "tasks.jsonl"
    # an instruct constraint random text meets: most samples are verified correct
    rows = [{"id": f"t{i}", "domain": "inst" if i % 2 else "other", "prompt": f"Say something {i}.",
             "verifier": "instruct", "metadata": {"constraints": [{"kind": "length", "min": 1, "unit": "chars"}]}}
            for i in range(4)]
    tasks.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = D.DistillConfig(k=2, sampling={"temperature": 1.0, "max_tokens": 6}, min_tokens=2, keep_quantiles=(0.25, 1.0),
                          buckets=[4], sft={"iters": 2, "save_every": 2, "batch_size": 2, "max_seq_length": 64,
                                            "lora": {"rank": 2, "num_layers": -1},
                                            "probe": {"k": 1, "max_tasks": 2, "progress": False,
                                                      "sampling": {"temperature": 1.0, "max_tokens": 4}}})
    out = tmp_path / "distill"
    kw = dict(sources={"rl:a": str(tiny_qwen3), "rl:b": str(tiny_qwen3)}, student=str(tiny_qwen3),
              tasks_path=tasks, probe_path=tasks, out_dir=out, seed=0, progress=False)
    rep = D.run_distill(cfg, **kw)
    scored = [json.loads(x) for x in (out / "scored.jsonl").read_text().splitlines()]
    assert rep["correct"] == len(scored) > 0 and {s["source"] for s in scored} == {"rl:a", "rl:b"}
    sel = [s for s in scored if s["selected"]]
    assert rep["selected"] == len(sel) > 0 and all(s["tokens"] >= 2 for s in sel)
    data = [json.loads(x) for x in (out / "data" / "train.jsonl").read_text().splitlines()]
    assert len(data) == len(sel) and all(d["messages"][-1]["role"] == "assistant" for d in data)
    assert Path(rep["model"], "config.json").is_file()
    # a rerun resumes: nothing is sampled again, the student is not retrained
    stamp = {p.name: p.stat().st_mtime_ns for p in (out / "collect").glob("*.jsonl")}
    spec = Path(rep["model"]) / "model.safetensors"
    before = spec.stat().st_mtime_ns
    assert D.run_distill(cfg, **kw)["selected"] == rep["selected"]
    assert {p.name: p.stat().st_mtime_ns for p in (out / "collect").glob("*.jsonl")} == stamp
    assert spec.stat().st_mtime_ns == before


def test_unknown_sft_override_is_a_load_time_error():
    """A typo in distill.sft fails when the run file loads, not after the collection and scoring."""
    import pydantic

    D.DistillConfig(sft={"iters": 3, "learning_rate": 1e-4})
    with pytest.raises(pydantic.ValidationError, match="itres"):
        D.DistillConfig(sft={"itres": 3})
