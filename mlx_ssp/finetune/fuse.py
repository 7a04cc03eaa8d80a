"""Fuse adapters into the base weights (the LoRA layers' own ``fuse()``, what ``mlx_lm fuse`` does)
and swap the wrappers back for their untouched base layers."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from mlx_ssp.card import Card, write_card
from mlx_ssp.finetune.lora import lora_modules
from mlx_ssp.io import atomic_dir


def _base_of(m):
    base = getattr(m, "linear", None)
    return base if base is not None else getattr(m, "embedding")


def restore_base(model) -> None:
    """Swap every LoRA/DoRA wrapper back for the base layer it wraps (untouched by training)."""
    from mlx.utils import tree_unflatten

    mods = [(n, _base_of(m)) for n, m in lora_modules(model)]
    if mods:
        model.update_modules(tree_unflatten(mods))


def fuse_and_save(model, tokenizer, model_path: Path, out: Path, *, dequantize: bool, overwrite: bool,
                  card: Optional[Card] = None) -> None:
    """Fuse the current adapters into the weights and save an HF-layout model at ``out`` (same dtype
    as the base) with ``card`` as its README.md (in place of mlx-lm's blank one); the in-memory
    model gets its LoRA wrappers back afterwards."""
    from mlx.utils import tree_unflatten
    from mlx_lm.utils import dequantize_model, load_config, save

    wrappers = lora_modules(model)
    fused = [(n, m.fuse(dequantize=dequantize)) for n, m in wrappers]
    config = load_config(model_path)
    model.update_modules(tree_unflatten(fused))
    try:
        to_save = model
        if dequantize:
            to_save = dequantize_model(model)
            config.pop("quantization", None)
            config.pop("quantization_config", None)
        with atomic_dir(out, overwrite=overwrite) as tmp:
            save(tmp, model_path, to_save, tokenizer, config, donate_model=False)
            if card is not None:
                write_card(tmp, card)
    finally:
        model.update_modules(tree_unflatten(wrappers))
