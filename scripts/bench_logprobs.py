"""Benchmark: chunked token_logprobs vs naive log_softmax + gather (forward + backward).

Measures, side by side in one process, for hidden [N, D] float32 and an untied float32 LM head
[V, D]: peak MLX memory and forward+backward wall time (gradient w.r.t. the hidden states, the
LoRA case: the head is frozen) of
  naive:   log_softmax(h @ W^T / T) then gather the targets (full [N x V] logits),
  chunked: mlx_ssp.rl.token_logprobs (chunks of --chunk tokens, recompute in the vjp: 3 head
           matmuls, 2 exp passes),
  saved:   the same with save_grad=True (d logp / d h rows computed in the forward; the RL
           loop's training path): two head matmuls (as naive) and one exp pass (naive: two).
Each variant runs --repeat times after one warm-up; the median is reported.

    python scripts/bench_logprobs.py                      # the target setting: 4096 x 151936 x 1024
    python scripts/bench_logprobs.py --tokens 1024 --vocab 32000 --hidden 512
"""

from __future__ import annotations

import argparse
import os
import datetime
import platform

import mlx_ssp  # noqa: F401  (OpenBLAS before mlx.core)
import mlx.core as mx
import mlx.nn as nn

from mlx_ssp.rl.logprobs import auto_chunk_size, chunk_impl_name, naive_token_logprobs, token_logprobs

from bench_kernels import measure  # scripts/ is on sys.path when this script runs


def run(fn, h, g, repeat):
    """(median time, peak memory) of the gradient of ``sum(fn(h) * g)`` w.r.t. h; first run is the warm-up."""
    return measure(mx.grad(lambda x: (fn(x) * g).sum()), (h,), repeat)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=None, help="tokens per chunk (default: auto, from a 768 MiB budget)")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--skip-naive", action="store_true")
    a = ap.parse_args()

    load0 = os.getloadavg()[0]
    mx.random.seed(0)
    head = nn.Linear(a.hidden, a.vocab, bias=False)
    head.freeze()  # the LoRA case: no head gradient
    h = mx.random.normal((a.tokens, a.hidden)) * 0.5
    targets = mx.random.randint(0, a.vocab, (a.tokens,))
    g = mx.random.normal((a.tokens,))
    mx.eval(head.parameters(), h, targets, g)

    rows = []
    t_c, m_c = run(lambda x: token_logprobs(x, head, targets, a.temperature, a.chunk), h, g, a.repeat)
    rows.append(("chunked", t_c, m_c))
    t_s, m_s = run(lambda x: token_logprobs(x, head, targets, a.temperature, a.chunk, save_grad=True), h, g, a.repeat)
    rows.append(("saved", t_s, m_s))
    if not a.skip_naive:
        t_n, m_n = run(lambda x: naive_token_logprobs(x, head, targets, a.temperature), h, g, a.repeat)
        rows.append(("naive", t_n, m_n))

    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.machine()} "
          f"{platform.system()}, mlx {mx.__version__}, device {mx.default_device()}, impl {chunk_impl_name()}")
    chunk = a.chunk or auto_chunk_size(a.vocab)
    print(f"# tokens {a.tokens}, vocab {a.vocab}, hidden {a.hidden}, float32, chunk {chunk}, T {a.temperature}, "
          f"forward+backward (grad w.r.t. hidden), median of {a.repeat}")
    print(f"{'variant':8s} {'time_s':>8s} {'peak_MB':>9s}   (load avg {load0:.1f} at start, {os.getloadavg()[0]:.1f} at end)")
    for name, t, m in rows:
        print(f"{name:8s} {t:8.3f} {m / 2**20:9.1f}")
    if not a.skip_naive:
        for name, t, m in rows[:2]:
            print(f"{name}/naive: time {t / t_n:.2f}x, peak memory {m / m_n:.3f}x (1/{m_n / max(m, 1):.1f})")


if __name__ == "__main__":
    main()
