"""Shared fixtures: tiny random models (built once per session, offline) and the real data."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# Many tests compare two float32 routes that must agree (shared vs unshared prefix, chunked vs naive,
# micro-batch vs full batch). mlx's CUDA matmuls default to TF32, which broke 10 of 61 such
# comparisons on an H200 by 1e-4 to 6e-4 relative (BENCHMARKS.md); set before mlx is imported
os.environ.setdefault("MLX_ENABLE_TF32", "0")

import mlx_ssp  # noqa: F401,E402  (loads OpenBLAS before mlx.core)

from merge_helpers import rand_arrays, write_model  # noqa: E402

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


# -- the merge tests' models (test_merge*.py) -------------------------------------------------------


@pytest.fixture(scope="module")
def trio(tmp_path_factory):
    """base + two fine-tunes in float32 and bfloat16 (bf16 deltas have many exact ties)."""
    root = tmp_path_factory.mktemp("merge_models")
    base = rand_arrays(0)
    a = rand_arrays(1, 0.05, base)
    b = rand_arrays(2, 0.05, base)
    out = {}
    for dt in ("float32", "bfloat16"):
        out[dt] = [write_model(root / f"{dt}_{i}", arr, dt) for i, arr in enumerate((base, a, b))]
    out["arrays"] = (base, a, b)
    return out


# -- the learning regression test's model (tests/test_learning.py) ---------------------------------

_CI_BUILD = pytest.StashKey[dict]()


def pytest_collection_finish(session):
    """Learning tests run last, and their testbed model is pretrained in a background process
    meanwhile: the suite keeps about one of the two CI cores busy, so the build's minutes overlap
    it. This runs after every deselection and reordering (-k, -m, --lf, --ff), so only a selected
    learning test starts a build. The model is built into the testbed cache (as
    ``scripts/testbed.py build --size ci`` would); one already there is used as it is."""
    items = session.items
    learning = [it for it in items if it.get_closest_marker("learning")]
    if not learning or session.config.option.collectonly:
        return
    items[:] = [it for it in items if not it.get_closest_marker("learning")] + learning
    from mlx_ssp.errors import UserError
    from mlx_ssp.testbed.build import cached, testbed_dir

    try:
        built = cached("ci", 0)
    except UserError as e:  # a stale cache fails the learning tests, not the whole run
        session.config.stash[_CI_BUILD] = {"error": str(e)}
        return
    if built is not None:
        session.config.stash[_CI_BUILD] = {"out": built}
        return
    out = testbed_dir("ci", 0)
    out.parent.mkdir(parents=True, exist_ok=True)
    log = open(out.parent / f"ci-s0.build.{os.getpid()}.log", "w")
    code = "import sys, pathlib; from mlx_ssp.testbed.build import build; build('ci', 0, pathlib.Path(sys.argv[1]), progress=False)"
    proc = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=log, stderr=subprocess.STDOUT,
                            preexec_fn=_background_child())
    session.config.stash[_CI_BUILD] = {"out": out, "proc": proc, "log": log}


def _background_child():
    """The build process's setup between fork and exec (prepared here: nothing is imported there)."""
    prctl = None
    if sys.platform.startswith("linux"):  # die with pytest, even when it is killed (no orphaned build)
        import ctypes

        prctl = ctypes.CDLL(None).prctl

    def setup() -> None:
        os.nice(5)  # the suite's own tests keep their priority
        if prctl is not None:
            prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL

    return setup


def pytest_sessionfinish(session):
    b = session.config.stash.get(_CI_BUILD, None)
    if b and "proc" in b:
        if b["proc"].poll() is None:  # stopped early (-x, Ctrl-C): the build's temp dir goes with it
            b["proc"].kill()
            b["proc"].wait()
            for tmp in b["out"].parent.glob(b["out"].name + ".tmp*"):
                shutil.rmtree(tmp, ignore_errors=True)
        b["log"].close()
        Path(b["log"].name).unlink(missing_ok=True)


@pytest.fixture(scope="session")
def ci_testbed(request) -> Path:
    """The pretrained ``testbed:ci:0`` model (about 3-4 minutes of one core, overlapped with the suite)."""
    b = request.config.stash.get(_CI_BUILD, None)
    if b is None:
        pytest.fail("ci_testbed is for tests marked learning")
    if "error" in b:
        pytest.fail(b["error"])
    if "proc" in b:
        try:
            rc = b["proc"].wait(timeout=1800)
        except subprocess.TimeoutExpired:
            pytest.fail("the testbed:ci build did not finish in 30 minutes")
        if rc != 0:
            b["log"].flush()
            pytest.fail("the testbed:ci build failed:\n" + Path(b["log"].name).read_text()[-4000:])
    return b["out"]
