"""Tokenizer surgery in ``mlx_ssp merge`` (tokenizer_source base | model | union, tokenizer:)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mlx_ssp.errors import UserError

TOOL = "<tool_call>"


def _vocab(d: Path) -> dict[str, int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(d / "tokenizer.json")).get_vocab(with_added_tokens=True)


def _weights(d: Path) -> dict[str, np.ndarray]:
    import mlx.core as mx

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update({k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(f)).items()})
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """a, a2: one tokenizer (different weights); b: a tokenizer trained on other text plus an added
    special token, so that shared tokens mostly have different ids. Untied LM heads."""
    from tokenizers import AddedToken, Tokenizer

    from mlx_ssp.testing import make_tiny_model, train_tokenizer

    d = tmp_path_factory.mktemp("tokmerge")
    kw = dict(hidden_size=32, num_layers=1, intermediate_size=64, tie_word_embeddings=False)
    a = make_tiny_model(d / "a", vocab_size=300, **kw)
    a2 = make_tiny_model(d / "a2", tokenizer_dir=a, seed=2, **kw)
    tb = train_tokenizer(d / "tb", vocab_size=300, corpus=["zebra xylophone quantum jazz"] * 50)
    t = Tokenizer.from_file(str(tb / "tokenizer.json"))
    t.add_special_tokens([AddedToken(TOOL, special=True, normalized=False)])
    t.save(str(tb / "tokenizer.json"))
    b = make_tiny_model(d / "b", tokenizer_dir=tb, seed=1, **kw)
    return {"dir": d, "a": a, "a2": a2, "b": b}


def _merge(models, out: str, extra: dict, entries=(("a", 0.3), ("b", 0.7))) -> Path:
    from mlx_ssp.merge.config import MergeConfig
    from mlx_ssp.merge.engine import run_merge

    cfg = MergeConfig.model_validate({
        "models": [{"model": str(models[m]), "parameters": {"weight": w}} for m, w in entries],
        "merge_method": "linear", **extra})
    path = models["dir"] / out
    run_merge(cfg, path, overwrite=True, progress=False, workers=1)
    return path


def _reference(out_vocab, inputs, name):
    """NumPy reference of a normalized linear merge on ``out_vocab``: each model's row of a token
    by string; a token one model lacks takes the row of the model that has it (two models)."""
    rows = np.zeros((len(out_vocab), inputs[0][2][name].shape[1]))
    total = sum(w for w, _, _ in inputs)
    for tok, i in out_vocab.items():
        have = [(v[tok], W[name]) for _, v, W in inputs if tok in v]
        for w, v, W in inputs:
            r = W[name][v[tok]] if tok in v else have[0][1][have[0][0]]
            rows[i] += w * r.astype(np.float64)
    return rows / total


def test_union_rows_tokenizer_and_loading(models):
    a, b = models["a"], models["b"]
    va, vb = _vocab(a), _vocab(b)
    shared = [t for t in va if t in vb]
    assert any(va[t] != vb[t] for t in shared), "the test needs shared tokens at different ids"
    only_b = [t for t in vb if t not in va]
    assert TOOL in only_b and len(only_b) > 3

    out = _merge(models, "union", {"tokenizer_source": "union"})
    vo = _vocab(out)
    # base (first model) ids kept; the new tokens appended after them
    assert all(vo[t] == i for t, i in va.items())
    assert sorted(vo[t] for t in only_b) == list(range(len(va), len(va) + len(only_b)))
    conf = json.loads((out / "config.json").read_text())
    w = _weights(out)
    assert conf["vocab_size"] == len(vo) == w["model.embed_tokens.weight"].shape[0] == w["lm_head.weight"].shape[0]
    inputs = [(0.3, va, _weights(a)), (0.7, vb, _weights(b))]
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        np.testing.assert_allclose(w[name], _reference(vo, inputs, name), rtol=0, atol=2e-6)
    # a token only b has: b's row exactly (both models take it)
    np.testing.assert_array_equal(w["model.embed_tokens.weight"][vo[TOOL]], inputs[1][2]["model.embed_tokens.weight"][vb[TOOL]])

    import mlx_lm
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    ids = tok.encode(f"hi {TOOL} there", add_special_tokens=False)
    assert vo[TOOL] in ids and vo[TOOL] != vb[TOOL]
    model, mtok = mlx_lm.load(str(out))
    assert model.model.embed_tokens.weight.shape[0] == len(vo)
    assert mtok.encode(TOOL, add_special_tokens=False) == [vo[TOOL]]


def test_base_and_model_sources(models):
    a, b = models["a"], models["b"]
    va, vb = _vocab(a), _vocab(b)
    inputs = [(0.3, va, _weights(a)), (0.7, vb, _weights(b))]
    out = _merge(models, "base", {"tokenizer_source": "base"})
    assert (out / "tokenizer.json").read_bytes() == (a / "tokenizer.json").read_bytes()
    w = _weights(out)
    assert json.loads((out / "config.json").read_text())["vocab_size"] == len(va) == w["lm_head.weight"].shape[0]
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        np.testing.assert_allclose(w[name], _reference(va, inputs, name), rtol=0, atol=2e-6)

    out = _merge(models, "fromb", {"tokenizer_source": str(b)})
    for f in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / f).read_bytes() == (b / f).read_bytes()
    w = _weights(out)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        np.testing.assert_allclose(w[name], _reference(vb, inputs, name), rtol=0, atol=2e-6)


def test_identical_tokenizers_union_is_byte_identical(models):
    entries = (("a", 0.4), ("a2", 0.6))
    plain = _merge(models, "plain", {}, entries)
    union = _merge(models, "same_union", {"tokenizer_source": "union"}, entries)
    assert (plain / "model.safetensors").read_bytes() == (union / "model.safetensors").read_bytes()
    assert (union / "tokenizer.json").read_bytes() == (models["a"] / "tokenizer.json").read_bytes()


def test_tokens_section_and_padding(models):
    a, b = models["a"], models["b"]
    va, vb = _vocab(a), _vocab(b)
    Wa, Wb = _weights(a), _weights(b)
    out = _merge(models, "tokens", {"tokenizer": {
        "source": "base", "pad_to_multiple_of": 64,
        "tokens": {"<|im_end|>": {"source": {"kind": "zero"}, "force": True},
                   "<new>": {"source": {"kind": "model_token", "model": str(b), "token": TOOL}},
                   "Ġthe": {"source": str(b), "force": True}}}})
    vo = _vocab(out)
    n = len(va) + 1
    assert vo["<new>"] == len(va) and len(vo) == n
    w = _weights(out)
    E = w["model.embed_tokens.weight"]
    assert E.shape[0] == 320 == json.loads((out / "config.json").read_text())["vocab_size"]
    name = "model.embed_tokens.weight"
    assert not E[vo["<|im_end|>"]].any()
    np.testing.assert_allclose(E[vo["<new>"]], Wb[name][vb[TOOL]], atol=1e-6)
    assert "Ġthe" in va and "Ġthe" in vb
    np.testing.assert_allclose(E[vo["Ġthe"]], Wb[name][vb["Ġthe"]], atol=1e-6)
    # pad rows: each model's mean row; the linear merge of means is the mean of the merged rows
    np.testing.assert_allclose(E[n:], np.broadcast_to(E[:n].mean(axis=0), E[n:].shape), atol=1e-6)
    # an ordinary shared token keeps the weighted rows of both models
    t = next(t for t in va if t in vb and va[t] != vb[t] and t != "Ġthe")
    np.testing.assert_allclose(E[vo[t]], 0.3 * Wa[name][va[t]] + 0.7 * Wb[name][vb[t]], atol=2e-6)


def test_default_rules_follow_mergekit():
    from mlx_ssp.merge.tokenizer import RowRule, TokenChoice, default_rules, gather_index

    out = {"all": 0, "only1": 1, "base_and_2": 2, "1_and_2": 3, "none": 4, "forced": 5}
    perms = {0: np.array([0, -1, 1, -1, -1, 2]),  # the base
             1: np.array([3, 0, -1, 1, -1, 4]),
             2: np.array([1, -1, 2, 0, -1, 3])}
    rules, forced = default_rules(perms, out, {"forced": TokenChoice("model", source=2, force=True)}, base=0)
    assert rules == {1: RowRule("copy", ((1, 0),)), 2: RowRule("copy", ((0, 1),)),
                     3: RowRule("mean", ((1, 1), (2, 0))), 4: RowRule("zero"), 5: RowRule("copy", ((2, 3),))}
    assert forced == {5}
    # without a base, a token two models have is their mean
    no_base, _ = default_rules(perms, out, {}, base=None)
    assert no_base[2] == RowRule("mean", ((0, 1), (2, 2))) and 5 not in no_base
    pos = {t: j for j, t in enumerate(sorted(rules))}
    idx = gather_index(perms[1], 10, pos, {5})
    assert idx[0] == 3 and idx[1] == 0 and idx[2] == 10 + pos[2] and idx[5] == 10 + pos[5]


def test_union_order_and_config_errors(models, tmp_path):
    from mlx_ssp.merge.config import MergeConfig, load_merge_config
    from mlx_ssp.merge.engine import plan_merge
    from mlx_ssp.merge.tokenizer import Vocab, union_additions

    v0 = Vocab({"a": 0, "b": 1, "<s>": 2}, {2: {"content": "<s>", "special": True}}, 3)
    v1 = Vocab({"<t>": 0, "c": 1, "a": 2, "d": 3, "e": 4}, {0: {"content": "<t>", "special": True}}, 4)
    assert [x["content"] for x in union_additions([v0, v1])] == ["c", "d", "<t>"]  # "e" has no row

    def load(data):
        f = tmp_path / "m.yml"
        f.write_text(json.dumps(data))
        return load_merge_config(f)[0]

    base = {"models": [{"model": str(models["a"]), "parameters": {"weight": 1.0}}], "merge_method": "linear"}
    with pytest.raises(UserError, match="valid keys: force, source"):
        load({**base, "tokenizer": {"tokens": {"x": {"sorce": "a"}}}})
    with pytest.raises(UserError, match="one of zero, model_token"):
        load({**base, "tokenizer": {"tokens": {"x": {"source": {"kind": "mean"}}}}})
    with pytest.raises(UserError, match="unknown key 'tokenizer.pad_to'"):
        load({**base, "tokenizer": {"pad_to": 8}})
    with pytest.raises(UserError, match="not both"):
        load({**base, "tokenizer_source": "base", "tokenizer": {"source": "base"}})
    with pytest.raises(UserError, match="valid: base, union or one of them"):
        plan_merge(MergeConfig.model_validate({**base, "tokenizer_source": "elsewhere"}))
    with pytest.raises(UserError, match="not one of the models"):
        plan_merge(MergeConfig.model_validate({**base, "tokenizer": {"tokens": {"x": {"source": "other"}}}}))
