"""mlx_ssp merge: config gradients and filters, the output layout, adapters, the safety of the inputs,
and bad input (errors naming the tensor and model)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import yaml

import mlx_ssp  # noqa: F401
import mlx.core as mx

from mlx_ssp.errors import UserError
from mlx_ssp.merge import safetensors_io as sio
from mlx_ssp.merge.config import evaluate, load_merge_config
from mlx_ssp.merge.engine import merge_models, plan_merge, run_merge
from mlx_ssp.merge.config import MergeStageConfig
from mlx_ssp.merge.sparsify import bernoulli_mask, dare_seed

from merge_helpers import SHAPES, as_stored, cfg_of, load_out, merge, ref_task_vectors, write_model


# ------------------------------------------------------------------ config: gradients, filters, precedence


def test_gradient_and_filter_evaluation(trio, tmp_path):
    from mlx_ssp.merge.config import Conditional

    assert evaluate("weight", [0.0, 1.0], "x", 0.5, "w") == 0.5
    assert evaluate("weight", [0.0, 1.0, 0.0], "x", 0.75, "w") == 0.5
    conds = [Conditional(filter="mlp", value=[0.0, 1.0]), Conditional(value=0.3)]
    assert evaluate("weight", conds, "model.layers.1.mlp.down_proj.weight", 1.0, "w") == 1.0
    assert evaluate("weight", conds, "model.layers.1.self_attn.q_proj.weight", 1.0, "w") == 0.3
    assert evaluate("normalize", [True, False], "x", 0.6, "w") is True
    # end to end: layer 0 gets t=0, layer 2 gets t=1, norms outside the layers get t=0
    base, a, _ = (as_stored(x, "float32") for x in trio["arrays"])
    m = trio["float32"]
    got = merge(tmp_path, merge_method="task_arithmetic", base_model=str(m[0]), parameters={"weight": 0.1},
                models=[{"model": str(m[1]), "parameters": {"weight": [{"filter": "mlp", "value": 0.0},
                                                                       {"value": [0.0, 1.0]}]}}])
    np.testing.assert_allclose(got["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"])
    np.testing.assert_allclose(got["model.layers.2.self_attn.q_proj.weight"], a["model.layers.2.self_attn.q_proj.weight"], atol=1e-6)
    np.testing.assert_allclose(got["model.layers.1.self_attn.q_proj.weight"],
                               base["model.layers.1.self_attn.q_proj.weight"] + 0.5 * (a["model.layers.1.self_attn.q_proj.weight"] - base["model.layers.1.self_attn.q_proj.weight"]), atol=1e-6)
    np.testing.assert_allclose(got["model.layers.1.mlp.down_proj.weight"], base["model.layers.1.mlp.down_proj.weight"])
    np.testing.assert_allclose(got["model.norm.weight"], base["model.norm.weight"])


def test_paper_variants(trio, tmp_path):
    base, a, b = (as_stored(x, "float32") for x in trio["arrays"])
    m = trio["float32"]
    got = merge(tmp_path, merge_method="ties", base_model=str(m[0]), parameters={"sign_vote": "count"},
                models=[{"model": str(m[1]), "parameters": {"weight": 0.7, "density": 0.4}},
                        {"model": str(m[2]), "parameters": {"weight": 0.4, "density": 0.6}}])
    n = "model.layers.0.mlp.down_proj.weight"
    want = ref_task_vectors(base[n], [a[n], b[n]], [0.7, 0.4], [0.4, 0.6], method="ties", normalize=True,
                            cd="float32", vote="count")
    np.testing.assert_allclose(got[n], want, atol=1e-6)
    got = merge(tmp_path, name="inv", merge_method="dare_linear", base_model=str(m[0]), seed=2,
                parameters={"rescale_mode": "inverse_density"},
                models=[{"model": str(m[1]), "parameters": {"weight": 1.0, "density": 0.25}}])
    mask = np.array(bernoulli_mask(16 * 24, 0.25, dare_seed(2, n, "0"))).reshape(16, 24)
    np.testing.assert_allclose(got[n], base[n] + np.where(mask, (a[n] - base[n]) / 0.25, 0), atol=1e-5)


# ------------------------------------------------------------------ output layout, adapters, safety


def test_output_layout_loads_in_mlx_lm(tiny_llama, tmp_path):
    import mlx_lm

    cfg = tmp_path / "c.yml"
    cfg.write_text(yaml.safe_dump({"merge_method": "linear", "models": [
        {"model": str(tiny_llama), "parameters": {"weight": 1}}]}))
    out = tmp_path / "merged"
    r = subprocess.run([sys.executable, "-m", "mlx_ssp.cli", "merge", str(cfg), str(out), "--quiet",
                        "--out-shard-size", "20KB"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(idx["weight_map"].values())) > 1
    assert (out / "tokenizer.json").is_file() and (out / "mergekit_config.yml").is_file()
    assert set(idx["weight_map"]) == set(sio.scan_model(tiny_llama))
    model, tok = mlx_lm.load(str(out))
    ref, _ = mlx_lm.load(str(tiny_llama))
    x = mx.array([[1, 2, 3]])
    np.testing.assert_array_equal(np.array(model(x)), np.array(ref(x)))
    # exists -> refused; --overwrite replaces
    r = subprocess.run([sys.executable, "-m", "mlx_ssp.cli", "merge", str(cfg), str(out)], capture_output=True, text=True)
    assert r.returncode == 2 and "already exists" in r.stderr


def test_adapter_fused_on_the_fly(trio, tmp_path):
    base = as_stored(trio["arrays"][0], "float32")
    m = trio["float32"][0]
    ad = tmp_path / "adapter"
    ad.mkdir()
    rng = np.random.default_rng(3)
    la = rng.standard_normal((16, 4)).astype(np.float32)  # (in, r)
    lb = rng.standard_normal((4, 24)).astype(np.float32)  # (r, out)... for down_proj (16 out, 24 in)
    la = rng.standard_normal((24, 4)).astype(np.float32)
    lb = rng.standard_normal((4, 16)).astype(np.float32)
    mx.save_safetensors(str(ad / "adapters.safetensors"), {
        "model.layers.0.mlp.down_proj.lora_a": mx.array(la), "model.layers.0.mlp.down_proj.lora_b": mx.array(lb)})
    (ad / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "lora", "lora_parameters": {"scale": 2.0, "rank": 4}}))
    got = merge(tmp_path, merge_method="linear", models=[{"model": f"{m}+{ad}", "parameters": {"weight": 1}}])
    n = "model.layers.0.mlp.down_proj.weight"
    np.testing.assert_allclose(got[n], base[n] + 2.0 * lb.T @ la.T, atol=1e-5)
    np.testing.assert_array_equal(got["model.norm.weight"], base["model.norm.weight"])


def test_inputs_untouched_and_failed_merge_leaves_nothing(trio, tmp_path, monkeypatch):
    m = trio["float32"]
    before = {p: (p.stat().st_mtime_ns, p.stat().st_size) for d in m for p in d.iterdir()}
    from mlx_ssp.merge import engine

    calls = {"n": 0}
    real = engine.merge_tensor

    def boom(job, p, seed):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(job, p, seed)

    monkeypatch.setattr(engine, "merge_tensor", boom)
    with pytest.raises(KeyboardInterrupt):
        run_merge(cfg_of(merge_method="ties", base_model=str(m[0]),
                         models=[{"model": str(m[1]), "parameters": {"weight": 1, "density": 0.5}}]),
                  tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.tmp-*"))
    after = {p: (p.stat().st_mtime_ns, p.stat().st_size) for d in m for p in d.iterdir()}
    assert before == after


def test_pipeline_merge_models(trio, tmp_path):
    m = trio["float32"]
    stage = MergeStageConfig(method="ties", density=0.5)
    res = merge_models([m[1], m[2]], m[0], stage, tmp_path / "merged", progress=False)
    assert res["tensors"] == len(SHAPES)
    via_cfg = merge(tmp_path, merge_method="ties", base_model=str(m[0]),
                    models=[{"model": str(m[i]), "parameters": {"weight": 1.0, "density": 0.5}} for i in (1, 2)])
    got = load_out(tmp_path / "merged")
    for n in SHAPES:
        np.testing.assert_array_equal(got[n], via_cfg[n])
    with pytest.raises(UserError, match="needs a base"):
        merge_models([m[1]], None, MergeStageConfig(method="ties"), tmp_path / "x", progress=False)


# ------------------------------------------------------------------ bad input


def _two(trio, tmp_path, arrays_b, dtype="float32", **kw):
    m0 = trio[dtype][0]
    mb = write_model(tmp_path / "bad", arrays_b, dtype)
    return cfg_of(merge_method="ties", base_model=str(m0),
                  models=[{"model": str(mb), "parameters": {"weight": 1, "density": 0.5}}], **kw), mb


def test_errors_name_tensor_and_model(trio, tmp_path):
    arr = dict(trio["arrays"][1])
    arr["model.layers.0.self_attn.q_proj.weight"] = np.zeros((16, 8), np.float32)
    cfg, mb = _two(trio, tmp_path, arr)
    with pytest.raises(UserError, match=r"tensor 'model.layers.0.self_attn.q_proj.weight'.*bad"):
        plan_merge(cfg)
    arr = dict(trio["arrays"][1])
    del arr["model.norm.weight"]
    cfg, mb = _two(trio, tmp_path / "b", arr)
    with pytest.raises(UserError, match=r"'model.norm.weight' is missing from model .*bad"):
        plan_merge(cfg)


def test_vocab_mismatch_error_truncate_pad(trio, tmp_path):
    base = as_stored(trio["arrays"][0], "float32")
    for rows, fix in ((48, "truncate"), (32, "pad")):
        arr = dict(trio["arrays"][1])
        for n in ("model.embed_tokens.weight", "lm_head.weight"):
            arr[n] = np.ones((rows, 16), np.float32)
        cfg, mb = _two(trio, tmp_path / fix, arr)
        with pytest.raises(UserError, match=rf"vocabulary size {rows} in model .*--vocab-mismatch {fix}"):
            plan_merge(cfg)
        out = tmp_path / f"out_{fix}"
        run_merge(cfg, out, vocab_mismatch=fix, progress=False)
        got = load_out(out)["lm_head.weight"]
        assert got.shape == (40, 16)
        if fix == "pad":  # padded rows come from the base: no change there
            np.testing.assert_array_equal(got[32:], base["lm_head.weight"][32:])


def test_corrupt_and_truncated_files(trio, tmp_path):
    good = trio["float32"][1]
    bad = tmp_path / "trunc"
    bad.mkdir()
    (bad / "config.json").write_text((good / "config.json").read_text())
    data = (good / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[:-100])
    cfg = cfg_of(merge_method="linear", models=[{"model": str(bad), "parameters": {"weight": 1}}])
    with pytest.raises(UserError, match="truncated safetensors file: tensor"):
        plan_merge(cfg)
    (bad / "model.safetensors").write_bytes(b"\xff" * 8 + data[8:100])
    with pytest.raises(UserError, match="corrupt or truncated"):
        plan_merge(cfg)
    (bad / "model.safetensors").write_bytes(data)
    (bad / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(UserError, match="corrupt index"):
        plan_merge(cfg)
    (bad / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "missing.safetensors"}}))
    with pytest.raises(UserError, match="missing.safetensors"):
        plan_merge(cfg)


def test_config_errors(trio, tmp_path):
    m = trio["float32"]
    with pytest.raises(UserError, match=r"tensor '.*' of model .*: density 1.5 is outside \(0, 1\]"):
        plan_merge(cfg_of(merge_method="ties", base_model=str(m[0]),
                          models=[{"model": str(m[1]), "parameters": {"weight": 1, "density": 1.5}}]))
    with pytest.raises(UserError, match="sum to zero"):
        plan_merge(cfg_of(merge_method="linear", models=[{"model": str(m[1]), "parameters": {"weight": 1}},
                                                         {"model": str(m[2]), "parameters": {"weight": -1}}]))
    with pytest.raises(UserError, match="needs base_model"):
        plan_merge(cfg_of(merge_method="dare_ties", models=[{"model": str(m[1]), "parameters": {"weight": 1}}]))
    with pytest.raises(UserError, match="no weight given"):
        plan_merge(cfg_of(merge_method="linear", models=[{"model": str(m[1])}]))
    for bad, pat in (({"merge_method": "slerpy"}, "valid methods: linear, task_arithmetic, ties"),
                     ({"merge_method": "linear", "slices": [{"sources": [{"model": "x", "layer_range": [0, 1]}]}]},
                      "exactly one of models: .* or slices:"),
                     ({"merge_method": "linear", "modules": {}}, "unknown key 'modules'"),
                     ({"merge_method": "linear", "parameters": {"densty": 0.5}}, "unknown parameter 'densty'.*valid"),
                     ({"merge_method": "ties", "base_model": str(m[0]), "parameters": {"sign_vote": "max"}}, None)):
        p = tmp_path / "c.yml"
        p.write_text(yaml.safe_dump({"models": [{"model": str(m[1]), "parameters": {"weight": 1}}], **bad}))
        if pat is None:
            with pytest.raises(UserError, match="sign_vote must be one of weighted, unweighted, count"):
                plan_merge(load_merge_config(p)[0])
        else:
            with pytest.raises(UserError, match=pat):
                load_merge_config(p)
