"""Benchmark `mlx_ssp extract-lora` against `mergekit-extract-lora` (mergekit 0.1.5) at the same rank.

Uses the benchmark models of ``scripts/bench_merge.py`` (built there, or here when ``--keep`` holds
none): BASE = model0, TUNED = model1 (model1 = model0 + independent Gaussian noise of 1/10 its scale
per tensor, so every difference is full rank and its spectrum is flat: a hard case for a rank-r fit
and one where a randomized SVD and an exact one should end close). ``--spiked`` instead builds a
TUNED model whose differences are a rank-``rank`` spike plus small noise (a fine-tune-like spectrum)
in ``ROOT/tuned_spiked``.

Each tool runs in one child process (wall time, peak RSS of the child). Both do the same work: the
linear layers inside the transformer blocks only (mergekit with ``--exclude-regex
'embed_tokens|lm_head' --skip-undecomposable``, so it neither saves the embeddings / LM head at full
rank nor the norms; ours reports those, never saves them), factors stored in bf16 (ours with
``--dtype bfloat16``; mergekit stores the dtype of the difference, bf16). The relative reconstruction
error ``||D - D_r||_F / ||D||_F`` of every adapted layer is then computed here, by one function in
float32 NumPy for both outputs (ours: ``scale * (lora_a @ lora_b)^T``; mergekit's PEFT adapter:
``(lora_alpha / r) * lora_B @ lora_A``), against the exact rank-r optimum (Eckart-Young, from
NumPy's singular values) on a sample of layers.

    python scripts/bench_extract_lora.py --keep /tmp/bfull --rank 16 --mergekit-bin /tmp/mkvenv/bin
    python scripts/bench_extract_lora.py --small --rank 16 --repeat 2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_merge as bm  # noqa: E402

import mlx_ssp  # noqa: F401,E402
import mlx.core as mx  # noqa: E402
from mlx_ssp.merge import safetensors_io as sio  # noqa: E402

LAYER_LINEAR = re.compile(r"model\.layers\.(\d+)\.(.+)\.weight$")


def read_f32(model: Path) -> dict[str, np.ndarray]:
    """Every 2-D linear weight inside the layers of a safetensors model, as float32."""
    out = {}
    for f in sorted(model.glob("*.safetensors")):
        for k, v in mx.load(str(f)).items():
            if LAYER_LINEAR.search(k) and v.ndim == 2:
                out[k] = np.array(v.astype(mx.float32))
    return out


def ours_deltas(adapter: Path) -> dict[str, np.ndarray]:
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    scale = float(cfg["lora_parameters"]["scale"])
    t = {k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(adapter / "adapters.safetensors")).items()}
    return {k[: -len(".lora_a")] + ".weight": scale * (t[k] @ t[k[: -1] + "b"]).T
            for k in t if k.endswith(".lora_a")}


def mergekit_deltas(adapter: Path) -> dict[str, np.ndarray]:
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    scale = cfg["lora_alpha"] / cfg["r"]
    t = {k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(adapter / "adapter_model.safetensors")).items()}
    out = {}
    for k in t:
        if k.endswith(".lora_A.weight"):
            name = k.replace("base_model.model.", "", 1)[: -len(".lora_A.weight")] + ".weight"
            out[name] = scale * (t[k.replace("lora_A", "lora_B")] @ t[k])
    return out


def rel_errors(base: dict, tuned: dict, deltas: dict) -> dict[str, float]:
    """||D - D_r|| / ||D|| per layer (a layer the adapter lacks counts as error 1)."""
    errs = {}
    for k in tuned:
        d = tuned[k] - base[k]
        r = deltas.get(k)
        errs[k] = 1.0 if r is None else float(np.linalg.norm(d - r) / np.linalg.norm(d))
    return errs


def optimum(base: dict, tuned: dict, rank: int, names: list[str]) -> dict[str, float]:
    """The Eckart-Young rank-r relative error of the listed layers (exact singular values)."""
    out = {}
    for k in names:
        s = np.linalg.svd((tuned[k] - base[k]).astype(np.float64), compute_uv=False)
        out[k] = float(np.sqrt((s[rank:] ** 2).sum() / (s ** 2).sum()))
    return out


def make_spiked(base: Path, out: Path, rank: int) -> Path:
    """base + (rank-``rank`` spike + noise of 1/100 its scale) on every layer linear, else base."""
    if (out / "config.json").is_file():
        return out
    info = sio.scan_model(base)
    plan = [sio.PlannedTensor(n, "BF16", i.shape) for n, i in info.items()]
    total = sum(i.nbytes for i in info.values())
    out.mkdir(parents=True, exist_ok=True)
    w = sio.ShardedWriter(out, plan, max_shard_bytes=total // 3 + 1)
    weights = {k: v for f in sorted(base.glob("*.safetensors")) for k, v in mx.load(str(f)).items()}
    for n, i in info.items():
        x = np.array(weights[n].astype(mx.float32))
        if LAYER_LINEAR.search(n) and x.ndim == 2:
            g = np.random.default_rng(zlib.crc32(n.encode()) + 1)
            spike = (g.standard_normal((x.shape[0], rank), dtype=np.float32)
                     @ g.standard_normal((rank, x.shape[1]), dtype=np.float32)) * (0.004 / np.sqrt(rank))
            x = x + spike + g.standard_normal(x.shape, dtype=np.float32) * 0.0004
        w.write(n, bm.bf16_bytes(x))
    w.close()
    shutil.copy(base / "config.json", out / "config.json")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--small", action="store_true", help="hidden 256, intermediate 1024, 4 layers, vocab 8000")
    ap.add_argument("--layers", type=int, default=None, help="override the layer count (a quicker proxy at full width)")
    ap.add_argument("--keep", default=None, help="build/keep models in this dir")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--spiked", action="store_true", help="TUNED = base + rank-r spike + small noise")
    ap.add_argument("--mergekit-bin", default=None, metavar="DIR", help="directory holding mergekit-extract-lora")
    ap.add_argument("--no-mergekit", action="store_true")
    ap.add_argument("--optimum-sample", type=int, default=7, help="layers whose exact rank-r optimum is computed")
    args = ap.parse_args()
    args.hidden, args.intermediate, args.layers_, args.heads, args.vocab = (
        (256, 1024, 4, 4, 8000) if args.small else (1024, 4096, 14, 16, 32000))
    args.layers = args.layers or args.layers_
    root = Path(args.keep or tempfile.mkdtemp(prefix="bench_lora_"))
    models = ([root / f"model{i}" for i in range(3)] if (root / "model2" / "config.json").is_file()
              else bm.make_models(root, args))
    base, tuned = models[0], models[1]
    if args.spiked:
        tuned = make_spiked(base, root / "tuned_spiked", args.rank)
    mk = shutil.which("mergekit-extract-lora", path=args.mergekit_bin)
    have_mk = mk is not None and not args.no_mergekit
    ours_out, mk_out = root / "lora_ours", root / "lora_mk"
    ours_s, ours_rss, mk_s, mk_rss = [], [], [], []
    for _ in range(args.repeat):
        shutil.rmtree(ours_out, ignore_errors=True)
        w, r = bm.timed(["mlx_ssp", "extract-lora", str(base), str(tuned), str(ours_out), "--rank", str(args.rank),
                         "--dtype", "bfloat16", "--quiet"])
        ours_s.append(w)
        ours_rss.append(r)
        if have_mk:
            shutil.rmtree(mk_out, ignore_errors=True)
            w, r = bm.timed([mk, "--model", str(tuned), "--base-model", str(base), "--out-path", str(mk_out),
                             "--max-rank", str(args.rank), "--exclude-regex", "embed_tokens|lm_head",
                             "--skip-undecomposable", "--quiet"])
            mk_s.append(w)
            mk_rss.append(r)
    b, t = read_f32(base), read_f32(tuned)
    med = lambda v: round(float(np.median(v)), 2)  # noqa: E731
    e_ours = rel_errors(b, t, ours_deltas(ours_out))
    sample = sorted(t)[:: max(1, len(t) // args.optimum_sample)][: args.optimum_sample]
    opt = optimum(b, t, args.rank, sample)
    row = {"rank": args.rank, "tuned": tuned.name, "layers_adapted": len(t), "rounds": args.repeat,
           "ours_s": med(ours_s), "ours_rss_mib": round(max(ours_rss)), "ours_s_all": [round(x, 2) for x in ours_s],
           "ours_err_mean": round(float(np.mean(list(e_ours.values()))), 5),
           "ours_err_max": round(max(e_ours.values()), 5),
           "optimum_err_mean_sample": round(float(np.mean(list(opt.values()))), 5),
           "ours_err_mean_sample": round(float(np.mean([e_ours[k] for k in sample])), 5)}
    if have_mk:
        e_mk = rel_errors(b, t, mergekit_deltas(mk_out))
        per_round = [m / o for m, o in zip(mk_s, ours_s)]
        row.update({"mergekit_s": med(mk_s), "mergekit_rss_mib": round(min(mk_rss)),
                    "mergekit_s_all": [round(x, 2) for x in mk_s], "speedup": med(per_round),
                    "rss_ratio": round(max(ours_rss) / min(mk_rss), 2),
                    "mergekit_err_mean": round(float(np.mean(list(e_mk.values()))), 5),
                    "mergekit_err_max": round(max(e_mk.values()), 5),
                    "mergekit_err_mean_sample": round(float(np.mean([e_mk[k] for k in sample])), 5),
                    "max_err_gap_ours_minus_mk": round(max(e_ours[k] - e_mk[k] for k in t), 5)})
    print(json.dumps(row), flush=True)
    print(f"command: python scripts/bench_extract_lora.py {' '.join(sys.argv[1:])}")
    print(f"load average: {' '.join(f'{x:.1f}' for x in os.getloadavg())} (at the end; {os.cpu_count()} CPUs)")
    for p in (ours_out, mk_out):
        shutil.rmtree(p, ignore_errors=True)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
