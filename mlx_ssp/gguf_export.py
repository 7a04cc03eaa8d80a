"""GGUF export of a model directory (``--export-gguf``), through mlx-lm's converter
(``mlx_lm.gguf.convert_to_gguf``, what ``mlx_lm fuse --export-gguf`` runs).

The converter writes llama.cpp's ``llama`` architecture (its tensor names, rotary permutation of the
q/k projections, metadata) and the vocabulary from ``tokenizer.json``; weights stay as stored
(float16/float32; bfloat16 becomes float16). So only the architectures in :data:`ARCHITECTURES`
convert, and only unquantized weights; anything else is refused with one line before any file is
written. The file is written beside the weights, atomically.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Optional

import mlx.core as mx

from mlx_ssp.errors import UserError
from mlx_ssp.io import atomic_path

#: the ``model_type`` values mlx-lm's converter handles (the list ``mlx_lm fuse --export-gguf`` checks)
ARCHITECTURES = ("llama", "mistral", "mixtral")
#: the file name ``mlx_lm fuse`` uses
DEFAULT_NAME = "ggml-model-f16.gguf"


def check_exportable(config: dict, where: str) -> None:
    """A one-line UserError when mlx-lm's converter cannot write ``config``'s model."""
    arch = config.get("model_type")
    if arch not in ARCHITECTURES:
        raise UserError(f"{where}: GGUF export supports model_type {', '.join(ARCHITECTURES)} (mlx-lm's converter); "
                        f"this model is {arch!r}: convert it with llama.cpp's convert_hf_to_gguf.py instead")
    if config.get("quantization") or config.get("quantization_config"):
        raise UserError(f"{where}: GGUF export needs unquantized weights (mlx-lm's converter); "
                        "export the unquantized model (e.g. merge without out_quantization, fuse with dequantize)")


def export_gguf(model_dir: str | Path, out: Optional[str | Path] = None) -> Path:
    """Write ``model_dir``'s weights as a GGUF file (default ``model_dir/ggml-model-f16.gguf``); returns its path."""
    model_dir = Path(model_dir)
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{model_dir}: no readable config.json for the GGUF export ({type(e).__name__})") from None
    check_exportable(config, str(model_dir))
    if not (model_dir / "tokenizer.json").is_file():
        raise UserError(f"{model_dir}: GGUF export needs tokenizer.json (the vocabulary it stores)")
    weights: dict = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    if not weights:
        raise UserError(f"{model_dir}: no *.safetensors weights to export")
    # mlx_lm.gguf imports mlx_lm and with it transformers (~1 s): only an export loads it
    from mlx_lm.gguf import convert_to_gguf

    out = Path(out) if out is not None else model_dir / DEFAULT_NAME
    with atomic_path(out) as tmp:
        # mx.save_gguf appends ".gguf" to a name without it
        written = Path(f"{tmp}.gguf")
        try:
            # the converter prints progress on stdout, which our commands keep for their result line
            with contextlib.redirect_stdout(sys.stderr):
                convert_to_gguf(model_dir, weights, config, str(written))
            os.replace(written, tmp)
        finally:
            written.unlink(missing_ok=True)
    return out
