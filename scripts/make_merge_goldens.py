"""Write the golden references of ``mlx_ssp merge`` against mergekit 0.1.5 (tests/goldens/merge/).

Run once by a developer; the files are checked in and ``tests/test_merge_goldens.py`` compares our
merges with them on every run, without torch or mergekit. It builds small Llama-shaped models
deterministically (float32 and bfloat16: a base, three fine-tunes with dense and sparse task
vectors, and a model whose BPE tokenizer was trained on other text), writes one mergekit YAML per
case (every method and option we claim: filters, gradients, slices, tokenizer surgery), runs
mergekit 0.1.5's ``run_merge`` on each in a subprocess of mergekit's own venv, and stores the
inputs, the YAMLs, mergekit's outputs and a manifest (versions, date, sha256 of every file).

mergekit needs torch, so it lives in its own venv, never in this project's::

    python3 -m venv /tmp/mkvenv
    /tmp/mkvenv/bin/pip install mergekit==0.1.5        # pulls torch (CPU is enough)
    python scripts/make_merge_goldens.py --mergekit-python /tmp/mkvenv/bin/python

Without ``--mergekit-python`` the script makes that venv itself (``--venv DIR``, default a new
temporary directory) with the two commands above.

Methods whose draw is random (dare_*, della*) cannot match mergekit element for element (its masks
come from torch's global generator): their cases use density 1, where both are deterministic, and
DELLA's keep rate per magnitude-rank quartile of mergekit's ``della_magprune`` is stored for a
statistical comparison. The TIES-family cases in bfloat16 are also run with mergekit's sorts made
stable (``*_stable``): bf16 task vectors have exactly tied magnitudes, which torch's unstable CPU
sort breaks its own way, and the stable twin shows that ties are the only difference.

A rerun with the same versions writes the same bytes, except for the manifest's date and the
``tokenizer_union`` and ``tokenizer_section`` outputs: mergekit numbers a union's new tokens in the
order of a hash map that differs between processes (the tests match rows by token string, so any
run's output serves). ``pip install mergekit==0.1.5`` takes the newest torch and transformers it
allows; the manifest records the versions used (``versions``), and installing those reproduces the
stored float32 outputs of the whole-tensor-sum methods, whose last bits depend on torch (and the
CPU it runs on).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import yaml
from tokenizers import AddedToken, Tokenizer

import mlx_ssp  # noqa: F401  (loads OpenBLAS before mlx.core)
import mlx.core as mx

from mlx_ssp.io import atomic_dir, write_json_atomic
from mlx_ssp.testing import make_tiny_model, train_tokenizer

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "tests" / "goldens" / "merge"
DTYPES = ("float32", "bfloat16")
SHAPE = {"hidden_size": 16, "num_layers": 3, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 16,
         "tie_word_embeddings": False}
TOOL = "<tool_call>"
#: DELLA's keep-rate statistic: a (rows, cols) tensor, density, epsilon, torch seeds averaged over
DELLA = {"shape": (128, 200), "density": 0.4, "epsilon": 0.2, "draws": 16}

# Runs inside mergekit's venv: each case through mergekit's run_merge, then DELLA's keep rates.
DRIVER = r'''
import importlib.metadata as md, json, sys, types
import numpy as np, torch, yaml
from safetensors.numpy import load_file
import mergekit.sparsify as sp
from mergekit.config import MergeConfiguration
from mergekit.merge import MergeOptions, run_merge

job = json.load(open(sys.argv[1]))
real = sp.torch
stable = types.ModuleType("torch_stable")
stable.__dict__.update(torch.__dict__)
stable.argsort = lambda w, descending=False, **k: torch.sort(w, descending=descending, stable=True, **k).indices
stable.sort = lambda w, descending=False, **k: torch.sort(w, descending=descending, stable=True, **k)
for case in job["cases"]:
    sp.torch = stable if case["stable_sort"] else real
    cfg = MergeConfiguration.model_validate(yaml.safe_load(open(case["config"])))
    run_merge(cfg, case["out"], options=MergeOptions(quiet=True, random_seed=0, write_model_card=False))
sp.torch = real
d = job["della"]
x32 = torch.from_numpy(load_file(d["input"])["x"])
rates = {}
for dt in ("float32", "bfloat16"):
    x = x32.to(getattr(torch, dt))
    mag = x.float().abs().numpy()
    ranks = np.argsort(np.argsort(mag, axis=1, kind="stable"), axis=1)
    q = ranks * 4 // mag.shape[1]
    kept = np.zeros(4)
    for s in range(d["draws"]):
        torch.manual_seed(s)
        m = (sp.della_magprune(x, d["density"], d["epsilon"]) != 0).numpy()
        kept += [m[q == i].mean() for i in range(4)]
    rates[dt] = [float(v) for v in kept / d["draws"]]
json.dump({"della_keep_rates": rates,
           "versions": {p: md.version(p) for p in ("mergekit", "torch", "transformers", "tokenizers")}},
          open(job["result"], "w"), indent=2)
'''


def sha256(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def load_weights(d: Path) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update({k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(f)).items()})
    return out


def write_model(d: Path, arrays: dict[str, np.ndarray], dt: str, tok_dir: Path, conf: dict) -> None:
    """``arrays`` stored in ``dt`` (bf16: rounded to nearest even by MLX) with a Llama config.json
    mergekit recognises and the tokenizer files of ``tok_dir``."""
    d.mkdir(parents=True)
    stored = {k: mx.array(v).astype(getattr(mx, dt)) for k, v in arrays.items()}
    mx.save_safetensors(str(d / "model.safetensors"), stored, metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps({**conf, "architectures": ["LlamaForCausalLM"], "torch_dtype": dt},
                                              indent=2, sort_keys=True) + "\n")
    for f in sorted(tok_dir.iterdir()):
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, d / f.name)


def build_inputs(root: Path, scratch: Path) -> None:
    """inputs/DT/{base,ft1,ft2,ft3} and inputs/float32/tok. Task vectors share a common direction
    (model_stock's cosines are then well away from 0); ft2 and ft3 change only part of each tensor,
    so that ram has unique and shared changes and bf16 deltas have exact zeros."""
    base_dir = make_tiny_model(scratch / "base", "llama", vocab_size=300, seed=0, **SHAPE)
    conf = json.loads((base_dir / "config.json").read_text())
    base = load_weights(base_dir)
    rng = np.random.default_rng(20261206)
    common = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in base.items()}
    fts = []
    for keep in (1.0, 0.5, 0.6):
        ft = {}
        for k, v in base.items():
            d = 0.02 * common[k] + 0.03 * rng.standard_normal(v.shape).astype(np.float32)
            ft[k] = (v + d * (rng.random(v.shape) < keep)).astype(np.float32)
        fts.append(ft)
    for dt in DTYPES:
        for name, arrays in zip(("base", "ft1", "ft2", "ft3"), [base] + fts):
            write_model(root / "inputs" / dt / name, arrays, dt, base_dir, conf)
    # another tokenizer: trained on other text plus an added special token (shared tokens mostly
    # get other ids); the same layer shapes, its own random weights
    tb = train_tokenizer(scratch / "tb", vocab_size=300, corpus=["zebra xylophone quantum jazz"] * 50)
    t = Tokenizer.from_file(str(tb / "tokenizer.json"))
    t.add_special_tokens([AddedToken(TOOL, special=True, normalized=False)])
    t.save(str(tb / "tokenizer.json"))
    tok_dir = make_tiny_model(scratch / "tok", "llama", tokenizer_dir=tb, seed=1, **SHAPE)
    write_model(root / "inputs" / "float32" / "tok", load_weights(tok_dir), "float32", tok_dir,
                json.loads((tok_dir / "config.json").read_text()))


def m(dt: str, name: str, **params) -> dict:
    e = {"model": f"inputs/{dt}/{name}"}
    if params:
        e["parameters"] = params
    return e


def cases() -> dict[str, dict]:
    """name -> mergekit YAML (paths relative to the goldens directory). A case named ``*_stable``
    is run with mergekit's sorts made stable; its config is its twin's."""
    out = {}
    mlp_filter = [{"filter": "mlp", "value": 0.3}, {"value": 0.9}]
    for dt in DTYPES:
        b = f"inputs/{dt}/base"
        c = {
            "linear": {"models": [m(dt, "ft1", weight=[0.2, 0.7]), m(dt, "ft2", weight=1.0),
                                  m(dt, "ft3", weight=[{"filter": "self_attn", "value": 0.3}, {"value": 0.5}])]},
            "task_arithmetic": {"base_model": b, "parameters": {"lambda": 0.9},
                                "models": [m(dt, "ft1", weight=0.6), m(dt, "ft2", weight=0.4),
                                           m(dt, "ft3", weight=[0.1, 0.5, 0.3])]},
            "ties": {"base_model": b, "models": [m(dt, "ft1", weight=0.6, density=0.5),
                                                 m(dt, "ft2", weight=mlp_filter, density=0.3),
                                                 m(dt, "ft3", weight=0.5, density=[0.2, 0.8])]},
            "dare_linear": {"base_model": b, "models": [m(dt, "ft1", weight=0.6, density=1.0),
                                                        m(dt, "ft2", weight=0.4, density=1.0)]},
            "dare_ties": {"base_model": b, "models": [m(dt, "ft1", weight=0.6, density=1.0),
                                                      m(dt, "ft2", weight=-0.4, density=1.0),
                                                      m(dt, "ft3", weight=0.5, density=1.0)]},
            "breadcrumbs": {"base_model": b, "models": [m(dt, "ft1", weight=0.6, density=0.6, gamma=0.05),
                                                        m(dt, "ft2", weight=0.4, density=0.5)]},
            "breadcrumbs_ties": {"base_model": b, "models": [m(dt, "ft1", weight=0.6, density=0.6, gamma=0.05),
                                                             m(dt, "ft2", weight=0.4, density=0.5),
                                                             m(dt, "ft3", weight=0.5, density=0.7)]},
            "della": {"base_model": b, "models": [m(dt, "ft1", weight=0.6, density=1.0),
                                                  m(dt, "ft2", weight=0.4, density=1.0)]},
            "della_linear": {"base_model": b, "models": [m(dt, "ft1", weight=0.6, density=1.0),
                                                         m(dt, "ft3", weight=0.5, density=1.0)]},
            "slerp": {"base_model": b, "models": [m(dt, "ft1")], "parameters": {"t": [0.1, 0.5, 0.9]}},
            "slerp_filter": {"base_model": b, "models": [m(dt, "ft2")],
                             "parameters": {"t": [{"filter": "self_attn", "value": 0.3}, {"value": 0.8}]}},
            "nuslerp": {"models": [m(dt, "ft1", weight=0.3), m(dt, "ft2", weight=0.7)]},
            "nuslerp_row_wise": {"models": [m(dt, "ft1", weight=0.4), m(dt, "ft3", weight=0.6)],
                                 "parameters": {"nuslerp_flatten": False, "nuslerp_row_wise": True}},
            "multislerp": {"models": [m(dt, "ft1", weight=0.2), m(dt, "ft2", weight=0.5), m(dt, "ft3", weight=0.3)]},
            "karcher": {"models": [m(dt, "ft1"), m(dt, "ft2"), m(dt, "ft3")]},
            "model_stock": {"base_model": b, "models": [m(dt, "ft1"), m(dt, "ft2"), m(dt, "ft3")]},
            "model_stock_filter_wise": {"base_model": b, "models": [m(dt, "ft1"), m(dt, "ft3")],
                                        "parameters": {"filter_wise": True}},
            "sce": {"base_model": b, "models": [m(dt, "ft1"), m(dt, "ft2"), m(dt, "ft3")]},
            "sce_topk": {"base_model": b, "models": [m(dt, "ft1"), m(dt, "ft2"), m(dt, "ft3")],
                         "parameters": {"select_topk": 0.3}},
            "nearswap": {"base_model": b, "models": [m(dt, "ft1")], "parameters": {"t": 0.02}},
            "arcee_fusion": {"base_model": b, "models": [m(dt, "ft1")]},
            "ram": {"base_model": b, "models": [m(dt, "ft2"), m(dt, "ft3")]},
            "ramplus_tl": {"base_model": b, "models": [m(dt, "ft2"), m(dt, "ft3")],
                           "parameters": {"r": 0.3, "alpha": 0.5}},
            "passthrough_slices": {"slices": [{"sources": [{"model": f"inputs/{dt}/ft1", "layer_range": [0, 2]}]},
                                              {"sources": [{"model": f"inputs/{dt}/ft2", "layer_range": [1, 3]}]}]},
        }
        variants = {"slerp_filter": "slerp", "nuslerp_row_wise": "nuslerp", "model_stock_filter_wise": "model_stock",
                    "sce_topk": "sce", "passthrough_slices": "passthrough"}
        for name, cfg in c.items():
            out[f"{name}-{dt}"] = {"merge_method": variants.get(name, name), **cfg, "dtype": dt}
        if dt == "bfloat16":
            for name in ("ties", "breadcrumbs", "breadcrumbs_ties"):
                out[f"{name}_stable-{dt}"] = out[f"{name}-{dt}"]
    f32 = "float32"
    out["tokenizer_union-float32"] = {
        "merge_method": "linear", "dtype": f32, "tokenizer_source": "union",
        "models": [m(f32, "ft1", weight=0.3), m(f32, "tok", weight=0.7)]}
    out["tokenizer_base-float32"] = {
        "merge_method": "task_arithmetic", "dtype": f32, "tokenizer_source": "base", "base_model": f"inputs/{f32}/base",
        "models": [m(f32, "ft1", weight=0.5), m(f32, "tok", weight=0.3)]}
    out["tokenizer_model-float32"] = {
        "merge_method": "linear", "dtype": f32, "tokenizer_source": f"inputs/{f32}/tok",
        "models": [m(f32, "ft1", weight=0.4), m(f32, "tok", weight=0.6)]}
    out["tokenizer_section-float32"] = {
        "merge_method": "linear", "dtype": f32,
        "tokenizer": {"source": "union", "pad_to_multiple_of": 16,
                      "tokens": {TOOL: {"source": {"kind": "zero"}},
                                 "<|im_end|>": {"source": f"inputs/{f32}/tok", "force": True}}},
        "models": [m(f32, "ft1", weight=0.3), m(f32, "ft2", weight=0.2), m(f32, "tok", weight=0.5)]}
    return out


#: of mergekit's output, what the tests read besides the weights (TOKENIZER_FILES: tokenizer cases)
KEEP = ("config.json",)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def make_venv(venv: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "mergekit==0.1.5"], check=True)
    return venv / "bin" / "python"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mergekit-python", type=Path, help="a Python with mergekit 0.1.5 installed")
    ap.add_argument("--venv", type=Path, help="where to make that venv when --mergekit-python is not given")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    py = args.mergekit_python or make_venv(args.venv or Path(tempfile.mkdtemp(prefix="mkvenv-")))
    with tempfile.TemporaryDirectory() as scratch, atomic_dir(args.out, overwrite=True) as root:
        scratch = Path(scratch)
        build_inputs(root, scratch)
        rng = np.random.default_rng(8)
        (root / "della").mkdir()
        mx.save_safetensors(str(root / "della" / "input.safetensors"),
                            {"x": mx.array(rng.standard_normal(DELLA["shape"]).astype(np.float32))})
        job = {"cases": [], "result": str(scratch / "result.json"),
               "della": {**DELLA, "input": str(root / "della" / "input.safetensors")}}
        all_cases = cases()
        (root / "cases").mkdir()
        for name, cfg in all_cases.items():
            (root / "cases" / f"{name}.yml").write_text(yaml.safe_dump(cfg, sort_keys=False))
            job["cases"].append({"config": f"cases/{name}.yml", "out": str(scratch / "mk" / name),
                                 "stable_sort": name.split("-")[0].endswith("_stable")})
        (scratch / "job.json").write_text(json.dumps(job))
        subprocess.run([str(py), "-c", DRIVER, str(scratch / "job.json")], cwd=root, check=True)
        for name in all_cases:
            src, dst = scratch / "mk" / name, root / "expected" / name
            dst.mkdir(parents=True)
            keep = KEEP + (TOKENIZER_FILES if name.startswith("tokenizer") else ())
            for f in sorted(src.iterdir()):
                if f.suffix == ".safetensors" or f.name in keep:
                    shutil.copy(f, dst / f.name)
        result = json.loads((scratch / "result.json").read_text())
        files = sorted(p for p in root.rglob("*") if p.is_file())
        write_json_atomic(root / "manifest.json", {
            "generator": "scripts/make_merge_goldens.py",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "versions": result["versions"],
            "cases": sorted(all_cases),
            "della": {**DELLA, "input": "della/input.safetensors", "mergekit_keep_rates": result["della_keep_rates"]},
            "sha256": {str(p.relative_to(root)): sha256(p) for p in files},
        })
    size = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(f"{len(all_cases)} cases written to {args.out} ({size / 2**20:.2f} MiB)")


if __name__ == "__main__":
    main()
