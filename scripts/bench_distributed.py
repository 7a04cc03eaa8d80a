"""All-reduce cost and step-time scaling of data-parallel LoRA training over mx.distributed.

    python scripts/bench_distributed.py            # launches 1 and 2 local ranks (ring), prints a table
    python scripts/bench_distributed.py --steps 5 --batch 4 --seq 64

Model: the demo model's shape (SmolLM2-135M: 30 layers, hidden 576, 9 heads / 3 KV heads of dim 64,
FFN 1536, vocab 49152, tied embeddings) with random float32 weights (no download), LoRA rank 8 on
q/k/v/o/gate/up/down of every layer: 2,442,240 trainable parameters (9.8 MB in float32).

Measured on each run (median over repeated calls, after warm-up):
- ``allreduce``: ``mlx_ssp.distributed.average_gradients`` of the LoRA tree (mlx's bucketed all_sum,
  what an RL or SFT step pays per optimizer update), and the unbucketed per-array all_sum for
  comparison;
- ``gather``: ``all_gather_records`` of one RL step's rollout records (token ids + log-probs);
- ``step``: one optimizer step on a fixed global batch (forward, backward, gradient averaging,
  AdamW update), the global batch split across the ranks.

On a machine with few cores the ranks share the same cores, so 1 -> 2 ranks measures the
distributed overhead, not a speedup.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SMOLLM2_135M = dict(
    model_type="llama", hidden_size=576, num_hidden_layers=30, intermediate_size=1536,
    num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, vocab_size=49152,
    rope_theta=100000.0, tie_word_embeddings=True, max_position_embeddings=8192,
)
LORA_KEYS = [
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
]


def _median_ms(fn, n: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def worker(args) -> None:
    import mlx_ssp  # noqa: F401
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.models import llama
    from mlx_lm.tuner.utils import linear_to_lora_layers

    from mlx_ssp import distributed as dist

    w = dist.world()
    mx.random.seed(0)  # same base weights and LoRA init on every rank
    model = llama.Model(llama.ModelArgs(**SMOLLM2_135M))
    model.freeze()
    linear_to_lora_layers(model, SMOLLM2_135M["num_hidden_layers"],
                          {"rank": 8, "scale": 20.0, "dropout": 0.0, "keys": LORA_KEYS})
    mx.eval(model.parameters())
    params = model.trainable_parameters()
    n_params = sum(v.size for _, v in tree_flatten(params))
    # make the B matrices non-zero so the step really changes the model
    model.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.01, params))
    res: dict = {"size": w.size, "lora_params": n_params, "lora_mb": n_params * 4 / 1e6}

    grads = tree_map(lambda p: mx.random.normal(p.shape), model.trainable_parameters())
    mx.eval(grads)

    def allreduce():
        dist.average_gradients(grads)

    def allreduce_naive():
        out = tree_map(lambda g: mx.distributed.all_sum(g, group=w.group) / w.size, grads)
        mx.eval(out)

    def barrier():
        dist.barrier()

    if w.size > 1:
        res["allreduce_ms"] = _median_ms(allreduce, args.reps)
        res["allreduce_per_array_ms"] = _median_ms(allreduce_naive, args.reps)
        res["barrier_ms"] = _median_ms(barrier, args.reps)
    rng = random.Random(w.rank)
    per_rank = args.rl_records // w.size
    records = [
        {"task_id": f"t{i}", "sample": i, "tokens": [rng.randrange(49152) for _ in range(args.rl_tokens)],
         "logprobs": [-rng.random() for _ in range(args.rl_tokens)], "reward": 1.0}
        for i in range(per_rank)
    ]
    res["gather_records"] = per_rank * w.size
    res["gather_ms"] = _median_ms(lambda: dist.all_gather_records(records), max(3, args.reps // 4))

    # one data-parallel optimizer step on a fixed global batch
    data = mx.random.randint(0, SMOLLM2_135M["vocab_size"], (args.batch, args.seq + 1), key=mx.random.key(1))
    mine = data[dist.shard_bounds(args.batch, w.rank, w.size)[0]: dist.shard_bounds(args.batch, w.rank, w.size)[1]]
    opt = optim.AdamW(learning_rate=1e-4)

    def loss_fn(m, x):
        logits = m(x[:, :-1])
        return nn.losses.cross_entropy(logits, x[:, 1:], reduction="mean")

    vg = nn.value_and_grad(model, loss_fn)

    def step():
        loss, g = vg(model, mine)
        g = dist.average_gradients(g)
        opt.update(model, g)
        mx.eval(model.trainable_parameters(), opt.state, loss)

    res["step_ms"] = _median_ms(step, args.steps, warmup=1)
    res["tokens_per_step"] = args.batch * args.seq
    if w.is_main:
        Path(args.out).write_text(json.dumps(res))


def free_port_base(n: int) -> int:
    for _ in range(100):
        base = random.randint(20000, 60000)
        try:
            socks = [socket.create_server(("127.0.0.1", p)) for p in range(base, base + n)]
        except OSError:
            continue
        for s in socks:
            s.close()
        return base
    raise RuntimeError("no free ports")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="1,2", help="rank counts to launch (comma separated)")
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions of each collective")
    ap.add_argument("--steps", type=int, default=3, help="timed optimizer steps")
    ap.add_argument("--batch", type=int, default=4, help="global batch (sequences per step)")
    ap.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    ap.add_argument("--rl-records", type=int, default=64, help="rollout records gathered per RL step")
    ap.add_argument("--rl-tokens", type=int, default=256, help="tokens per rollout record")
    ap.add_argument("--threads", type=int, default=None,
                    help="OPENBLAS_NUM_THREADS for every rank (default: OpenBLAS's own choice)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return

    results = []
    for n in [int(x) for x in args.ranks.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "res.json"
            env = ["--env", f"OPENBLAS_NUM_THREADS={args.threads}"] if args.threads else []
            cmd = ["mlx.launch", "-n", str(n), "--backend", "ring", "-p", str(free_port_base(n)), *env, "--",
                   sys.executable, str(Path(__file__).resolve()), "--worker", "--out", str(out),
                   "--reps", str(args.reps), "--steps", str(args.steps), "--batch", str(args.batch),
                   "--seq", str(args.seq), "--rl-records", str(args.rl_records), "--rl-tokens", str(args.rl_tokens)]
            p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL)
            if not out.exists():
                sys.exit(f"{n} ranks failed:\n{p.stdout}\n{p.stderr}")
            results.append(json.loads(out.read_text()))

    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()} {os.cpu_count()} cores, "
          f"{platform.system()}; command: python scripts/bench_distributed.py " + " ".join(sys.argv[1:]))
    r0 = results[0]
    print(f"LoRA tree: {r0['lora_params']:,} params ({r0['lora_mb']:.1f} MB float32); "
          f"step: global batch {args.batch} x {args.seq} tokens")
    print("| ranks | all-reduce (bucketed) ms | all-reduce (per array) ms | barrier ms | gather "
          f"{args.rl_records} records ms | step ms | step vs 1 rank |")
    print("|---|---|---|---|---|---|---|")
    base = results[0]["step_ms"]
    for r in results:
        def f(k):
            return f"{r[k]:.2f}" if k in r else "-"

        print(f"| {r['size']} | {f('allreduce_ms')} | {f('allreduce_per_array_ms')} | {f('barrier_ms')} | "
              f"{f('gather_ms')} | {r['step_ms']:.0f} | {r['step_ms'] / base:.2f}x |")


if __name__ == "__main__":
    main()
