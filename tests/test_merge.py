"""mlx_ssp merge: methods against an independent NumPy reference, and their properties (helpers:
merge_helpers.py; config and bad input: test_merge_inputs.py; threads: test_merge_workers.py)."""

from __future__ import annotations


import numpy as np
import pytest

import mlx_ssp  # noqa: F401
import mlx.core as mx

from mlx_ssp.merge.sparsify import bernoulli_mask, dare_seed

from merge_helpers import SHAPES, as_stored, load_out, merge, ref_linear, ref_task_vectors, ref_topk_mask, write_model


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
