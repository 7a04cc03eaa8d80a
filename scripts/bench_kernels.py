"""Benchmark: custom kernels vs the plain-MLX reference, side by side in one process.

Two measurements, each forward + backward, median of --repeat runs after one warm-up, with MLX peak
memory above the inputs:
  sls:    the per-chunk op, selective_log_softmax(logits [tokens, V], targets, T), gradient w.r.t.
          the logits (this is what token_logprobs calls per chunk);
  chunked: token_logprobs(hidden [tokens, D], head [V, D], ...) gradient w.r.t. hidden (the RL case).
for every implementation that can run here: "reference" always; "metal" / "cuda" when available.
On a machine without Metal or CUDA only the reference runs and the script says so.

    python scripts/bench_kernels.py                               # 4096 x 151936, float32 and bfloat16
    python scripts/bench_kernels.py --tokens 1024 --vocab 32000 --dtypes float32 --what sls
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import mlx_ssp  # noqa: F401  (OpenBLAS before mlx.core)
import mlx.core as mx
import mlx.nn as nn

from mlx_ssp.rl import kernels as K
from mlx_ssp.rl.kernels import dispatch as KD
from mlx_ssp.rl.logprobs import token_logprobs

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def measure(fn, args, repeat):
    times, peaks = [], []
    for i in range(repeat + 1):
        mx.synchronize()
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        t0 = time.perf_counter()
        out = fn(*args)
        mx.eval(out)
        dt = time.perf_counter() - t0
        if i:  # the first run is the warm-up (and, for a kernel, its JIT compile)
            times.append(dt)
            peaks.append(mx.get_peak_memory() - base)
        del out
    return statistics.median(times), max(peaks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--what", default="sls,chunked", help="comma list of: sls, chunked")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()

    impls = ["reference"] + [b for b in K.BACKENDS if KD._PROBES[b]()]
    info = K.available()
    now = datetime.datetime.now(datetime.timezone.utc)
    print(f"# {now:%Y-%m-%d %H:%M} UTC, {platform.machine()} {platform.system()}, "
          f"mlx {mx.__version__}, device {mx.default_device()}, kernels: {info['backend']} ({info['reason']})")
    if impls == ["reference"]:
        print("# no Metal or CUDA back-end here: only the reference runs (no kernel figures from this machine)")
    print(f"# tokens {a.tokens}, vocab {a.vocab}, hidden {a.hidden}, chunk {a.chunk}, T {a.temperature}, "
          f"forward+backward, median of {a.repeat}")
    print(f"{'op':8s} {'dtype':9s} {'impl':10s} {'time_s':>8s} {'peak_MB':>9s} "
          f"{'vs_ref_time':>11s} {'vs_ref_mem':>10s}")

    mx.random.seed(0)
    targets = mx.random.randint(0, a.vocab, (a.tokens,)).astype(mx.int32)
    g = mx.random.normal((a.tokens,))
    for dname in a.dtypes.split(","):
        dtype = DTYPES[dname]
        for what in a.what.split(","):
            if what == "sls":
                x = (mx.random.normal((a.tokens, a.vocab)) * 3.0).astype(dtype)
                mx.eval(x)
                args = (x,)

                def make(impl):
                    return mx.grad(lambda x: (K.selective_log_softmax_on(impl, x, targets, a.temperature) * g).sum())
            elif what == "chunked":
                head = nn.Linear(a.hidden, a.vocab, bias=False)
                head.set_dtype(dtype)
                h = (mx.random.normal((a.tokens, a.hidden)) * 0.5).astype(dtype)
                mx.eval(head.parameters(), h)
                args = (h,)

                def make(impl, head=head):
                    def f(h):
                        with K.use_mode(impl):
                            return (token_logprobs(h, head, targets, a.temperature, a.chunk) * g).sum()

                    return mx.grad(f)
            else:
                raise SystemExit(f"--what: unknown {what!r}")
            ref = None
            for impl in impls:
                t, m = measure(make(impl), args, a.repeat)
                ref = ref or (t, m)
                print(f"{what:8s} {dname:9s} {impl:10s} {t:8.3f} {m / 2**20:9.1f} "
                      f"{t / ref[0]:11.2f} {m / max(ref[1], 1):10.2f}")
            del args
            mx.clear_cache()


if __name__ == "__main__":
    main()
