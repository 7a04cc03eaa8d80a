"""Benchmark: SFT step time with length-sorted batches (what `mlx_ssp sft` uses) vs batches of
random composition, on traces of mixed length (so that long traces do not waste batches).

The records are GSM8K train solutions rendered as chat (question masked, solution trained), each
repeated 1-4 times so lengths spread from ~150 to ~1,000 tokens, as a curriculum's long-trace subset
does next to short ones. Both batchers cut the same records into batches of --batch-size and pad
each batch to mlx-lm's width rule (:func:`mlx_ssp.sft.batches.masked_batch`); "sorted" is
:func:`~mlx_ssp.sft.batches.make_masked_iterate_batches` (sorted by length, consecutive batches, the
batch order shuffled), "random" shuffles the records first. One pass over all batches each, the
same LoRA model and optimizer (a random float32 Qwen3, LoRA rank 8 on every block), the loss
:func:`~mlx_ssp.sft.loss.masked_loss` through ``nn.value_and_grad``; reported: padded tokens per
trained token, seconds per pass and per step, and trained (target) tokens per second. The two
passes alternate over --repeats rounds so that machine load hits both alike.

Sequence packing (several records per row) is not implemented: with length-sorted batches the
padding left is small (the table says how small), and packing needs a block-diagonal attention mask
that mlx-lm's models do not take.

    python scripts/bench_sft_batching.py
    python scripts/bench_sft_batching.py --quick
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import mlx_ssp  # noqa: F401  (OpenBLAS before mlx.core)
import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("MLX_SSP_SHARED", ROOT.parent / "shared")) / "data" / "gsm8k" / "train.jsonl"


def records(tok, n: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """``n`` (token ids, target mask) items of mixed length from GSM8K train."""
    rng = np.random.RandomState(seed)
    rows = [json.loads(x) for x in DATA.read_text().splitlines()[: 4 * n]]
    out = []
    for i in rng.choice(len(rows), n, replace=False):
        q, a = rows[i]["question"], rows[i]["answer"]
        reps = int(rng.randint(1, 5))  # long traces: the solution restated, 1-4 times
        prompt = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        answer = tok.encode(("\n".join([a] * reps)), add_special_tokens=False) + [tok.eos_token_id]
        out.append((list(prompt) + answer, [0] * len(prompt) + [1] * len(answer)))
    return out


def sorted_batches(items, bs: int, max_len: int, seed: int):
    from mlx_ssp.sft.batches import make_masked_iterate_batches

    return list(make_masked_iterate_batches(seed)(items, bs, max_len, loop=False))


def random_batches(items, bs: int, max_len: int, seed: int):
    from mlx_ssp.sft.batches import masked_batch

    order = np.random.RandomState(seed).permutation(len(items))
    return [masked_batch([items[j] for j in order[i: i + bs]], max_len) for i in range(0, len(order) - bs + 1, bs)]


def one_pass(model, opt, batches) -> float:
    from mlx_ssp.sft.loss import masked_loss

    step = nn.value_and_grad(model, lambda m, t, w: masked_loss(m, t, w)[0])
    t0 = time.perf_counter()
    for tokens, weights in batches:
        loss, grads = step(model, tokens, weights)
        opt.update(model, grads)
        mx.eval(loss, model.trainable_parameters(), opt.state)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--max-seq-length", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="16 records, hidden 64, one round")
    a = ap.parse_args()
    if a.quick:
        a.records, a.hidden, a.layers, a.repeats = 16, 64, 2, 1
    from mlx_lm import load
    from mlx_ssp.finetune.lora import LoRAConfig, attach_lora
    from mlx_ssp.sft.episodes import TokenDataset
    from mlx_ssp.testing import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="bench_sft_batching_") as tmp:
        path = make_tiny_model(Path(tmp) / "m", "qwen3", hidden_size=a.hidden, num_layers=a.layers,
                               intermediate_size=3 * a.hidden, seed=0)
        model, tok = load(str(path))
    items = TokenDataset(records(tok, a.records, seed=0))
    kinds = {"sorted": sorted_batches(items, a.batch_size, a.max_seq_length, 0),
             "random": random_batches(items, a.batch_size, a.max_seq_length, 0)}
    stats = {}
    if a.records % a.batch_size:
        ap.error("--records must be a multiple of --batch-size (both batchers drop a partial last batch)")
    for k, bs in kinds.items():
        padded = sum(t.size for t, _ in bs)
        trained = sum(int(w.sum().item()) for _, w in bs)
        real = sum(min(len(items[j][0]), a.max_seq_length) for j in range(len(items)))  # every record is batched
        stats[k] = {"steps": len(bs), "padded": padded, "trained": trained, "pad_frac": 1 - real / padded, "s": []}
    attach_lora(model, LoRAConfig(rank=8, num_layers=-1, scale=20.0), seed=0)
    opt = optim.Adam(learning_rate=1e-5)
    for k in kinds:  # warm-up: every batch shape seen once before timing
        one_pass(model, opt, kinds[k])
    for _ in range(a.repeats):
        for k in kinds:
            stats[k]["s"].append(one_pass(model, opt, kinds[k]))
    lens = [items.itemlen(i) for i in range(len(items))]
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.machine()} {platform.system()}, "
          f"{os.cpu_count()} cores (load avg {os.getloadavg()[0]:.1f}); {len(items)} GSM8K records of "
          f"{min(lens)}-{max(lens)} tokens (median {int(statistics.median(lens))}), batch {a.batch_size}, random "
          f"Qwen3 hidden {a.hidden} x {a.layers} layers, LoRA r8; median of {a.repeats} passes")
    print(f"{'batches':8s} {'steps':>5s} {'padding':>8s} {'pass_s':>7s} {'step_s':>7s} {'trained tok/s':>13s}")
    for k, s in stats.items():
        t = statistics.median(s["s"])
        print(f"{k:8s} {s['steps']:5d} {s['pad_frac']:8.1%} {t:7.2f} {t / s['steps']:7.3f} {s['trained'] / t:13.0f}")
    r = statistics.median(stats["random"]["s"]) / statistics.median(stats["sorted"]["s"])
    print(f"sorted is x{r:.2f} faster per pass ({stats['random']['padded'] / stats['sorted']['padded']:.2f}x fewer padded tokens)")


if __name__ == "__main__":
    main()
