"""Benchmark: peak memory of one `mlx_ssp rl` step (generation, then the update) at real model shapes.

Each point runs in its own process (so its peak RSS is its own): a random float32 model of mlx-lm's
qwen3 class built in memory from a config dict (real hidden / layer / head / vocab sizes for
Qwen3-0.6B and 1.7B, a cheap shape for the grid; nothing written to disk), LoRA attached as
`mlx_ssp rl` does, then ``--steps`` calls of :meth:`mlx_ssp.rl.trainer.Trainer.step` on synthetic
prompts of a set token length. A random model almost never samples EOS, so every completion is
``max_tokens`` long and the padded training length is prompt + completion - 1. The tokenizer is the
tiny trained one of :func:`mlx_ssp.testing.make_tiny_model` (ids beyond its vocabulary decode to
nothing; only the verifier sees the text, and rewards are random, which moves no memory).

Per point: MLX active memory after setup (weights + LoRA + optimizer state), the step's MLX peak in
generation and in the update (the loop's own ``peak_memory_gen_mb`` / ``peak_memory_train_mb``,
the largest over the steps), and the process's peak RSS (``ru_maxrss``: MLX's buffer cache, Python
and the libraries on top). Then the coefficients of :mod:`mlx_ssp.rl.memory` are fitted on the
grid's fit points (least squares) and its error reported on the held-out points.

    nice -n 19 python scripts/bench_rl_memory.py --out /tmp/rl_memory.jsonl            # grid + real shapes
    nice -n 19 python scripts/bench_rl_memory.py --fit /tmp/rl_memory.jsonl            # refit only
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

QWEN3 = {  # config.json of the real models (Hugging Face Qwen/Qwen3-*), weights random here
    "qwen3-0.6b": dict(hidden_size=1024, num_hidden_layers=28, intermediate_size=3072, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "qwen3-1.7b": dict(hidden_size=2048, num_hidden_layers=28, intermediate_size=6144, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    # the grid's cheap shape: Qwen3's proportions (intermediate 3x hidden, head_dim 64-128), few layers
    "small": dict(hidden_size=256, num_hidden_layers=2, intermediate_size=768, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, vocab_size=16384, tie_word_embeddings=True),
}
BASE = dict(shape="small", batch=1, group=4, prompt=64, completion=4, rank=8, lora_layers=-1, micro=8, steps=1)

# (tag, overrides of BASE): one term moved at a time; "held" points are kept out of the fit
GRID = [
    ("real", {"shape": "qwen3-0.6b", "group": 4, "prompt": 128, "micro": 4, "rank": 16}),
    ("real", {"shape": "qwen3-1.7b", "group": 2, "prompt": 64, "completion": 4, "micro": 2, "rank": 16}),
    ("fit", {}),
    ("fit", {"batch": 2}), ("fit", {"group": 8}), ("fit", {"prompt": 192}), ("fit", {"completion": 64}),
    ("fit", {"micro": 2}), ("fit", {"rank": 64}), ("fit", {"vocab": 4096}), ("fit", {"vocab": 65536}),
    ("fit", {"layers": 6}), ("fit", {"hidden": 768}), ("fit", {"prompt": 128, "vocab": 4096, "layers": 6}),
    ("held", {"batch": 2, "group": 2, "prompt": 160, "completion": 32, "micro": 2}),
    ("held", {"prompt": 128, "completion": 48, "rank": 32, "vocab": 32768}),
    ("held", {"layers": 4, "hidden": 512, "micro": 1, "group": 2, "prompt": 128}),
]


def model_config(point: dict) -> dict:
    """config.json of a point: the shape's, with the grid's size overrides (hidden, layers, vocab)."""
    cfg = {"model_type": "qwen3", "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "rope_theta": 1e6,
           **QWEN3[point["shape"]]}
    if "hidden" in point:  # heads scale with hidden at a fixed head_dim, the intermediate stays 3x
        cfg.update(hidden_size=point["hidden"], intermediate_size=3 * point["hidden"],
                   num_attention_heads=point["hidden"] // cfg["head_dim"],
                   num_key_value_heads=max(1, point["hidden"] // cfg["head_dim"] // 2))
    if "layers" in point:
        cfg["num_hidden_layers"] = point["layers"]
    if "vocab" in point:
        cfg["vocab_size"] = point["vocab"]
    return cfg


def rl_section(point: dict, tasks: str, out: str) -> dict:
    """The rl: section of a point (what `mlx_ssp rl` would read)."""
    return {"tasks": tasks, "output": out, "steps": point["steps"], "batch_size": point["batch"],
            "group_size": point["group"], "sampling": {"temperature": 1.0, "max_tokens": point["completion"]},
            "micro_batch_size": point["micro"], "lora": {"rank": point["rank"], "num_layers": point["lora_layers"]},
            "optimizer": "adamw", "progress": False, "checkpoint_every": 1000}


def _prompt_of_length(tokenizer, n: int):
    """A task whose rendered prompt has about ``n`` tokens (a word repeated: two renders give the
    template's overhead and the tokens per word)."""
    from mlx_ssp.tasks import Task, render_prompt

    def task(words: int) -> Task:
        return Task(id="p", domain="math", prompt=" ".join(["seven"] * words) + " 2+3?", answer="5", verifier="exact")

    a, b = (len(render_prompt(tokenizer, task(w), None)) for w in (1, 11))
    words = max(1, 1 + round((n - a) * 10 / max(b - a, 1)))
    return task(words), len(render_prompt(tokenizer, task(words), None))


def measure(point: dict, tok_dir: str) -> dict:
    """One point in this process: build, set up, step; the memory figures (MB = 2**20 bytes)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.qwen3 import Model, ModelArgs
    from mlx_lm.utils import load_tokenizer

    import mlx_ssp  # noqa: F401  (OpenBLAS first)
    from mlx_ssp.rl.config import RLConfig
    from mlx_ssp.rl.policy import setup_model
    from mlx_ssp.rl.trainer import Trainer
    from mlx_ssp.tasks import Task

    import gc

    gc.collect()
    mx.clear_cache()
    rss_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    active_before = mx.get_active_memory() / 2**20  # ~0: the previous point's arrays are gone
    cfg_json = model_config(point)
    mx.random.seed(0)
    model = Model(ModelArgs.from_dict(cfg_json))
    mx.eval(model.parameters())
    tokenizer = load_tokenizer(Path(tok_dir))
    base, prompt_tokens = _prompt_of_length(tokenizer, point["prompt"])
    tasks = [Task(id=f"p{i}", domain="math", prompt=base.prompt, answer="5", verifier="exact")
             for i in range(max(4, point["batch"]))]
    with tempfile.TemporaryDirectory(prefix="rlmem_") as tmp:
        rl = RLConfig.model_validate(rl_section(point, str(Path(tmp) / "t.jsonl"), tmp))
        setup_model(model, rl, 0)
        tr = Trainer(model, tokenizer, tasks, rl, Path(tmp), seed=0)
        mx.eval(model.parameters(), tr.opt.state)
        setup_mb = mx.get_active_memory() / 2**20
        params = sum(v.size for _, v in tree_flatten(model.parameters()))
        trainable = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
        recs = [tr.step() for _ in range(point["steps"])]
    return {
        **point, "config": cfg_json, "prompt_tokens": prompt_tokens, "params": params, "trainable": trainable,
        "gen_tokens": max(r["gen_tokens"] for r in recs) // (point["batch"] * point["group"]),
        "setup_mb": setup_mb, "active_before_mb": active_before,
        "peak_gen_mb": max(r["peak_memory_gen_mb"] for r in recs),
        "peak_train_mb": max(r["peak_memory_train_mb"] for r in recs),
        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "rss_start_mb": rss_start,
        "step_s": max(r["step_s"] for r in recs),
    }


# -- fitting ---------------------------------------------------------------------------------------


def attention_probe(L: int = 1024, heads: int = 4, dim: int = 64) -> dict:
    """Peak MLX memory of one causal attention, forward alone and forward + backward, in units of
    its [heads x L x L] float32 score buffer: the coefficients of the prefill and update attention
    terms (fixed in the fit: the grid's sequences are too short to pin them down)."""
    import mlx.core as mx

    q, k, v = (mx.random.normal((1, heads, L, dim)) for _ in range(3))
    mx.eval(q, k, v)
    scores = heads * L * L * 4

    def peak(fn) -> float:
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        mx.eval(fn())
        return (mx.get_peak_memory() - base) / scores

    attn = lambda q: mx.fast.scaled_dot_product_attention(q, k, v, scale=dim**-0.5, mask="causal")
    return {"forward": peak(lambda: attn(q)), "backward": peak(lambda: mx.grad(lambda q: attn(q).sum())(q))}


def fit(rows: list[dict], fixed: dict | None = None) -> dict:
    """Non-negative least-squares coefficients of :mod:`mlx_ssp.rl.memory`'s terms on the "fit" rows
    (each row's residual relative to its peak, so small and large points weigh alike)."""
    from mlx_ssp.rl import memory

    fit_rows = [r for r in rows if r["tag"] == "fit"]
    out = {}
    for phase in ("gen", "train"):
        X = np.array([memory.features(r["config"], _rl(r), phase=phase, prompt_tokens=r["prompt_tokens"])
                      for r in fit_rows], np.float64)
        base = np.array([memory.fixed_bytes(r["config"], _rl(r), phase=phase) for r in fit_rows], np.float64)
        peak = np.array([r[f"peak_{phase}_mb"] * 2**20 for r in fit_rows], np.float64)
        pinned = (fixed or {}).get(phase, {})  # {term index: coefficient} set from attention_probe
        free = [i for i in range(X.shape[1]) if i not in pinned]
        y = peak - base - sum(c * X[:, i] for i, c in pinned.items())
        coef = np.zeros(X.shape[1])
        coef[free] = _nnls(X[:, free] / peak[:, None], y / peak)
        for i, c in pinned.items():
            coef[i] = c
        out[phase] = [float(c) for c in coef]
    return out


def _nnls(A: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares by trying every subset of columns (exact; a handful of terms)."""
    import itertools

    best, best_res = np.zeros(A.shape[1]), float(np.sum(y**2))
    for k in range(1, A.shape[1] + 1):
        for cols in itertools.combinations(range(A.shape[1]), k):
            c = np.linalg.lstsq(A[:, cols], y, rcond=None)[0]
            if (c >= 0).all() and (res := float(np.sum((A[:, cols] @ c - y) ** 2))) < best_res:
                best_res, best = res, np.zeros(A.shape[1])
                best[list(cols)] = c
    return best


def _rl(r: dict) -> dict:
    return rl_section(r, "t", "o")


def report(rows: list[dict], coefs: dict | None = None) -> None:
    from mlx_ssp.rl import memory

    print(f"{'tag':5s} {'shape':11s} {'BxG':>5s} {'P':>4s} {'C':>4s} {'r':>4s} {'mb':>3s} {'V':>7s} "
          f"{'setup':>7s} {'gen':>7s} {'pred':>7s} {'err%':>6s} {'train':>7s} {'pred':>7s} {'err%':>6s} {'rss':>7s}")
    errs: dict[str, list[float]] = {}
    for r in rows:
        est = memory.predict(r["config"], _rl(r), prompt_tokens=r["prompt_tokens"], coefficients=coefs)
        eg = 100 * (est.gen_bytes / 2**20 / r["peak_gen_mb"] - 1)
        et = 100 * (est.train_bytes / 2**20 / r["peak_train_mb"] - 1)
        errs.setdefault(r["tag"], []).extend([abs(eg), abs(et)])
        print(f"{r['tag']:5s} {r['shape']:11s} {r['batch']}x{r['group']:<3d} {r['prompt_tokens']:4d} {r['completion']:4d} "
              f"{r['rank']:4d} {r['micro']:3d} {r['config']['vocab_size']:7d} {r['setup_mb']:7.0f} {r['peak_gen_mb']:7.0f} "
              f"{est.gen_bytes / 2**20:7.0f} {eg:6.1f} {r['peak_train_mb']:7.0f} {est.train_bytes / 2**20:7.0f} "
              f"{et:6.1f} {r['rss_mb']:7.0f}")
    for tag, e in errs.items():
        print(f"# {tag}: max |error| {max(e):.1f}%, mean {np.mean(e):.1f}% over {len(e)} phase peaks")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="rl_memory.jsonl", help="results (JSON lines, one per point)")
    ap.add_argument("--fit", default=None, help="refit and report an existing results file only")
    ap.add_argument("--only", default=None, help="comma-separated tags to run (fit, held, real)")
    ap.add_argument("--jobs", type=int, default=1, help="points run at once (1 for the real shapes: memory)")
    ap.add_argument("--point", default=None, help=argparse.SUPPRESS)  # child: one point as JSON
    ap.add_argument("--tok", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.point:  # one point, or a list of them run one after another in this process
        points = json.loads(a.point)
        for p in points if isinstance(points, list) else [points]:
            print(json.dumps(measure(p, a.tok)), flush=True)
        return
    if a.fit:
        rows = [json.loads(x) for x in Path(a.fit).read_text().splitlines() if x.strip()]
    else:
        rows = run_all(a)
    probe = attention_probe()
    print(f"# attention probe (L 1024, 4 heads, float32): peak / scores = {probe['forward']:.2f} forward, "
          f"{probe['backward']:.2f} forward + backward")
    pinned = {"gen": {2: probe["forward"]}, "train": {1: probe["backward"]}}
    coefs = fit(rows, pinned)
    print("# fitted coefficients (gen, train):", json.dumps(coefs))
    report(rows, coefs)
    loo_errors(rows, pinned)


def loo_errors(rows: list[dict], pinned: dict) -> None:
    """Leave-one-out: each fit point predicted by the coefficients fitted on the others."""
    from mlx_ssp.rl import memory

    fit_rows = [r for r in rows if r["tag"] == "fit"]
    errs = []
    for i, r in enumerate(fit_rows):
        coefs = fit(fit_rows[:i] + fit_rows[i + 1 :], pinned)
        est = memory.predict(r["config"], _rl(r), prompt_tokens=r["prompt_tokens"], coefficients=coefs)
        errs += [est.gen_bytes / 2**20 / r["peak_gen_mb"] - 1, est.train_bytes / 2**20 / r["peak_train_mb"] - 1]
    if errs:
        print(f"# leave-one-out over {len(fit_rows)} fit points: max |error| {100 * max(map(abs, errs)):.1f}%, "
              f"mean {100 * float(np.mean(np.abs(errs))):.1f}%")


def run_all(a) -> list[dict]:
    from mlx_ssp.io import write_jsonl_atomic
    from mlx_ssp.testing import make_tiny_model

    tags = set(a.only.split(",")) if a.only else {"fit", "held", "real"}
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.machine()} "
          f"{platform.system()}, {os.cpu_count()} cores, float32, mlx {_version('mlx')}, mlx-lm {_version('mlx-lm')}")
    # points already in --out are kept and not run again (a stopped run resumes)
    rows = [json.loads(x) for x in Path(a.out).read_text().splitlines() if x.strip()] if Path(a.out).is_file() else []
    done = [{k: r[k] for k in (*BASE, "tag", *(k for k in ("hidden", "layers", "vocab") if k in r))} for r in rows]
    with tempfile.TemporaryDirectory(prefix="rlmem_tok_") as tmp:
        tok = str(make_tiny_model(Path(tmp) / "tok", "qwen3"))
        todo = [p for p in ({**BASE, **over, "tag": tag} for tag, over in GRID) if p["tag"] in tags and p not in done]

        def one(points: list[dict]) -> list[dict]:
            res = subprocess.run([sys.executable, __file__, "--point", json.dumps(points), "--tok", tok],
                                 capture_output=True, text=True)
            got = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
            if res.returncode != 0:
                print(f"# points {points[len(got):]} failed:\n{res.stderr[-3000:]}", flush=True)
            return got

        # the real shapes one per process (their RSS is theirs); the grid's cheap points --jobs
        # processes, each running its share in turn (the MLX peaks are reset per phase by the loop
        # and every point frees its model first; the RSS of those is the process's running maximum)
        real = [[p] for p in todo if p["tag"] == "real"]
        grid = [p for p in todo if p["tag"] != "real"]
        batches = real + [grid[i :: a.jobs] for i in range(a.jobs) if grid[i :: a.jobs]]
        with ThreadPoolExecutor(a.jobs if not real else 1) as pool:
            for got in pool.map(one, batches):
                for row in got:
                    rows.append(row)
                    print(json.dumps({k: row[k] for k in ("tag", "shape", "setup_mb", "peak_gen_mb", "peak_train_mb",
                                                          "rss_mb", "step_s")}), flush=True)
                write_jsonl_atomic(a.out, rows)
    return rows


def _version(pkg: str) -> str:
    import importlib.metadata as md

    return md.version(pkg)


if __name__ == "__main__":
    main()
