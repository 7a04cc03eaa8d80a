"""Merging LoRA adapters in LoRA space (``mlx_ssp merge-lora``) against the dense merge of the
fused models, on a tiny float32 model and random adapters."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

import mlx_ssp  # noqa: F401
import mlx.core as mx

from mlx_ssp.cli import main
from mlx_ssp.errors import UserError
from mlx_ssp.merge import safetensors_io as sio
from mlx_ssp.merge.config import MergeConfig
from mlx_ssp.merge.engine import run_merge
from mlx_ssp.merge.extract_lora import layer_key
from mlx_ssp.merge.lora_merge import (LORA_METHODS, LoraMergeConfig, load_lora_merge_config, run_lora_merge,
                                      truncate_factors)
from mlx_ssp.testing import make_tiny_model

Q, K, V, O = (f"self_attn.{p}_proj" for p in "qkvo")
UP, DOWN = "mlp.up_proj", "mlp.down_proj"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("lora") / "base", num_layers=2, seed=0)


def weights(d: Path) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        out.update({k: np.asarray(v) for k, v in mx.load(str(f)).items()})
    return out


def make_adapter(d: Path, base: Path, keys, *, rank: int, scale: float, seed: int, layers=(0, 1),
                 fine_tune_type: str = "lora", size: float = 0.05) -> Path:
    """A random LoRA adapter of ``base`` on ``keys`` of ``layers`` (mlx-lm's layout)."""
    info = sio.scan_model(base)
    rng = np.random.default_rng(seed)
    t = {}
    for i in layers:
        for k in keys:
            out_n, in_n = info[f"model.layers.{i}.{k}.weight"].shape
            stem = f"model.layers.{i}.{k}"
            t[stem + ".lora_a"] = mx.array(rng.normal(0, size, (in_n, rank)).astype(np.float32))
            t[stem + ".lora_b"] = mx.array(rng.normal(0, size, (rank, out_n)).astype(np.float32))
    d.mkdir(parents=True)
    mx.save_safetensors(str(d / "adapters.safetensors"), t, metadata={"format": "mlx"})
    conf = {"fine_tune_type": fine_tune_type, "num_layers": 2,
            "lora_parameters": {"rank": rank, "scale": scale, "dropout": 0.0, "keys": list(keys)}, "model": str(base)}
    (d / "adapter_config.json").write_text(json.dumps(conf))
    return d


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    """Two adapters with different ranks, scales and key sets (only q_proj in common)."""
    d = tmp_path_factory.mktemp("ads")
    return (make_adapter(d / "a1", base, [Q, V, DOWN], rank=4, scale=2.0, seed=1),
            make_adapter(d / "a2", base, [Q, O, UP], rank=2, scale=8.0, seed=2))


def lora_cfg(method: str, ads, params=None, top=None, **kw) -> LoraMergeConfig:
    return LoraMergeConfig.model_validate({
        "merge_method": method,
        "models": [{"model": str(a), "parameters": p} for a, p in zip(ads, params or [{}] * len(ads))],
        "parameters": {"weight": 1.0, **(top or {})}, **kw})


def dense_merge(method, base, ads, tmp, params=None, top=None, seed=0) -> dict[str, np.ndarray]:
    """The dense merge of the fused models (``base+adapter``) with ``mlx_ssp merge``."""
    cfg = MergeConfig.model_validate({
        "merge_method": method, "dtype": "float32", "parameters": {"weight": 1.0, **(top or {})},
        "models": [{"model": f"{base}+{a}", "parameters": p} for a, p in zip(ads, params or [{}] * len(ads))],
        # linear takes a base_model as one more input: the fused models are the inputs there
        **({} if method == "linear" else {"base_model": str(base)})})
    run_merge(cfg, tmp, progress=False, seed=seed)
    return weights(tmp)


def applied(base: Path, out: Path) -> dict[str, np.ndarray]:
    """The base's weights with the merged adapter's deltas added (float32)."""
    W, ad = weights(base), weights(out)
    scale = json.loads((out / "adapter_config.json").read_text())["lora_parameters"]["scale"]
    for k in list(W):
        stem = k[: -len(".weight")]
        if stem + ".lora_a" in ad:
            W[k] = W[k] + scale * (ad[stem + ".lora_b"].T @ ad[stem + ".lora_a"].T)
    return W


def delta_of(ad_dir: Path, stem: str) -> np.ndarray:
    ad = weights(ad_dir)
    s = json.loads((ad_dir / "adapter_config.json").read_text())["lora_parameters"]["scale"]
    return s * (ad[stem + ".lora_b"].T @ ad[stem + ".lora_a"].T)


# ------------------------------------------------------------------ linear: exact on the factors


def test_linear_equals_the_dense_merge_of_the_fused_models(base, adapters, tmp_path):
    params = [{"weight": 0.7}, {"weight": 0.3}]
    res = run_lora_merge(lora_cfg("linear", adapters, params), tmp_path / "out")
    conf = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert res["rank"] == conf["lora_parameters"]["rank"] == 6 and res["max_rel_error"] == 0
    assert conf["lora_parameters"]["scale"] == 1.0  # the scales differ: folded into lora_b
    assert conf["lora_parameters"]["keys"] == sorted([Q, V, DOWN, O, UP]) and conf["num_layers"] == 2
    dense = dense_merge("linear", base, adapters, tmp_path / "dense", params)
    mine = applied(base, tmp_path / "out")
    for k, v in dense.items():
        np.testing.assert_allclose(mine[k], v, rtol=0, atol=2e-6, err_msg=k)
    # a module only one adapter has counts as zero in the other: 0.3 * a2's delta
    stem = "model.layers.1.self_attn.o_proj"
    np.testing.assert_allclose(delta_of(tmp_path / "out", stem), 0.3 * delta_of(adapters[1], stem), atol=1e-7)


def test_truncation_is_the_best_rank_r_approximation():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((48, 10)).astype(np.float32), rng.standard_normal((10, 40)).astype(np.float32)
    d = b.T @ a.T
    u, s, vt = np.linalg.svd(d.astype(np.float64))
    for r in (1, 3, 7):
        a2, b2, err = truncate_factors(mx.array(a), mx.array(b), r)
        assert a2.shape == (48, r) and b2.shape == (r, 40)
        best = (u[:, :r] * s[:r]) @ vt[:r]
        np.testing.assert_allclose(np.asarray(b2).T @ np.asarray(a2).T, best, atol=2e-4 * s[0])
        # Eckart-Young: the error is the tail of the singular values
        assert err == pytest.approx(np.sqrt((s[r:] ** 2).sum() / (s ** 2).sum()), rel=1e-4)
        assert np.linalg.norm(d - best) / np.linalg.norm(d) == pytest.approx(err, rel=1e-4)
    a3, b3, err = truncate_factors(mx.array(a), mx.array(b), 12)  # more rank than needed: zero-padded, exact
    assert err == 0 and a3.shape == (48, 12)
    np.testing.assert_array_equal(np.asarray(b3)[10:], 0)


def test_linear_truncated_rank_reports_the_tail(base, adapters, tmp_path):
    run_lora_merge(lora_cfg("linear", adapters, rank=3), tmp_path / "out")
    rep = json.loads((tmp_path / "out" / "lora_merge.json").read_text())
    assert json.loads((tmp_path / "out" / "adapter_config.json").read_text())["lora_parameters"]["rank"] == 3
    stem = "model.layers.0.self_attn.q_proj"  # rank 6 in both adapters together
    full = 0.5 * delta_of(adapters[0], stem) + 0.5 * delta_of(adapters[1], stem)
    s = np.linalg.svd(full.astype(np.float64), compute_uv=False)
    assert rep["rel_error"][stem] == pytest.approx(np.sqrt((s[3:] ** 2).sum() / (s ** 2).sum()), rel=1e-3)
    # a1's rank-4 v_proj alone, cut to 3: its own tail
    v = "model.layers.0.self_attn.v_proj"
    sv = np.linalg.svd(0.5 * delta_of(adapters[0], v).astype(np.float64), compute_uv=False)
    assert sv[3] > 0 and rep["rel_error"][v] == pytest.approx(np.sqrt((sv[3:] ** 2).sum() / (sv ** 2).sum()), rel=1e-3)


def test_one_adapter_weight_one_is_the_same_adapter(base, adapters, tmp_path):
    run_lora_merge(lora_cfg("linear", adapters[:1], [{"weight": 1.0}]), tmp_path / "out")
    a, b = weights(adapters[0]), weights(tmp_path / "out")
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    conf = json.loads((tmp_path / "out" / "adapter_config.json").read_text())["lora_parameters"]
    assert (conf["rank"], conf["scale"]) == (4, 2.0)


# ------------------------------------------------------------------ TIES / DARE on the products


def assert_dense_equal(base: Path, out: Path, dense: dict[str, np.ndarray]) -> None:
    """The merged adapter applied to the base is the dense merge, to float32 rounding: per tensor
    within 1e-5 of its largest merged delta (measured: <= 2.1e-6 here; the dense path's deltas are
    ``(W + D) - W``, off by float32 rounding of ``W``, and the SVD's own rounding is ~1e-6 relative;
    one trimmed, dropped or sign-flipped element would be off by about a delta element's size).
    Tensors no adapter touches are equal bit for bit."""
    mine, W = applied(base, out), weights(base)
    for k, v in dense.items():
        np.testing.assert_allclose(mine[k], v, rtol=0, atol=1e-5 * np.abs(v - W[k]).max(), err_msg=k)


@pytest.mark.parametrize("method,top", [
    ("ties", {"density": 0.5}),
    ("dare_ties", {"density": 0.6}),
    ("dare_linear", {"density": 0.7}),
    ("task_arithmetic", {"lambda": 0.8}),
    ("breadcrumbs_ties", {"density": 0.8, "gamma": 0.05}),
    ("della", {"density": 0.6, "epsilon": 0.1}),  # ranks magnitudes within rows: the (out, in) shape matters
])
def test_product_methods_equal_the_dense_merge_before_truncation(base, adapters, tmp_path, method, top):
    """At a rank that covers every layer (the SVD then loses nothing), the adapter's deltas are the
    dense merge's: same trimming, the same DARE masks for the same seed (both derive them from the
    tensor name ``<module>.weight`` and the model's position in ``models:``), the same sign vote."""
    params = [{"weight": 1.0}, {"weight": 0.5}]
    res = run_lora_merge(lora_cfg(method, adapters, params, top, rank=128), tmp_path / "out", seed=3)
    assert res["max_rel_error"] < 1e-5
    assert_dense_equal(base, tmp_path / "out", dense_merge(method, base, adapters, tmp_path / "dense", params, top,
                                                           seed=3))


def test_product_method_with_a_common_scale_keeps_it(base, adapters, tmp_path):
    """Adapters of one scale: the output keeps that scale (lora_b divided by it) and is still the dense merge."""
    same = (adapters[0], make_adapter(tmp_path / "a3", base, [Q, K], rank=3, scale=2.0, seed=3))
    run_lora_merge(lora_cfg("ties", same, top={"density": 0.5}, rank=128), tmp_path / "out")
    conf = json.loads((tmp_path / "out" / "adapter_config.json").read_text())["lora_parameters"]
    assert conf["scale"] == 2.0 and conf["keys"] == sorted([Q, K, V, DOWN])
    dense = dense_merge("ties", base, same, tmp_path / "dense", top={"density": 0.5})
    assert_dense_equal(base, tmp_path / "out", dense)


def test_product_method_truncated_reports_its_error(base, adapters, tmp_path):
    lines = []
    run_lora_merge(lora_cfg("ties", adapters, top={"density": 0.5}, rank=4), tmp_path / "out",
                   on_module=lambda r: lines.append(r))
    rep = json.loads((tmp_path / "out" / "lora_merge.json").read_text())
    assert len(lines) == len(rep["rel_error"]) == 10
    assert all(0 < r.rel_error < 1 for r in lines)  # TIES's trimmed sum is full rank: rank 4 loses some
    ad = weights(tmp_path / "out")
    assert all(v.shape[1 if k.endswith("lora_a") else 0] == 4 for k, v in ad.items())
    # the reported error is ||D - D_4|| / ||D|| against the untruncated merge D (the same merge at a
    # rank covering the layer), and the randomized SVD is within 2% of the best rank-4 error
    run_lora_merge(lora_cfg("ties", adapters, top={"density": 0.5}, rank=128), tmp_path / "full")
    for r in lines:
        d, d4 = delta_of(tmp_path / "full", r.module), delta_of(tmp_path / "out", r.module)
        assert r.rel_error == pytest.approx(np.linalg.norm(d - d4) / np.linalg.norm(d), rel=1e-3), r.module
        s = np.linalg.svd(d.astype(np.float64), compute_uv=False)
        best = np.sqrt((s[4:] ** 2).sum() / (s ** 2).sum())
        assert best * (1 - 1e-4) <= r.rel_error <= best * 1.02, r.module


# ------------------------------------------------------------------ loading and the command


def test_merged_adapter_loads_with_mlx_lm_and_as_base_plus_adapter(base, adapters, tmp_path):
    import mlx_lm

    from mlx_ssp.merge.sources import open_source

    out = tmp_path / "merged"
    r = CliRunner().invoke(main, ["merge-lora", str(write_yaml(tmp_path, "linear", adapters)), str(out)])
    assert r.exit_code == 0, r.output
    assert "model.layers.1.mlp.up_proj  128x64  rel_error 0.000e+00" in r.output
    model, tok = mlx_lm.load(str(base), adapter_path=str(out))
    text = mlx_lm.generate(model, tok, "def add", max_tokens=4)
    assert isinstance(text, str)
    # the logits are the dense merge's
    dense_dir = tmp_path / "dense"
    dense_merge("linear", base, adapters, dense_dir)
    ref, _ = mlx_lm.load(str(dense_dir))
    x = mx.array([[1, 2, 3, 4, 5]])
    np.testing.assert_allclose(np.asarray(model(x)), np.asarray(ref(x)), atol=1e-4)
    # our own tools read it as BASE+ADAPTER
    src = open_source(f"{base}+{out}")
    k = "model.layers.0.mlp.up_proj.weight"
    np.testing.assert_allclose(np.asarray(src.load(k)), applied(base, out)[k], atol=1e-6)


def write_yaml(tmp: Path, method: str, ads, **extra) -> Path:
    p = tmp / f"{method}.yml"
    p.write_text(yaml.safe_dump({"merge_method": method, "models": [{"model": str(a), "parameters": {"weight": 1.0}}
                                                                   for a in ads], **extra}))
    return p


def test_inputs_are_protected_and_overwrite_only_replaces_our_output(base, adapters, tmp_path):
    cfg = lora_cfg("linear", adapters)
    with pytest.raises(UserError, match="input adapter"):
        run_lora_merge(cfg, adapters[0])
    out = tmp_path / "out"
    run_lora_merge(cfg, out)
    with pytest.raises(UserError, match="already exists"):
        run_lora_merge(cfg, out)
    run_lora_merge(cfg, out, overwrite=True)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("x")
    with pytest.raises(UserError, match="not an adapter directory this command wrote"):
        run_lora_merge(cfg, other, overwrite=True)


def one_line_error(tmp_path, cfg_path: Path) -> str:
    r = CliRunner().invoke(main, ["merge-lora", str(cfg_path), str(tmp_path / "never")])
    assert r.exit_code == 2, r.output
    assert not (tmp_path / "never").exists()
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    return lines[0]


def test_bad_inputs_are_one_line(base, adapters, tmp_path):
    assert "valid: " + ", ".join(LORA_METHODS) in one_line_error(tmp_path, write_yaml(tmp_path, "slerp", adapters))
    assert "unknown parameter 'gamma'" in one_line_error(
        tmp_path, write_yaml(tmp_path, "ties", adapters, parameters={"gamma": 0.1}))
    msg = one_line_error(tmp_path, write_yaml(tmp_path, "linear", adapters, ranks=4))
    assert "unknown key 'ranks'" in msg and "oversample, parameters, power_iters, rank" in msg
    dora = make_adapter(tmp_path / "dora", base, [Q], rank=2, scale=1.0, seed=5, fine_tune_type="dora")
    assert "fine_tune_type 'dora'" in one_line_error(tmp_path, write_yaml(tmp_path, "linear", [adapters[0], dora]))
    other = make_tiny_model(tmp_path / "wide", num_layers=2, hidden_size=32, num_heads=2, num_kv_heads=1, seed=1)
    foreign = make_adapter(tmp_path / "foreign", other, [Q], rank=2, scale=1.0, seed=6)
    assert "different base models" in one_line_error(tmp_path, write_yaml(tmp_path, "ties", [adapters[0], foreign]))
    assert "not on base_model" in one_line_error(
        tmp_path, write_yaml(tmp_path, "linear", [foreign], base_model=str(base)))
    conf = json.loads((foreign / "adapter_config.json").read_text())
    del conf["model"]  # no recorded base: the shapes tell
    (foreign / "adapter_config.json").write_text(json.dumps(conf))
    assert "not an adapter of this base" in one_line_error(
        tmp_path, write_yaml(tmp_path, "linear", [foreign], base_model=str(base)))
    emb = make_adapter(tmp_path / "emb", base, [Q], rank=2, scale=1.0, seed=7)  # + mlx-lm's embedding LoRA layout
    vocab, hidden = sio.scan_model(base)["model.embed_tokens.weight"].shape
    t = dict(mx.load(str(emb / "adapters.safetensors")))
    t["model.embed_tokens.lora_a"], t["model.embed_tokens.lora_b"] = mx.zeros((vocab, 2)), mx.zeros((2, hidden))
    mx.save_safetensors(str(emb / "adapters.safetensors"), t)
    assert "is an embedding LoRA" in one_line_error(tmp_path, write_yaml(tmp_path, "ties", [emb], base_model=str(base)))
    assert "scales the base model" in one_line_error(
        tmp_path, write_yaml(tmp_path, "linear", adapters, parameters={"normalize": False}))
    assert "is not an mlx-lm adapter directory" in one_line_error(
        tmp_path, write_yaml(tmp_path, "linear", [base]))


def test_lora_keys_are_mlx_lms():
    """mlx-lm matches ``keys`` within each layer, and a module outside the layers by its full path."""
    assert layer_key("model.layers.3.self_attn.q_proj.weight") == "self_attn.q_proj"
    assert layer_key("model.layers.0.mlp.down_proj.weight") == "mlp.down_proj"
    assert layer_key("lm_head.weight") == "lm_head"


def test_config_overrides_and_choices(tmp_path, adapters):
    p = write_yaml(tmp_path, "linear", adapters)
    cfg, data = load_lora_merge_config(p, ("rank=5", "merge_method=ties"))
    assert (cfg.rank, cfg.merge_method) == (5, "ties") and data["rank"] == 5
    # every task-vector method of the dense merger runs here too; interpolations cannot
    assert {"linear", "task_arithmetic", "ties", "dare_linear", "dare_ties", "della"} <= set(LORA_METHODS)
    assert not {"slerp", "model_stock", "karcher"} & set(LORA_METHODS)
