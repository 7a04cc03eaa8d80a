"""Benchmark: one MGPO-GRPO step of `mlx_ssp rl` vs mlx-lm-lora's GRPO trainer, side by side.

Same random float32 Qwen3-shaped models (built here, offline), same settings for both: batch 2
prompts, group 4, 32-token completions (min 32: EOS is suppressed for neither, so lengths vary),
temperature 0.8, LoRA rank 8 on every linear layer of every block, Adam lr 1e-5, beta 0.1 (k3 KL;
ours: reference = adapters off, theirs: a second model). Each tool runs in its own process
(`mlx_ssp rl` and `python -m mlx_lm_lora.train --train-mode grpo`) for --steps steps; we report
the median (and min: the machine is shared, the min is the least disturbed) step wall time
over the steps after the first two (warm-up), completion tokens per
second of step time (generated tokens / step time, the same definition for both), and MLX peak
memory (theirs: since process start, as it reports it; ours: the largest per-step peak).
CPU seconds per step (all threads; ours from the metrics, theirs from a second run whose
clock is swapped for process CPU time) are reported too: they suffer far less than wall time when
other jobs share the cores. mlx-lm-lora gets OpenBLAS through LD_PRELOAD (as `import mlx_ssp` does for us) so BLAS is equal.

    python -m venv /tmp/lora-venv && /tmp/lora-venv/bin/pip install "mlx[cpu]" mlx-lm-lora
    python scripts/bench_rl.py --lora-python /tmp/lora-venv/bin/python

At a real model's shape: ``--model demo`` (SmolLM2-135M, vocabulary 49,152) or any model
directory, with ``--prompt-tokens 256`` (a shared system prompt padded so that every rendered prompt
is about that long; both tools get the same one), ``--group 8 --batch 1 --max-tokens 128``. Ours
also reports the step split: generation, the reference forward (adapters off: the same cost as a
forward-only log-prob pass) and the update (forward with log-probs, backward, optimizer).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml

import mlx_ssp  # noqa: F401
from mlx_ssp._blas import loaded_path

SIZES = {  # name -> make_tiny_model kwargs (vocab 512 from the built-in tokenizer)
    "0.46M": dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=384),
    "3.3M": dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=768),
}
PAIRS = [(2, 3), (7, 4), (12, 30), (5, 9), (8, 8), (1, 6), (20, 22), (3, 14), (9, 9), (4, 11), (6, 7), (15, 5)]
PROMPTS = [f"What is {a} + {b}? Give the answer." for a, b in PAIRS]
ANSWERS = [str(a + b) for a, b in PAIRS]
# the shared system prompt at --prompt-tokens: this paragraph repeated, cut to length in tokens
SYSTEM_TEXT = ("You are a careful assistant that solves arithmetic questions. Read the question, work out the "
               "result step by step, check each step, and end with the final number on its own line. ")


@dataclass
class Shape:
    batch: int = 2
    group: int = 4
    max_tokens: int = 32
    system: Optional[str] = None  # None: each tool's own default
    warmup: int = 2
    micro_batch_size: Optional[int] = None  # ours only; None: the rl default
    ours_set: tuple = ()  # ours only: extra rl keys, ("share_prefix", False), ...


def padded_system(model: Path, n_tokens: int) -> tuple[str, list[int]]:
    """A system prompt such that the first task's rendered prompt is ``n_tokens`` long (the others
    differ by their question's length only), and every prompt's length."""
    from mlx_lm import load

    _, tok = load(str(model), lazy=True)

    def render(system: str, q: str) -> list[int]:
        return tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}],
                                       add_generation_prompt=True, tokenize=True)

    ids = tok.encode(SYSTEM_TEXT * (1 + n_tokens // 20), add_special_tokens=False)
    lo, hi = 0, len(ids)
    while lo < hi:  # the longest cut of the paragraph whose rendered prompt fits n_tokens
        mid = (lo + hi + 1) // 2
        if len(render(tok.decode(ids[:mid]), PROMPTS[0])) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    system = tok.decode(ids[:lo])
    return system, [len(render(system, q)) for q in PROMPTS]


def count_params(path: Path) -> int:
    import mlx.core as mx

    return sum(v.size for v in mx.load(str(path / "model.safetensors")).values())


def run_ours(model: Path, work: Path, steps: int, shape: Shape) -> dict:
    from mlx_ssp.tasks import Task, write_tasks

    tasks = work / "tasks.jsonl"
    write_tasks(tasks, [Task(id=f"q{i}", domain="math", prompt=p, answer=a, verifier="exact")
                        for i, (p, a) in enumerate(zip(PROMPTS, ANSWERS))])
    rl = {"tasks": str(tasks), "output": str(work / "ours"), "steps": steps, "batch_size": shape.batch,
          "group_size": shape.group, "sampling": {"temperature": 0.8, "max_tokens": shape.max_tokens},
          "lora": {"rank": 8, "num_layers": -1}, "optimizer": "adam", "learning_rate": 1e-5, "beta": 0.1,
          "progress": False, "checkpoint_every": 1000, "eps_low": 0.2, "eps_high": 0.2}
    if shape.system is not None:
        rl["system"] = shape.system
    if shape.micro_batch_size is not None:
        rl["micro_batch_size"] = shape.micro_batch_size
    rl.update(dict(shape.ours_set))
    path = work / "ours.yaml"
    path.write_text(json.dumps({"model": str(model), "seed": 0, "rl": rl}))
    subprocess.run([sys.executable, "-m", "mlx_ssp.cli", "rl", str(path), "--restart"], check=True,
                   stdout=subprocess.DEVNULL)
    rows = [json.loads(x) for x in (work / "ours" / "metrics.jsonl").read_text().splitlines()]
    rows = rows[shape.warmup:]
    med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    split = {"gen_s": med("gen_s"), "ref_s": med("ref_s"),
             "update_s": statistics.median(r["train_s"] - r["ref_s"] for r in rows),
             "peak_gen_mb": max(r["peak_memory_gen_mb"] for r in rows),
             "peak_train_mb": max(r["peak_memory_train_mb"] for r in rows)}
    return {"split": split,
        "step_s": statistics.median(r["step_s"] for r in rows),
        "min_step_s": min(r["step_s"] for r in rows),
        "cpu_s": statistics.median(r["step_cpu_s"] for r in rows),
        "gen_tok_per_step_s": statistics.median(r["gen_tokens"] / r["step_s"] for r in rows),
        "peak_mb": max(r["peak_memory_mb"] for r in rows),
        "clip_or_ratio": f"ratio_max {max(r['ratio_max'] for r in rows):.4f}",
    }


def run_theirs(python: str, model: Path, work: Path, steps: int, shape: Shape, cpu_rerun: bool = True) -> dict:
    data = work / "data"
    data.mkdir(exist_ok=True)
    recs = [{"prompt": p, "answer": a, **({"system": shape.system} if shape.system is not None else {})}
            for p, a in zip(PROMPTS, ANSWERS)]
    for name in ("train", "valid"):
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    conf = work / "lora.yaml"
    conf.write_text(json.dumps({"lora_parameters": {"rank": 8, "dropout": 0.0, "scale": 10.0}}))
    env = dict(os.environ)
    if loaded_path:
        env["LD_PRELOAD"] = loaded_path
    cmd = [python, "-m", "mlx_lm_lora.train", "--model", str(model), "--train", "--train-mode", "grpo",
           "--data", str(data), "--batch-size", str(shape.batch), "--group-size", str(shape.group),
           "--max-completion-length", str(shape.max_tokens),
           "--iters", str(steps), "--steps-per-report", "1", "--num-layers", "-1", "--temperature", "0.8",
           "--beta", "0.1", "--learning-rate", "1e-5", "--adapter-path", str(work / "theirs"),
           "--steps-per-eval", "100000", "--val-batches", "1", "--save-every", "100000", "-c", str(conf)]
    text = _run_lora(cmd, env)
    its = [float(x) for x in re.findall(r"Speed: ([\d.]+) it/s", text)]
    # the same run again with its clock swapped for process CPU time (its it/s then reads CPU s/step)
    wrap = ("import runpy, sys, time; time.perf_counter = time.process_time; sys.argv = ['mlx_lm_lora.train'] + "
            "sys.argv[1:]; runpy.run_module('mlx_lm_lora.train', run_name='__main__')")
    if cpu_rerun:
        cpu_text = _run_lora([python, "-c", wrap] + cmd[3:], env)
        cpu = [1.0 / float(x) for x in re.findall(r"Speed: ([\d.]+) it/s", cpu_text)][shape.warmup:]
    else:
        cpu = [float("nan")]
    avg_tok = [float(x) for x in re.findall(r"Avg tokens: ([\d.]+)", text)]
    mem = [float(x) for x in re.findall(r"Memory: ([\d.]+)GB", text)]
    clip = re.findall(r"Clipping:\s+low=([\d.]+), high=([\d.]+)", text)
    step_s = [1.0 / x for x in its][shape.warmup:]
    return {
        "step_s": statistics.median(step_s),
        "min_step_s": min(step_s),
        "cpu_s": statistics.median(cpu),
        "gen_tok_per_step_s": statistics.median(a * shape.batch * shape.group / s
                                                for a, s in zip(avg_tok[shape.warmup:], step_s)),
        "peak_mb": max(mem) * 1e9 / 2**20,
        "clip_or_ratio": f"clip total max {max(float(a) + float(b) for a, b in clip):.3f}" if clip else "",
    }


def _run_lora(cmd: list[str], env: dict) -> str:
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"mlx-lm-lora failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out.stdout + out.stderr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lora-python", default=None, help="python with mlx-lm-lora installed (skip theirs if absent)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--sizes", default=",".join(SIZES), help="random models to build (ignored with --model)")
    ap.add_argument("--model", default=None, help="a real model instead: 'demo' or a model directory")
    ap.add_argument("--prompt-tokens", type=int, default=None,
                    help="pad a shared system prompt so each prompt is about this long (default: each tool's own)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the medians")
    ap.add_argument("--micro-batch-size", type=int, default=None,
                    help="ours: sequences per training forward/backward (default: the rl default)")
    ap.add_argument("--ours-set", action="append", default=[], metavar="KEY=YAML",
                    help="ours: one more rl key, e.g. share_prefix=false (repeatable)")
    ap.add_argument("--no-cpu-rerun", action="store_true", help="skip mlx-lm-lora's second run that reads CPU time")
    a = ap.parse_args()
    if a.steps <= a.warmup:
        ap.error("--steps must exceed --warmup")
    from mlx_ssp.models import resolve_model
    from mlx_ssp.testing import make_tiny_model

    shape = Shape(batch=a.batch, group=a.group, max_tokens=a.max_tokens, warmup=a.warmup,
                  micro_batch_size=a.micro_batch_size,
                  ours_set=tuple((k, yaml.safe_load(v)) for k, v in (kv.split("=", 1) for kv in a.ours_set)))
    with tempfile.TemporaryDirectory(prefix="bench_rl_") as tmp:
        if a.model:
            models = [(a.model, lambda work: resolve_model(a.model))]
        else:
            models = [(name, lambda work, name=name: make_tiny_model(work / "model", "qwen3", seed=0, **SIZES[name]))
                      for name in a.sizes.split(",")]
        header = False
        for name, build in models:
            work = Path(tmp) / name.replace("/", "_")
            work.mkdir(parents=True)
            model = build(work)
            if a.prompt_tokens:
                shape.system, lens = padded_system(model, a.prompt_tokens)
                prompt_note = f"shared system prompt, prompts {min(lens)}-{max(lens)} tokens"
            else:
                prompt_note = "each tool's default system prompt"
            if not header:
                print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.machine()} "
                      f"{platform.system()}, {os.cpu_count()} cores (shared, load avg {os.getloadavg()[0]:.1f}); "
                      f"batch {shape.batch}, group {shape.group}, {shape.max_tokens} tokens, {prompt_note}, "
                      f"LoRA r8 all layers, T 0.8, beta 0.1; median step over steps {shape.warmup + 1}..{a.steps}")
                print(f"{'model':8s} {'tool':12s} {'step_s':>7s} {'min_s':>7s} {'cpu_s':>7s} {'gen_tok/s':>9s} "
                      f"{'peak_MB':>8s}  note")
                header = True
            n = count_params(model)
            res = {"mlx_ssp": run_ours(model, work, a.steps, shape)}
            if a.lora_python:
                res["mlx-lm-lora"] = run_theirs(a.lora_python, model, work, a.steps, shape, cpu_rerun=not a.no_cpu_rerun)
            for tool, r in res.items():
                print(f"{name:8s} {tool:12s} {r['step_s']:7.3f} {r['min_step_s']:7.3f} {r['cpu_s']:7.3f} "
                      f"{r['gen_tok_per_step_s']:9.1f} {r['peak_mb']:8.1f}  {r['clip_or_ratio']} ({n / 1e6:.2f}M params)")
            sp = res["mlx_ssp"]["split"]
            print(f"{name:8s} mlx_ssp split: generation {sp['gen_s']:.2f} s, reference forward {sp['ref_s']:.2f} s, "
                  f"update {sp['update_s']:.2f} s; peak {sp['peak_gen_mb']:.0f} MB generating, "
                  f"{sp['peak_train_mb']:.0f} MB training")
            if len(res) == 2:
                o, t = res["mlx_ssp"], res["mlx-lm-lora"]
                print(f"{name:8s} ratio        throughput x{t['step_s'] / o['step_s']:.2f} (median), "
                      f"x{t['min_step_s'] / o['min_step_s']:.2f} (min), x{t['cpu_s'] / o['cpu_s']:.2f} (CPU s/step), "
                      f"peak memory x{o['peak_mb'] / t['peak_mb']:.2f} (ours/theirs)")


if __name__ == "__main__":
    main()
