"""Model resolution: local directories load; every bad spec is one line on stderr and exit 2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from mlx_ssp.cli import main
from mlx_ssp.errors import UserError
from mlx_ssp.models import ModelConfig, load_model, names_a_model, resolve_model


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the real console entry point in a fresh process (env vars like HF_HUB_OFFLINE are read
    at import time by huggingface_hub, so they need a new interpreter)."""
    return subprocess.run(
        [sys.executable, "-m", "mlx_ssp.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


def _assert_one_line_error(r, *needles: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    err = r.stderr.strip()
    assert "Traceback" not in err, err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("error: "), err
    for n in needles:
        assert n in err, (n, err)


def test_resolve_local_dir(tiny_qwen3):
    assert resolve_model(str(tiny_qwen3)) == tiny_qwen3.resolve()
    r = CliRunner().invoke(main, ["models", "resolve", str(tiny_qwen3)])
    assert r.exit_code == 0, r.output
    assert r.output.strip() == str(tiny_qwen3.resolve())


def test_resolve_relative_and_home_paths(tiny_qwen3, monkeypatch):
    monkeypatch.chdir(tiny_qwen3.parent)
    assert resolve_model(f"./{tiny_qwen3.name}") == tiny_qwen3.resolve()
    assert resolve_model(f" {tiny_qwen3.name} ") == tiny_qwen3.resolve()  # stray whitespace from YAML/shell
    monkeypatch.setenv("HOME", str(tiny_qwen3.parent))
    assert resolve_model(f"~/{tiny_qwen3.name}") == tiny_qwen3.resolve()


def test_load_model_returns_working_model(tiny_qwen3):
    import mlx.core as mx

    model, tok, path = load_model(str(tiny_qwen3))
    assert path == tiny_qwen3.resolve()
    ids = tok.encode("What is 2 + 3?")
    logits = model(mx.array([ids]))
    assert logits.shape == (1, len(ids), model.args.vocab_size)
    assert logits.dtype == mx.float32

    model16, _, _ = load_model(ModelConfig(path=str(tiny_qwen3), dtype="bfloat16"))
    assert model16.model.embed_tokens.weight.dtype == mx.bfloat16


def test_generate_command_on_tiny_model(tiny_qwen3):
    r = CliRunner().invoke(main, ["models", "generate", str(tiny_qwen3), "-p", "hi", "--max-tokens", "4"])
    assert r.exit_code == 0, r.output


@pytest.fixture
def bad_dirs(tmp_path, tiny_qwen3) -> dict[str, Path]:
    empty = tmp_path / "empty"
    empty.mkdir()
    corrupt = tmp_path / "corrupt"
    shutil.copytree(tiny_qwen3, corrupt)
    (corrupt / "config.json").write_text('{"model_type": "qwen3", "hidden_size": 64,')  # truncated
    no_type = tmp_path / "no_type"
    shutil.copytree(tiny_qwen3, no_type)
    (no_type / "config.json").write_text(json.dumps({"hidden_size": 64}))
    no_weights = tmp_path / "no_weights"
    shutil.copytree(tiny_qwen3, no_weights)
    for f in no_weights.glob("*.safetensors"):
        f.unlink()
    a_file = tmp_path / "model.txt"
    a_file.write_text("not a model")
    return {"empty": empty, "corrupt": corrupt, "no_type": no_type, "no_weights": no_weights, "file": a_file}


@pytest.mark.parametrize(
    "case, needles",
    [
        ("empty", ["is not a model directory", "no config.json"]),
        ("corrupt", ["config.json is corrupt", "line 1"]),
        ("no_type", ["no 'model_type'"]),
        ("no_weights", ["no *.safetensors"]),
        ("file", ["is not a directory"]),
    ],
)
def test_bad_dirs_library_and_cli(bad_dirs, case, needles):
    path = bad_dirs[case]
    with pytest.raises(UserError) as ei:
        resolve_model(str(path))
    for n in needles:
        assert n in str(ei.value)
    r = CliRunner().invoke(main, ["models", "resolve", str(path)])
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needles[0] in lines[0], r.output


def test_missing_path_is_one_line_exit_2(tmp_path):
    _assert_one_line_error(_cli("models", "resolve", str(tmp_path / "nope")), "does not exist")
    # a bare word is neither a path nor a repo id
    _assert_one_line_error(_cli("models", "resolve", "no-such-model-dir"), "does not exist", "repo id")


def test_hub_id_offline_is_one_line_exit_2(tmp_path):
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}  # an empty hub cache
    r = _cli("models", "resolve", "mlx-ssp-test/does-not-exist", env=env)
    _assert_one_line_error(r, "mlx-ssp-test/does-not-exist", "HF_HUB_OFFLINE")


def test_names_a_model_agrees_with_resolve_model(tiny_qwen3, tmp_path):
    """The check without resolving (a multimerge's misspelt names) says yes exactly to what
    resolve_model takes: what it refuses as no path and no repo id is refused here too."""
    for spec in (str(tiny_qwen3), "demo", "testbed:tiny", "Qwen/Qwen3-0.6B"):
        assert names_a_model(spec), spec
    for spec in ("", "frist", str(tmp_path / "nope"), "./nope/x", "~/nope-mlx-ssp/x"):
        assert not names_a_model(spec), spec
        with pytest.raises(UserError, match="does not exist|empty model spec"):
            resolve_model(spec)


def test_empty_spec_is_a_user_error():
    with pytest.raises(UserError, match="empty model spec"):
        resolve_model("  ")


def test_load_model_wraps_mlx_lm_failures(tiny_qwen3, tmp_path):
    # config.json is valid JSON with a model_type mlx-lm does not know: one clean error, not a traceback
    d = tmp_path / "unknown_arch"
    shutil.copytree(tiny_qwen3, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "no_such_arch"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="mlx_lm could not load"):
        load_model(str(d))
