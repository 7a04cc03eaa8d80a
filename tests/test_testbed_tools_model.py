"""The tool-use testbed model's corpus and build: the designed mix (gold, skewed call orders,
unreliable traces) is what the corpus holds, its gold conversations verify to 1 and its unreliable
ones below, the training items mask everything but the model's messages, and a short build gives a
model that runs episodes."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from mlx_ssp.testbed.tools.corpus import corpus, train_tasks
from mlx_ssp.verify import verify


@pytest.fixture(scope="module")
def recs():
    return corpus(24, 3, unreliable=0.4)


def test_corpus_is_deterministic_and_holds_the_designed_mix(recs):
    again = corpus(24, 3, unreliable=0.4)
    assert [r["messages"] for r in recs] == [r["messages"] for r in again]
    kinds = Counter(r["kind"] for r in recs)
    assert len(recs) == 4 * 24 and set(Counter(r["backend"] for r in recs).values()) == {24}
    assert kinds["gold"] > 0 and any(k.startswith("order") for k in kinds)
    unreliable = sum(v for k, v in kinds.items() if k != "gold" and not k.startswith("order"))
    assert 0.2 < unreliable / len(recs) < 0.6  # about the share asked for (0.4), where a variant applies
    assert corpus(24, 3, unreliable=0.0) != recs and all(
        r["kind"] == "gold" or r["kind"].startswith("order") for r in corpus(8, 3, unreliable=0.0))


def test_gold_and_reordered_conversations_pass_and_unreliable_ones_do_not(recs):
    for r in recs:
        good = r["kind"] == "gold" or r["kind"].startswith("order")
        assert (verify(r["messages"], r["task"]).reward == 1.0) == good, (r["kind"], r["task"].id)


def test_corpus_episodes_come_from_the_train_space_only():
    eval_like = train_tasks(16, 3, ("kv",))
    assert all(ep.space == "train" for _, ep in eval_like)


def test_training_items_mask_everything_but_the_models_messages(recs, tiny_qwen3):
    from mlx_lm.utils import load_tokenizer

    from mlx_ssp.testbed.build import _episode_item

    tok = load_tokenizer(tiny_qwen3)
    r = next(x for x in recs if len(x["messages"]) > 6)
    ids, mask = _episode_item(tok, r, 10_000)
    assert len(ids) == len(mask) and mask[0] == 0
    target = tok.decode([i for i, m in zip(ids, mask) if m])
    for m in r["messages"]:
        if m["role"] == "assistant":
            assert m["content"] in target
        elif m["role"] in ("tool", "user") and len(m["content"]) > 6 and m["content"] not in ("Done.",):
            assert m["content"] not in target, m
    cut_ids, cut_mask = _episode_item(tok, r, 40)
    assert cut_ids == ids[:40] and cut_mask == mask[:40]


@pytest.mark.slow
def test_a_short_build_gives_a_model_that_runs_episodes(tmp_path):
    from mlx_lm import load

    from mlx_ssp.testbed.build import build
    from mlx_ssp.testbed.tools.calibrate import calibrate_tools

    out = build("tools", 0, tmp_path / "tb", steps=4, corpus_size=16, progress=False)
    info = json.loads((out / "build.json").read_text())
    assert info["corpus_records"] == 64 and set(info["mix"]) == {"kv", "ctr", "files", "bank"}
    assert sum(sum(m["strategies"].values()) for m in info["mix"].values()) == 64
    model, tok = load(str(out))
    res = calibrate_tools(model, tok, n_per_backend=2, k=2, max_tokens=8)
    assert set(res["backends"]) == {"kv", "ctr", "files", "bank"}
    assert all(b["n"] == 2 and 0.0 <= b["pass@1"] <= 1.0 for b in res["backends"].values())
