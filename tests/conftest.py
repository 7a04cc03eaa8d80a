"""Shared fixtures: tiny random models (built once per session, offline) and the real data."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import mlx_ssp  # noqa: F401  (loads OpenBLAS before mlx.core)

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("MLX_SSP_SHARED", ROOT.parent / "shared"))
DATA = SHARED / "data"
QWEN3_TOKENIZER = DATA / "tokenizers" / "qwen3"
GSM8K = DATA / "gsm8k"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not DATA.is_dir():
        pytest.skip(f"shared data not found at {DATA} (set MLX_SSP_SHARED)")
    return DATA


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    """Random float32 Qwen3 (2 layers, hidden 64, tied embeddings) with a locally trained tokenizer."""
    from mlx_ssp.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """Random float32 Llama (untied lm_head) with a locally trained tokenizer."""
    from mlx_ssp.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama", tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_qwen3_real_tokenizer(tmp_path_factory) -> Path:
    """Random Qwen3 with the real Qwen3 tokenizer and chat template (vocab 151,669)."""
    if not QWEN3_TOKENIZER.is_dir():
        pytest.skip(f"Qwen3 tokenizer not found at {QWEN3_TOKENIZER}")
    from mlx_ssp.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_real"), "qwen3", tokenizer_dir=QWEN3_TOKENIZER, hidden_size=32)


# -- the learning regression test's model (tests/test_learning.py) ---------------------------------

_CI_BUILD = pytest.StashKey[dict]()


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: only a selected learning test starts a build
def pytest_collection_modifyitems(session, config, items):
    """Learning tests run last, and their testbed model is pretrained in a background process
    meanwhile: the suite keeps about one of the two CI cores busy, so the build's minutes overlap
    it. A model already in the cache (``scripts/testbed.py build --size ci``) is used as it is."""
    learning = [it for it in items if it.get_closest_marker("learning")]
    if not learning:
        return
    items[:] = [it for it in items if not it.get_closest_marker("learning")] + learning
    from mlx_ssp.testbed.build import cached

    built = cached("ci", 0)
    if built is not None:
        config.stash[_CI_BUILD] = {"out": built}
        return
    work = Path(tempfile.mkdtemp(prefix="mlx_ssp_ci_testbed_"))
    log = open(work / "build.log", "w")
    code = "import sys, pathlib; from mlx_ssp.testbed.build import build; build('ci', 0, pathlib.Path(sys.argv[1]), progress=False)"
    proc = subprocess.Popen([sys.executable, "-c", code, str(work / "model")], stdout=log, stderr=subprocess.STDOUT,
                            preexec_fn=lambda: os.nice(5))  # the suite's own tests keep their priority
    config.stash[_CI_BUILD] = {"out": work / "model", "proc": proc, "log": log, "work": work}


def pytest_sessionfinish(session):
    b = session.config.stash.get(_CI_BUILD, None)
    if b and "proc" in b:
        if b["proc"].poll() is None:
            b["proc"].kill()
            b["proc"].wait()
        b["log"].close()
        shutil.rmtree(b["work"], ignore_errors=True)


@pytest.fixture(scope="session")
def ci_testbed(request) -> Path:
    """The pretrained ``testbed:ci:0`` model (about 3-4 minutes of one core, overlapped with the suite)."""
    b = request.config.stash.get(_CI_BUILD, None)
    if b is None:
        pytest.fail("ci_testbed is for tests marked learning")
    if "proc" in b and b["proc"].wait() != 0:
        b["log"].flush()
        pytest.fail("the testbed:ci build failed:\n" + (b["work"] / "build.log").read_text()[-4000:])
    return b["out"]
