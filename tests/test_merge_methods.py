"""mergekit 0.1.5's other merge methods: each against an independent NumPy reference (float32 and
bfloat16), their properties, end-to-end merges of tiny models, parameter errors. Parity with
mergekit itself: test_merge_goldens.py."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

import mlx_ssp  # noqa: F401
import mlx.core as mx

from mlx_ssp.errors import UserError
from mlx_ssp.merge import interpolate as I
from mlx_ssp.merge import selective as S
from mlx_ssp.merge import slerp as SL
from mlx_ssp.merge import sphere_means as SM
from mlx_ssp.merge.config import load_merge_config
from mlx_ssp.merge.engine import plan_merge, run_merge
from mlx_ssp.merge.methods import METHODS
from mlx_ssp.merge.sparsify import dare_seed, magprune_mask, magprune_probabilities

from test_merge import SHAPES, R, cfg_of, load_out, rand_arrays, ref_task_vectors, write_model

DTS = ["float32", "bfloat16"]


def tol(dt):
    # float32: reduction order; bf16: one rounding of nearly equal float32 values may differ by an ulp
    return dict(rtol=1e-5, atol=1e-6) if dt == "float32" else dict(rtol=2 ** -7, atol=1e-6)


def mxa(x, dt):
    return mx.array(np.asarray(x, np.float32)).astype(getattr(mx, dt))


def npy(x):
    return np.array(x.astype(mx.float32))


def pair(dt, n=(8, 12), scale=0.3, seed=0):
    rng = np.random.default_rng(seed)
    a = R(rng.standard_normal(n).astype(np.float32), dt)
    b = R(a + scale * rng.standard_normal(n).astype(np.float32), dt)
    return a, b


# ------------------------------------------------------------------ NumPy references (float64)


def ref_slerp(t, a, b, thr=0.9995, eps=1e-8):
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    na, nb = (na if na > eps else 1.0), (nb if nb > eps else 1.0)
    d = np.clip(np.dot(a / na, b / nb), -1, 1)
    if abs(d) > thr:
        return (1 - t) * a + t * b
    th = np.arccos(d)
    return (np.sin((1 - t) * th) * a + np.sin(t * th) * b) / np.sin(th)


def ref_nuslerp(t, a, b, row_wise=False, flatten=True, eps=1e-8):
    shape = a.shape
    a, b = a.astype(np.float64), b.astype(np.float64)
    if flatten:
        a, b = a.reshape(1, -1), b.reshape(1, -1)
    elif row_wise:
        a, b = a.T, b.T
    out = np.empty_like(a)
    for i in range(a.shape[0]):
        x, y = a[i], b[i]
        c = np.clip(np.dot(x / max(np.linalg.norm(x), 1e-7), y / max(np.linalg.norm(y), 1e-7)), -1, 1)
        if 1 - c * c <= eps ** 2:
            out[i] = (1 - t) * x + t * y
        else:
            th = np.arccos(c)
            out[i] = (np.sin((1 - t) * th) * x + np.sin(t * th) * y) / np.sin(th)
    if row_wise and not flatten:
        out = out.T
    return out.reshape(shape)


def ref_multislerp(xs, w, eps=1e-8):
    X = np.stack([x.astype(np.float64).ravel() for x in xs])
    w = np.asarray(w, np.float64) / np.sum(w)
    norms = np.linalg.norm(X, axis=1)
    U = X / (norms[:, None] + eps)
    m = (U * w[:, None]).sum(0)
    m /= np.linalg.norm(m)
    T = ((U - (U @ m)[:, None] * m) * w[:, None]).sum(0)
    tn = np.linalg.norm(T) + eps
    return (m * np.cos(tn) + T * np.sin(tn) / tn) * (norms * w).sum()


def ref_karcher(xs, iters=10, tol_=1e-5):
    X = [x.astype(np.float64).ravel() for x in xs]
    norms = [np.linalg.norm(x) for x in X]
    U = [x / n for x, n in zip(X, norms)]
    m = sum(U) / len(U)
    m /= np.linalg.norm(m)
    for _ in range(iters):
        tg = np.zeros_like(m)
        for u in U:
            d = np.clip(m @ u, -1, 1)
            th = np.arccos(d)
            if th >= tol_:
                tg += (th / np.sin(th)) * (u - d * m) / len(U)
        tn = np.linalg.norm(tg)
        if tn < tol_:
            break
        m = np.cos(tn) * m + np.sin(tn) * tg / tn
        m /= np.linalg.norm(m)
    return np.mean(norms) * m


def ref_model_stock(base, xs, cd, filter_wise=False):
    """mergekit's model_stock, each torch op rounded to cd (float64 arithmetic per op)."""
    r = lambda v: R(np.asarray(v, np.float64).astype(np.float32), cd)  # noqa: E731
    shape = base.shape
    w0 = base.reshape(-1, shape[-1]) if (filter_wise and base.ndim >= 2) else base.reshape(1, -1)
    ws = [x.reshape(w0.shape) for x in xs]
    off = [r(w.astype(np.float64) - w0) for w in ws]
    cos = []
    for i in range(len(off)):
        for j in range(i + 1, len(off)):
            n = r(r(np.linalg.norm(off[i].astype(np.float64), axis=-1)) * r(np.linalg.norm(off[j].astype(np.float64), axis=-1)))
            d = r((r(off[i].astype(np.float64) * off[j])).astype(np.float64).sum(-1))
            cos.append(np.clip(r(d / np.maximum(n, 1e-6)), -1, 1))
    c = r(np.mean(np.stack(cos).astype(np.float64), axis=0))[..., None]
    k = len(ws)
    den = r(1 + r((k - 1) * c.astype(np.float64)))
    t = np.where(np.abs(den) < 1e-6, 0, r(r(k * c.astype(np.float64)) / np.where(np.abs(den) < 1e-6, 1, den)))
    tot = ws[0]
    for w in ws[1:]:
        tot = r(tot.astype(np.float64) + w)
    avg = r(tot.astype(np.float64) / k)
    res = r(r(t * avg.astype(np.float64)) + r(r(1 - t.astype(np.float64)) * w0))
    return res.reshape(shape)


def ref_nearswap(t, a, b, cd):
    r = lambda v: R(np.asarray(v, np.float64).astype(np.float32), cd)  # noqa: E731
    diff = np.maximum(np.abs(r(a.astype(np.float64) - b)), r(1e-6))
    w = np.clip(r(r(1 / diff.astype(np.float64)) * t), 0, 1)  # torch: scalar / x is reciprocal(x) * scalar
    return r(r(w * b.astype(np.float64)) + r(r(1 - w.astype(np.float64)) * a))


def ref_sce(base, xs, topk, cd):
    T = np.stack([R(x - base, cd) for x in xs]).astype(np.float64)
    if topk < 1:
        var = T.var(0).ravel()
        k = int(np.count_nonzero(var) * topk)
        m = np.zeros(var.size, bool)
        m[np.argsort(-var, kind="stable")[:k]] = True
        T = T * m.reshape(base.shape)
    maj = np.where(T.sum(0) >= 0, 1, -1)
    erase = np.sign(T) == maj
    w = (T ** 2).reshape(len(xs), -1).mean(1)
    w = w / w.sum()
    ew = w.reshape((-1,) + (1,) * base.ndim) * erase
    return base + (T * ew).sum(0) / np.maximum(ew.sum(0), 1e-6)


def ref_ram(base, xs, cd, eps=1e-5, plus=False, r=0.1, alpha=0.2):
    T = np.stack([R(x - base, cd) for x in xs]).astype(np.float64).reshape(len(xs), -1)
    nz = np.abs(T) > eps
    cnt = nz.sum(0)
    out = np.zeros(T.shape[1])
    for i in range(len(xs)):
        lam = 1.0
        if plus:
            shared, uniq = (nz[i] & (cnt > 1)).sum(), (nz[i] & (cnt == 1)).sum()
            lam = 1 + r * min(max(shared / max(uniq, eps), 0), alpha)
        out += np.where(nz[i] & (cnt == 1), T[i] * lam, 0) + np.where(nz[i] & (cnt > 1), T[i] / np.maximum(cnt, 1), 0)
    return base + out.reshape(base.shape)


def ref_fusion(base, x, cd):
    b, p = base.astype(np.float64), x.astype(np.float64)
    sm = lambda v: np.exp(v - v.max(-1, keepdims=True)) / np.exp(v - v.max(-1, keepdims=True)).sum(-1, keepdims=True)  # noqa: E731
    P, Q = sm(p) + 1e-8, sm(b) + 1e-8
    imp = np.abs(p - b) * (P * np.log(P / Q)).sum(-1, keepdims=True)
    s = np.sort(imp.ravel())
    q = [s[int(np.float32(v) * np.float32(s.size - 1))] for v in (0.25, 0.5, 0.75)]
    keep = imp >= q[1] + 1.5 * (q[2] - q[0])
    return b + R(x - base, cd) * keep, imp, q[1] + 1.5 * (q[2] - q[0])


def ref_magprune_probs(mag, density, eps):
    """Per row: rank by ascending magnitude (stable), linearly mapped to [density - eps, density + eps]."""
    n = mag.shape[1]
    ranks = np.empty(mag.shape)
    for i, row in enumerate(mag):
        ranks[i, np.argsort(row, kind="stable")] = np.arange(n)
    return density - eps + ranks / (n - 1) * 2 * eps


# ------------------------------------------------------------------ pure functions vs the references


@pytest.mark.parametrize("dt", DTS)
@pytest.mark.parametrize("t", [0.0, 0.3, 0.75, 1.0])
def test_slerp_matches_reference_and_endpoints(dt, t):
    a, b = pair(dt)
    got = npy(SL.slerp(t, mxa(a, dt), mxa(b, dt)).astype(getattr(mx, dt)))
    np.testing.assert_allclose(got.ravel(), R(ref_slerp(t, a, b), dt), **tol(dt))
    if t in (0.0, 1.0):  # the endpoints, exactly
        np.testing.assert_array_equal(got, a if t == 0 else b)


def test_slerp_nearly_parallel_falls_back_to_linear():
    a = np.linspace(-1, 1, 64, dtype=np.float32)
    for b in (a * 2.5 + 1e-4, -a):  # cos > 0.9995, and antiparallel
        got = npy(SL.slerp(0.3, mx.array(a), mx.array(b)))
        np.testing.assert_allclose(got, 0.7 * a + 0.3 * b, rtol=1e-6, atol=1e-7)
    # just below the threshold it is spherical: not the linear mix
    rng = np.random.default_rng(3)
    b = a + 0.2 * rng.standard_normal(64).astype(np.float32)
    lin = 0.7 * a + 0.3 * b
    assert np.abs(npy(SL.slerp(0.3, mx.array(a), mx.array(b))) - lin).max() > 1e-4


@pytest.mark.parametrize("dt", DTS)
@pytest.mark.parametrize("row_wise,flatten", [(False, True), (False, False), (True, False)])
def test_nuslerp_matches_reference(dt, row_wise, flatten):
    a, b = pair(dt, scale=1.0)
    got = npy(SL.nuslerp(0.35, mxa(a, dt), mxa(b, dt), a.shape, row_wise, flatten).astype(getattr(mx, dt)))
    np.testing.assert_allclose(got.reshape(a.shape), R(ref_nuslerp(0.35, a, b, row_wise, flatten), dt), **tol(dt))


@pytest.mark.parametrize("dt", DTS)
def test_multislerp_and_karcher_match_reference(dt):
    rng = np.random.default_rng(1)
    xs = [R(rng.standard_normal(50).astype(np.float32) + 1.0, dt) for _ in range(3)]
    w = [0.2, 0.5, 0.3]
    got = npy(SM.multislerp([mxa(x, dt) for x in xs], w).astype(getattr(mx, dt)))
    np.testing.assert_allclose(got, R(ref_multislerp(xs, w), dt), **tol(dt))
    got = npy(SM.karcher([mxa(x, dt) for x in xs]).astype(getattr(mx, dt)))
    np.testing.assert_allclose(got, R(ref_karcher(xs), dt), **tol(dt))


def test_karcher_and_multislerp_of_identical_models_return_it():
    x = np.random.default_rng(2).standard_normal(40).astype(np.float32)
    got = npy(SM.karcher([mx.array(x)] * 3))
    np.testing.assert_allclose(got, x, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(npy(SM.multislerp([mx.array(x)] * 3, [1, 2, 3])), x, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dt", DTS)
@pytest.mark.parametrize("filter_wise", [False, True])
def test_model_stock_matches_reference(dt, filter_wise):
    rng = np.random.default_rng(4)
    base = R(rng.standard_normal((6, 10)).astype(np.float32), dt)
    xs = [R(base + 0.05 * rng.standard_normal(base.shape).astype(np.float32) + 0.03, dt) for _ in range(3)]
    got = npy(I.model_stock(mxa(base, dt), [mxa(x, dt) for x in xs], getattr(mx, dt), base.shape,
                            filter_wise).astype(getattr(mx, dt)))
    np.testing.assert_allclose(got.reshape(base.shape), ref_model_stock(base, xs, dt, filter_wise),
                               rtol=1e-5 if dt == "float32" else 0, atol=1e-6 if dt == "float32" else 0)


@pytest.mark.parametrize("dt", DTS)
def test_nearswap_matches_reference(dt):
    a, b = pair(dt, scale=0.01)
    got = npy(I.nearswap(0.005, mxa(a, dt), mxa(b, dt), getattr(mx, dt)).astype(getattr(mx, dt)))
    np.testing.assert_allclose(got.reshape(a.shape), ref_nearswap(0.005, a, b, dt),
                               rtol=2e-7 if dt == "float32" else 0, atol=0)


@pytest.mark.parametrize("dt", DTS)
def test_arcee_fusion_matches_reference(dt):
    a, b = pair(dt, scale=0.5, n=(10, 16))
    want, imp, thr = ref_fusion(a, b, dt)
    got = npy(I.arcee_fusion(mxa(a, dt), mxa(b, dt), a.shape, 0, getattr(mx, dt)).astype(getattr(mx, dt)))
    close = np.isclose(imp, thr, rtol=1e-4)  # an element at the threshold may fall either way
    np.testing.assert_allclose(got.reshape(a.shape)[~close], R(want, dt)[~close], rtol=0, atol=1e-7)
    assert 0 < (got.reshape(a.shape) != a).mean() < 0.5  # some, not all, changes kept


@pytest.mark.parametrize("dt", DTS)
@pytest.mark.parametrize("topk", [1.0, 0.4])
def test_sce_matches_reference(dt, topk):
    rng = np.random.default_rng(5)
    base = R(rng.standard_normal((8, 8)).astype(np.float32), dt)
    xs = [R(base + 0.1 * rng.standard_normal(base.shape).astype(np.float32), dt) for _ in range(3)]
    tvs = [mx.array(R(x - base, dt)) for x in xs]
    got = npy(S.sce(mx.array(base), tvs, topk).astype(getattr(mx, dt)))
    np.testing.assert_allclose(got.reshape(base.shape), R(ref_sce(base, xs, topk, dt), dt), **tol(dt))


@pytest.mark.parametrize("dt", DTS)
@pytest.mark.parametrize("plus", [False, True])
def test_ram_matches_reference(dt, plus):
    rng = np.random.default_rng(6)
    base = R(rng.standard_normal((8, 8)).astype(np.float32), dt)
    # sparse RL-like task vectors: some elements changed by one model, some by both
    xs = [R(base + 0.1 * rng.standard_normal(base.shape).astype(np.float32) * (rng.random(base.shape) < p), dt)
          for p in (0.3, 0.5)]
    tvs = [mx.array(R(x - base, dt)) for x in xs]
    got = npy(S.ram(mx.array(base), tvs, plus=plus, r=0.3, alpha=0.5).astype(getattr(mx, dt)))
    np.testing.assert_allclose(got.reshape(base.shape), R(ref_ram(base, xs, dt, plus=plus, r=0.3, alpha=0.5), dt),
                               **tol(dt))


@pytest.mark.parametrize("dt", DTS)
def test_magprune_probabilities_and_keep_rates(dt):
    rng = np.random.default_rng(7)
    mag = np.abs(rng.standard_normal((4, 200))).astype(np.float32)
    p = magprune_probabilities(mag, 0.5, 0.2, getattr(mx, dt) if dt == "bfloat16" else mx.float32)
    np.testing.assert_allclose(p, R(ref_magprune_probs(mag, 0.5, 0.2), dt), rtol=0, atol=1e-6 if dt == "float32" else 4e-3)
    # the draw: larger magnitudes survive more often (mean p of the lowest / highest quarter of ranks:
    # 0.3 + 0.4 * 49.5 / 399 and 0.3 + 0.4 * 349.5 / 399), the overall rate is the density
    d = rng.standard_normal((64, 400)).astype(np.float32)
    m = np.array(magprune_mask(mx.array(d.ravel()), 0.5, 0.2, seed=11, shape=d.shape)).reshape(d.shape)
    assert abs(m.mean() - 0.5) < 0.01
    ranks = np.argsort(np.argsort(np.abs(d), axis=1, kind="stable"), axis=1)
    assert abs(m[ranks < 100].mean() - 0.35) < 0.02 and abs(m[ranks >= 300].mean() - 0.65) < 0.02
    again = np.array(magprune_mask(mx.array(d.ravel()), 0.5, 0.2, seed=11, shape=d.shape)).reshape(d.shape)
    np.testing.assert_array_equal(m, again)  # seeded: deterministic
    with pytest.raises(UserError, match="epsilon"):
        magprune_mask(mx.array(d.ravel()), 0.9, 0.15, seed=1, shape=d.shape)


# ------------------------------------------------------------------ end to end (tiny models on disk)


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
