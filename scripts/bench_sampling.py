"""Benchmark: one decoding step's parts on the demo model, the sampler before and after, side by side.

For each batch size: the forward pass of one token after GSM8K prompts (up to ``--prompt-tokens``),
mlx-lm's normalisation (``logits - logsumexp``), and the sampler's parts at the quickstart's
settings (T ``--temperature``, top-p ``--top-p``) on the step's real log-probs:

- before: the sampler of ``--baseline DIR`` (a checkout of an earlier commit; its
  ``mlx_ssp/sampling.py`` is loaded on its own): top-p filter, whole noise rows + argmax, and the
  behaviour log-prob's tempered ``mx.logsumexp``;
- after: this tree's :func:`mlx_ssp.sampling.nucleus_draw` (threshold, noise at the kept tokens,
  argmax) and :func:`mlx_ssp.sampling.tempered_logsumexp`.

Both draw with the same keys; the script checks that the tokens and the log-sum-exps are
bit-identical. Times are medians of ``--repeats`` ``mx.eval``-ed runs after one warm-up.

    python scripts/bench_sampling.py --baseline /tmp/base --batch 4 32 128 256
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

import mlx_ssp  # noqa: F401  (OpenBLAS before mlx.core)

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402


def timed(fn, repeats: int) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def load_baseline(root: Path):
    spec = importlib.util.spec_from_file_location("baseline_sampling", root / "mlx_ssp" / "sampling.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def real_prompts(tok, batch: int, prompt_tokens: int) -> mx.array:
    """(batch, L) token ids of GSM8K questions in the chat template (the shared data; synthetic
    questions without it), all cut to the shortest so that no row is padded."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_rollout import gsm8k_tasks

    from mlx_ssp.tasks import render_prompt

    ids = [render_prompt(tok, t) for t in gsm8k_tasks(batch)]
    n = min(prompt_tokens, *(len(i) for i in ids))
    return mx.array([i[-n:] for i in ids])


def step_inputs(model, tok, batch: int, prompt_tokens: int, seed: int):
    """A KV cache of real prompts, the next token's logits and log-probs, and the step's keys."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    x = real_prompts(tok, batch, prompt_tokens)
    mx.eval(model(x[:, :-1], cache=cache))
    y = x[:, -1:]

    def forward():
        out = model(y, cache=cache)[:, -1, :]
        mx.eval(out)
        for c in cache:
            c.offset -= 1
        return out

    logits = forward()
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.eval(logprobs)
    keys = np.random.default_rng(seed).integers(0, 2**32, (batch, 2), dtype=np.uint64).astype(np.uint32)
    return forward, logits, logprobs, keys


def one_batch(model, tok, base, batch: int, args) -> dict:
    from mlx_ssp import sampling

    T, p, n = args.temperature, args.top_p, args.repeats
    forward, logits, lp, keys = step_inputs(model, tok, batch, args.prompt_tokens, seed=batch)
    vocab, mkeys = lp.shape[-1], mx.array(keys)

    def before_draw():
        g = base._gumbel_rows(vocab)(mkeys)
        return mx.argmax(base.top_p_filter(lp, p) + T * g, axis=-1)

    def before_lse():
        return mx.logsumexp(lp * (1.0 / T), axis=-1, keepdims=True)

    same_tokens = mx.array_equal(before_draw(), sampling.nucleus_draw(lp, p, keys, T)).item()
    a, b = np.array(before_lse()), np.array(sampling.tempered_logsumexp(lp, T))
    return {
        "batch": batch,
        "forward_s": timed(forward, n),
        "mlx_lm_normalise_s": timed(lambda: mx.eval(logits - mx.logsumexp(logits, axis=-1, keepdims=True)), n),
        "before_top_p_s": timed(lambda: mx.eval(base.top_p_filter(lp, p)), n),
        "before_noise_argmax_s": timed(lambda: mx.eval(mx.argmax(lp + T * base._gumbel_rows(vocab)(mkeys), axis=-1)), n),
        "before_draw_s": timed(lambda: mx.eval(before_draw()), n),
        "before_tempered_lse_s": timed(lambda: mx.eval(before_lse()), n),
        "after_draw_s": timed(lambda: mx.eval(sampling.nucleus_draw(lp, p, keys, T)), n),
        "after_tempered_lse_s": timed(lambda: mx.eval(sampling.tempered_logsumexp(lp, T)), n),
        "identical_tokens": bool(same_tokens),
        "identical_lse": bool(np.array_equal(a.view(np.uint32), b.view(np.uint32))),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", type=Path, required=True, help="checkout of the commit to compare against")
    ap.add_argument("--model", default="demo")
    ap.add_argument("--batch", type=int, nargs="+", default=[4, 32, 128, 256])
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--temperature", type=float, default=0.9)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    from mlx_ssp.models import load_model

    model, tok, _ = load_model(args.model)
    base = load_baseline(args.baseline)
    rows = []
    for b in args.batch:
        rows.append(one_batch(model, tok, base, b, args))
        print(json.dumps(rows[-1]), flush=True)
    print("| batch | forward | mlx-lm normalise | draw before (top-p / noise+argmax) | draw after | "
          "tempered lse before | after | same tokens, lse |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['forward_s']:.3f} | {r['mlx_lm_normalise_s']:.3f} | {r['before_draw_s']:.3f} "
              f"({r['before_top_p_s']:.3f} / {r['before_noise_argmax_s']:.3f}) | {r['after_draw_s']:.3f} | "
              f"{r['before_tempered_lse_s']:.3f} | {r['after_tempered_lse_s']:.3f} | "
              f"{r['identical_tokens']}, {r['identical_lse']} |")


if __name__ == "__main__":
    main()
