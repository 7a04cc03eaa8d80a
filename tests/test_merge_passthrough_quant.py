"""mlx_ssp merge: passthrough with slices: (layer surgery) and MLX-quantized inputs/outputs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

import mlx_ssp  # noqa: F401
import mlx.core as mx

from mlx_ssp.errors import UserError
from mlx_ssp.merge.config import MergeConfig, load_merge_config
from mlx_ssp.merge.engine import plan_merge, run_merge
from mlx_ssp.testing import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Two 3-layer float32 models with the same tokenizer (different weights), and a 2-layer one."""
    d = tmp_path_factory.mktemp("pt")
    a = make_tiny_model(d / "a", num_layers=3, seed=0)
    b = make_tiny_model(d / "b", num_layers=3, seed=1, tokenizer_dir=a)
    return {"a": a, "b": b, "dir": d}


def weights(d: Path) -> dict[str, mx.array]:
    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        out.update(mx.load(str(f)))
    return out


def raw_bytes(a: mx.array) -> bytes:
    return np.asarray(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).tobytes()


def passthrough(slices, **kw) -> MergeConfig:
    return MergeConfig.model_validate({"merge_method": "passthrough", "slices": [
        {"sources": [{"model": str(m), "layer_range": list(r)}]} for m, r in slices], **kw})


# ------------------------------------------------------------------ passthrough / slices


def test_full_range_passthrough_is_the_identity(tiny, tmp_path):
    out = tmp_path / "full"
    run_merge(passthrough([(tiny["a"], (0, 3))]), out, progress=False)
    src, got = weights(tiny["a"]), weights(out)
    assert sorted(src) == sorted(got)
    for k in src:
        assert got[k].dtype == src[k].dtype and raw_bytes(got[k]) == raw_bytes(src[k]), k
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 3
    # the models: form with one model is the identity as well
    out2 = tmp_path / "models"
    run_merge(MergeConfig.model_validate({"merge_method": "passthrough", "models": [{"model": str(tiny["a"])}]}),
              out2, progress=False)
    got2 = weights(out2)
    assert all(raw_bytes(got2[k]) == raw_bytes(src[k]) for k in src)


def test_frankenmerge_renumbers_layers_and_loads(tiny, tmp_path):
    """a's layers 0-1 then b's layers 1-2 (overlapping ranges of two models): 4 layers; embeddings from
    the first slice's model, the final norm from the last slice's (mergekit's pre/post weights)."""
    import mlx_lm

    out = tmp_path / "fr"
    run_merge(passthrough([(tiny["a"], (0, 2)), (tiny["b"], (1, 3))]), out, progress=False)
    A, B, got = weights(tiny["a"]), weights(tiny["b"]), weights(out)
    conf = json.loads((out / "config.json").read_text())
    assert conf["num_hidden_layers"] == 4
    want = {}
    for k, v in A.items():
        if ".layers." not in k and "norm.weight" != k.split("model.")[-1]:
            want[k] = v  # embeddings: the first slice's model
    want["model.norm.weight"] = B["model.norm.weight"]
    for out_layer, (src, li) in enumerate([(A, 0), (A, 1), (B, 1), (B, 2)]):
        for k, v in src.items():
            if f".layers.{li}." in k:
                want[k.replace(f".layers.{li}.", f".layers.{out_layer}.")] = v
    assert sorted(got) == sorted(want)
    for k in want:
        assert mx.array_equal(got[k], want[k]).item(), k
    model, _ = mlx_lm.load(str(out))
    assert len(model.model.layers) == 4
    np.testing.assert_array_equal(np.asarray(model.model.layers[2].mlp.up_proj.weight),
                                  np.asarray(B["model.layers.1.mlp.up_proj.weight"]))


def test_passthrough_scale_and_errors(tiny, tmp_path):
    out = tmp_path / "scaled"
    cfg = MergeConfig.model_validate({"merge_method": "passthrough", "slices": [{"sources": [
        {"model": str(tiny["a"]), "layer_range": [0, 3], "parameters": {"scale": [
            {"filter": "down_proj", "value": 0.5}, {"value": 1.0}]}}]}]})
    run_merge(cfg, out, progress=False)
    A, got = weights(tiny["a"]), weights(out)
    k = "model.layers.1.mlp.down_proj.weight"
    np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(A[k]) * np.float32(0.5))
    assert mx.array_equal(got["model.layers.1.mlp.up_proj.weight"], A["model.layers.1.mlp.up_proj.weight"]).item()
    with pytest.raises(UserError, match="--vocab-mismatch pad is not supported with slices"):
        plan_merge(passthrough([(tiny["a"], (0, 3))]), vocab_mismatch="pad")
    with pytest.raises(UserError, match="goes past its 3 layers"):
        plan_merge(passthrough([(tiny["a"], (0, 4))]))
    with pytest.raises(UserError, match="takes 1 source per slice"):
        plan_merge(MergeConfig.model_validate({"merge_method": "passthrough", "slices": [{"sources": [
            {"model": str(tiny["a"]), "layer_range": [0, 1]}, {"model": str(tiny["b"]), "layer_range": [0, 1]}]}]}))
    with pytest.raises(UserError, match="takes at most 1 model"):
        plan_merge(MergeConfig.model_validate({"merge_method": "passthrough", "models": [
            {"model": str(tiny["a"])}, {"model": str(tiny["b"])}]}))
    for bad, pat in (({"slices": [{"sources": [{"model": "x", "layer_range": [2, 1]}]}]}, "layer_range must be"),
                     ({"slices": [{"sources": [{"model": "x", "layer_range": [0, 1], "rng": 1}]}]},
                      "unknown key 'slices.0.sources.0.rng'; valid keys: .*layer_range"),
                     ({"slices": [{"sources": [{"model": "x", "layer_range": [0, 1]}], "base_model": "x"}]},
                      "unknown key 'slices.0.base_model'; valid keys: .*sources"),
                     ({"slices": [{"sources": [{"model": "x", "layer_range": [0, 1], "parameters": {"weight": 1}}]}]},
                      "unknown parameter 'weight' for passthrough; valid here: scale")):
        p = tmp_path / "c.yml"
        p.write_text(yaml.safe_dump({"merge_method": "passthrough", **bad}))
        with pytest.raises(UserError, match=pat):
            load_merge_config(p)


def test_slices_with_other_methods_equal_the_models_form(tiny, tmp_path):
    """One slice over the full range of each model is the models: form, byte for byte (linear, and
    dare_ties, whose seeds depend on the model's position); ranges at an offset merge layer j of
    one model with layer j + 1 of the other."""
    a, b = str(tiny["a"]), str(tiny["b"])
    cases = {"linear": ({"models": [{"model": a, "parameters": {"weight": 0.3}}, {"model": b, "parameters": {"weight": [1, 2]}}]},
                        [{"model": a, "layer_range": [0, 3], "parameters": {"weight": 0.3}},
                         {"model": b, "layer_range": [0, 3], "parameters": {"weight": [1, 2]}}]),
             "dare_ties": ({"base_model": a, "models": [{"model": b, "parameters": {"weight": 0.7, "density": 0.5}}]},
                           [{"model": b, "layer_range": [0, 3], "parameters": {"weight": 0.7, "density": 0.5}},
                            {"model": a, "layer_range": [0, 3]}])}
    for method, (models_form, sources) in cases.items():
        extra = {"base_model": a} if method != "linear" else {}
        run_merge(MergeConfig.model_validate({"merge_method": method, **models_form}), tmp_path / f"m_{method}",
                  progress=False, seed=3)
        run_merge(MergeConfig.model_validate({"merge_method": method, "slices": [{"sources": sources}], **extra}),
                  tmp_path / f"s_{method}", progress=False, seed=3)
        m, sl = weights(tmp_path / f"m_{method}"), weights(tmp_path / f"s_{method}")
        assert sorted(m) == sorted(sl)
        for k in m:
            assert raw_bytes(m[k]) == raw_bytes(sl[k]), (method, k)
    out = tmp_path / "offset"
    run_merge(MergeConfig.model_validate({"merge_method": "linear", "slices": [{"sources": [
        {"model": a, "layer_range": [0, 2]}, {"model": b, "layer_range": [1, 3]}]}], "parameters": {"weight": 1}}),
        out, progress=False)
    A, B, got = weights(tiny["a"]), weights(tiny["b"]), weights(out)
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
    for j in range(2):
        k = f"model.layers.{j}.mlp.gate_proj.weight"
        kb = f"model.layers.{j + 1}.mlp.gate_proj.weight"
        np.testing.assert_allclose(np.asarray(got[k]), (np.asarray(A[k]) + np.asarray(B[kb])) / 2, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(got["model.embed_tokens.weight"]),
                               (np.asarray(A["model.embed_tokens.weight"]) + np.asarray(B["model.embed_tokens.weight"])) / 2,
                               rtol=1e-6)
    for bad, pat in (({"merge_method": "ties", "base_model": a, "slices": [{"sources": [{"model": b, "layer_range": [0, 3]}]}]},
                      "base_model .* is not among the slice's sources"),
                     ({"merge_method": "linear", "slices": [{"sources": [{"model": a, "layer_range": [0, 3]},
                                                                          {"model": b, "layer_range": [1, 3]}]}]},
                      "every source must span the same number of layers")):
        with pytest.raises(UserError, match=pat):
            plan_merge(MergeConfig.model_validate(bad))


# ------------------------------------------------------------------ MLX-quantized inputs and outputs


def _mixed_predicate(path, module):
    """Mixed quantization: layer 1's MLP at 8 bits / group 32, layer 2's q_proj left in float."""
    if "layers.1.mlp" in path:
        return {"bits": 8, "group_size": 32}
    return "layers.2.self_attn.q_proj" not in path


@pytest.fixture(scope="module")
def quantized(tiny):
    """``a`` quantized by mlx-lm (4 bits, group 64, mixed per-module overrides) and mlx-lm's own
    dequantized float copy of it."""
    from mlx_lm import convert

    q, f = tiny["dir"] / "q4", tiny["dir"] / "q4_float"
    convert(str(tiny["a"]), str(q), quantize=True, q_bits=4, q_group_size=64, quant_predicate=_mixed_predicate)
    convert(str(q), str(f), dequantize=True)
    return {"q": q, "f": f}


def reference_dequantized(q: Path) -> dict[str, mx.array]:
    """Every module of a quantized model dequantized with its own bits / group size (read from
    config.json here, independently of the merge code)."""
    conf = json.loads((q / "config.json").read_text())["quantization"]
    w = weights(q)
    out = {}
    for k, v in w.items():
        stem = k.rsplit(".", 1)[0]
        if k.endswith((".scales", ".biases")):
            continue
        if stem + ".scales" in w:
            own = conf.get(stem, {})
            v = mx.dequantize(v, w[stem + ".scales"], w[stem + ".biases"],
                              group_size=own.get("group_size", conf["group_size"]), bits=own.get("bits", conf["bits"]))
        out[k] = v
    return out


def test_quantized_input_merges_dequantized_and_loads(tiny, quantized, tmp_path):
    import mlx_lm

    conf = json.loads((quantized["q"] / "config.json").read_text())["quantization"]
    assert conf["model.layers.1.mlp.up_proj"] == {"bits": 8, "group_size": 32}  # the fixture is mixed
    deq = reference_dequantized(quantized["q"])
    assert deq["model.layers.1.mlp.up_proj.weight"].shape == (128, 64)
    # linear of the quantized model and a float copy of it: the dequantized values exactly
    out = tmp_path / "m"
    run_merge(MergeConfig.model_validate({"merge_method": "linear", "models": [
        {"model": str(quantized["q"]), "parameters": {"weight": 1}},
        {"model": str(quantized["f"]), "parameters": {"weight": 1}}]}), out, progress=False)
    got = weights(out)
    assert sorted(got) == sorted(deq)
    for k in deq:
        assert got[k].dtype == mx.float32 and mx.array_equal(got[k], deq[k]).item(), k
    conf_out = json.loads((out / "config.json").read_text())
    assert "quantization" not in conf_out and "quantization_config" not in conf_out
    mlx_lm.load(str(out))
    # with the original float model: (dequantized + float) / 2 against NumPy
    out2 = tmp_path / "m2"
    run_merge(MergeConfig.model_validate({"merge_method": "linear", "models": [
        {"model": str(quantized["q"]), "parameters": {"weight": 1}},
        {"model": str(tiny["a"]), "parameters": {"weight": 3}}]}), out2, progress=False)
    A, got2 = weights(tiny["a"]), weights(out2)
    k = "model.layers.1.mlp.down_proj.weight"
    want = (np.asarray(deq[k], np.float64) + 3 * np.asarray(A[k], np.float64)) / 4
    np.testing.assert_allclose(np.asarray(got2[k]), want, rtol=1e-6, atol=1e-7)


def test_out_quantization_round_trip(tiny, quantized, tmp_path):
    import mlx_lm

    flat, out = tmp_path / "float", tmp_path / "q"
    models = [{"model": str(quantized["q"]), "parameters": {"weight": 1}},
              {"model": str(tiny["b"]), "parameters": {"weight": 1}}]
    run_merge(MergeConfig.model_validate({"merge_method": "linear", "models": models}), flat, progress=False)
    run_merge(MergeConfig.model_validate({"merge_method": "linear", "models": models,
                                          "out_quantization": {"bits": 4, "group_size": 128}}), out, progress=False)
    conf = json.loads((out / "config.json").read_text())
    assert conf["quantization"] == conf["quantization_config"] == {"group_size": 128, "bits": 4, "mode": "affine"}
    F, got = weights(flat), weights(out)
    # in = 128 is quantized; q_proj (in = 64) cannot use group 128 and stays float, as mlx-lm decides
    assert "model.layers.0.self_attn.q_proj.scales" not in got
    assert mx.array_equal(got["model.layers.0.self_attn.q_proj.weight"], F["model.layers.0.self_attn.q_proj.weight"]).item()
    k = "model.layers.0.mlp.down_proj"
    wq, s, b = mx.quantize(F[k + ".weight"], group_size=128, bits=4)
    assert got[k + ".weight"].dtype == mx.uint32
    for x, y in ((got[k + ".weight"], wq), (got[k + ".scales"], s), (got[k + ".biases"], b)):
        assert mx.array_equal(x, y).item()
    back = mx.dequantize(got[k + ".weight"], got[k + ".scales"], got[k + ".biases"], group_size=128, bits=4)
    err = np.abs(np.asarray(back - F[k + ".weight"])).reshape(*s.shape, 128)
    assert (err <= np.abs(np.asarray(got[k + ".scales"]))[..., None] * 1.001).all()  # within a step of its group
    model, _ = mlx_lm.load(str(out))
    import mlx.nn as nn
    assert isinstance(model.model.layers[0].mlp.down_proj, nn.QuantizedLinear)
    assert isinstance(model.model.layers[0].self_attn.q_proj, nn.Linear)
    logits = model(mx.array([[1, 2, 3]]))
    assert logits.shape[-1] == json.loads((out / "config.json").read_text())["vocab_size"]
    # a quantized output merged again is read back (quantized in, quantized out)
    again = tmp_path / "again"
    run_merge(MergeConfig.model_validate({"merge_method": "passthrough", "models": [{"model": str(out)}],
                                          "out_quantization": {"bits": 4, "group_size": 128}}), again, progress=False)
    g2 = weights(again)
    assert sorted(g2) == sorted(got)
    for key in (k + ".weight", k + ".scales", k + ".biases", "model.layers.0.self_attn.q_proj.weight"):
        assert mx.array_equal(g2[key], got[key]).item(), key


def test_quantized_input_errors(quantized, tmp_path):
    from mlx_ssp.merge.quant import dequantized_view
    from mlx_ssp.merge import safetensors_io as sio

    tensors = sio.scan_model(quantized["q"])
    conf = json.loads((quantized["q"] / "config.json").read_text())["quantization"]
    with pytest.raises(UserError, match=r"model q4: quantized module '.*'.*do not match 4 bits with group size 128"):
        dequantized_view(tensors, {**conf, "group_size": 128}, "q4")
    with pytest.raises(UserError, match="mode mxfp4 has no biases"):
        dequantized_view(tensors, {**conf, "mode": "mxfp4"}, "q4")
    with pytest.raises(UserError, match="mode int3 is not supported"):
        dequantized_view(tensors, {**conf, "mode": "int3"}, "q4")
    import shutil
    stripped = tmp_path / "no_quant_config"
    shutil.copytree(quantized["q"], stripped)
    full = json.loads((stripped / "config.json").read_text())
    (stripped / "config.json").write_text(json.dumps({k: v for k, v in full.items() if not k.startswith("quantization")}))
    with pytest.raises(UserError, match="packed quantized weight .* has no 'quantization' entry"):
        plan_merge(MergeConfig.model_validate({"merge_method": "passthrough", "models": [{"model": str(stripped)}]}))
    for bad, pat in (({"bits": 7}, "out_quantization.bits"), ({"group": 64}, "unknown key 'out_quantization.group'"),
                     ({"mode": "mxfp4", "group_size": 64}, "mode mxfp4 takes bits 4 and group_size 32 only"),
                     ({"group_size": 16}, "group_size 16 is for mode nvfp4 only"),
                     ({"mode": "fp4"}, "out_quantization.mode")):
        p = tmp_path / "c.yml"
        p.write_text(yaml.safe_dump({"merge_method": "linear", "models": [{"model": "x"}], "out_quantization": bad}))
        with pytest.raises(UserError, match=pat):
            load_merge_config(p)


def test_qlora_adapter_on_a_quantized_base(quantized, tmp_path):
    """``quantized+adapter`` (a QLoRA run, unfused): dequantized, then the LoRA delta added."""
    ad = tmp_path / "ad"
    ad.mkdir()
    rng = np.random.default_rng(0)
    la, lb = rng.standard_normal((64, 2)).astype(np.float32), rng.standard_normal((2, 64)).astype(np.float32)
    stem = "model.layers.0.self_attn.q_proj"
    mx.save_safetensors(str(ad / "adapters.safetensors"), {stem + ".lora_a": mx.array(la), stem + ".lora_b": mx.array(lb)})
    (ad / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "lora", "lora_parameters": {"scale": 2.0}}))
    out = tmp_path / "m"
    run_merge(MergeConfig.model_validate({"merge_method": "passthrough",
                                          "models": [{"model": f"{quantized['q']}+{ad}"}]}), out, progress=False)
    deq, got = reference_dequantized(quantized["q"]), weights(out)
    want = np.asarray(deq[stem + ".weight"]) + 2.0 * (lb.T @ la.T)
    np.testing.assert_allclose(np.asarray(got[stem + ".weight"]), want, rtol=1e-5, atol=1e-6)
    assert mx.array_equal(got["model.layers.1.mlp.up_proj.weight"], deq["model.layers.1.mlp.up_proj.weight"]).item()


# ------------------------------------------------------------------ extract-lora


@pytest.fixture(scope="module")
def tuned(tiny):
    """``a`` with every layer linear replaced by ``b``'s (full-rank differences), layer 0's q_proj
    a rank-2 update of ``a``'s, and the final norm changed (which no LoRA adapter can hold)."""
    import shutil

    d = tiny["dir"] / "tuned"
    shutil.copytree(tiny["a"], d)
    A, B = weights(tiny["a"]), weights(tiny["b"])
    T = {k: (B[k] if ".layers." in k and v.ndim == 2 else v) for k, v in A.items()}
    rng = np.random.default_rng(1)
    k = "model.layers.0.self_attn.q_proj.weight"
    T[k] = A[k] + mx.array((rng.standard_normal((64, 2)) @ rng.standard_normal((2, 64))).astype(np.float32))
    T["model.norm.weight"] = A["model.norm.weight"] * 1.5
    mx.save_safetensors(str(d / "model.safetensors"), T, metadata={"format": "mlx"})
    return d


def test_extract_lora_full_rank_reconstructs_and_loads(tiny, tuned, tmp_path):
    import mlx_lm
    from click.testing import CliRunner
    from mlx_ssp.cli import main

    out = tmp_path / "lora"
    r = CliRunner().invoke(main, ["extract-lora", str(tiny["a"]), str(tuned), str(out), "--rank", "64"])
    assert r.exit_code == 0, r.output
    assert "model.layers.1.mlp.down_proj  64x128  rel_error" in r.output
    summary = json.loads(r.output.strip().splitlines()[-1])
    assert summary["modules"] == 21 and summary["max_rel_error"] < 1e-5
    assert list(summary["not_captured"]) == ["model.norm.weight"]
    A, T, ad = weights(tiny["a"]), weights(tuned), weights(out)
    conf = json.loads((out / "adapter_config.json").read_text())
    scale = conf["lora_parameters"]["scale"]
    for k in A:
        stem = k[: -len(".weight")]
        if stem + ".lora_a" not in ad:
            continue
        rec = np.asarray(A[k]) + scale * (np.asarray(ad[stem + ".lora_b"]).T @ np.asarray(ad[stem + ".lora_a"]).T)
        d = np.asarray(T[k]) - np.asarray(A[k])
        assert np.linalg.norm(rec - np.asarray(T[k])) <= 1e-5 * np.linalg.norm(d), k
    # mlx-lm applies it: base + adapter gives the tuned model's logits, up to the uncaptured norm
    T2 = dict(T, **{"model.norm.weight": A["model.norm.weight"]})
    ref_dir = tmp_path / "tuned_same_norm"
    import shutil
    shutil.copytree(tuned, ref_dir)
    mx.save_safetensors(str(ref_dir / "model.safetensors"), T2)
    with_ad, _ = mlx_lm.load(str(tiny["a"]), adapter_path=str(out))
    ref, _ = mlx_lm.load(str(ref_dir))
    x = mx.array([[1, 5, 9, 2]])
    np.testing.assert_allclose(np.asarray(with_ad(x)), np.asarray(ref(x)), atol=2e-4)
    # and the merge engine's BASE+ADAPTER spec reads it
    m = tmp_path / "fused"
    run_merge(MergeConfig.model_validate({"merge_method": "passthrough", "models": [{"model": f"{tiny['a']}+{out}"}]}),
              m, progress=False)
    got = weights(m)
    k = "model.layers.2.mlp.up_proj.weight"
    np.testing.assert_allclose(np.asarray(got[k]), np.asarray(T[k]), atol=1e-5)


def test_extract_lora_rank_r_is_near_the_optimum(tiny, tuned, tmp_path):
    """Randomized SVD at rank 2 recovers the rank-2 update exactly and is within 2% of the
    Eckart-Young optimum (NumPy's exact SVD) on the full-rank differences; --overwrite replaces
    only its own output."""
    from mlx_ssp.merge.extract_lora import run_extract

    fits = []
    out = tmp_path / "r2"
    run_extract(str(tiny["a"]), str(tuned), out, 2, on_module=fits.append)
    by = {f.module: f.rel_error for f in fits}
    assert by["model.layers.0.self_attn.q_proj"] < 1e-5
    A, T = weights(tiny["a"]), weights(tuned)
    for mod in ("model.layers.1.mlp.down_proj", "model.layers.2.self_attn.k_proj"):
        d = np.asarray(T[mod + ".weight"], np.float64) - np.asarray(A[mod + ".weight"], np.float64)
        s = np.linalg.svd(d, compute_uv=False)
        best = np.sqrt((s[2:] ** 2).sum() / (s ** 2).sum())
        assert best * (1 - 1e-5) <= by[mod] <= best * 1.02, (mod, by[mod], best)
    ad = weights(out)
    assert ad["model.layers.0.mlp.up_proj.lora_a"].shape == (64, 2)
    assert ad["model.layers.0.mlp.up_proj.lora_b"].shape == (2, 128)
    with pytest.raises(UserError, match="already exists"):
        run_extract(str(tiny["a"]), str(tuned), out, 2)
    run_extract(str(tiny["a"]), str(tuned), out, 3, overwrite=True)
    assert weights(out)["model.layers.0.mlp.up_proj.lora_a"].shape == (64, 3)
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("x")
    with pytest.raises(UserError, match="not an adapter directory this command wrote"):
        run_extract(str(tiny["a"]), str(tuned), other, 2, overwrite=True)
    with pytest.raises(UserError, match="OUT_DIR"):
        run_extract(str(tiny["a"]), str(tuned), tuned, 2, overwrite=True)


def test_pipeline_merge_section_out_quantization(quantized, tiny, tmp_path):
    """The run file's merge: section takes out_quantization too (and leaves old dumps unchanged)."""
    from mlx_ssp.merge.config import MergeStageConfig
    from mlx_ssp.merge.engine import merge_models

    assert "out_quantization" not in MergeStageConfig().model_dump()
    out = tmp_path / "p"
    merge_models([quantized["q"], tiny["b"]], None, MergeStageConfig(out_quantization={"bits": 8, "group_size": 32}),
                 out, progress=False)
    conf = json.loads((out / "config.json").read_text())
    assert conf["quantization"] == {"group_size": 32, "bits": 8, "mode": "affine"}
    assert weights(out)["model.layers.0.mlp.up_proj.weight"].shape == (128, 16)


def test_slices_rebuild_layer_types_and_check_vocabularies(tiny, tmp_path):
    import shutil

    srcs = []
    for name, kinds in (("a", ["full", "sliding", "full"]), ("b", ["x0", "x1", "x2"])):
        d = tmp_path / name
        shutil.copytree(tiny[name], d)
        conf = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**conf, "layer_types": kinds}))
        srcs.append(d)
    out = tmp_path / "out"
    res = run_merge(passthrough([(srcs[0], (1, 3)), (srcs[1], (0, 2))], out_quantization={"bits": 4, "group_size": 64}),
                    out, progress=False)
    conf = json.loads((out / "config.json").read_text())
    assert conf["layer_types"] == ["sliding", "full", "x0", "x1"] and conf["num_hidden_layers"] == 4
    assert res["quantized"] == 4 * 7 + 1  # every layer linear and the (tied) embeddings
    # untied models with different vocabularies: embeddings from one, LM head from the other
    c = make_tiny_model(tmp_path / "c", num_layers=1, vocab_size=300, tie_word_embeddings=False)
    d = make_tiny_model(tmp_path / "d", num_layers=1, vocab_size=512, tie_word_embeddings=False, seed=3)
    with pytest.raises(UserError, match="different vocabularies.*lm_head.weight.*model.embed_tokens.weight"):
        plan_merge(passthrough([(c, (0, 1)), (d, (0, 1))]))


@pytest.mark.parametrize("mode", ["mxfp4", "nvfp4"])
def test_float_mode_quantization_in_and_out(tiny, tmp_path, mode):
    """mxfp4 / nvfp4 (uint8 scales, no biases): dequantized to bfloat16 with mx.dequantize on read;
    out_quantization in that mode stores mx.quantize's pair and mlx_lm.load reads it."""
    import mlx_lm
    from mlx_lm import convert
    from mlx_ssp.merge.config import OutQuantization

    q = tmp_path / "q"
    convert(str(tiny["a"]), str(q), quantize=True, q_mode=mode)
    stored = weights(q)
    k = "model.layers.1.mlp.down_proj"
    gs = OutQuantization(mode=mode).group_size
    out = tmp_path / "float"
    run_merge(MergeConfig.model_validate({"merge_method": "passthrough", "models": [{"model": str(q)}]}), out,
              progress=False)
    got = weights(out)
    want = mx.dequantize(stored[k + ".weight"], stored[k + ".scales"], None, group_size=gs, bits=4, mode=mode)
    assert got[k + ".weight"].dtype == mx.bfloat16 and mx.array_equal(got[k + ".weight"], want).item()
    back = tmp_path / "back"
    res = run_merge(MergeConfig.model_validate({"merge_method": "passthrough", "models": [{"model": str(out)}],
                                                "out_quantization": {"mode": mode}}), back, progress=False)
    assert res["quantized"] == 3 * 7 + 1
    conf = json.loads((back / "config.json").read_text())
    assert conf["quantization"] == {"group_size": gs, "bits": 4, "mode": mode}
    again = weights(back)
    assert k + ".biases" not in again
    wq, sc = mx.quantize(got[k + ".weight"], group_size=gs, bits=4, mode=mode)
    assert mx.array_equal(again[k + ".weight"], wq).item() and mx.array_equal(again[k + ".scales"], sc).item()
    model, _ = mlx_lm.load(str(back))
    assert model(mx.array([[1, 2, 3]])).shape[-1] == conf["vocab_size"]
