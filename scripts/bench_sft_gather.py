"""Benchmark: SFT training time with the LM head at the weighted targets only (``sft.gather_targets``)
against the full-width head, at the quickstart's SFT settings.

The demo model (SmolLM2-135M float32, tied 49,152 x 576 head), LoRA rank 8 on the last 8 blocks,
batch 4, max_seq_length 256, Adam at 2e-4 (configs/quickstart.yaml's ``sft:`` block), on chat records
shaped like the quickstart's (an arithmetic prompt of about 60 tokens with the chat template, a
completion of about 25, the prompt masked). Each variant runs mlx-lm's ``train`` through the stage's
own batching (:func:`mlx_ssp.sft.stage.batching`) in its own subprocess, alternating, so machine load
hits all alike; a variant may run another source tree (``--tree``, e.g. the commit before the key
existed: it then runs that tree's default path). Reported: wall seconds of all iterations (compiles
of new batch shapes included, as in the stage), the median seconds per iteration after the first
``--warm`` (steady state), and the 1-minute load average around each run.

    python scripts/bench_sft_gather.py                               # gather vs full width, this tree
    python scripts/bench_sft_gather.py --tree main=/path/to/checkout  # adds that tree's default path
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

# first, at the top: loads OpenBLAS before mlx.core (the children import it; otherwise MLX's
# reference BLAS runs the matmuls, tens of times slower)
import mlx_ssp

ROOT = Path(__file__).resolve().parents[1]


def make_data(out: Path, n: int, seed: int = 0) -> Path:
    """Chat records like the quickstart's selected rollouts (two-term additions and a worked answer)."""
    import random

    rng = random.Random(seed)
    d = out / "data"
    d.mkdir(parents=True, exist_ok=True)
    rows = []
    for _ in range(n):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        prompt = (f"Calculate {a} + {b}.\n\nGive your final answer on the last line in the form:\n"
                  "Answer: <your answer>")
        answer = f"We add {a} and {b}. {a} + {b} = {a + b}, so the sum is {a + b}.\nAnswer: {a + b}"
        rows.append({"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]})
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "probe.jsonl").write_text(json.dumps({"id": "p0", "domain": "d", "prompt": "1 + 1?", "answer": "2",
                                               "verifier": "exact"}) + "\n")
    return d


def child(a: dict) -> dict:
    from mlx_ssp._blas import loaded_path

    if loaded_path is None:
        raise SystemExit("OpenBLAS is not loaded: the timing would be MLX's reference BLAS")
    import mlx.core as mx
    from mlx_lm.tuner.trainer import TrainingArgs, train

    from mlx_ssp.demo import demo_dir
    from mlx_ssp.finetune.lora import attach_lora
    from mlx_ssp.models import load_model
    from mlx_ssp.sft import SFTConfig
    from mlx_ssp.sft.data import plan_domains
    from mlx_ssp.sft.stage import batching, build_optimizer

    model, tok, _ = load_model(str(demo_dir()))
    d = Path(a["data"])
    extra = {} if a["gather"] is None else {"gather_targets": a["gather"]}
    cfg = SFTConfig(domains={"d": {"data": str(d / "train.jsonl"), "probe_tasks": str(d / "probe.jsonl")}},
                    lora={"rank": 8, "scale": 20.0, "num_layers": 8}, learning_rate=2e-4, iters=a["iters"],
                    batch_size=4, max_seq_length=256, seed=0, **extra)
    (plan,) = plan_domains(cfg, model, tok, {}, Path(a["work"]))
    attach_lora(model, cfg.lora, 0)
    stamps, losses = [], []

    class CB:
        def on_train_loss_report(self, info):
            stamps.append(time.perf_counter())
            losses.append(info["train_loss"])

        def on_val_loss_report(self, info):
            pass

    mx.random.seed(0)
    model.train()
    t0 = time.perf_counter()
    train(model=model, optimizer=build_optimizer(cfg), train_dataset=plan.train_set, training_callback=CB(),
          args=TrainingArgs(batch_size=4, iters=a["iters"], steps_per_report=1, steps_per_eval=10**9,
                            steps_per_save=10**9, max_seq_length=256, adapter_file=str(Path(a["work"]) / "a.safetensors")),
          **batching(cfg, plan, 0))
    steps = [b - x for x, b in zip([t0] + stamps, stamps)]
    return {"code": mlx_ssp.__file__, "total": stamps[-1] - t0, "first": steps[: a["warm"]], "steady": statistics.median(steps[a["warm"]:]), "losses": losses}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warm", type=int, default=10, help="iterations left out of the steady-state median")
    p.add_argument("--records", type=int, default=40)
    p.add_argument("--tree", action="append", default=[], help="NAME=PATH: also run PATH's default SFT path")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(args.child))))
        return
    variants = [(name, Path(path), None) for name, path in (t.split("=", 1) for t in args.tree)]
    variants += [("full width", ROOT, False), ("gathered", ROOT, True)]
    results: dict[str, list[dict]] = {v[0]: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix="bench_sft_gather_") as tmp:
        data = make_data(Path(tmp), args.records)
        for r in range(args.rounds):
            for name, tree, gather in variants:
                work = Path(tmp) / f"w{r}-{len(results[name])}-{abs(hash(name))}"
                work.mkdir()
                spec = {"data": str(data), "work": str(work), "iters": args.iters, "warm": args.warm, "gather": gather}
                env = {**os.environ, "PYTHONPATH": str(tree)}
                load0 = os.getloadavg()[0]
                out = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env, cwd=tree,
                                     capture_output=True, text=True)
                if out.returncode:
                    sys.exit(f"{name} failed:\n{out.stderr[-3000:]}")
                res = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))[7:])
                res["load"] = (load0 + os.getloadavg()[0]) / 2
                assert res["code"].startswith(str(tree)), (name, res["code"])  # that tree's code ran
                results[name].append(res)
                print(f"round {r + 1} {name:>12}: {res['total']:6.1f} s for {args.iters} iterations, "
                      f"{res['steady']:.3f} s/iteration steady, first {' '.join(f'{x:.1f}' for x in res['first'])} s, "
                      f"load {res['load']:.2f}, "
                      f"loss {res['losses'][0]:.4f} -> {res['losses'][-1]:.4f}", flush=True)
    print(f"\n| variant | s for {args.iters} iterations (median) | s/iteration steady (median) | load (mean) |")
    print("|---|---|---|---|")
    for name, rs in results.items():
        print(f"| {name} | {statistics.median(x['total'] for x in rs):.1f} | "
              f"{statistics.median(x['steady'] for x in rs):.3f} | {statistics.mean(x['load'] for x in rs):.2f} |")


if __name__ == "__main__":
    main()
