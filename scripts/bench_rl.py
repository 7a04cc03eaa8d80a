"""Benchmark: one MGPO-GRPO step of `mlx_ssp rl` side by side with two MLX peers: mlx-lm-lora's
GRPO trainer and inductive-mlxrl's GRPO.

Each tool runs in its own process on the same model, prompts, batch (prompts per step), group G,
completion length (EOS is suppressed by none, so lengths vary where a model stops), LoRA rank 8 on
every linear layer of every block, float32. Two settings per model:

- ``defaults``: everything else at each tool's own default (sampling, KL beta, LoRA scale,
  optimizer, micro-batching, prompt template; ours: beta 0, so no reference pass);
- ``matched``: the same chat-rendered prompt with the same system prompt for all, T 0.8, top-p
  0.95, top-k 20 (mlx-lm-lora's training sampler, which its CLI does not change), beta 0.1 (k3 KL: ours and mlxrl switch the adapters off for the reference,
  mlx-lm-lora keeps a second model), Adam at lr 1e-5, LoRA scale 20.

Reported per tool: the median (and min: the machine is shared, the min is the least disturbed)
step wall time over the steps after the warm-up, CPU seconds per step (all threads; they suffer far
less than wall time when other jobs share the cores), completion tokens per second of step time
(generated tokens / step time, the same definition for all), each step's MLX peak memory (the
largest over the measured steps), and the step split: generation / reference / update (ours from
its metrics; mlxrl from scripts/bench_rl_mlxrl.py, which calls its training loop's three
functions in its order; mlx-lm-lora: generation / reference + update, from
scripts/bench_rl_lora.py, which times its generation function and its per-step report from
outside: its reference forward runs inside its loss graph). The peers get OpenBLAS through
LD_PRELOAD (as `import mlx_ssp` does for us) so BLAS is equal.

Each peer lives in its own venv; one that is not given or not installed is skipped with a note:

    python -m venv /tmp/lora-venv && /tmp/lora-venv/bin/pip install "mlx[cpu]" mlx-lm-lora==5.10.2
    python -m venv /tmp/mlxrl-venv && /tmp/mlxrl-venv/bin/pip install "mlx[cpu]" mlx-lm inductive-mlxrl==0.2.4
    python scripts/bench_rl.py --model demo --batch 1 --group 4 --max-tokens 256 --steps 3 --warmup 1 \
        --lora-python /tmp/lora-venv/bin/python --mlxrl-python /tmp/mlxrl-venv/bin/python --json bench_rl.json

(mlxrl declares mlx and mlx-lm only for Apple Silicon: on Linux install them by name.) Models:
``--model demo`` (SmolLM2-135M, vocabulary 49,152), ``--model qwen3-0.6b`` (Qwen3-0.6B's
architecture from its config, random float32 weights, built offline with the demo model's tokenizer:
its 151,936-row vocabulary is the real one, the tokenizer's 49,152 ids are a subset and the other
ids decode to nothing), any model directory, or without ``--model`` the small random ``--sizes``.
``--prompt-tokens N`` pads the shared system prompt (matched setting) so every prompt is about N
tokens. Before a model is built or loaded, our step's peak is predicted by the memory model
(mlx_ssp.rl.memory, as ``mlx_ssp doctor``) and a shape over ``--memory-limit-gb`` (default: this
machine's memory) is refused in one line. ``--json`` writes every figure with the shape, load
averages, versions, date and command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

import mlx_ssp  # noqa: F401  (loads OpenBLAS before mlx)
from mlx_ssp._blas import loaded_path
from mlx_ssp.doctor import machine_memory_bytes
from mlx_ssp.errors import UserError
from mlx_ssp.io import write_json_atomic
from mlx_ssp.rl import memory

HERE = Path(__file__).resolve().parent
SIZES = {  # name -> make_tiny_model kwargs (vocab 512 from the built-in tokenizer)
    "0.46M": dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=384),
    "3.3M": dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=768),
}
#: real architectures built with random weights: make_tiny_model kwargs (Qwen3-0.6B's config.json)
ARCHS = {
    "qwen3-0.6b": dict(hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8, intermediate_size=3072,
                       tie_word_embeddings=True,
                       config_overrides={"head_dim": 128, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                                         "vocab_size": 151936, "max_position_embeddings": 40960}),
}
PAIRS = [(2, 3), (7, 4), (12, 30), (5, 9), (8, 8), (1, 6), (20, 22), (3, 14), (9, 9), (4, 11), (6, 7), (15, 5)]
PROMPTS = [f"What is {a} + {b}? Give the answer." for a, b in PAIRS]
ANSWERS = [str(a + b) for a, b in PAIRS]
# the shared system prompt of the matched setting: this paragraph, cut to --prompt-tokens if given
SYSTEM_TEXT = ("You are a careful assistant that solves arithmetic questions. Read the question, work out the "
               "result step by step, check each step, and end with the final number on its own line. ")
#: the matched setting's sampling and objective, for every tool
MATCHED = dict(temperature=0.8, top_p=0.95, top_k=20, beta=0.1, learning_rate=1e-5, scale=20.0)
SETTINGS = ("defaults", "matched")


@dataclass(frozen=True)
class Peer:
    module: str  # what its venv must import
    dist: str  # its package on the registry
    option: str  # the bench's option naming its python
    install: str  # how to make its venv


PEERS = {
    "mlx-lm-lora": Peer("mlx_lm_lora", "mlx-lm-lora", "--lora-python",
                        'python -m venv /tmp/lora-venv && /tmp/lora-venv/bin/pip install "mlx[cpu]" mlx-lm-lora==5.10.2'),
    "mlxrl": Peer("mlxrl", "inductive-mlxrl", "--mlxrl-python",
                  'python -m venv /tmp/mlxrl-venv && /tmp/mlxrl-venv/bin/pip install "mlx[cpu]" mlx-lm inductive-mlxrl==0.2.4'),
}


@dataclass
class Shape:
    batch: int = 2
    group: int = 4
    max_tokens: int = 32
    settings: str = "matched"
    system: Optional[str] = None  # the matched setting's system prompt
    warmup: int = 2
    micro_batch_size: Optional[int] = None  # ours only; None: the rl default
    ours_set: tuple = ()  # ours only: extra rl keys, ("share_prefix", False), ...
    prompts: list = field(default_factory=lambda: list(PROMPTS))


def peer_version(python: Optional[str], peer: Peer) -> tuple[Optional[str], str]:
    """(the peer's installed version, "") or (None, why it is skipped): a missing interpreter or a
    venv without the package is a note, never a traceback."""
    if not python:
        return None, f"not given ({peer.option}; install: {peer.install})"
    probe = (f"import importlib.metadata as m, importlib.util as u; "
             f"print(m.version({peer.dist!r}) if u.find_spec({peer.module!r}) else '')")
    try:
        out = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{python} does not run ({type(e).__name__}: {e})"
    version = out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else ""
    if not version:
        return None, f"{python} has no {peer.module} package (install: {peer.install})"
    return version, ""


def chat_system(model: Path, n_tokens: Optional[int]) -> tuple[str, list[int]]:
    """The matched setting's system prompt (SYSTEM_TEXT, or with ``n_tokens`` cut so that the first
    task's rendered prompt is that long) and every rendered prompt's length."""
    from mlx_lm import load

    _, tok = load(str(model), lazy=True)
    render = lambda system, q: render_chat(tok, system, q)  # noqa: E731
    if not n_tokens:
        return SYSTEM_TEXT.strip(), [len(render(SYSTEM_TEXT.strip(), q)) for q in PROMPTS]
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


def render_chat(tok, system: str, question: str, tokenize: bool = True):
    return tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": question}],
                                   add_generation_prompt=True, tokenize=tokenize)


def count_params(path: Path) -> int:
    import mlx.core as mx

    return sum(v.size for f in sorted(path.glob("*.safetensors")) for v in mx.load(str(f)).values())


def ours_rl(work: Path, steps: int, shape: Shape) -> dict:
    """Our rl: section for this shape and setting (our defaults for everything the setting leaves out)."""
    rl = {"tasks": str(work / "tasks.jsonl"), "output": str(work / "ours"), "steps": steps, "batch_size": shape.batch,
          "group_size": shape.group, "sampling": {"max_tokens": shape.max_tokens}, "lora": {"rank": 8, "num_layers": -1},
          "progress": False, "checkpoint_every": 1000}
    if shape.settings == "matched":
        rl["sampling"].update(temperature=MATCHED["temperature"], top_p=MATCHED["top_p"], top_k=MATCHED["top_k"])
        rl["lora"]["scale"] = MATCHED["scale"]
        rl.update(optimizer="adam", learning_rate=MATCHED["learning_rate"], beta=MATCHED["beta"], system=shape.system)
    if shape.micro_batch_size is not None:
        rl["micro_batch_size"] = shape.micro_batch_size
    rl.update(dict(shape.ours_set))
    return rl


def run_ours(model: Path, work: Path, steps: int, shape: Shape) -> dict:
    from mlx_ssp.tasks import Task, write_tasks

    write_tasks(work / "tasks.jsonl", [Task(id=f"q{i}", domain="math", prompt=p, answer=a, verifier="exact")
                                       for i, (p, a) in enumerate(zip(PROMPTS, ANSWERS))])
    path = work / "ours.yaml"
    path.write_text(json.dumps({"model": str(model), "seed": 0, "rl": ours_rl(work, steps, shape)}))
    subprocess.run([sys.executable, "-m", "mlx_ssp.cli", "rl", str(path), "--restart"], check=True,
                   stdout=subprocess.DEVNULL)
    rows = [json.loads(x) for x in (work / "ours" / "metrics.jsonl").read_text().splitlines()][shape.warmup:]
    steps_ = [{"step_s": r["step_s"], "cpu_s": r["step_cpu_s"], "gen_tokens": r["gen_tokens"], "gen_s": r["gen_s"],
               "ref_s": r["ref_s"], "update_s": r["train_s"] - r["ref_s"], "peak_mb": r["peak_memory_mb"],
               "peak_gen_mb": r["peak_memory_gen_mb"], "peak_train_mb": r["peak_memory_train_mb"]} for r in rows]
    return summarize(steps_, ("gen_s", "ref_s", "update_s"))


def _peer_env() -> dict:
    env = dict(os.environ)
    if loaded_path:
        env["LD_PRELOAD"] = loaded_path
    return env


def _run_peer(name: str, cmd: list[str], cwd: Path) -> str:
    out = subprocess.run(cmd, env=_peer_env(), capture_output=True, text=True, cwd=cwd)
    if out.returncode != 0:
        raise RuntimeError(f"{name} failed (exit {out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out.stdout


def run_lora(python: str, model: Path, work: Path, steps: int, shape: Shape) -> dict:
    data = work / "data"
    data.mkdir(exist_ok=True)
    system = {"system": shape.system} if shape.settings == "matched" else {}
    recs = [{"prompt": p, "answer": a, **system} for p, a in zip(PROMPTS, ANSWERS)]
    # no valid.jsonl: its validation (a generation and a loss at the first and the last step) is skipped
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    log = work / "lora_steps.jsonl"
    log.unlink(missing_ok=True)
    cmd = [python, str(HERE / "bench_rl_lora.py"), str(log), "--", "--model", str(model), "--train",
           "--train-mode", "grpo", "--data", str(data), "--batch-size", str(shape.batch),
           "--group-size", str(shape.group), "--max-completion-length", str(shape.max_tokens), "--iters", str(steps),
           "--steps-per-report", "1", "--num-layers", "-1", "--adapter-path", str(work / "lora"),
           "--save-every", "100000"]
    if shape.settings == "matched":
        conf = work / "lora.yaml"
        conf.write_text(json.dumps({"lora_parameters": {"rank": 8, "dropout": 0.0, "scale": MATCHED["scale"]}}))
        cmd += ["--temperature", str(MATCHED["temperature"]), "--beta", str(MATCHED["beta"]), "--learning-rate", str(MATCHED["learning_rate"]), "-c", str(conf)]
    _run_peer("mlx-lm-lora", cmd, work)
    rows = [json.loads(x) for x in log.read_text().splitlines()][shape.warmup:]
    return summarize(rows, ("gen_s", "ref_update_s"))


def run_mlxrl(python: str, model: Path, work: Path, steps: int, shape: Shape) -> dict:
    spec = {"model": str(model), "answers": ANSWERS, "steps": steps, "batch": shape.batch,
            "group_size": shape.group, "max_tokens": shape.max_tokens, "rank": 8, "prompts": PROMPTS}
    if shape.settings == "matched":
        from mlx_lm import load

        _, tok = load(str(model), lazy=True)
        spec.update(MATCHED, use_chat_template=False,
                    prompts=[render_chat(tok, shape.system, q, tokenize=False) for q in PROMPTS])
    (work / "mlxrl.json").write_text(json.dumps(spec))
    text = _run_peer("mlxrl", [python, str(HERE / "bench_rl_mlxrl.py"), str(work / "mlxrl.json")], work)
    rows = [json.loads(x) for x in text.splitlines() if x.startswith("{")][shape.warmup:]
    return summarize(rows, ("gen_s", "ref_s", "update_s"))


def summarize(rows: list[dict], split: tuple[str, ...]) -> dict:
    """Medians over the measured steps (min of the step time; the largest peak)."""
    med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    return {"steps": len(rows), "step_s": med("step_s"), "min_step_s": min(r["step_s"] for r in rows),
            "cpu_s": med("cpu_s"), "gen_tokens": med("gen_tokens"),
            "tok_per_s": statistics.median(r["gen_tokens"] / r["step_s"] for r in rows),
            "peak_mb": max(r["peak_mb"] for r in rows), "peak_gen_mb": max(r["peak_gen_mb"] for r in rows),
            "split": {k: med(k) for k in split}, "per_step": rows}


def build_model(spec: str, work: Path) -> tuple[Path, dict]:
    """(model directory, config.json) of ``spec``: a random architecture of ARCHS or SIZES is built
    in ``work`` (reused when already there), 'demo' or a directory resolved."""
    from mlx_ssp.models import resolve_model
    from mlx_ssp.testing import make_tiny_model

    if spec in ARCHS or spec in SIZES:
        out = work / "model"
        if not (out / "model.safetensors").is_file():
            if spec in ARCHS:
                make_tiny_model(out, "qwen3", seed=0, tokenizer_dir=resolve_model("demo"), **ARCHS[spec])
            else:
                make_tiny_model(out, "qwen3", seed=0, **SIZES[spec])
        path = out
    else:
        path = resolve_model(spec)
    return path, json.loads((path / "config.json").read_text())


def arch_config(spec: str) -> Optional[dict]:
    """config.json of a random architecture before building it (None for other specs)."""
    if spec not in ARCHS:
        return None
    a = ARCHS[spec]
    return {"hidden_size": a["hidden_size"], "num_hidden_layers": a["num_layers"],
            "intermediate_size": a["intermediate_size"], "num_attention_heads": a["num_heads"],
            "num_key_value_heads": a["num_kv_heads"], "tie_word_embeddings": a["tie_word_embeddings"],
            "torch_dtype": "float32", **a["config_overrides"]}


def preflight(name: str, config: dict, rl: dict, prompt_tokens: int, limit_bytes: float) -> None:
    """Refuse a shape whose predicted step peak (ours, float32 on the CPU) is over the limit."""
    est = memory.predict(config, rl, prompt_tokens=prompt_tokens, dtype="float32")
    if est.peak_bytes > limit_bytes:
        raise UserError(f"{name}: refused before loading: mlx_ssp's step is predicted to peak at "
                        f"{est.peak_bytes / 2**30:.1f} GiB (mlx_ssp.rl.memory, {prompt_tokens}-token prompts), over the "
                        f"limit of {limit_bytes / 2**30:.1f} GiB (--memory-limit-gb)")


def markdown(report: dict) -> str:
    """The JSON's runs as one markdown table per model and setting: figure | each tool | ours / the
    fastest peer (by tokens per second)."""
    out = [f"{report['date']}, {report['machine']}; `{report['command']}`"]
    groups: dict = {}
    for r in report["runs"]:
        groups.setdefault((r["model"], r["settings"]), {})[r["tool"]] = r
    for (model, setting), res in groups.items():
        tools = list(res)
        peers = [t for t in tools if t != "mlx_ssp"]
        best = max(peers, key=lambda t: res[t]["tok_per_s"]) if peers else None
        sh = res[tools[0]]["shape"]
        out += ["", f"**{model}, {setting}** (batch {sh['batch']}, G {sh['group']}, {sh['max_tokens']} tokens; "
                f"median of {res[tools[0]]['steps']} measured step(s))", "",
                "| figure | " + " | ".join(tools) + (f" | ratio vs {best} (>1: ours faster; memory: ours/theirs) |"
                                                     if best else " |"),
                "|---" * (len(tools) + 1 + bool(best)) + "|"]
        rows = [("step time, median (s)", lambda r: r["step_s"], "{:.1f}", True),
                ("step time, min (s)", lambda r: r["min_step_s"], "{:.1f}", True),
                ("CPU s per step", lambda r: r["cpu_s"], "{:.1f}", True),
                ("completion tokens per step", lambda r: r["gen_tokens"], "{:.0f}", None),
                ("CPU s per completion token", lambda r: r["cpu_s"] / r["gen_tokens"], "{:.3f}", True),
                ("completion tokens/s", lambda r: r["tok_per_s"], "{:.2f}", False),
                ("peak MLX memory (MB)", lambda r: r["peak_mb"], "{:,.0f}", None),
                ("generation (s)", lambda r: r["split"].get("gen_s"), "{:.1f}", None),
                ("reference (s)", lambda r: r["split"].get("ref_s"), "{:.1f}", None),
                ("update (s)", lambda r: r["split"].get("update_s"), "{:.1f}", None),
                ("reference + update, not split (s)", lambda r: r["split"].get("ref_update_s"), "{:.1f}", None),
                ("load average (before-after)", lambda r: "{}-{}".format(*r["load"]), "{}", None)]
        for name, get, fmt, lower_better in rows:
            vals = [get(res[t]) for t in tools]
            cells = ["" if v is None else fmt.format(v) for v in vals]
            ratio = ""
            if best and get(res["mlx_ssp"]) is not None and get(res[best]) is not None and name.startswith(
                    ("step time", "CPU", "completion tokens/s", "peak")):
                o, b = get(res["mlx_ssp"]), get(res[best])
                ratio = f"x{(b / o if lower_better else o / b):.2f}"
                if name.startswith("peak"):
                    ratio = f"x{o / b:.2f}"
            out.append(f"| {name} | " + " | ".join(cells) + (f" | {ratio} |" if best else " |"))
    return "\n".join(out)


def load1() -> float:
    return round(os.getloadavg()[0], 2)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for peer in PEERS.values():
        ap.add_argument(peer.option, default=None, help=f"python with {peer.dist} installed (skipped if absent)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--sizes", default=",".join(SIZES), help="random models to build (ignored with --model)")
    ap.add_argument("--model", default=None,
                    help=f"'demo', a random architecture ({', '.join(ARCHS)}) or a model directory")
    ap.add_argument("--settings", default="matched", choices=[*SETTINGS, "both"],
                    help="peers at their own defaults, at matched settings, or both (in that order)")
    ap.add_argument("--prompt-tokens", type=int, default=None,
                    help="pad the matched setting's system prompt so each prompt is about this long")
    ap.add_argument("--batch", type=int, default=2, help="prompts per step")
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the medians")
    ap.add_argument("--micro-batch-size", type=int, default=None,
                    help="ours: sequences per training forward/backward (default: the rl default)")
    ap.add_argument("--ours-set", action="append", default=[], metavar="KEY=YAML",
                    help="ours: one more rl key, e.g. share_prefix=false (repeatable)")
    ap.add_argument("--memory-limit-gb", type=float, default=None,
                    help="refuse a shape whose predicted peak is over this (default: this machine's memory)")
    ap.add_argument("--work", default=None, help="working directory (kept; a random model built there is reused)")
    ap.add_argument("--json", default=None, help="write every figure here")
    ap.add_argument("--report", default=None, metavar="JSON", help="print an earlier run's JSON as markdown tables")
    return ap


def find_peers(a: argparse.Namespace) -> dict:
    """The peers whose python was given and has the package: name -> (python, version)."""
    peers = {}
    for name, peer in PEERS.items():
        version, why = peer_version(getattr(a, peer.option[2:].replace("-", "_")), peer)
        if version:
            peers[name] = (getattr(a, peer.option[2:].replace("-", "_")), version)
        else:
            print(f"# {name} skipped: {why}")
    return peers


def prepare_model(spec: str, work: Path, a: argparse.Namespace, limit: float):
    """Build (or reuse) one model and its matched system prompt, refusing a shape predicted over the memory limit."""
    probe = Shape(batch=a.batch, group=a.group, max_tokens=a.max_tokens)
    cfg = arch_config(spec)
    if cfg is not None:  # a random architecture: refuse before building it
        preflight(spec, cfg, ours_rl(work, a.steps, probe), a.prompt_tokens or 64, limit)
    model, cfg = build_model(spec, work)
    system, lens = chat_system(model, a.prompt_tokens)
    preflight(spec, cfg, ours_rl(work, a.steps, probe), max(lens), limit)
    return model, system, lens


def print_ratios(setting: str, res: dict) -> None:
    """Our throughput, CPU per token and peak memory against each peer's."""
    others = [t for t in res if t != "mlx_ssp"]
    if others:
        o = res["mlx_ssp"]
        best = max(others, key=lambda t: res[t]["tok_per_s"])
        for t in others:
            print(f"{setting:9s} ratio vs {t:12s} throughput x{o['tok_per_s'] / res[t]['tok_per_s']:.2f} "
                  f"(tok/s), x{res[t]['cpu_s'] / o['cpu_s'] * o['gen_tokens'] / res[t]['gen_tokens']:.2f} "
                  f"(CPU s per token), peak memory x{o['peak_mb'] / res[t]['peak_mb']:.2f} (ours/theirs)"
                  + ("  <- fastest peer" if t == best else ""))


def run_setting(a: argparse.Namespace, setting: str, spec: str, n: int, model: Path, system: str, lens: list[int],
                work: Path, peers: dict, ours_set: tuple, report: dict) -> None:
    """Every tool at one setting on one model: a line each, the JSON rewritten after each, then the ratios."""
    shape = Shape(batch=a.batch, group=a.group, max_tokens=a.max_tokens, settings=setting,
                  system=system, warmup=a.warmup, micro_batch_size=a.micro_batch_size, ours_set=ours_set)
    runs = [("mlx_ssp", lambda w: run_ours(model, w, a.steps, shape))]
    if "mlx-lm-lora" in peers:
        runs.append(("mlx-lm-lora", lambda w: run_lora(peers["mlx-lm-lora"][0], model, w, a.steps, shape)))
    if "mlxrl" in peers:
        runs.append(("mlxrl", lambda w: run_mlxrl(peers["mlxrl"][0], model, w, a.steps, shape)))
    res = {}
    for tool, fn in runs:
        w = work / setting / tool
        w.mkdir(parents=True, exist_ok=True)
        before = load1()
        r = fn(w)
        r.update(tool=tool, model=spec, params=n, settings=setting, load=[before, load1()],
                 shape={"batch": a.batch, "group": a.group, "max_tokens": a.max_tokens,
                        "matched_prompt_tokens": [min(lens), max(lens)]})
        res[tool] = r
        report["runs"].append({k: v for k, v in r.items()})
        split = ", ".join(f"{k} {v:.2f}" for k, v in r["split"].items())
        print(f"{setting:9s} {tool:12s} {r['step_s']:8.2f} {r['min_step_s']:8.2f} {r['cpu_s']:8.2f} "
              f"{r['tok_per_s']:7.2f} {r['peak_mb']:8.0f} {before:4.1f}-{load1():4.1f}  {split}", flush=True)
        if a.json:
            write_json_atomic(a.json, report)
    print_ratios(setting, res)


def main(argv: Optional[list[str]] = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.report:
        print(markdown(json.loads(Path(a.report).read_text())))
        return 0
    if a.steps <= a.warmup:
        ap.error("--steps must exceed --warmup")
    limit = a.memory_limit_gb * 2**30 if a.memory_limit_gb else (machine_memory_bytes() or float("inf"))
    peers = find_peers(a)
    settings = list(SETTINGS) if a.settings == "both" else [a.settings]
    ours_set = tuple((k, yaml.safe_load(v)) for k, v in (kv.split("=", 1) for kv in a.ours_set))
    report = {"date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
              "command": shlex.join([sys.executable, *sys.argv]), "machine": f"{platform.machine()} {platform.system()}, "
              f"{os.cpu_count()} cores", "peers": {n: v for n, (_, v) in peers.items()}, "matched": MATCHED, "runs": []}
    models = [a.model] if a.model else a.sizes.split(",")
    with tempfile.TemporaryDirectory(prefix="bench_rl_") as tmp:
        root = Path(a.work or tmp)
        refused = 0
        for spec in models:
            work = root / spec.replace("/", "_")
            work.mkdir(parents=True, exist_ok=True)
            try:
                model, system, lens = prepare_model(spec, work, a, limit)
            except UserError as e:
                print(f"bench_rl: {e}")
                refused += 1
                continue
            n = count_params(model)
            print(f"# {report['date']}, {report['machine']}; model {spec} ({n / 1e6:.1f}M params, float32); "
                  f"batch {a.batch}, G {a.group}, {a.max_tokens} tokens, LoRA r8 all layers; matched prompts "
                  f"{min(lens)}-{max(lens)} tokens; median over steps {a.warmup + 1}..{a.steps}")
            print(f"{'settings':9s} {'tool':12s} {'step_s':>8s} {'min_s':>8s} {'cpu_s':>8s} {'tok/s':>7s} "
                  f"{'peak_MB':>8s} {'load':>10s}  split")
            for setting in settings:
                run_setting(a, setting, spec, n, model, system, lens, work, peers, ours_set, report)
        if a.json:
            write_json_atomic(a.json, report)
        return 2 if refused == len(models) else 0


if __name__ == "__main__":
    sys.exit(main())
