"""Shared helpers of the merge tests: independent NumPy references of the merge methods (float64
math, rounded like the engine: float32 accumulation, one rounding to the stored dtype) and tiny
random models written to disk as safetensors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

import mlx_ssp  # noqa: F401
import mlx.core as mx

from mlx_ssp.merge import torch_math as TM
from mlx_ssp.merge.config import MergeConfig
from mlx_ssp.merge.engine import run_merge

#: the oneMKL code path torch's float32 goldens were recorded on (oneMKL may give other last bits
#: on another path, e.g. an Intel CPU's AVX2 or AVX-512 one)
RECORDED_MKL_BRANCH = json.loads((Path(__file__).resolve().parent / "goldens" / "torch_math"
                                  / "mkl_branch.json").read_text())["mkl_cbwr_auto_branch"]


def mkl_parity_skip() -> str | None:
    """None where the torch float32 bit-identity tests apply (oneMKL, on the recorded code path),
    else the one-line reason to skip them."""
    here = TM.mkl_branch()
    if TM.backend() == "mkl" and here == RECORDED_MKL_BRANCH:
        return None
    return (f"oneMKL code path here: {here} (backend {TM.backend()}), goldens recorded on "
            f"{RECORDED_MKL_BRANCH}: torch's float32 bits are checked only on the recorded path")

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


def cfg_of(**kw) -> MergeConfig:
    return MergeConfig.model_validate(kw)


def merge(tmp_path, name="out", **kw):
    seed = kw.pop("seed", 0)
    extra = {k: kw.pop(k) for k in ("vocab_mismatch", "out_shard_size") if k in kw}
    out = tmp_path / name
    run_merge(cfg_of(**kw), out, progress=False, seed=seed, **extra)
    return load_out(out)


# ------------------------------------------------------------------ the further methods: helpers and references

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
