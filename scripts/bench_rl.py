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

    python -m venv --system-site-packages /tmp/lora-venv && /tmp/lora-venv/bin/pip install mlx-lm-lora
    python scripts/bench_rl.py --lora-python /tmp/lora-venv/bin/python
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
from pathlib import Path

import mlx_ssp  # noqa: F401
from mlx_ssp._blas import loaded_path

SIZES = {  # name -> make_tiny_model kwargs (vocab 512 from the built-in tokenizer)
    "0.46M": dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=384),
    "3.3M": dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=768),
}
PROMPTS = [f"What is {a} + {b}? Give the answer." for a, b in [(2, 3), (7, 4), (12, 30), (5, 9), (8, 8), (1, 6),
                                                                (20, 22), (3, 14), (9, 9), (4, 11), (6, 7), (15, 5)]]


def count_params(path: Path) -> int:
    import mlx.core as mx

    return sum(v.size for v in mx.load(str(path / "model.safetensors")).values())


def run_ours(model: Path, work: Path, steps: int) -> dict:
    from mlx_ssp.tasks import Task, write_tasks

    tasks = work / "tasks.jsonl"
    write_tasks(tasks, [Task(id=f"q{i}", domain="math", prompt=p, answer=str(eval(p.split("is ")[1].split("?")[0])),
                             verifier="exact") for i, p in enumerate(PROMPTS)])
    cfg = {
        "model": str(model), "seed": 0,
        "rl": {"tasks": str(tasks), "output": str(work / "ours"), "steps": steps, "batch_size": 2, "group_size": 4,
               "sampling": {"temperature": 0.8, "max_tokens": 32}, "lora": {"rank": 8, "num_layers": -1},
               "optimizer": "adam", "learning_rate": 1e-5, "beta": 0.1, "progress": False,
               "checkpoint_every": 1000, "eps_low": 0.2, "eps_high": 0.2},
    }
    path = work / "ours.yaml"
    path.write_text(json.dumps(cfg))
    subprocess.run([sys.executable, "-m", "mlx_ssp.cli", "rl", str(path), "--restart"], check=True,
                   stdout=subprocess.DEVNULL)
    rows = [json.loads(x) for x in (work / "ours" / "metrics.jsonl").read_text().splitlines()]
    rows = rows[2:]
    return {
        "step_s": statistics.median(r["step_s"] for r in rows),
        "min_step_s": min(r["step_s"] for r in rows),
        "cpu_s": statistics.median(r["step_cpu_s"] for r in rows),
        "gen_tok_per_step_s": statistics.median(r["gen_tokens"] / r["step_s"] for r in rows),
        "peak_mb": max(r["peak_memory_mb"] for r in rows),
        "clip_or_ratio": f"ratio_max {max(r['ratio_max'] for r in rows):.4f}",
    }


def run_theirs(python: str, model: Path, work: Path, steps: int) -> dict:
    data = work / "data"
    data.mkdir(exist_ok=True)
    recs = [{"prompt": p, "answer": str(eval(p.split("is ")[1].split("?")[0]))} for p in PROMPTS]
    for name in ("train", "valid"):
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    conf = work / "lora.yaml"
    conf.write_text(json.dumps({"lora_parameters": {"rank": 8, "dropout": 0.0, "scale": 10.0}}))
    env = dict(os.environ)
    if loaded_path:
        env["LD_PRELOAD"] = loaded_path
    cmd = [python, "-m", "mlx_lm_lora.train", "--model", str(model), "--train", "--train-mode", "grpo",
           "--data", str(data), "--batch-size", "2", "--group-size", "4", "--max-completion-length", "32",
           "--iters", str(steps), "--steps-per-report", "1", "--num-layers", "-1", "--temperature", "0.8",
           "--beta", "0.1", "--learning-rate", "1e-5", "--adapter-path", str(work / "theirs"),
           "--steps-per-eval", "100000", "--val-batches", "1", "--save-every", "100000", "-c", str(conf)]
    text = _run_lora(cmd, env)
    its = [float(x) for x in re.findall(r"Speed: ([\d.]+) it/s", text)]
    # the same run again with its clock swapped for process CPU time (its it/s then reads CPU s/step)
    wrap = ("import runpy, sys, time; time.perf_counter = time.process_time; sys.argv = ['mlx_lm_lora.train'] + "
            "sys.argv[1:]; runpy.run_module('mlx_lm_lora.train', run_name='__main__')")
    cpu_text = _run_lora([python, "-c", wrap] + cmd[3:], env)
    cpu = [1.0 / float(x) for x in re.findall(r"Speed: ([\d.]+) it/s", cpu_text)][2:]
    avg_tok = [float(x) for x in re.findall(r"Avg tokens: ([\d.]+)", text)]
    mem = [float(x) for x in re.findall(r"Memory: ([\d.]+)GB", text)]
    clip = re.findall(r"Clipping:\s+low=([\d.]+), high=([\d.]+)", text)
    step_s = [1.0 / x for x in its][2:]
    return {
        "step_s": statistics.median(step_s),
        "min_step_s": min(step_s),
        "cpu_s": statistics.median(cpu),
        "gen_tok_per_step_s": statistics.median(a * 2 * 4 / s for a, s in zip(avg_tok[2:], step_s)),
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
    ap.add_argument("--sizes", default=",".join(SIZES))
    a = ap.parse_args()
    from mlx_ssp.testing import make_tiny_model

    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.machine()} {platform.system()}, "
          f"{os.cpu_count()} cores (shared, load avg {os.getloadavg()[0]:.1f}); batch 2, group 4, 32 tokens, "
          f"LoRA r8 all layers, T 0.8, beta 0.1; median step over steps 3..{a.steps}")
    print(f"{'model':8s} {'tool':12s} {'step_s':>7s} {'min_s':>7s} {'cpu_s':>7s} {'gen_tok/s':>9s} {'peak_MB':>8s}  note")
    with tempfile.TemporaryDirectory(prefix="bench_rl_") as tmp:
        for name in a.sizes.split(","):
            work = Path(tmp) / name
            model = make_tiny_model(work / "model", "qwen3", seed=0, **SIZES[name])
            n = count_params(model)
            res = {"mlx_ssp": run_ours(model, work, a.steps)}
            if a.lora_python:
                res["mlx-lm-lora"] = run_theirs(a.lora_python, model, work, a.steps)
            for tool, r in res.items():
                print(f"{name:8s} {tool:12s} {r['step_s']:7.3f} {r['min_step_s']:7.3f} {r['cpu_s']:7.3f} {r['gen_tok_per_step_s']:9.1f} {r['peak_mb']:8.1f}  "
                      f"{r['clip_or_ratio']} ({n / 1e6:.2f}M params)")
            if len(res) == 2:
                o, t = res["mlx_ssp"], res["mlx-lm-lora"]
                print(f"{name:8s} ratio        throughput x{t['step_s'] / o['step_s']:.2f} (median), "
                      f"x{t['min_step_s'] / o['min_step_s']:.2f} (min), x{t['cpu_s'] / o['cpu_s']:.2f} (CPU s/step), "
                      f"peak memory x{o['peak_mb'] / t['peak_mb']:.2f} (ours/theirs)")


if __name__ == "__main__":
    main()
