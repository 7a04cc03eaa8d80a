"""Benchmark `mlx_ssp merge-lora` (adapters merged in LoRA space) against densify-merge-extract
(`mlx_ssp merge` of the fused specialists, then `mlx_ssp extract-lora` back to an adapter), side by
side in one run, on real specialists' adapters of one base.

For each method, each path runs in child processes (wall time; peak RSS of the child, the larger
of the two children for densify-merge-extract), at the same output rank. Then every output is
evaluated on the same held-out tasks with the same sampling seed (pass@1 per domain, mlx_ssp's
eval): the dense merged model itself (the reference the adapters approximate), the LoRA-space
adapter and the extracted adapter, each adapter loaded with ``mlx_lm.load(BASE, adapter_path=...)``.
The LoRA-space row also gives the merge's own time inside the process (``lora_merge.json``'s
``seconds``: the rest of its wall time is starting Python and importing mlx). ``delta err`` is the
mean over the adapted layers of ``||D_adapter - D_dense||_F / ||D_dense||_F``, where ``D_dense`` is
the dense merged model minus the base. With a bfloat16 base the dense path fuses each adapter into
bfloat16 weights, so ``D_dense`` (and the TIES / DARE trimming behind it) carries that rounding:
part of ``delta err`` is the reference's own rounding, not the adapter's error. The load average is
printed with every timing.

    python scripts/bench_merge_lora.py --adapters RUN/sft/KEY/diverse-s0/addition RUN/sft/KEY/diverse-s0/subtraction \\
        --tasks RUN/tasks/KEY/eval.jsonl --methods linear,ties --rank 16
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_merge as bm  # noqa: E402

import mlx_ssp  # noqa: F401,E402
import mlx.core as mx  # noqa: E402

from mlx_ssp.merge.methods import METHODS  # noqa: E402

CLI = [sys.executable, "-m", "mlx_ssp.cli"]


def load_avg() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def params(method: str, density: float) -> tuple[list[dict], dict]:
    """(per-model, top-level) parameters, the same for both paths: equal weights, and ``density``
    where the method takes one."""
    per_model = {"weight": 1.0, **({"density": density} if "density" in METHODS[method].model_params else {})}
    return [per_model, dict(per_model)], {"normalize": True} if method == "task_arithmetic" else {}


def layer_weights(model_dir: Path, names: list[str]) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        w = mx.load(str(f))
        out.update({k: np.array(w[k].astype(mx.float32)) for k in names if k in w})
    return out


def adapter_deltas(ad: Path) -> dict[str, np.ndarray]:
    w = {k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(ad / "adapters.safetensors")).items()}
    s = json.loads((ad / "adapter_config.json").read_text())["lora_parameters"]["scale"]
    return {k[: -len(".lora_a")] + ".weight": s * (w[k[: -1] + "b"].T @ w[k].T) for k in w if k.endswith(".lora_a")}


def delta_error(ad: Path, dense: dict[str, np.ndarray], base: dict[str, np.ndarray]) -> float:
    d = adapter_deltas(ad)
    errs = []
    for k, w in dense.items():
        ref = w - base[k]
        got = d.get(k, np.zeros_like(ref))
        errs.append(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))
    return float(np.mean(errs))


def evaluate(base: Path, tasks, args, adapter: Path | None = None, model_dir: Path | None = None) -> dict:
    import mlx_lm

    from mlx_ssp.eval import evaluate as run_eval
    from mlx_ssp.rollout.config import SamplingConfig

    model, tok = (mlx_lm.load(str(model_dir)) if model_dir else
                  mlx_lm.load(str(base), adapter_path=str(adapter)))
    sampling = SamplingConfig(temperature=args.temperature, top_p=1.0, max_tokens=args.max_tokens)
    res = run_eval(model, tok, tasks, k=args.k, n=args.k, sampling=sampling, seed=args.seed,
                   batch_size=args.batch_size, progress=False)
    return {d: v["pass@1"] for d, v in res["domains"].items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--adapters", nargs="+", required=True, help="the specialists' mlx-lm adapter directories")
    ap.add_argument("--base", default=None, help="the base model (default: the adapters' recorded 'model')")
    ap.add_argument("--tasks", required=True, help="held-out tasks (JSONL) to evaluate every output on")
    ap.add_argument("--methods", default="linear,ties")
    ap.add_argument("--rank", type=int, default=16, help="output rank of both paths")
    ap.add_argument("--density", type=float, default=0.5, help="density of the sparsifying methods")
    ap.add_argument("--k", type=int, default=8, help="samples per task (pass@1 from k samples)")
    ap.add_argument("--temperature", type=float, default=0.9)
    ap.add_argument("--max-tokens", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0, help="sampling seed of the eval and the merges' seed")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--keep", default=None, help="write the outputs here (default: a temp dir, removed)")
    args = ap.parse_args()

    from mlx_ssp.tasks import load_tasks

    ads = [Path(a).resolve() for a in args.adapters]
    base = Path(args.base or json.loads((ads[0] / "adapter_config.json").read_text())["model"])
    tasks = load_tasks(args.tasks)
    work = Path(args.keep or tempfile.mkdtemp(prefix="bench_merge_lora_"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for method in args.methods.split(","):
        per_model, top = params(method, args.density)
        lora_yml, dense_yml = work / f"{method}-lora.yml", work / f"{method}-dense.yml"
        lora_yml.write_text(yaml.safe_dump({
            "merge_method": method, "base_model": str(base), "rank": args.rank, "parameters": top or None,
            "models": [{"model": str(a), "parameters": p} for a, p in zip(ads, per_model)]}))
        dense_yml.write_text(yaml.safe_dump({
            "merge_method": method, "dtype": "float32", "parameters": top or None,
            **({} if method == "linear" else {"base_model": str(base)}),
            "models": [{"model": f"{base}+{a}", "parameters": p} for a, p in zip(ads, per_model)]}))
        out_lora, out_dense, out_ext = work / f"{method}-lora", work / f"{method}-dense", work / f"{method}-extracted"
        for d in (out_lora, out_dense, out_ext):
            shutil.rmtree(d, ignore_errors=True)
        l0 = load_avg()
        t_lora, rss_lora = bm.timed([*CLI, "merge-lora", str(lora_yml), str(out_lora), "--quiet",
                                     "--seed", str(args.seed)])
        l1 = load_avg()
        t_merge, rss_merge = bm.timed([*CLI, "merge", str(dense_yml), str(out_dense), "--quiet",
                                       "--seed", str(args.seed)])
        t_ext, rss_ext = bm.timed([*CLI, "extract-lora", str(base), str(out_dense), str(out_ext), "--rank",
                                   str(args.rank), "--quiet", "--seed", str(args.seed)])
        l2 = load_avg()
        names = sorted(adapter_deltas(out_lora))
        dense_w, base_w = layer_weights(out_dense, names), layer_weights(base, names)
        report = json.loads((out_lora / "lora_merge.json").read_text())
        print(f"{method}: lora-space {t_lora:.2f}s {rss_lora:.0f} MiB (load {l0}); densify+extract "
              f"{t_merge:.2f}+{t_ext:.2f}s {max(rss_merge, rss_ext):.0f} MiB (load {l1} -> {l2})", flush=True)
        common = {"method": method, "rank": args.rank}
        rows.append({**common, "path": "dense merged model (reference)", "wall_s": t_merge, "rss_mib": rss_merge,
                     "load": l1, "delta_err": 0.0, "svd_err": None,
                     "pass@1": evaluate(base, tasks, args, model_dir=out_dense)})
        rows.append({**common, "path": "merge-lora (LoRA space)", "wall_s": t_lora, "rss_mib": rss_lora, "load": l0,
                     "delta_err": delta_error(out_lora, dense_w, base_w), "svd_err": report["mean_rel_error"],
                     "in_process_s": report["seconds"],
                     "pass@1": evaluate(base, tasks, args, adapter=out_lora)})
        rows.append({**common, "path": "merge + extract-lora", "wall_s": t_merge + t_ext,
                     "rss_mib": max(rss_merge, rss_ext), "load": l2,
                     "delta_err": delta_error(out_ext, dense_w, base_w), "svd_err": None,
                     "pass@1": evaluate(base, tasks, args, adapter=out_ext)})
        print(f"load after the evals: {load_avg()}", flush=True)
    domains = sorted({d for r in rows for d in r["pass@1"]})
    head = "| method | path | wall s | peak RSS MiB | load (1/5/15 min) | delta err vs dense | " + \
        " | ".join(f"pass@1 {d}" for d in domains) + " |"
    print("\n" + head + "\n|" + "---|" * (6 + len(domains)))
    for r in rows:
        wall = f"{r['wall_s']:.2f}" + (f" ({r['in_process_s']:.2f} merging)" if "in_process_s" in r else "")
        passes = " | ".join(f"{r['pass@1'].get(d, float('nan')):.3f}" for d in domains)
        print(f"| {r['method']} | {r['path']} | {wall} | {r['rss_mib']:.0f} | {r['load']} | "
              f"{r['delta_err']:.3g} | {passes} |")
    print(json.dumps(rows))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
