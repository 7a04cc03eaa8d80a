"""Shared fixtures: tiny random models (built once per session, offline) and the real data."""

from __future__ import annotations

import os
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
