"""The policy model of an RL run: loading, the training dtype, LoRA or full fine-tuning, the adapter config.

LoRA (the default) freezes the base and trains adapters; the KL reference (VibeThinker-1.5B
section 3.4; GRPO, DeepSeekMath arXiv:2402.03300 section 4) is then the same model with its
adapters switched off. Deviation: the reference for KL with full fine-tuning is a second, frozen
copy of the model (only LoRA can switch the adapters off).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from mlx_ssp.finetune.lora import adapter_config as lora_adapter_config
from mlx_ssp.finetune.lora import attach_lora
from mlx_ssp.models import load_model
from mlx_ssp.rl import memory
from mlx_ssp.rl.config import RLConfig


def resolve_train_dtype(cfg: RLConfig):
    """float32 on CPU (half-precision matmul is slow there), else the model's own dtype (None);
    log-softmax always accumulates in float32."""
    if cfg.train_dtype == "auto":
        return mx.float32 if mx.default_device() == mx.cpu else None
    return getattr(mx, cfg.train_dtype)


def memory_config(model: nn.Module) -> Optional[dict]:
    """The model's mlx-lm arguments as a config.json dict for :mod:`mlx_ssp.rl.memory`, or None where
    the memory model does not cover it (no ``args``, experts, a missing size)."""
    try:
        cfg = dict(vars(model.args))
        memory.shape_from_config(cfg)
    except (AttributeError, TypeError, ValueError, KeyError):
        return None
    return cfg


def setup_model(model: nn.Module, cfg: RLConfig, seed: int = 0) -> nn.Module:
    """Freeze the base and add LoRA adapters (``lora``; their init is seeded by ``seed``), or
    train every weight (``full``); cast to the training dtype (float32 on CPU by default)."""
    dtype = resolve_train_dtype(cfg)
    if dtype is not None:
        model.set_dtype(dtype)
    if cfg.fine_tune_type == "lora":
        attach_lora(model, cfg.lora, seed)
    else:
        model.unfreeze()
    model.train()
    return model


def adapter_config(cfg: RLConfig, model: nn.Module) -> dict:
    """``adapter_config.json`` (:func:`mlx_ssp.finetune.lora.adapter_config`) with the block count resolved."""
    n = len(model.layers) if cfg.lora.num_layers < 0 else cfg.lora.num_layers
    return lora_adapter_config(cfg.lora, fine_tune_type=cfg.fine_tune_type, num_layers=n)


def load_policy(model_cfg, cfg: RLConfig, seed: int = 0):
    """Load the policy (plus a frozen reference copy only for full fine-tuning with a KL term: with
    LoRA the reference is the same model with adapters off) and set it up.
    Returns ``(model, tokenizer, model_path, ref_model)``."""
    model, tokenizer, path = load_model(model_cfg)
    ref = None
    if cfg.beta > 0 and cfg.fine_tune_type == "full":
        ref, _, _ = load_model(model_cfg)
        ref.freeze()
        if (dt := resolve_train_dtype(cfg)) is not None:
            ref.set_dtype(dt)
    setup_model(model, cfg, seed)
    return model, tokenizer, path, ref
