"""Benchmark `mlx_ssp merge` against mergekit (if installed) and the I/O floor, side by side.

Builds three Llama-shaped bf16 models with random weights (default: hidden 1024, intermediate 4096,
14 layers, 16 heads, vocab 32000, separate lm_head: ~300M parameters, 3 shards each) in a temp
dir, then for each method runs, in one process each: the I/O floor, our merge and mergekit-yaml (when
installed), recording wall time and peak RSS (ru_maxrss of the child). The I/O floor is the time to
read every input tensor the merge reads and write one output model's bytes. ``--repeat N`` runs N
such rounds back to back and reports medians (speedup: the median of the per-round ratios, with
their range), since the pace of a shared machine drifts between minutes. Prints a table and a JSON
line per method.

    python scripts/bench_merge.py                      # full size, all methods
    python scripts/bench_merge.py --repeat 3 --keep /tmp/bfull   # the BENCHMARKS.md figures
    python scripts/bench_merge.py --small --methods ties  # quick look
    python scripts/bench_merge.py --layers 2 --no-mergekit --methods ties,dare_ties  # full-width proxy
    python scripts/bench_merge.py --small --no-mergekit --compare /tmp/ref_tree --repeat 5  # vs another tree
    python scripts/bench_merge.py --methods slerp,della,model_stock,passthrough --mergekit-bin /tmp/mkvenv/bin

Methods: linear, ties, dare_ties and slerp (t 0.5, base + 1), della (base + 2, density
0.5, epsilon 0.1, lambda 1), model_stock (base + 2), passthrough (a frankenmerge of overlapping
layer ranges of two models via ``slices:``), karcher (the three models), nuslerp (model1, model2,
weights 0.4 / 0.6), multislerp (the three, weights 0.5 / 0.3 / 0.2), sce (base + 2, select_topk
0.5); each config is valid for both tools.
``--mergekit-bin DIR`` finds mergekit-yaml in DIR (a separate venv) instead of on PATH.

``--compare TREE`` also times the merge of another checkout of this project (its ``mlx_ssp``
imported from TREE), alternating with ours in every round, reports the per-round time ratio and
checks that both write byte-identical files (sha256 of each).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

import mlx_ssp  # noqa: F401
from mlx_ssp.merge import safetensors_io as sio

RSS = ("import resource,subprocess,sys,time;t=time.perf_counter();r=subprocess.run(sys.argv[1:],"
       "stdout=subprocess.DEVNULL,stderr=subprocess.PIPE,text=True);w=time.perf_counter()-t;"
       "print(r.returncode,w,resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss);"
       "sys.stderr.write(r.stderr[-3000:] if r.returncode else '')")


def llama_shapes(h, inter, layers, vocab):
    shapes = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
        shapes += [(p + f"self_attn.{n}_proj.weight", (h, h)) for n in "qkvo"]
        shapes += [(p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                   (p + "mlp.down_proj.weight", (h, inter))]
    shapes += [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
    return shapes


def bf16_bytes(x: np.ndarray) -> bytes:
    return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()


def make_models(root: Path, args) -> list[Path]:
    shapes = llama_shapes(args.hidden, args.intermediate, args.layers, args.vocab)
    total = sum(int(np.prod(s)) * 2 for _, s in shapes)
    conf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": args.hidden,
            "intermediate_size": args.intermediate, "num_hidden_layers": args.layers,
            "num_attention_heads": args.heads, "num_key_value_heads": args.heads, "vocab_size": args.vocab,
            "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "max_position_embeddings": 2048, "hidden_act": "silu"}
    paths = []
    for m in range(3):
        d = root / f"model{m}"
        d.mkdir(parents=True)
        plan = [sio.PlannedTensor(n, "BF16", s) for n, s in shapes]
        w = sio.ShardedWriter(d, plan, max_shard_bytes=total // 3 + 1)
        for n, s in shapes:
            base = np.random.default_rng(zlib.crc32(n.encode())).standard_normal(s, dtype=np.float32) * 0.02
            if m:
                base += np.random.default_rng(m * 7919 + zlib.crc32(n.encode())).standard_normal(s, dtype=np.float32) * 0.002
            w.write(n, bf16_bytes(base))
        w.close()
        (d / "config.json").write_text(json.dumps(conf))
        paths.append(d)
    return paths


def configs(models: list[Path], layers: int) -> dict:
    """mergekit 0.1.5 YAML of every benchmarked method (each valid for both tools)."""
    m0, m1, m2 = (str(p) for p in models)
    # passthrough: a frankenmerge of overlapping ranges, the first two thirds of model0's layers then
    # the last two thirds of model1's (14 layers: [0, 9) + [5, 14) = 18 output layers)
    a_end, b_start = -(-2 * layers // 3), layers // 3
    return {
        "linear": {"merge_method": "linear", "dtype": "bfloat16",
                   "models": [{"model": m, "parameters": {"weight": 1.0}} for m in (m0, m1, m2)]},
        "ties": {"merge_method": "ties", "base_model": m0, "dtype": "bfloat16",
                 "models": [{"model": m, "parameters": {"weight": 0.5, "density": 0.5}} for m in (m1, m2)]},
        "dare_ties": {"merge_method": "dare_ties", "base_model": m0, "dtype": "bfloat16",
                      "models": [{"model": m, "parameters": {"weight": 0.5, "density": 0.5}} for m in (m1, m2)]},
        # the base and one other model; mergekit's slerp wants both under models:
        "slerp": {"merge_method": "slerp", "base_model": m0, "dtype": "bfloat16", "parameters": {"t": 0.5},
                  "models": [{"model": m0}, {"model": m1}]},
        "della": {"merge_method": "della", "base_model": m0, "dtype": "bfloat16", "parameters": {"lambda": 1.0},
                  "models": [{"model": m, "parameters": {"weight": 0.5, "density": 0.5, "epsilon": 0.1}}
                             for m in (m1, m2)]},
        "model_stock": {"merge_method": "model_stock", "base_model": m0, "dtype": "bfloat16",
                        "models": [{"model": m} for m in (m1, m2)]},
        "karcher": {"merge_method": "karcher", "dtype": "bfloat16", "models": [{"model": m} for m in (m0, m1, m2)]},
        "nuslerp": {"merge_method": "nuslerp", "dtype": "bfloat16",
                    "models": [{"model": m, "parameters": {"weight": w}} for m, w in ((m1, 0.4), (m2, 0.6))]},
        "multislerp": {"merge_method": "multislerp", "dtype": "bfloat16",
                       "models": [{"model": m, "parameters": {"weight": w}} for m, w in ((m0, 0.5), (m1, 0.3), (m2, 0.2))]},
        "sce": {"merge_method": "sce", "base_model": m0, "dtype": "bfloat16", "parameters": {"select_topk": 0.5},
                "models": [{"model": m} for m in (m1, m2)]},
        "passthrough": {"merge_method": "passthrough", "dtype": "bfloat16",
                        "slices": [{"sources": [{"model": m0, "layer_range": [0, a_end]}]},
                                   {"sources": [{"model": m1, "layer_range": [b_start, layers]}]}]},
    }


def config_models(cfg: dict) -> list[str]:
    """The distinct models a config reads (what the I/O floor reads)."""
    names = [cfg.get("base_model")] + [m["model"] for m in cfg.get("models", [])]
    names += [s["model"] for sl in cfg.get("slices", []) for s in sl["sources"]]
    return list(dict.fromkeys(n for n in names if n))


def timed(cmd: list[str]) -> tuple[float, float]:
    r = subprocess.run([sys.executable, "-c", RSS, *cmd], capture_output=True, text=True)
    if len(r.stdout.split()) != 3:  # the command could not start (e.g. `mlx_ssp` not on PATH)
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"bench_merge: could not run {cmd[0]!r}: {last}")
    rc, wall, rss_kb = r.stdout.split()
    if int(rc):
        raise SystemExit(f"failed: {' '.join(cmd)}\n{r.stderr}")
    return float(wall), int(rss_kb) / 1024


def ours_cmd(tree: str | None) -> list[str]:
    """The `mlx_ssp` command of this checkout, or of the checkout at ``tree``."""
    if tree is None:
        return ["mlx_ssp"]
    boot = f"import sys; sys.path.insert(0, {str(Path(tree).resolve())!r}); from mlx_ssp.cli import main; main()"
    return [sys.executable, "-c", boot]


def digest(out: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(out.iterdir()) if f.is_file()}


def timed_merge(tree: str | None, cfg: Path, out: Path, keep: bool = False,
                workers: int | None = None) -> tuple[float, float, dict[str, str]]:
    """(wall s, peak RSS MiB, sha256 per output file) of one merge into ``out`` (removed after
    unless ``keep``)."""
    shutil.rmtree(out, ignore_errors=True)
    extra = ["--workers", str(workers)] if workers else []
    wall, rss = timed([*ours_cmd(tree), "merge", str(cfg), str(out), "--quiet", "--seed", "1", *extra])
    sha = digest(out)
    if not keep:
        shutil.rmtree(out, ignore_errors=True)
    return wall, rss, sha


def load_tensors(model: Path) -> dict:
    import mlx.core as mx

    return {k: v for f in sorted(model.glob("*.safetensors")) for k, v in mx.load(str(f)).items()}


def diff_outputs(ours: Path, theirs: Path) -> dict:
    """How our output differs from mergekit's: tensors bit-identical, elements that differ, the
    largest difference in units of the output dtype's spacing at that value (ulps), and the
    tensor with the largest relative Frobenius difference."""
    import mlx.core as mx

    a, b = load_tensors(ours), load_tensors(theirs)
    res = {"tensors": len(a), "only_ours": sorted(set(a) - set(b))[:5], "only_mergekit": sorted(set(b) - set(a))[:5],
           "identical": 0, "elements": 0, "elements_differ": 0, "max_abs": 0.0, "max_ulps": 0.0, "worst": None, "worst_rel": 0.0}
    for k in sorted(set(a) & set(b)):
        x, y = np.array(a[k].astype(mx.float32), dtype=np.float64), np.array(b[k].astype(mx.float32), dtype=np.float64)
        if x.shape != y.shape:
            res.setdefault("shape_mismatch", []).append(k)
            continue
        diff = np.abs(x - y)
        res["elements"] += x.size
        n = int((diff > 0).sum())
        res["elements_differ"] += n
        res["identical"] += n == 0
        if n:
            res["max_abs"] = max(res["max_abs"], float(diff.max()))
            # bf16 spacing at the larger magnitude, 2^(exponent - 7), floored at 2^-133 (bf16's
            # smallest subnormal step), so two values either side of zero do not count as 1e25 ulps
            big = np.maximum(np.abs(x), np.abs(y))
            spacing = np.maximum(np.exp2(np.floor(np.log2(np.maximum(big, 1e-38))) - 7), 2.0 ** -133)
            res["max_ulps"] = max(res["max_ulps"], float((diff / spacing).max()))
            rel = float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))
            if rel > res["worst_rel"]:
                res["worst"], res["worst_rel"] = k, rel
    res["frac_differ"] = res["elements_differ"] / max(res["elements"], 1)
    return res


def io_floor(models: list[Path], out: Path) -> float:
    """Read every tensor of the given models (pread) and write one model's bytes (an upper bound
    for passthrough, which reads and writes only the sliced layers)."""
    t = time.perf_counter()
    biggest = 0
    for m in models:
        for info in sio.scan_model(m).values():
            with open(info.file, "rb", buffering=0) as f:
                buf = os.pread(f.fileno(), info.nbytes, info.start)
            biggest = max(biggest, len(buf))
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "floor.bin", "wb") as f:
        for info in sio.scan_model(models[0]).values():
            f.write(b"\0" * info.nbytes)
    return time.perf_counter() - t


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--methods", default="linear,ties,dare_ties")
    ap.add_argument("--small", action="store_true", help="hidden 256, intermediate 1024, 4 layers, vocab 8000")
    ap.add_argument("--no-mergekit", action="store_true")
    ap.add_argument("--mergekit-bin", default=None, metavar="DIR",
                    help="directory holding mergekit-yaml (e.g. a separate venv's bin/); default: PATH")
    ap.add_argument("--keep", default=None, help="build/keep models in this dir")
    ap.add_argument("--layers", type=int, default=None, help="override the layer count (a quicker proxy at full width)")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of (floor, ours, mergekit); medians are reported")
    ap.add_argument("--workers", type=int, default=None, help="our merge's --workers (default: its own)")
    ap.add_argument("--diff", action="store_true",
                    help="compare our last round's output with mergekit's, tensor by tensor (bf16 outputs)")
    ap.add_argument("--compare", default=None, metavar="TREE",
                    help="also time another checkout's merge (alternating with ours) and check identical outputs")
    return ap


def method_rounds(name: str, cfg: Path, cfgs: dict, args, root: Path, mk_yaml, have_mk: bool) -> tuple:
    """One method's rounds: the I/O floor, ours (and --compare's tree) and mergekit, times and peak RSS of each."""
    # ours, mergekit and the I/O floor back to back, `--repeat` times: this machine's pace
    # drifts by 10-30% within minutes, so each ratio is taken within one round, and the
    # table reports medians over rounds (with the range of the per-round speedups)
    ours_s, ours_rss, mk_s, mk_rss, floors, cmp_s, same, loads = [], [], [], [], [], [], [], []
    diff = None
    for r in range(args.repeat):
        loads.append(round(os.getloadavg()[0], 1))  # a shared machine: the 1-minute load per round
        floors.append(io_floor([Path(m) for m in config_models(cfgs[name])], root / "floor"))
        # with --compare, alternate which tree goes first so that drift favours neither
        order = (None,) if not args.compare else (None, args.compare) if r % 2 == 0 else (args.compare, None)
        last = r == args.repeat - 1 and args.diff and have_mk
        # each tree writes its own directory: ours is kept for --diff in the last round
        runs = {tree: timed_merge(tree, cfg, root / (f"ours_{name}" if tree is None else f"cmp_{name}"),
                                 keep=last and tree is None, workers=args.workers) for tree in order}
        wall, rss, sha = runs[None]
        ours_s.append(wall)
        ours_rss.append(rss)
        if args.compare:
            cmp_s.append(runs[args.compare][0])
            same.append(runs[args.compare][2] == sha)
        if have_mk:
            mk_out = root / f"mk_{name}"
            shutil.rmtree(mk_out, ignore_errors=True)
            wall, rss = timed([mk_yaml, str(cfg), str(mk_out), "--random-seed", "1"])
            mk_s.append(wall)
            mk_rss.append(rss)
            if last:
                diff = diff_outputs(root / f"ours_{name}", mk_out)
                shutil.rmtree(root / f"ours_{name}", ignore_errors=True)
            shutil.rmtree(mk_out, ignore_errors=True)
    return ours_s, ours_rss, mk_s, mk_rss, floors, cmp_s, same, loads, diff


def method_row(name: str, args, have_mk: bool, ours_s, ours_rss, mk_s, mk_rss, floors, cmp_s, same, loads,
               diff) -> dict:
    """One method's record: medians over the rounds, the per-round ratios' median and range."""
    med = lambda v: float(np.median(v))  # noqa: E731
    row = {"method": name, "rounds": args.repeat, "ours_s": round(med(ours_s), 2), "ours_rss_mib": round(max(ours_rss)),
           "io_floor_s": round(med(floors), 2),
           "ours_over_floor": round(med([o / f for o, f in zip(ours_s, floors)]), 2),
           "ours_s_all": [round(x, 2) for x in ours_s], "load_1min": loads}
    if args.compare:
        ratios = [o / c for o, c in zip(ours_s, cmp_s)]
        row.update({"compare_s": round(med(cmp_s), 2), "ours_over_compare": round(med(ratios), 3),
                    "ours_over_compare_range": [round(min(ratios), 3), round(max(ratios), 3)],
                    "compare_s_all": [round(x, 2) for x in cmp_s], "identical_outputs": all(same)})
    if have_mk:
        per_round = [m / o for m, o in zip(mk_s, ours_s)]
        row.update({"mergekit_s": round(med(mk_s), 2), "mergekit_rss_mib": round(min(mk_rss)),
                    "speedup": round(med(per_round), 2),
                    "speedup_range": [round(min(per_round), 2), round(max(per_round), 2)],
                    "rss_ratio": round(max(ours_rss) / min(mk_rss), 2), "mergekit_s_all": [round(x, 2) for x in mk_s]})
    if args.diff and have_mk:
        row["diff_vs_mergekit"] = diff
    return row


def print_table(rows: list[dict]) -> None:
    print("\n| method | ours s | ours RSS MiB | mergekit s | mergekit RSS MiB | speedup (range) | RSS ratio | I/O floor s | ours/floor |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        rng = f" ({r['speedup_range'][0]}-{r['speedup_range'][1]})" if "speedup_range" in r and r["rounds"] > 1 else ""
        print(f"| {r['method']} | {r['ours_s']} | {r['ours_rss_mib']} | {r.get('mergekit_s', '-')} | "
              f"{r.get('mergekit_rss_mib', '-')} | {r.get('speedup', '-')}{rng} | {r.get('rss_ratio', '-')} | "
              f"{r['io_floor_s']} | {r['ours_over_floor']} |")


def main() -> None:
    args = build_parser().parse_args()
    args.hidden, args.intermediate, args.layers_, args.heads, args.vocab = (
        (256, 1024, 4, 4, 8000) if args.small else (1024, 4096, 14, 16, 32000))
    args.layers = args.layers or args.layers_
    root = Path(args.keep or tempfile.mkdtemp(prefix="bench_merge_"))
    if (root / "model2" / "config.json").is_file():
        models = [root / f"model{i}" for i in range(3)]
    else:
        t = time.perf_counter()
        models = make_models(root, args)
        print(f"built 3 models in {time.perf_counter() - t:.1f}s under {root}", flush=True)
    mk_yaml = shutil.which("mergekit-yaml", path=args.mergekit_bin)
    have_mk = mk_yaml is not None and not args.no_mergekit
    import yaml

    rows = []
    cfgs = configs(models, args.layers)
    for name in args.methods.split(","):
        cfg = root / f"{name}.yml"
        cfg.write_text(yaml.safe_dump(cfgs[name]))
        rounds = method_rounds(name, cfg, cfgs, args, root, mk_yaml, have_mk)
        row = method_row(name, args, have_mk, *rounds)
        rows.append(row)
        print(json.dumps(row), flush=True)
    shutil.rmtree(root / "floor", ignore_errors=True)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    print_table(rows)
    print(f"command: python scripts/bench_merge.py {' '.join(sys.argv[1:])}")
    print(f"load average: {' '.join(f'{x:.1f}' for x in os.getloadavg())} (at the end; {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
