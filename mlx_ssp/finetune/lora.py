"""LoRA / DoRA adapters (Hu et al. 2021; Liu et al. 2024) through mlx-lm: one config, attach,
detection of the adapter layers, the scale-0 "adapters off" view, and ``adapter_config.json``.

The config's defaults are SFT's (the last 16 blocks); RL's ``rl.lora`` overrides ``num_layers`` to
-1 (all blocks) as its documented default, so both stages keep the settings they shipped with.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Literal, Optional

from pydantic import Field, field_validator

from mlx_ssp.config import StrictModel
from mlx_ssp.errors import UserError


class LoRAConfig(StrictModel):
    """Which layers get adapters, and their shape (mlx-lm's ``lora_parameters``): every linear
    layer of the last ``num_layers`` blocks (-1 = all), or only the module paths in ``keys``."""

    fine_tune_type: Literal["lora", "dora"] = "lora"
    rank: int = Field(8, ge=1)
    scale: float = Field(20.0, gt=0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    #: transformer blocks, counted from the last; -1 = all (SFT's default 16, RL's -1)
    num_layers: int = 16
    #: module names inside a block (e.g. ``self_attn.q_proj``); null = every linear layer of the block
    keys: Optional[list[str]] = Field(None, min_length=1)

    @field_validator("num_layers")
    @classmethod
    def _layers(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError("must be -1 (all blocks) or a positive number of blocks")
        return v


def lora_parameters(lora: LoRAConfig) -> dict[str, Any]:
    """mlx-lm's ``lora_parameters`` dict (``keys`` only when given)."""
    params: dict[str, Any] = {"rank": lora.rank, "scale": lora.scale, "dropout": lora.dropout}
    if lora.keys is not None:
        params["keys"] = list(lora.keys)
    return params


def attach_lora(model, lora: LoRAConfig, seed: int) -> None:
    """Freeze the base and wrap the target layers; the adapters' A init is drawn from ``seed``."""
    import mlx.core as mx
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model.freeze()
    mx.random.seed(seed)
    linear_to_lora_layers(model, lora.num_layers, lora_parameters(lora), use_dora=lora.fine_tune_type == "dora")


def lora_modules(model) -> list[tuple[str, Any]]:
    """(name, wrapper) of every LoRA/DoRA layer (linear, switch or embedding)."""
    return [(n, m) for n, m in model.named_modules() if "lora_a" in m and "lora_b" in m and hasattr(m, "fuse")]


@contextmanager
def adapters_disabled(model):
    """The model as it was before LoRA: every adapter's scale is 0 inside the block, so
    ``y = base(x) + 0 * lora(x)`` is the base output exactly (no second model in memory)."""
    mods = [m for _, m in lora_modules(model)]
    old = [m.scale for m in mods]
    try:
        for m in mods:
            m.scale = 0.0
        yield model
    finally:
        for m, s in zip(mods, old):
            m.scale = s


def foldable(module) -> bool:
    """Whether :func:`folded_adapters` folds this LoRA layer: a plain LoRA linear on a float32 weight.
    mlx-lm's ``fuse`` rounds ``B A`` and ``W + s B A`` to the weight's dtype, which in bf16/fp16
    drops most of a small update (decoding would sample another policy); quantized, DoRA and switch
    (expert) layers have no exact plain-linear form either."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.tuner.lora import LoRALinear

    return type(module) is LoRALinear and type(module.linear) is nn.Linear and module.linear.weight.dtype == mx.float32


@contextmanager
def folded_adapters(model):
    """The model with every foldable LoRA layer (:func:`foldable`: plain linear, float32 weight)
    swapped for one plain linear layer of weight ``W + scale * B A`` (mlx-lm's ``fuse``) inside the
    block, the adapter layers put back after. For decoding: one matmul per layer instead of three
    and the elementwise ops, on a copy of the weights (the base and the adapters are not touched;
    the copy is freed after the block). The outputs equal the adapter form's up to float rounding
    (``W x + s B (A x)`` is summed in another order). Layers on bf16/fp16 weights keep decoding
    through their adapters (folding would round the update away), as do DoRA, quantized and
    switch (expert) layers: with a bf16 model nothing is folded."""
    import mlx.core as mx
    from mlx.utils import tree_unflatten

    mods = [(n, m) for n, m in lora_modules(model) if foldable(m)]
    if not mods:
        yield model
        return
    fused = [(n, m.fuse()) for n, m in mods]
    mx.eval([f.parameters() for _, f in fused])
    model.update_modules(tree_unflatten(fused))
    try:
        yield model
    finally:
        model.update_modules(tree_unflatten(mods))


def adapter_config(lora: LoRAConfig, *, fine_tune_type: str, num_layers: int, **extra) -> dict:
    """``adapter_config.json`` as mlx-lm's ``load_adapters`` / ``fuse`` read it, plus ``extra``
    (provenance) after mlx-lm's keys."""
    return {"fine_tune_type": fine_tune_type, "num_layers": num_layers, "lora_parameters": lora_parameters(lora),
            **extra}


def check_lora_targets(model, lora: LoRAConfig, section: str) -> list[str]:
    """The names LoRA will wrap; layers the model does not have are an error listing valid ones."""
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    n = len(model.layers)
    if lora.num_layers > n:
        raise UserError(f"{section}.num_layers={lora.num_layers} but the model has only {n} blocks (use -1 for all)")
    kinds = (nn.Linear, nn.QuantizedLinear, SwitchLinear, QuantizedSwitchLinear, nn.Embedding, nn.QuantizedEmbedding)
    blocks = model.layers if lora.num_layers == -1 else model.layers[-lora.num_layers :]
    available: set[str] = set()
    for b in blocks:
        for name, m in b.named_modules():
            if name and (hasattr(m, "to_lora") or isinstance(m, kinds)):
                available.add(name)
    if lora.keys is None:
        return sorted(available)
    top = {name for name, m in model.named_modules() if name and isinstance(m, kinds)}
    missing = [k for k in lora.keys if k not in available and k not in top]
    if missing:
        raise UserError(
            f"{section}.keys: the model has no layer {', '.join(repr(k) for k in missing)}; "
            f"valid: {', '.join(sorted(available))}"
        )
    return list(lora.keys)
