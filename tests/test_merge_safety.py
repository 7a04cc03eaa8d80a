"""merge safety: OUT_DIR never deletes or writes into an input, and
every tensor of every input is accounted for (item 9)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

import mlx_ssp  # noqa: F401
import mlx.core as mx

from mlx_ssp.cli import main
from mlx_ssp.errors import UserError
from mlx_ssp.merge.config import MergeConfig, MergeStageConfig
from mlx_ssp.merge.engine import merge_models, plan_merge, run_merge

#: the subprocesses import this checkout's package, whatever their cwd
ENV = {**os.environ, "PYTHONPATH": str(Path(mlx_ssp.__file__).resolve().parents[1])}

SHAPES = {
    "model.embed_tokens.weight": (12, 8),
    "model.layers.0.mlp.down_proj.weight": (8, 8),
    "model.layers.1.mlp.down_proj.weight": (8, 8),
    "model.norm.weight": (8,),
    "lm_head.weight": (12, 8),
}


def arrays(seed: int, shapes=SHAPES) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}


def write_model(d: Path, arr: dict[str, np.ndarray], layers: int = 2, **conf) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": layers, **conf}))
    mx.save_safetensors(str(d / "model.safetensors"), {n: mx.array(v) for n, v in arr.items()},
                        metadata={"format": "pt"})
    (d / "tokenizer_config.json").write_text("{}")
    return d


def snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` (relative path -> sha256): proves nothing was deleted or added."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def write_config(path: Path, models: list[str], method: str = "linear", base: str | None = None) -> Path:
    data: dict = {"merge_method": method, "models": [{"model": m, "parameters": {"weight": 0.5}} for m in models]}
    if base:
        data["base_model"] = base
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def ws(tmp_path):
    """tmp/models/{a,b} and tmp/cfg/merge.yml merging them."""
    a = write_model(tmp_path / "models" / "a", arrays(1))
    b = write_model(tmp_path / "models" / "b", arrays(2))
    cfg = write_config(tmp_path / "cfg" / "merge.yml", [str(a), str(b)])
    return tmp_path, a, b, cfg


def cli_merge(cfg: Path, out, *flags: str):
    r = CliRunner().invoke(main, ["merge", str(cfg), str(out), "--quiet", *flags])
    return r


def refused(r, *needles: str) -> None:
    assert r.exit_code == 2, (r.exit_code, r.output, r.exception)
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in err, (n, err)


# ------------------------------------------------------------------ item 1: OUT_DIR vs the inputs


def test_out_dir_parent_of_the_models_is_refused(ws):
    root, a, b, cfg = ws
    before = snapshot(root)
    r = cli_merge(cfg, root / "models", "--overwrite")
    refused(r, f"OUT_DIR {root / 'models'}", "contains input model", str(a))
    r = cli_merge(cfg, root / "models", "--overwrite-any")
    refused(r, "contains input model")
    assert snapshot(root) == before


def test_out_dir_lora_adapter_is_refused(ws):
    root, a, b, cfg = ws
    ad = root / "adapters"
    ad.mkdir()
    mx.save_safetensors(str(ad / "adapters.safetensors"), {
        "model.layers.0.mlp.down_proj.lora_a": mx.ones((8, 2)), "model.layers.0.mlp.down_proj.lora_b": mx.ones((2, 8))})
    (ad / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "lora", "lora_parameters": {"scale": 1.0}}))
    cfg = write_config(root / "cfg" / "lora.yml", [f"{a}+{ad}", str(b)])
    before = snapshot(root)
    r = cli_merge(cfg, ad, "--overwrite")
    refused(r, f"OUT_DIR {ad}", "is the LoRA adapter of model", str(ad))
    assert snapshot(root) == before
    with pytest.raises(UserError, match="LoRA adapter"):  # the library entry point refuses it too
        run_merge(MergeConfig.model_validate(yaml.safe_load(cfg.read_text())), ad, overwrite_any=True, progress=False)
    assert snapshot(root) == before


def test_out_dir_holding_the_merge_config_is_refused(ws):
    root, a, b, cfg = ws
    (cfg.parent / "notes.txt").write_text("mine")
    before = snapshot(root)
    r = cli_merge(cfg, cfg.parent, "--overwrite")
    refused(r, f"OUT_DIR {cfg.parent}", "contains the merge config", str(cfg))
    r = cli_merge(cfg, cfg.parent, "--overwrite-any")
    refused(r, "contains the merge config")
    assert snapshot(root) == before
    # an output beside the config (inside its folder) is the ordinary case and works
    r = cli_merge(cfg, cfg.parent / "merged")
    assert r.exit_code == 0, r.output


def test_out_dir_inside_an_input_model_is_refused(ws):
    root, a, b, cfg = ws
    before = snapshot(root)
    r = cli_merge(cfg, a / "merged")
    refused(r, f"OUT_DIR {a / 'merged'}", "lies inside input model", str(a))
    assert sorted(p.name for p in a.iterdir()) == ["config.json", "model.safetensors", "tokenizer_config.json"]
    assert snapshot(root) == before


def test_symlinks_to_inputs_are_followed(ws):
    root, a, b, cfg = ws
    link = root / "link_to_a"
    link.symlink_to(a, target_is_directory=True)
    before = snapshot(root)
    r = cli_merge(cfg, link, "--overwrite")
    refused(r, str(link), "input model")
    # a model reached through a symlinked folder: replacing the folder would drop the link
    far = write_model(root / "far" / "c", arrays(3))
    holder = root / "holder"
    holder.mkdir()
    (holder / "c").symlink_to(far, target_is_directory=True)
    cfg2 = write_config(root / "cfg" / "c.yml", [str(holder / "c"), str(b)])
    refused(cli_merge(cfg2, holder, "--overwrite"), f"OUT_DIR {holder}", "contains input model")
    # weights that really live elsewhere (a hub cache's blobs): that directory is protected too
    blobs = root / "blobs"
    blobs.mkdir()
    snap = root / "snap"
    snap.mkdir()
    os.replace(b / "model.safetensors", blobs / "abc123")
    (snap / "model.safetensors").symlink_to(blobs / "abc123")
    (snap / "config.json").write_text((b / "config.json").read_text())
    cfg3 = write_config(root / "cfg" / "s.yml", [str(a), str(snap)])
    refused(cli_merge(cfg3, blobs, "--overwrite"), f"OUT_DIR {blobs}", "a directory holding files of model")
    assert (blobs / "abc123").is_file() and (a / "model.safetensors").is_file()
    assert link.is_symlink() and link.resolve() == a.resolve()


def test_out_dir_dot_is_one_line_error(ws):
    """`mlx_ssp merge c.yml . --overwrite` in the models' folder: a one-line error, nothing deleted."""
    root, a, b, cfg = ws
    before = snapshot(root)
    for flags in (["--overwrite"], ["--overwrite-any"], []):
        r = subprocess.run([sys.executable, "-m", "mlx_ssp.cli", "merge", str(cfg), ".", "--quiet", *flags],
                           capture_output=True, text=True, cwd=root / "models", env=ENV)
        assert r.returncode == 2, r.stderr
        err = r.stderr.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert ("OUT_DIR ." in err) if flags else ("already exists" in err)
    # the cwd itself, when it is no input: still refused (the merge would rename it away)
    empty = root / "elsewhere"
    empty.mkdir()
    (empty / "x.txt").write_text("x")
    r = subprocess.run([sys.executable, "-m", "mlx_ssp.cli", "merge", str(cfg), ".", "--quiet", "--overwrite-any"],
                       capture_output=True, text=True, cwd=empty, env=ENV)
    assert r.returncode == 2 and "is the working directory" in r.stderr, r.stderr
    assert (empty / "x.txt").read_text() == "x"
    assert snapshot(root) == before | {"elsewhere/x.txt": hashlib.sha256(b"x").hexdigest()}


def test_non_output_directory_needs_overwrite_any(ws):
    root, a, b, cfg = ws
    out = root / "stuff"
    out.mkdir()
    (out / "thesis.tex").write_text("precious")
    r = cli_merge(cfg, out, "--overwrite")
    refused(r, f"OUT_DIR {out}", "not a previous merge output", "--overwrite-any")
    assert (out / "thesis.tex").read_text() == "precious"
    # a previous output someone put a subdirectory into is not replaced by --overwrite either
    prev = root / "prev"
    assert cli_merge(cfg, prev).exit_code == 0
    (prev / "adapters").mkdir()
    refused(cli_merge(cfg, prev, "--overwrite"), "not a previous merge output")
    assert (prev / "adapters").is_dir()
    # explicitly told: replaced
    r = cli_merge(cfg, out, "--overwrite-any")
    assert r.exit_code == 0, r.output
    assert not (out / "thesis.tex").exists() and (out / "model.safetensors").is_file()
    # an empty directory is nothing to lose
    empty = root / "empty"
    empty.mkdir()
    assert cli_merge(cfg, empty, "--overwrite").exit_code == 0


def test_merge_refuses_an_out_dir_another_process_writes(ws):
    """OUT_DIR's lock (.NAME.lock beside it) is held for the merge: a second merge into it fails at once."""
    from mlx_ssp.io import exclusive_lock

    root, a, b, cfg = ws
    out = root / "merged"
    with exclusive_lock(root / ".merged.lock", "held"):
        refused(cli_merge(cfg, out), f"{out} is being written by another run (pid {os.getpid()}")
    assert not out.exists()
    assert cli_merge(cfg, out).exit_code == 0  # released: free again


def test_remerge_over_previous_output_is_byte_identical(ws):
    root, a, b, cfg = ws
    out = root / "merged"
    assert cli_merge(cfg, out).exit_code == 0
    first = snapshot(out)
    r = cli_merge(cfg, out, "--overwrite")
    assert r.exit_code == 0, r.output
    assert snapshot(out) == first
    assert not [p for p in root.iterdir() if p.name.startswith(".merged.")]  # no temporary left


def test_pipeline_merge_stage_reruns_over_its_output(tmp_path):
    base = write_model(tmp_path / "run" / "base", arrays(0))
    specs = [write_model(tmp_path / "run" / "sft" / d / "fused", arrays(i + 1)) for i, d in enumerate(("math", "code"))]
    out = tmp_path / "run" / "merge" / "model"
    stage = MergeStageConfig(method="ties", density=0.5)
    merge_models(specs, base, stage, out, overwrite=True, progress=False)
    first = snapshot(out)
    merge_models(specs, base, stage, out, overwrite=True, progress=False)  # a resumed run redoes the stage
    assert snapshot(out) == first
    with pytest.raises(UserError, match="lies inside input model"):
        merge_models(specs, base, stage, specs[0] / "merged", overwrite=True, progress=False)


def test_dry_run_reports_a_colliding_out_dir(ws):
    root, a, b, cfg = ws
    refused(cli_merge(cfg, root / "models", "--dry-run"), "contains input model")
    assert cli_merge(cfg, root / "new", "--dry-run").exit_code == 0
    assert not (root / "new").exists()


# ------------------------------------------------------------------ item 9: every tensor accounted for


def _cfg(models: list[Path], method="linear", base: Path | None = None) -> MergeConfig:
    data: dict = {"merge_method": method,
                  "models": [{"model": str(m), "parameters": {"weight": 0.5, "density": 0.5} if base else
                              {"weight": 0.5}} for m in models]}
    if base is not None:
        data["base_model"] = str(base)
    return MergeConfig.model_validate(data)


def test_tensor_missing_from_the_first_model_stops_the_merge(tmp_path):
    extra = {**SHAPES, "model.extra.bias": (8,)}
    a = write_model(tmp_path / "a", arrays(1))
    b = write_model(tmp_path / "b", arrays(2, extra))
    for cfg in (_cfg([a, b]), _cfg([b], "ties", base=a)):
        with pytest.raises(UserError, match=r"tensor 'model.extra.bias' is missing from model .*/a \(present in .*/b\)"):
            plan_merge(cfg)
    with pytest.raises(UserError, match="model.extra.bias"):
        run_merge(_cfg([a, b]), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_missing_tensor_names_every_model_that_lacks_it(tmp_path):
    less = {k: v for k, v in SHAPES.items() if k != "model.norm.weight"}
    a = write_model(tmp_path / "a", arrays(1))
    b = write_model(tmp_path / "b", arrays(2, less))
    c = write_model(tmp_path / "c", arrays(3, less))
    with pytest.raises(UserError, match=r"'model.norm.weight' is missing from models .*/b, .*/c \(present in .*/a\)"):
        plan_merge(_cfg([a, b, c]))


def test_lm_head_only_in_untied_models_gets_a_hint(tmp_path):
    tied = {k: v for k, v in SHAPES.items() if k != "lm_head.weight"}
    a = write_model(tmp_path / "a", arrays(1, tied), tie_word_embeddings=True)
    b = write_model(tmp_path / "b", arrays(2))
    with pytest.raises(UserError, match=r"'lm_head.weight' is missing from model .*/a .*tie_word_embeddings"):
        plan_merge(_cfg([a, b]))
    # all tied: nothing is missing, the merge runs
    c = write_model(tmp_path / "c", arrays(3, tied), tie_word_embeddings=True)
    assert {p.name for p in plan_merge(_cfg([a, c])).plans} == set(tied)


def test_layer_count_mismatch_is_an_error(tmp_path):
    three = {**SHAPES, "model.layers.2.mlp.down_proj.weight": (8, 8)}
    a = write_model(tmp_path / "a", arrays(1))
    b = write_model(tmp_path / "b", arrays(2, three), layers=3)
    for cfg in (_cfg([a, b]), _cfg([b], "ties", base=a)):
        with pytest.raises(UserError, match=r"different layer counts \(num_hidden_layers: (?=.*2 in \S*/a\b)(?=.*3 in \S*/b\b)"):
            plan_merge(cfg)
    # the configs alone disagree (same tensors): still an error
    c = write_model(tmp_path / "c", arrays(3), layers=5)
    with pytest.raises(UserError, match="different layer counts"):
        plan_merge(_cfg([a, c]))


def test_every_adapter_tensor_is_fused_or_refused(ws):
    """An adapter tensor that would not be fused (a lone lora_a, a non-LoRA tensor) stops the merge
    instead of leaving the model as if it were not there."""
    root, a, b, cfg = ws
    for name, tensors in (("lone", {"model.layers.0.mlp.down_proj.lora_a": mx.ones((8, 2))}),
                          ("extra", {"model.layers.0.mlp.down_proj.lora_a": mx.ones((8, 2)),
                                     "model.layers.0.mlp.down_proj.lora_b": mx.ones((2, 8)),
                                     "model.layers.0.mlp.down_proj.bias": mx.ones((8,))})):
        ad = root / name
        ad.mkdir()
        mx.save_safetensors(str(ad / "adapters.safetensors"), tensors)
        (ad / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "lora"}))
        with pytest.raises(UserError, match=r"adapter tensor 'model.layers.0.mlp.down_proj.(lora_a|bias)'"):
            plan_merge(_cfg([Path(f"{a}+{ad}"), b]))
