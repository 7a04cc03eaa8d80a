"""mlx_ssp merge: methods against an independent NumPy reference, properties, streaming IO, errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

import mlx_ssp  # noqa: F401
import mlx.core as mx

from mlx_ssp.errors import UserError
from mlx_ssp.merge import safetensors_io as sio
from mlx_ssp.merge.config import MergeConfig, evaluate, load_merge_config
from mlx_ssp.merge.engine import merge_models, plan_merge, run_merge
from mlx_ssp.merge.config import MergeStageConfig
from mlx_ssp.merge.sparsify import bernoulli_mask, dare_seed

# ------------------------------------------------------------------ NumPy reference (independent)


def np_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (round to nearest even) and back, with integer bit ops."""
    x = np.asarray(x, dtype=np.float32)
    u = np.ascontiguousarray(x).reshape(-1).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16
    return u.astype(np.uint32).view(np.float32).reshape(x.shape)


def R(x, cd):
    x = np.asarray(x, dtype=np.float32)
    return np_bf16(x) if cd == "bfloat16" else x


def ref_linear(xs, ws, normalize, cd):
    # torch's addcmul_: each step x * w + acc with a single rounding to float32
    acc = np.zeros_like(xs[0], dtype=np.float32)
    for x, w in zip(xs, ws):
        acc = (acc.astype(np.float64) + x.astype(np.float64) * np.float64(np.float32(w))).astype(np.float32)
    if normalize:
        acc = acc / np.float32(sum(ws))
    return R(acc, cd)


def ref_topk_mask(d, density):
    if density >= 1:
        return np.ones(d.shape, bool)
    k = max(1, int(density * d.size))
    order = np.argsort(-np.abs(d).ravel(), kind="stable")
    m = np.zeros(d.size, bool)
    m[order[:k]] = True
    return m.reshape(d.shape)


def ref_task_vectors(base, xs, ws, ds, *, method, normalize, cd, lam=1.0, rescale=False, masks=None, vote="weighted"):
    w = [float(R(np.float32(v), cd)) for v in ws]
    deltas = []
    for i, x in enumerate(xs):
        d = R(x - base, cd)
        if method in ("ties",):
            m = ref_topk_mask(d, ds[i])
        elif method in ("dare_ties", "dare_linear"):
            m = masks[i] if masks[i] is not None else np.ones(d.shape, bool)
        else:
            m = np.ones(d.shape, bool)
        md = np.where(m, d, np.float32(0))
        if rescale and not m.all():
            before, after = R(np.abs(d).sum(dtype=np.float64), cd), R(np.abs(md).sum(dtype=np.float64), cd)
            md = R(md * R(before / after, cd), cd)
        deltas.append(R(md * np.float32(w[i]), cd))
    D = np.stack(deltas)
    W = np.array(w, np.float32).reshape((-1,) + (1,) * base.ndim)
    if method in ("ties", "dare_ties"):
        s = D.sum(0) if vote == "weighted" else np.sign(D).sum(0)
        maj = np.where(s >= 0, 1.0, -1.0)
        agree = np.sign(D) == maj
        mixed = R((D * agree).sum(0), cd)
        div = R((W * agree).sum(0), cd)
        div[div == 0] = 1
    else:
        mixed = R(D.sum(0), cd)
        div = float(R(np.float32(sum(w)), cd))
        div = 1.0 if abs(div) < 1e-8 else div
    if normalize:
        mixed = R(mixed / div, cd)
    if lam != 1:
        mixed = R(mixed * np.float32(lam), cd)
    return R(base + mixed, cd)


# ------------------------------------------------------------------ fixtures: tiny random models on disk

SHAPES = {
    "model.embed_tokens.weight": (40, 16),
    "model.layers.0.self_attn.q_proj.weight": (16, 16),
    "model.layers.0.mlp.down_proj.weight": (16, 24),
    "model.layers.0.input_layernorm.weight": (16,),
    "model.layers.1.self_attn.q_proj.weight": (16, 16),
    "model.layers.1.mlp.down_proj.weight": (16, 24),
    "model.layers.1.input_layernorm.weight": (16,),
    "model.layers.2.self_attn.q_proj.weight": (16, 16),
    "model.norm.weight": (16,),
    "lm_head.weight": (40, 16),
}


def write_model(d: Path, arrays: dict[str, np.ndarray], dtype: str = "float32", shards: int = 1,
                conf: dict | None = None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    conf = conf or {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 3,
                    "hidden_size": 16, "vocab_size": 40}
    (d / "config.json").write_text(json.dumps(conf))
    names = list(arrays)
    groups = [names[i::shards] for i in range(shards)]
    mxd = getattr(mx, dtype)
    wm = {}
    for i, g in enumerate(groups):
        fname = "model.safetensors" if shards == 1 else f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        mx.save_safetensors(str(d / fname), {n: mx.array(arrays[n]).astype(mxd) for n in g}, metadata={"format": "pt"})
        wm.update({n: fname for n in g})
    if shards > 1:
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    (d / "tokenizer_config.json").write_text("{}")
    return d


def rand_arrays(seed: int, scale=1.0, base=None):
    rng = np.random.default_rng(seed)
    out = {}
    for n, s in SHAPES.items():
        x = rng.standard_normal(s).astype(np.float32) * np.float32(scale)
        out[n] = (base[n] + x) if base is not None else x
    return out


def load_out(d: Path) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update({k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(f)).items()})
    return out


def as_stored(arrays, dtype):
    return {k: R(v, dtype) for k, v in arrays.items()}


@pytest.fixture(scope="module")
def trio(tmp_path_factory):
    """base + two fine-tunes in float32 and bfloat16 (bf16 deltas have many exact ties)."""
    root = tmp_path_factory.mktemp("merge_models")
    base = rand_arrays(0)
    a = rand_arrays(1, 0.05, base)
    b = rand_arrays(2, 0.05, base)
    out = {}
    for dt in ("float32", "bfloat16"):
        out[dt] = [write_model(root / f"{dt}_{i}", arr, dt) for i, arr in enumerate((base, a, b))]
    out["arrays"] = (base, a, b)
    return out


def cfg_of(**kw) -> MergeConfig:
    return MergeConfig.model_validate(kw)


def merge(tmp_path, name="out", **kw):
    seed = kw.pop("seed", 0)
    extra = {k: kw.pop(k) for k in ("vocab_mismatch", "out_shard_size") if k in kw}
    out = tmp_path / name
    run_merge(cfg_of(**kw), out, progress=False, seed=seed, **extra)
    return load_out(out)


# ------------------------------------------------------------------ methods vs the NumPy reference


@pytest.mark.parametrize("dt", ["float32", "bfloat16"])
def test_linear_matches_reference(trio, tmp_path, dt):
    base, a, b = (as_stored(x, dt) for x in trio["arrays"])
    m = trio[dt]
    got = merge(tmp_path, merge_method="linear", models=[
        {"model": str(m[0]), "parameters": {"weight": 0.5}}, {"model": str(m[1]), "parameters": {"weight": 0.3}},
        {"model": str(m[2]), "parameters": {"weight": 0.2}}])
    for n in SHAPES:
        want = ref_linear([base[n], a[n], b[n]], [0.5, 0.3, 0.2], True, dt)
        np.testing.assert_allclose(got[n], want, rtol=0, atol=1e-6 if dt == "float32" else 0)


@pytest.mark.parametrize("dt", ["float32", "bfloat16"])
@pytest.mark.parametrize("method,normalize,lam,rescale", [
    ("task_arithmetic", False, 1.0, False), ("task_arithmetic", True, 0.7, False),
    ("ties", True, 1.0, False), ("ties", False, 0.8, True),
])
def test_task_vector_methods_match_reference(trio, tmp_path, dt, method, normalize, lam, rescale):
    base, a, b = (as_stored(x, dt) for x in trio["arrays"])
    m = trio[dt]
    got = merge(tmp_path, merge_method=method, base_model=str(m[0]),
                parameters={"normalize": normalize, "lambda": lam, "rescale": rescale},
                models=[{"model": str(m[1]), "parameters": {"weight": 0.7, "density": 0.4}},
                        {"model": str(m[2]), "parameters": {"weight": 0.4, "density": 0.6}}])
    for n in SHAPES:
        want = ref_task_vectors(base[n], [a[n], b[n]], [0.7, 0.4], [0.4, 0.6], method=method, normalize=normalize,
                                cd=dt, lam=lam, rescale=rescale)
        atol = 0 if dt == "bfloat16" and not rescale else 1e-5
        np.testing.assert_allclose(got[n], want, rtol=0, atol=atol, err_msg=n)


@pytest.mark.parametrize("dt", ["float32", "bfloat16"])
@pytest.mark.parametrize("method", ["dare_ties", "dare_linear"])
def test_dare_matches_reference_given_masks(trio, tmp_path, dt, method):
    base, a, b = (as_stored(x, dt) for x in trio["arrays"])
    m = trio[dt]
    got = merge(tmp_path, seed=5, merge_method=method, base_model=str(m[0]),
                models=[{"model": str(m[1]), "parameters": {"weight": 0.6, "density": 0.5}},
                        {"model": str(m[2]), "parameters": {"weight": 0.5, "density": 0.7}}])
    for n, shape in SHAPES.items():
        size = int(np.prod(shape))
        # the model id is the position in the models: list
        masks = [np.array(bernoulli_mask(size, d, dare_seed(5, n, str(j)))).reshape(shape)
                 for j, d in ((0, 0.5), (1, 0.7))]
        want = ref_task_vectors(base[n], [a[n], b[n]], [0.6, 0.5], [0.5, 0.7], method=method, normalize=False,
                                cd=dt, rescale=True, masks=masks)
        np.testing.assert_allclose(got[n], want, rtol=0, atol=1e-5 if dt == "float32" else 2 ** -6, err_msg=n)


# ------------------------------------------------------------------ properties

ALL = ["linear", "task_arithmetic", "ties", "dare_linear", "dare_ties", "breadcrumbs", "breadcrumbs_ties"]


@pytest.mark.parametrize("method", ALL)
def test_identical_models_give_the_model(trio, tmp_path, method):
    m = trio["bfloat16"][1]
    base = trio["bfloat16"][1]
    kw = {"base_model": str(base)} if method != "linear" else {}
    # three references to the same weights (a copy and the base itself)
    c1 = write_model(tmp_path / "c1", as_stored(trio["arrays"][1], "bfloat16"), "bfloat16")
    c2 = write_model(tmp_path / "c2", as_stored(trio["arrays"][1], "bfloat16"), "bfloat16", shards=2)
    got = merge(tmp_path, merge_method=method, **kw, models=[
        {"model": str(c1), "parameters": {"weight": 0.3, **({"density": 0.5} if method != "linear" else {})}},
        {"model": str(c2), "parameters": {"weight": 0.9, **({"density": 0.5} if method != "linear" else {})}}])
    want = load_out(m)
    for n in SHAPES:
        np.testing.assert_array_equal(got[n], want[n], err_msg=f"{method} {n}")


@pytest.mark.parametrize("dt", ["float32", "bfloat16"])
def test_linear_single_model_weight_one_is_identity(trio, tmp_path, dt):
    m = trio[dt][2]
    got = merge(tmp_path, merge_method="linear", models=[{"model": str(m), "parameters": {"weight": 1.0}}])
    want = load_out(m)
    for n in SHAPES:
        np.testing.assert_array_equal(got[n], want[n])


def test_ties_density_keeps_that_fraction():
    from mlx_ssp.merge.sparsify import magnitude_mask

    rng = np.random.default_rng(0)
    d = mx.array(rng.standard_normal(10_000).astype(np.float32))
    for dens in (0.1, 0.33, 0.5, 0.9):
        m = magnitude_mask(d, dens)
        assert int(mx.sum(m).item()) == int(dens * 10_000)
        # the kept ones are the largest
        kept = np.abs(np.array(d))[np.array(m)]
        dropped = np.abs(np.array(d))[~np.array(m)]
        assert kept.min() >= dropped.max()
    # heavy ties (bf16 / quantized deltas): exact count, lowest indices first among ties
    q = mx.array(np.round(rng.standard_normal(10_000) * 2).astype(np.float32))
    m = np.array(magnitude_mask(q, 0.37))
    assert m.sum() == 3700
    np.testing.assert_array_equal(m, ref_topk_mask(np.array(q), 0.37))


def test_dare_density_keeps_about_that_fraction(monkeypatch):
    from mlx_ssp.merge import sparsify

    # the chunked draw is the same stream as one draw
    one = np.random.Generator(np.random.PCG64(9)).random(1000, dtype=np.float32) < np.float32(0.3)
    monkeypatch.setattr(sparsify, "_RNG_CHUNK", 7)
    np.testing.assert_array_equal(np.array(bernoulli_mask(1000, 0.3, 9)), one)
    monkeypatch.undo()
    for dens in (0.2, 0.5, 0.8):
        m = bernoulli_mask(200_000, dens, dare_seed(0, "t", "m"))
        assert abs(float(mx.mean(m).item()) - dens) < 0.01


@pytest.mark.parametrize("method,params", [
    ("ties", {}), ("ties", {"rescale": True, "normalize": False}), ("dare_ties", {}),
    ("dare_ties", {"sign_vote": "unweighted"}), ("breadcrumbs_ties", {"sign_vote": "count"}),
    ("dare_linear", {"rescale_mode": "inverse_density"}), ("task_arithmetic", {"lambda": 0.7}),
])
def test_sliced_elementwise_equals_whole(trio, tmp_path, monkeypatch, method, params):
    """The elementwise steps run in slices of CHUNK elements: slice edges (and the TIES cut among
    tied magnitudes falling inside a slice) change nothing."""
    from mlx_ssp.merge import kernels

    m = trio["bfloat16"]
    kw = dict(merge_method=method, base_model=str(m[0]), seed=4, parameters=params,
              models=[{"model": str(m[1]), "parameters": {"weight": 0.7, "density": 0.4}},
                      {"model": str(m[2]), "parameters": {"weight": 0.4, "density": 0.6}}])
    whole = merge(tmp_path, name="whole", **kw)
    monkeypatch.setattr(kernels, "CHUNK", 37)
    sliced = merge(tmp_path, name="sliced", **kw)
    for n in SHAPES:
        np.testing.assert_array_equal(sliced[n], whole[n], err_msg=n)
    if method == "ties" and not params:
        base, a, b = (as_stored(x, "bfloat16") for x in trio["arrays"])
        for n in SHAPES:
            want = ref_task_vectors(base[n], [a[n], b[n]], [0.7, 0.4], [0.4, 0.6], method="ties", normalize=True,
                                    cd="bfloat16")
            np.testing.assert_array_equal(sliced[n], want, err_msg=n)


def test_one_shard_equals_four_shards(trio, tmp_path):
    base, a, b = (as_stored(x, "bfloat16") for x in trio["arrays"])
    one = [write_model(tmp_path / "one" / f"m{i}", x, "bfloat16", 1) for i, x in enumerate((base, a, b))]
    four = [write_model(tmp_path / "four" / f"m{i}", x, "bfloat16", 4) for i, x in enumerate((base, a, b))]
    for method in ("ties", "dare_ties"):
        outs = []
        for ms, shard in ((one, "5GB"), (four, "600")):
            outs.append(merge(tmp_path, name=f"{method}_{shard}", merge_method=method, base_model=str(ms[0]),
                              out_shard_size=shard, seed=3,
                              models=[{"model": str(ms[1]), "parameters": {"weight": 1, "density": 0.5}},
                                      {"model": str(ms[2]), "parameters": {"weight": 1, "density": 0.5}}]))
        assert len(list((tmp_path / f"{method}_600").glob("*.safetensors"))) > 1
        for n in SHAPES:
            np.testing.assert_array_equal(outs[0][n], outs[1][n])


def test_dare_seeded_per_tensor_and_model(trio, tmp_path):
    m = trio["float32"]

    def run(seed, name, order=(1, 2)):
        return merge(tmp_path, name=name, seed=seed, merge_method="dare_linear", base_model=str(m[0]),
                     models=[{"model": str(m[i]), "parameters": {"weight": 0.5, "density": 0.5}} for i in order])

    x, y, z = run(1, "s1"), run(1, "s1b"), run(2, "s2")
    for n in SHAPES:
        np.testing.assert_array_equal(x[n], y[n])
    assert all(not np.array_equal(x[n], z[n]) for n in SHAPES if n.endswith("proj.weight"))
    # the mask of a tensor does not depend on which other tensors exist or their order
    from mlx_ssp.merge.sparsify import bernoulli_mask as bm
    a1 = np.array(bm(1000, 0.5, dare_seed(1, "t", "0")))
    assert np.array_equal(a1, np.array(bm(1000, 0.5, dare_seed(1, "t", "0"))))
    assert not np.array_equal(a1, np.array(bm(1000, 0.5, dare_seed(1, "t", "1"))))


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


# ------------------------------------------------------------------ threads and the positional writer


@pytest.mark.parametrize("method", ["ties", "dare_ties", "linear", "breadcrumbs_ties"])
def test_workers_do_not_change_a_byte(trio, tmp_path, method):
    """Tensors merged side by side on 1, 2 or 3 threads give byte-identical shard files."""
    m = trio["bfloat16"]
    kw = dict(merge_method=method,
              models=[{"model": str(m[1]), "parameters": {"weight": 0.7, "density": 0.4}},
                      {"model": str(m[2]), "parameters": {"weight": 0.4, "density": 0.6}}])
    if method == "linear":
        for e in kw["models"]:
            del e["parameters"]["density"]
    else:
        kw["base_model"] = str(m[0])
    files = []
    for w in (1, 2, 3):
        out = tmp_path / f"w{w}"
        res = run_merge(cfg_of(**kw), out, progress=False, seed=5, workers=w, out_shard_size="700")
        assert res["workers"] == w and res["shards"] > 1
        files.append({p.name: p.read_bytes() for p in sorted(out.glob("*.safetensors*"))})
    assert files[0] == files[1] == files[2]


def test_sharded_writer_any_order_and_checks(tmp_path):
    """The writer puts each tensor at its planned offset whatever the order; it refuses a tensor
    outside the plan, a wrong size, a second write, and closing with a tensor missing."""
    rng = np.random.default_rng(0)
    arrays = {f"t{i}": rng.standard_normal((3, i + 1)).astype(np.float32) for i in range(6)}
    plan = [sio.PlannedTensor(n, "F32", a.shape) for n, a in arrays.items()]
    outs = []
    for order in (list(arrays), list(arrays)[::-1]):
        d = tmp_path / f"o{len(outs)}"
        d.mkdir()
        w = sio.ShardedWriter(d, plan, max_shard_bytes=100)
        for n in order:
            w.write(n, arrays[n].tobytes())
        w.close()
        outs.append({p.name: p.read_bytes() for p in sorted(d.iterdir())})
        got = {}
        for f in d.glob("*.safetensors"):
            got.update({k: np.array(v) for k, v in mx.load(str(f)).items()})
        assert set(got) == set(arrays) and all(np.array_equal(got[n], arrays[n]) for n in arrays)
    assert outs[0] == outs[1] and len([n for n in outs[0] if n.endswith(".safetensors")]) > 1
    d = tmp_path / "bad"
    d.mkdir()
    w = sio.ShardedWriter(d, plan, max_shard_bytes=100)
    with pytest.raises(RuntimeError, match="not in the plan"):
        w.write("nope", b"")
    with pytest.raises(RuntimeError, match="bytes"):
        w.write("t0", b"123")
    w.write("t0", arrays["t0"].tobytes())
    with pytest.raises(RuntimeError, match="twice"):
        w.write("t0", arrays["t0"].tobytes())
    with pytest.raises(RuntimeError, match="5 of 6 tensors unwritten"):
        w.close()
    w.abort()


def test_worker_error_stops_the_merge_and_leaves_nothing(trio, tmp_path, monkeypatch):
    """An error on a merging thread reaches the caller; the half-built output is removed."""
    from mlx_ssp.merge import engine

    m = trio["float32"]
    real = engine.merge_tensor

    def boom(job, p, seed):
        if p.name == "model.layers.1.mlp.down_proj.weight":
            raise OSError("disk on fire")
        return real(job, p, seed)

    monkeypatch.setattr(engine, "merge_tensor", boom)
    with pytest.raises(OSError, match="disk on fire"):
        run_merge(cfg_of(merge_method="ties", base_model=str(m[0]),
                         models=[{"model": str(m[1]), "parameters": {"weight": 1, "density": 0.5}}]),
                  tmp_path / "out", progress=False, workers=3)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_threaded_cli_exits_cleanly(trio, tmp_path):
    """Merging threads release their mlx streams before they end: without that, mlx aborts the
    process at exit (exit code 134) after a complete merge, which scripts and CI read as failure."""
    m = trio["bfloat16"]
    cfg = tmp_path / "t.yml"
    cfg.write_text(yaml.safe_dump({"merge_method": "ties", "base_model": str(m[0]), "models": [
        {"model": str(m[i]), "parameters": {"weight": 0.5, "density": 0.5}} for i in (1, 2)]}))
    outs = []
    for i in range(4):  # the abort was a race at exit: several runs
        out = tmp_path / f"o{i}"
        r = subprocess.run([sys.executable, "-m", "mlx_ssp.cli", "merge", str(cfg), str(out), "--quiet", "--workers", "3"],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
        assert json.loads(r.stdout)["workers"] == 3
        outs.append((out / "model.safetensors").read_bytes())
    assert all(o == outs[0] for o in outs)


def test_parallel_schedule_largest_first_within_budget():
    """Threads take the largest pending tensor that fits the in-flight budget: two of the large
    (vocabulary-sized) tensors are never in flight together, everything runs exactly once, the
    large ones start first (the run ends on small ones), and same-size tensors run side by side.
    The order is checked on the schedule step by step: on threads it depends on how long each
    tensor takes, which the load of the machine changes."""
    import threading

    from mlx_ssp.merge.parallel import Schedule, inflight_budget, run_parallel

    sizes = [64, 8, 8, 8, 8, 8, 8, 1, 8, 64]  # embed first, lm_head last, as in a file
    assert inflight_budget(sizes, 2) == 64 + 8 and inflight_budget(sizes, 3) == 64 + 16
    assert inflight_budget([8] * 5, 3) == 24 and inflight_budget([], 2) == 0
    s = Schedule(sizes, 3)
    unblock = threading.Timer(60, s.stop)  # a take() that waits with room in the budget returns None
    unblock.start()
    try:
        assert [s.take(), s.take(), s.take()] == [0, 1, 2]
        s.done(1)
        assert s.take() == 3  # the lm_head does not fit beside the embedding
        s.done(0)
        assert s.take() == 9  # and goes next once it does, before the small ones left
        s.done(2)
        s.done(3)
        assert [s.take(), s.take()] == [4, 5]
        for i in (9, 4, 5):
            s.done(i)
        assert [s.take(), s.take(), s.take()] == [6, 8, 7]
        for i in (6, 8, 7):
            s.done(i)
        assert s.take() is None
    finally:
        unblock.cancel()
    for workers in (2, 3):
        lock, live, seen = threading.Lock(), [], []
        peak = {"n": 0, "elems": 0}
        # the first hand-outs (the embedding and small ones beside it) wait for each other: every
        # worker is busy at once, whatever the timing
        together = threading.Barrier(workers, timeout=60)

        def fn(i):
            with lock:
                live.append(i)
                peak["n"] = max(peak["n"], len(live))
                peak["elems"] = max(peak["elems"], sum(sizes[j] for j in live))
                assert sum(sizes[j] >= 64 for j in live) <= 1
            if i < workers:
                together.wait()
            with lock:
                live.remove(i)
                seen.append(i)

        run_parallel(list(range(len(sizes))), fn, workers, lambda: None, sizes=sizes)
        assert sorted(seen) == list(range(len(sizes)))
        assert peak["n"] == workers and peak["elems"] <= inflight_budget(sizes, workers)
    # equal sizes: file order, all workers busy
    order = []
    run_parallel(list(range(6)), order.append, 2, lambda: None, sizes=[5] * 6)
    assert sorted(order) == list(range(6))


def test_merge_raises_the_cpu_buffer_cache_and_restores_it(trio, tmp_path, monkeypatch):
    """During a CPU merge mlx keeps up to 1 GiB of freed buffers for reuse (the 32 MiB default
    sends every large one back to the OS, to be faulted in and zeroed again for the next tensor);
    the caller's limit is back afterwards."""
    from mlx_ssp.merge import engine

    def current():
        lim = mx.set_cache_limit(0)
        mx.set_cache_limit(lim)
        return lim

    seen, real = [], engine.merge_tensor

    def spy(job, p, seed):
        seen.append(current())
        return real(job, p, seed)

    monkeypatch.setattr(engine, "merge_tensor", spy)
    before = mx.set_cache_limit(32 << 20)
    try:
        m = trio["float32"]
        run_merge(cfg_of(merge_method="linear", models=[{"model": str(m[i]), "parameters": {"weight": 1}} for i in (1, 2)]),
                  tmp_path / "out", progress=False, workers=1)
        assert seen and all(v == engine._CPU_BUFFER_CACHE for v in seen)
        assert current() == 32 << 20
    finally:
        mx.set_cache_limit(before)


def test_workers_setting_is_validated():
    from mlx_ssp.config import validate

    with pytest.raises(UserError, match="workers"):
        validate(MergeStageConfig, {"workers": 0}, source="run.yaml", prefix="merge")
    assert validate(MergeStageConfig, {"workers": 3}, source="run.yaml", prefix="merge").workers == 3
