"""Benchmark: `mlx_ssp sft` LoRA step time against `mlx_lm lora`, side by side, and the probing overhead.

Same model (a random float32 Qwen3 built here), same data (GSM8K train problems as chat records,
prompt masked), same LoRA settings, batch size, learning rate and seed. Each trainer runs in its own
subprocess, alternating (mlx-lm, ours, mlx-lm, ours, ...), so machine load hits both alike. Step
time = wall time between consecutive loss reports divided by the report interval: it includes
batch building, the compiled step and reporting. Both trainers see the same batches in the same
order (same seed), and are compared on the same report windows, leaving out the first (compile)
and those that end in a checkpoint (ours probes there). Probing
overhead = probe seconds / training seconds of our run, with the real rollout engine and the
GSM8K probe split configured below (the model is random, so every completion runs to max_tokens:
the worst case).

    python scripts/bench_sft.py            # prints a table and the ratio
    python scripts/bench_sft.py --quick    # smaller, for a smoke check
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GSM8K = Path(os.environ.get("MLX_SSP_SHARED", ROOT.parent / "shared")) / "data" / "gsm8k"


def make_data(out: Path, n: int) -> Path:
    d = out / "data"
    d.mkdir(parents=True, exist_ok=True)
    with open(GSM8K / "train.jsonl") as f, open(d / "train.jsonl", "w") as g:
        for i, line in zip(range(n), f):
            r = json.loads(line)
            g.write(json.dumps({"messages": [{"role": "user", "content": r["question"]},
                                             {"role": "assistant", "content": r["answer"]}]}) + "\n")
    return d


def child_mlx_lm(a: dict) -> dict:
    """What `mlx_lm lora --train` does (load, datasets, train_model), plus a timing callback.
    (mlx_lm.lora.run would drop our callback: it replaces it with its reporting callbacks.)"""
    import types

    import numpy as np

    import mlx_ssp  # noqa: F401
    from mlx_lm import load
    from mlx_lm.lora import CONFIG_DEFAULTS, train_model
    from mlx_lm.tuner.datasets import load_dataset

    args = dict(CONFIG_DEFAULTS)
    args.update(
        model=a["model"], train=True, data=a["data"], seed=a["seed"], num_layers=a["num_layers"],
        batch_size=a["batch"], iters=a["iters"], learning_rate=a["lr"], steps_per_report=a["report"],
        steps_per_eval=10**9, save_every=10**9, adapter_path=a["work"], max_seq_length=a["max_len"],
        mask_prompt=True, lora_parameters={"rank": a["rank"], "dropout": 0.0, "scale": 20.0},
    )
    args = types.SimpleNamespace(**args)
    np.random.seed(args.seed)
    model, tok = load(args.model)
    train_set, valid_set, _ = load_dataset(args, tok)
    stamps = []

    class CB:
        def on_train_loss_report(self, info):
            stamps.append((info["iteration"], time.perf_counter()))

        def on_val_loss_report(self, info):
            pass

    tic = time.perf_counter()
    train_model(args, model, train_set, valid_set, CB())
    return {"stamps": stamps, "wall": time.perf_counter() - tic}


def child_ours(a: dict) -> dict:
    import mlx_ssp  # noqa: F401
    from mlx_ssp.models import ModelConfig
    from mlx_ssp.sft import SFTConfig, run_sft

    stamps = []

    class CB:
        def on_train_loss_report(self, info):
            stamps.append((info["iteration"], time.perf_counter()))

    cfg = SFTConfig(
        domains={"gsm8k": {"data": a["data"]}}, out_dir=a["work"], seed=a["seed"],
        lora={"rank": a["rank"], "num_layers": a["num_layers"], "scale": 20.0, "dropout": 0.0},
        learning_rate=a["lr"], iters=a["iters"], batch_size=a["batch"], max_seq_length=a["max_len"],
        report_every=a["report"], save_every=a["save_every"], val_batches=0,
        probe={"k": a["k"], "max_tasks": a["probe_tasks"], "batch_size": 64, "progress": False,
               "sampling": {"temperature": 1.0, "max_tokens": a["probe_max_tokens"]}},
    )
    run_data = {"tasks": {"domains": {"gsm8k": {"source": f"gsm8k:{GSM8K / 'test.jsonl'}",
                                                "sizes": {"probe": a["probe_tasks"]}}}}}
    tic = time.perf_counter()
    s = run_sft(cfg, ModelConfig(path=a["model"]), run_data=run_data, callbacks=[CB()], run_dir=a["work"])
    wall = time.perf_counter() - tic
    res = json.loads((Path(a["work"]) / "gsm8k" / "result.json").read_text())
    return {"stamps": stamps, "wall": wall, "result": res, "summary": s}


def windows(stamps, report: int, save_every: int) -> dict[int, float]:
    """Seconds per step of each report window, keyed by its end step. Dropped: the first window
    (it still feels the compile) and windows ending at a checkpoint (for ours the stamp comes after
    the checkpoint and probe), in both runs, so that both are measured on the same batches."""
    out = {}
    for (s0, t0), (s1, t1) in zip(stamps, stamps[1:]):
        if s1 - s0 != report or s0 == report or s1 % save_every == 0:
            continue
        out[s1] = (t1 - t0) / report
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        spec = json.loads(a.spec)
        res = (child_mlx_lm if a.child == "mlx_lm" else child_ours)(spec)
        print("RESULT " + json.dumps(res))
        return

    import mlx_ssp  # noqa: F401
    from mlx_ssp.testing import make_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="bench_sft_"))
    hidden, layers = (128, 2) if a.quick else (256, 4)
    model = make_tiny_model(tmp / "model", "qwen3", hidden_size=hidden, num_layers=layers,
                            intermediate_size=hidden * 2, num_heads=4, num_kv_heads=2)
    data = make_data(tmp, 64)
    iters = 30 if a.quick else 50
    spec = dict(model=str(model), data=str(data), seed=0, num_layers=-1, batch=4, iters=iters, lr=1e-4,
                report=5, max_len=512, rank=8, save_every=iters // 2, k=4, probe_tasks=8,
                probe_max_tokens=32 if a.quick else 64)
    runs: dict[str, list] = {"mlx_lm": [], "ours": []}
    for r in range(a.rounds):
        for who in ("mlx_lm", "ours"):
            s = dict(spec, work=str(tmp / f"{who}{r}"))
            out = subprocess.run([sys.executable, __file__, "--child", who, "--spec", json.dumps(s)],
                                 capture_output=True, text=True)
            line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
            if out.returncode or not line:
                sys.exit(f"{who} failed:\n{out.stderr[-3000:]}")
            runs[who].append(json.loads(line[-1][7:]))
    # paired: round r of mlx-lm and of ours see the same batches (same seed, same data order)
    ratios, per = [], {"mlx_lm": [], "ours": []}
    for ra, rb in zip(runs["mlx_lm"], runs["ours"]):
        wa = windows([tuple(v) for v in ra["stamps"]], spec["report"], spec["save_every"])
        wb = windows([tuple(v) for v in rb["stamps"]], spec["report"], spec["save_every"])
        common = sorted(set(wa) & set(wb))
        per["mlx_lm"] += [wa[s] for s in common]
        per["ours"] += [wb[s] for s in common]
        ratios.append(sum(wb[s] for s in common) / sum(wa[s] for s in common))
    for who in ("mlx_lm", "ours"):
        print(f"{who:7s} step time: median {statistics.median(per[who]) * 1000:.0f} ms, "
              f"mean {statistics.mean(per[who]) * 1000:.0f} ms over {len(per[who])} windows of {spec['report']} steps")
    print("ratio ours / mlx_lm (same windows, per round): " + ", ".join(f"{r:.3f}" for r in ratios)
          + f"; overall {sum(per['ours']) / sum(per['mlx_lm']):.3f}")
    for x in runs["ours"]:
        res = x["result"]
        print(f"ours: train {res['train_seconds']:.1f}s, probe {res['probe_seconds']:.1f}s "
              f"({spec['iters'] // spec['save_every']} probes x {spec['probe_tasks']} tasks x k={spec['k']}, "
              f"max_tokens {spec['probe_max_tokens']}) -> probing overhead {res['probe_overhead']:.3f} of training time")
    print(f"settings: qwen3 hidden {hidden}, {layers} layers, float32; GSM8K 64 train records, batch {spec['batch']}, "
          f"max_seq_length {spec['max_len']}, LoRA rank {spec['rank']} on all layers, {iters} iters, {a.rounds} rounds")


if __name__ == "__main__":
    main()
