"""mlx-lm-lora's GRPO training (``python -m mlx_lm_lora.train ...``) with each step timed from
outside; run by scripts/bench_rl.py under the python of mlx-lm-lora's own venv (this file imports
mlx-lm-lora and mlx only, never mlx_ssp).

Its trainer reports a running it/s and the process's peak memory only. This wraps two of its
module functions before running its CLI unchanged: ``generate_grpo`` (the rollouts: timed, its
tokens counted, the peak reset at its start so each step's peak is its own) and the report writer
(``tqdm.write`` in its trainer, called once per step with ``--steps-per-report 1``). A step is
generation start to report; the part after generation holds the reference log-probs (a second
model's forward, inside its loss graph) and the update, which cannot be timed apart from outside.

    python scripts/bench_rl_lora.py OUT.jsonl -- <mlx_lm_lora.train arguments>
"""

from __future__ import annotations

import json
import runpy
import sys
import time

import mlx.core as mx
import mlx_lm_lora.trainer.grpo_trainer as grpo


def main() -> None:
    out_path, rest = sys.argv[1], sys.argv[sys.argv.index("--") + 1:]
    out = open(out_path, "a")
    cur: dict = {}
    generate, write = grpo.generate_grpo, grpo.tqdm.write

    def timed_generate(*args, **kwargs):
        mx.reset_peak_memory()
        cur.update(t0=time.perf_counter(), c0=time.process_time())
        completions, texts, indices = generate(*args, **kwargs)
        cur.update(t1=time.perf_counter(), gen_tokens=int(sum(c.size for c in completions)),
                   peak_gen_mb=mx.get_peak_memory() / 2**20)
        return completions, texts, indices

    def report(msg, *args, **kwargs):
        if "Speed:" in str(msg) and "t1" in cur:  # a training step's report (not validation's)
            t, c = time.perf_counter(), time.process_time()
            out.write(json.dumps({"gen_s": cur["t1"] - cur["t0"], "ref_update_s": t - cur["t1"], "step_s": t - cur["t0"],
                                  "cpu_s": c - cur["c0"], "gen_tokens": cur["gen_tokens"],
                                  "peak_gen_mb": cur["peak_gen_mb"], "peak_mb": mx.get_peak_memory() / 2**20}) + "\n")
            out.flush()
            cur.clear()
        return write(msg, *args, **kwargs)

    grpo.generate_grpo = timed_generate
    grpo.tqdm.write = report
    sys.argv = ["mlx_lm_lora.train"] + rest
    runpy.run_module("mlx_lm_lora.train", run_name="__main__")


if __name__ == "__main__":
    main()
