"""mergekit 0.1.5's other merge methods end to end on tiny models on disk (float32 and bfloat16),
their parameter errors and the registry of their parameters; the pure functions: test_merge_methods.py."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

import mlx_ssp  # noqa: F401
import mlx.core as mx

from mlx_ssp.errors import UserError
from mlx_ssp.merge.config import load_merge_config
from mlx_ssp.merge.engine import plan_merge, run_merge
from mlx_ssp.merge.methods import METHODS
from mlx_ssp.merge.sparsify import dare_seed, magprune_mask

from merge_helpers import (
    DTS, SHAPES, R, cfg_of, load_out, rand_arrays, ref_fusion, ref_karcher, ref_model_stock, ref_multislerp,
    ref_nearswap, ref_nuslerp, ref_ram, ref_sce, ref_slerp, ref_task_vectors, tol, write_model,
)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("methods")
    base = rand_arrays(0)
    arrs = (base, rand_arrays(1, 0.05, base), rand_arrays(2, 0.05, base))
    out = {dt: [str(write_model(root / f"{dt}_{i}", a, dt)) for i, a in enumerate(arrs)] for dt in DTS}
    out["arrays"] = arrs
    return out


def run(tmp_path, name, **kw):
    seed = kw.pop("seed", 0)
    run_merge(cfg_of(**kw), tmp_path / name, progress=False, seed=seed)
    return load_out(tmp_path / name)


def layer_t(name, grad):
    """mergekit's gradient at this tensor's layer (3 layers; outside the layers t = 0)."""
    import re

    m = re.search(r"layers\.(\d+)\.", name)
    x = (int(m.group(1)) / 2 if m else 0.0) * (len(grad) - 1)
    i0 = int(x)
    i1 = min(len(grad) - 1, i0 + 1)
    return (1 - (x - i0)) * grad[i0] + (x - i0) * grad[i1]


@pytest.mark.parametrize("dt", DTS)
def test_slerp_end_to_end_gradient_and_filters(models, tmp_path, dt):
    m = models[dt]
    base, a, _ = ({k: R(v, dt) for k, v in x.items()} for x in models["arrays"])
    p = tmp_path / "slerp.yml"
    grad = [0.0, 0.6, 1.0]
    p.write_text(yaml.safe_dump({"merge_method": "slerp", "base_model": m[0], "dtype": dt,
                                 "models": [{"model": m[0]}, {"model": m[1]}],
                                 "parameters": {"t": [{"filter": "self_attn", "value": grad}, {"value": 0.25}]}}))
    cfg, _ = load_merge_config(p)
    run_merge(cfg, tmp_path / "out", progress=False)
    got = load_out(tmp_path / "out")
    for n in SHAPES:
        t = layer_t(n, grad) if "self_attn" in n else 0.25
        want = R(ref_slerp(t, base[n], a[n]).reshape(base[n].shape), dt)
        np.testing.assert_allclose(got[n], want, **tol(dt), err_msg=n)
    # t = 0 everywhere is the base, t = 1 the other model, byte for byte
    for t, want in ((0.0, base), (1.0, a)):
        got = run(tmp_path, f"t{t}", merge_method="slerp", base_model=m[0], models=[{"model": m[1]}],
                  parameters={"t": t})
        for n in SHAPES:
            np.testing.assert_array_equal(got[n], want[n], err_msg=n)


@pytest.mark.parametrize("dt", DTS)
@pytest.mark.parametrize("method", ["della", "della_linear"])
def test_della_end_to_end_matches_reference_given_masks(models, tmp_path, dt, method):
    m = models[dt]
    base, a, b = ({k: R(v, dt) for k, v in x.items()} for x in models["arrays"])
    got = run(tmp_path, "out", seed=3, merge_method=method, base_model=m[0],
              models=[{"model": m[1], "parameters": {"weight": 0.6, "density": 0.5}},
                      {"model": m[2], "parameters": {"weight": 0.5, "density": 0.7, "epsilon": 0.1}}])
    work = mx.bfloat16 if dt == "bfloat16" else mx.float32
    for n, shape in SHAPES.items():
        masks = []
        for j, (x, d, e) in enumerate(((a, 0.5, 0.15), (b, 0.7, 0.1))):
            delta = mx.array(R(x[n] - base[n], dt).ravel()).astype(getattr(mx, dt))
            # the model id is the position in the models: list
            masks.append(np.array(magprune_mask(delta, d, e, dare_seed(3, n, str(j)), shape, work)).reshape(shape))
        want = ref_task_vectors(base[n], [a[n], b[n]], [0.6, 0.5], [0.5, 0.7],
                                method="dare_ties" if method == "della" else "dare_linear",
                                normalize=method == "della", cd=dt, rescale=True, masks=masks)
        np.testing.assert_allclose(got[n], want, rtol=0, atol=1e-5 if dt == "float32" else 2 ** -6, err_msg=n)
    again = run(tmp_path, "again", seed=3, merge_method=method, base_model=m[0],  # seeded: the same bytes
                models=[{"model": m[1], "parameters": {"weight": 0.6, "density": 0.5}},
                        {"model": m[2], "parameters": {"weight": 0.5, "density": 0.7, "epsilon": 0.1}}])
    for n in SHAPES:
        np.testing.assert_array_equal(got[n], again[n])


def test_cli_merges_slerp_and_della(models, tmp_path):
    """``mlx_ssp merge CONFIG OUT`` (in process) with slerp and della: the outputs are the library's."""
    from click.testing import CliRunner

    from mlx_ssp.cli import main

    m = models["bfloat16"]
    configs = {
        "slerp": {"merge_method": "slerp", "base_model": m[0], "models": [{"model": m[1]}],
                  "parameters": {"t": [0.0, 0.5, 1.0]}},
        "della": {"merge_method": "della", "base_model": m[0], "models": [
            {"model": m[i], "parameters": {"weight": 0.5, "density": 0.6, "epsilon": 0.2}} for i in (1, 2)]},
    }
    for name, c in configs.items():
        cfg = tmp_path / f"{name}.yml"
        cfg.write_text(yaml.safe_dump(c))
        r = CliRunner().invoke(main, ["merge", str(cfg), str(tmp_path / f"cli_{name}"), "--quiet", "--seed", "4"])
        assert r.exit_code == 0, r.output
        lib = run(tmp_path, f"lib_{name}", seed=4, **c)
        got = load_out(tmp_path / f"cli_{name}")
        assert set(got) == set(SHAPES)
        for n in SHAPES:
            np.testing.assert_array_equal(got[n], lib[n], err_msg=f"{name} {n}")
    # della merged: not the base, and its TIES step at density 0.6 left some elements at the base
    n = "model.layers.0.mlp.down_proj.weight"
    base = R(models["arrays"][0][n], "bfloat16")
    assert 0.05 < np.mean(got[n] == base) < 0.6


@pytest.mark.parametrize("dt", DTS)
def test_model_stock_and_karcher_of_identical_models_return_it(models, tmp_path, dt):
    m = models[dt]
    x = {k: R(v, dt) for k, v in models["arrays"][1].items()}
    c1 = str(write_model(tmp_path / "c1", x, dt))
    c2 = str(write_model(tmp_path / "c2", x, dt))
    got = run(tmp_path, "ms", merge_method="model_stock", base_model=m[0], models=[{"model": c1}, {"model": c2}])
    ks = run(tmp_path, "k", merge_method="karcher", models=[{"model": m[1]}, {"model": c1}, {"model": c2}])
    for n in SHAPES:
        # bf16: mergekit holds the unit vectors and the mean in bf16, so within two bf16 ulps
        np.testing.assert_allclose(ks[n], x[n], rtol=1e-6 if dt == "float32" else 2 ** -6, atol=1e-7, err_msg=n)
        # identical fine-tunes: cos = 1, t = 1, the fine-tune itself. In bf16 mergekit's cos (norms and
        # dot rounded to bf16) can fall an ulp below 1, so t < 1: there it is the reference's value.
        if dt == "float32":
            np.testing.assert_allclose(got[n], x[n], rtol=1e-6, atol=1e-7, err_msg=n)
        else:
            w0 = R(models["arrays"][0][n], dt)
            np.testing.assert_array_equal(got[n], ref_model_stock(w0, [x[n], x[n]], dt), err_msg=n)
            assert np.abs(got[n] - x[n]).max() < 2 ** -6 * np.abs(w0).max(), n


def test_every_new_method_runs_end_to_end(models, tmp_path):
    m = models["float32"]
    base, a, b = models["arrays"]
    cases = {
        "model_stock": dict(base_model=m[0], models=[{"model": m[1]}, {"model": m[2]}], parameters={"filter_wise": True}),
        "nuslerp": dict(models=[{"model": m[1], "parameters": {"weight": 0.3}}, {"model": m[2], "parameters": {"weight": 0.7}}]),
        "multislerp": dict(models=[{"model": x, "parameters": {"weight": 1.0}} for x in m[1:]]),
        "karcher": dict(models=[{"model": x} for x in m[1:]]),
        "sce": dict(base_model=m[0], models=[{"model": m[1]}, {"model": m[2]}], parameters={"select_topk": 0.5}),
        "nearswap": dict(base_model=m[0], models=[{"model": m[1]}], parameters={"t": 0.01}),
        "arcee_fusion": dict(base_model=m[0], models=[{"model": m[1]}]),
        "ram": dict(base_model=m[0], models=[{"model": m[1]}, {"model": m[2]}]),
        "ramplus_tl": dict(base_model=m[0], models=[{"model": m[1]}, {"model": m[2]}], parameters={"r": 0.2}),
    }
    n = "model.layers.1.mlp.down_proj.weight"
    wants = {
        "model_stock": ref_model_stock(base[n], [a[n], b[n]], "float32", True),
        "nuslerp": ref_nuslerp(0.7, a[n], b[n]),
        "multislerp": ref_multislerp([a[n], b[n]], [1, 1]).reshape(a[n].shape),
        "karcher": ref_karcher([a[n], b[n]]).reshape(a[n].shape),
        "sce": ref_sce(base[n], [a[n], b[n]], 0.5, "float32"),
        "nearswap": ref_nearswap(0.01, base[n], a[n], "float32"),
        "arcee_fusion": ref_fusion(base[n], a[n], "float32")[0],
        "ram": ref_ram(base[n], [a[n], b[n]], "float32"),
        "ramplus_tl": ref_ram(base[n], [a[n], b[n]], "float32", plus=True, r=0.2),
    }
    for method, c in cases.items():
        got = run(tmp_path, method, merge_method=method, **c)
        assert set(got) == set(SHAPES)
        np.testing.assert_allclose(got[n], wants[method], rtol=1e-4, atol=1e-5, err_msg=method)


def test_method_errors_name_the_valid_parameters(models, tmp_path):
    m = models["float32"]
    bad = [
        ({"merge_method": "slerp", "base_model": m[0], "parameters": {"tt": 0.5}}, r"unknown parameter 'tt'.*valid: t"),
        ({"merge_method": "della", "base_model": m[0],
          "models": [{"model": m[1], "parameters": {"weight": 1, "epsilonn": 0.1}}]},
         "unknown parameter 'epsilonn'.*valid.*: weight, density, epsilon"),
        ({"merge_method": "model_stock", "base_model": m[0], "parameters": {"filterwise": True}},
         "unknown parameter 'filterwise'.*valid: filter_wise"),
    ]
    for c, pat in bad:
        p = tmp_path / "c.yml"
        p.write_text(yaml.safe_dump({"models": [{"model": m[1]}], **c}))
        with pytest.raises(UserError, match=pat):
            load_merge_config(p)
    with pytest.raises(UserError, match="slerp needs the parameter t"):
        run(tmp_path, "no_t", merge_method="slerp", base_model=m[0], models=[{"model": m[1]}])
    with pytest.raises(UserError, match="slerp takes exactly 1 model besides base_model"):
        run(tmp_path, "three", merge_method="slerp", base_model=m[0], models=[{"model": m[1]}, {"model": m[2]}],
            parameters={"t": 0.5})
    with pytest.raises(UserError, match="no weight given"):
        plan_merge(cfg_of(merge_method="nuslerp", models=[{"model": m[1]}, {"model": m[2]}]))
    assert not (tmp_path / "no_t").exists() and not (tmp_path / "three").exists()


def test_methods_registry_names_mergekit_parameters():
    want = {"slerp": ("t",), "della": ("weight", "density", "epsilon"), "model_stock": ("filter_wise",),
            "nuslerp": ("weight", "nuslerp_row_wise", "nuslerp_flatten"), "sce": ("select_topk", "int8_mask"),
            "ramplus_tl": ("r", "alpha", "epsilon"), "karcher": ("max_iter", "tol")}
    for name, params in want.items():
        spec = METHODS[name]
        assert set(params) <= set(spec.model_params) | set(spec.shared_params), name
        for p in params:  # each in the scope mergekit gives it (per model or shared)
            assert (p in spec.model_params) == (p in ("weight", "density", "epsilon") and name != "ramplus_tl"), (name, p)


def test_pipeline_merge_section_takes_weightless_methods():
    """The run file's merge: section with slerp / model_stock (no per-model weight): no stray weight key."""
    from pathlib import Path

    from mlx_ssp.errors import UserError
    from mlx_ssp.merge.config import MergeStageConfig
    from mlx_ssp.merge.engine import stage_to_config

    a, b, base = Path("/a"), Path("/b"), Path("/base")
    c = stage_to_config([a, b], base, MergeStageConfig(method="slerp", parameters={"t": 0.3}))
    assert [m.parameters for m in c.models] == [None, None] and str(c.base_model) == "/base"
    assert stage_to_config([a, b], base, MergeStageConfig(method="linear")).models[0].parameters == {"weight": 1.0}
    with pytest.raises(UserError, match="takes no per-model weight"):
        stage_to_config([a, b], base, MergeStageConfig(method="model_stock", weights=[1, 2]))
