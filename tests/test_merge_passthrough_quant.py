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
                     ({"slices": [{"sources": [{"model": "x", "layer_range": [0, 1]}]}], "merge_method": "ties"},
                      "slices: works with merge_method passthrough only"),
                     ({"slices": [{"sources": [{"model": "x", "layer_range": [0, 1], "parameters": {"weight": 1}}]}]},
                      "unknown parameter 'weight' for passthrough; valid here: scale")):
        p = tmp_path / "c.yml"
        p.write_text(yaml.safe_dump({"merge_method": "passthrough", **bad}))
        with pytest.raises(UserError, match=pat):
            load_merge_config(p)
