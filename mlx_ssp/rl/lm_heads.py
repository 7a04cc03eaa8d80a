"""The LM heads the chunked log-prob op knows (:mod:`mlx_ssp.rl.logprobs`), and how to find one.

Heads: ``nn.Linear`` (with or without bias), a tied ``nn.Embedding`` (its ``as_linear``),
``nn.QuantizedLinear`` and ``nn.QuantizedEmbedding`` (``mx.quantized_matmul``; no gradient into the
quantized weights, which cannot be trained anyway). Each maps to a builder that returns the head's
parameters and its logits function; any other head module has no builder, and the op falls back to
the naive, unchunked computation (correct, not memory-efficient).
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

# type -> fn(module) -> (params tuple, logits_fn(h, *params)). Params are explicit inputs of the
# chunked op so that a trained head (full fine-tuning, untied or tied) gets its gradient.


def _dense(weight_key: str = "weight"):
    def build(m: nn.Module):
        if "bias" in m:
            return (m[weight_key], m["bias"]), lambda h, w, b: h @ w.T + b
        return (m[weight_key],), lambda h, w: h @ w.T

    return build


def _quantized(m: nn.Module):
    gs, bits, mode = m.group_size, m.bits, getattr(m, "mode", "affine")
    biases = m.get("biases")
    bias = m["bias"] if "bias" in m else None

    def fn(h, w, scales, *rest):
        qb = rest[0] if biases is not None else None
        out = mx.quantized_matmul(h, w, scales=scales, biases=qb, transpose=True, group_size=gs, bits=bits, mode=mode)
        return out + rest[-1] if bias is not None else out

    params = (m["weight"], m["scales"]) + ((biases,) if biases is not None else ()) + ((bias,) if bias is not None else ())
    return params, fn


HEADS: dict[type, Callable] = {
    nn.QuantizedLinear: _quantized,
    nn.QuantizedEmbedding: _quantized,
    nn.Linear: _dense(),
    nn.Embedding: _dense(),  # tied embeddings: logits = h @ E^T (Embedding.as_linear)
}


def head_of(model: nn.Module) -> nn.Module:
    """The LM head of an mlx-lm model: ``lm_head``, or the tied input embedding."""
    if "lm_head" in model:  # mlx-lm creates lm_head only for untied embeddings
        return model["lm_head"]
    inner = getattr(model, "model", None)
    emb = getattr(inner, "embed_tokens", None) if inner is not None else None
    if emb is None:
        raise ValueError(f"cannot find the LM head of {type(model).__name__} (no lm_head, no model.embed_tokens)")
    return emb


def head_builder(head: nn.Module):
    for cls, build in HEADS.items():  # exact types first so QuantizedLinear is not taken as Linear
        if type(head) is cls:
            return build
    for cls, build in HEADS.items():
        if isinstance(head, cls):
            return build
    return None


def head_trainable(head: nn.Module) -> bool:
    """Whether the head has float parameters that train (full fine-tuning), so it gets a gradient."""
    return any(mx.issubdtype(v.dtype, mx.floating) for _, v in tree_flatten(head.trainable_parameters()))


def head_vocab(head: nn.Module) -> int:
    """Output size of an LM head (rows of its weight)."""
    return int(head["weight"].shape[0]) if "weight" in head else 0
