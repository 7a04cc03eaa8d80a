"""Predicted peak memory of one ``mlx_ssp rl`` step, from the model's config.json and the rl: section.

The step has two phases whose MLX peaks the loop records separately (``peak_memory_gen_mb``,
``peak_memory_train_mb``; :mod:`mlx_ssp.rl.trainer`): generation of the B x G rollouts (GRPO,
DeepSeekMath arXiv:2402.03300 section 4; VibeThinker-1.5B section 3.4), then the update over
micro-batches. Each phase's peak is a sum of terms, each a size in bytes times a coefficient fitted
on measured steps (``scripts/bench_rl_memory.py``; BENCHMARKS.md, "RL step memory"):

- both: the weights (parameters x bytes of the training dtype) and the trainable state (LoRA
  parameters, float32 whatever the base dtype, as mlx-lm creates them; plus the optimizer's moments;
  in the update also the current and the accumulated gradients);
- generation: the KV cache (rows x (prompt + completion, rounded up to mlx-lm's 256-token cache
  step) x kv_heads x head_dim x layers x 2), the float32 logits of the decoded rows (rows x vocab),
  and the prefill's attention scores (up to 8 prompts x heads x min(prompt, 2048) x prompt: a prompt
  is prefilled once for its G samples, in mlx-lm's 2048-token steps), each times its coefficient;
- update: the activations kept for the backward (micro-batch rows x sequence x hidden x layers),
  one layer's attention scores (micro-batch rows x heads x sequence^2: the CPU's attention vjp
  recomputes them layer by layer in the backward, not kept from the forward) and the chunked log-prob
  op's [chunk x vocab] float32 buffers (:func:`mlx_ssp.rl.logprobs.auto_chunk_size`), each times
  its coefficient; a constant per phase.

Deviations and limits (docs/rl.md, "Memory model"): coefficients come from float32 runs on a Linux
CPU; a bf16 run is predicted by halving every term measured in the training dtype (weights, KV,
activations, attention scores), not by a bf16 measurement; whether Metal's attention backward
materialises the scores as the CPU's does was not measured (a fused Metal VJP was still an open
mlx pull request, #3241, when this was written). Dense decoder-only configs only (``num_experts`` /
quantized configs are refused). The prediction is MLX's peak (allocated buffers), not the process
RSS, which adds MLX's buffer cache, Python and the libraries.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional

from mlx_ssp.finetune.optim import OPTIMIZERS
from mlx_ssp.rl.config import RLConfig
from mlx_ssp.rl.logprobs import auto_chunk_size
from mlx_ssp.rl.prefix import MIN_PREFIX

#: bytes per element of the training dtypes
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: mlx-lm's KVCache grows its buffers in steps of this many tokens
KV_STEP = 256
#: prompts prefilled together (mlx-lm's default prefill batch) and tokens per prefill step
PREFILL_BATCH, PREFILL_STEP = 8, 2048
#: a block's linear layers, (name, in features, out features) as functions of the shape (Qwen3 / Llama)
BLOCK_LINEARS = {
    "self_attn.q_proj": lambda s: (s.hidden, s.heads * s.head_dim),
    "self_attn.k_proj": lambda s: (s.hidden, s.kv_heads * s.head_dim),
    "self_attn.v_proj": lambda s: (s.hidden, s.kv_heads * s.head_dim),
    "self_attn.o_proj": lambda s: (s.heads * s.head_dim, s.hidden),
    "mlp.gate_proj": lambda s: (s.hidden, s.intermediate),
    "mlp.up_proj": lambda s: (s.hidden, s.intermediate),
    "mlp.down_proj": lambda s: (s.intermediate, s.hidden),
}
#: fitted coefficients, in :func:`features` order (``scripts/bench_rl_memory.py --fit``, refitted
#: 2026-12-01 21:11 UTC after the trainer's block layout, float32, Linux x86_64, mlx 0.32.4, 12 grid
#: points): KV 1.52 (mlx-lm grows the cache by concatenation: old and new buffers coexist), the
#: decode logits 2.44, the attention terms pinned by the script's one-attention probe (1.19
#: forward, 3.50 forward + backward), activations 22.8 values per token, hidden unit and layer,
#: the log-prob chunk 2.96 [chunk x vocab] buffers (the op's design: 3), no constant in the update
COEFFICIENTS = {
    "gen": [1.5221, 2.4414, 1.1880, 0.7495],
    "train": [22.824, 3.5010, 2.9561, 0.0],
}
#: the relative error the predictor is stated to have: the largest over the grid's held-out points
#: with these coefficients (8.0%; fit points 7.7%, leave-one-out 16.2%; BENCHMARKS.md "RL step
#: memory"), rounded up. Real shapes are in BENCHMARKS.md (Qwen3-0.6B, the demo model)
HELD_OUT_ERROR = 0.08


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a dense decoder-only model that memory depends on."""

    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    dtype: str  # the checkpoint's torch_dtype (the training dtype of ``train_dtype: auto`` off the CPU)
    shareable: bool = True  # full attention in every layer: the trainer shares prompt prefixes

    @property
    def params(self) -> int:
        """Parameter count: embeddings (twice when untied), the blocks' linears and norms (Qwen3's
        q/k norms included), the final norm."""
        block = sum(i * o for i, o in (f(self) for f in BLOCK_LINEARS.values())) + 2 * self.hidden + 2 * self.head_dim
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.layers * block + self.hidden


def shape_from_config(config: Mapping[str, Any]) -> ModelShape:
    """A :class:`ModelShape` from a Hugging Face config.json (a ``text_config`` inside is used)."""
    c = dict(config.get("text_config") or config)
    if c.get("num_experts") or c.get("num_local_experts"):
        raise ValueError("the memory model covers dense models only (this config has experts)")
    if c.get("quantization") or config.get("quantization"):
        raise ValueError("the memory model covers unquantized models only")
    missing = [k for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                           "vocab_size") if k not in c]
    if missing:
        raise ValueError(f"config.json lacks {', '.join(missing)}")
    heads = int(c["num_attention_heads"])
    return ModelShape(
        hidden=int(c["hidden_size"]), layers=int(c["num_hidden_layers"]), intermediate=int(c["intermediate_size"]),
        heads=heads, kv_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=int(c.get("head_dim") or c["hidden_size"] // heads), vocab=int(c["vocab_size"]),
        tied=bool(c.get("tie_word_embeddings", config.get("tie_word_embeddings", False))),
        dtype=str(c.get("torch_dtype") or config.get("torch_dtype") or "bfloat16"),
        # sliding-window layers get mlx-lm's rotating cache, which the trainer does not share
        shareable=not ((c.get("sliding_window") and c.get("use_sliding_window", True))
                       or any("sliding" in str(t) for t in c.get("layer_types") or ())),
    )


def lora_params(shape: ModelShape, rank: int, num_layers: int, keys: Optional[list[str]] = None) -> int:
    """LoRA parameters: rank x (in + out) for every adapted linear of the last ``num_layers``
    blocks (-1 = all); ``keys`` = the module names adapted (default every linear, as mlx-lm)."""
    names = list(BLOCK_LINEARS) if keys is None else [k for k in keys if k in BLOCK_LINEARS]
    per_block = sum(rank * sum(BLOCK_LINEARS[n](shape)) for n in names)
    blocks = shape.layers if num_layers < 0 else min(num_layers, shape.layers)
    return per_block * blocks


def adapted_params(shape: ModelShape, num_layers: int, keys: Optional[list[str]] = None) -> int:
    """Weights of the linear layers LoRA adapts (the ones ``gen_fold_lora`` copies, folded, for
    generation when they are float32): in x out for each adapted linear of the last ``num_layers`` blocks (-1 = all)."""
    names = list(BLOCK_LINEARS) if keys is None else [k for k in keys if k in BLOCK_LINEARS]
    per_block = sum(i * o for i, o in (BLOCK_LINEARS[n](shape) for n in names))
    return per_block * (shape.layers if num_layers < 0 else min(num_layers, shape.layers))


def _rl(rl) -> Any:
    return rl if isinstance(rl, RLConfig) else RLConfig.model_validate(dict(rl))


def train_dtype(rl, shape: ModelShape, device: str = "cpu") -> str:
    """The dtype the loop trains in (:func:`mlx_ssp.rl.policy.resolve_train_dtype`): ``auto`` is
    float32 on the CPU and the checkpoint's dtype elsewhere."""
    rl = _rl(rl)
    if rl.train_dtype != "auto":
        return rl.train_dtype
    return "float32" if device == "cpu" else (shape.dtype if shape.dtype in DTYPE_BYTES else "bfloat16")


def _sizes(shape: ModelShape, rl, prompt_tokens: int) -> dict:
    """Row and token counts of one step, in the trainer's layout (:meth:`mlx_ssp.rl.step.Updater.layout`):
    with ``share_prefix`` a group's G rows share its prompt (all but its last token), which runs
    once per pass, and the rows' suffixes (the completions) go in pieces of at most
    ``micro_batch_size`` rows whose log-prob tokens fit one chunk of the op."""
    rows = rl.batch_size * rl.group_size
    seq = prompt_tokens + rl.sampling.max_tokens - 1  # the padded training length (inputs)
    chunk = rl.chunk_size or auto_chunk_size(shape.vocab)
    shared = (rl.share_prefix and rl.group_size > 1 and prompt_tokens > MIN_PREFIX and shape.shareable
              and (rl.fine_tune_type != "lora" or not rl.lora.dropout))
    prefix = prompt_tokens - 1 if shared else 0
    block = rl.group_size if shared else rows
    suffix = seq - prefix
    piece = max(1, min(rl.micro_batch_size, block, chunk // max(1, suffix)))
    return {"rows": rows, "gen_rows": min(rows, rl.gen_batch_size), "seq": seq, "prefix": prefix, "suffix": suffix,
            "mb_rows": piece, "chunk_tokens": min(chunk, piece * suffix),
            "kv_tokens": KV_STEP * math.ceil((prompt_tokens + rl.sampling.max_tokens) / KV_STEP)}


def features(config: Mapping[str, Any], rl, *, phase: str, prompt_tokens: int, dtype: str = "float32") -> list[float]:
    """The phase's size terms in bytes (before their coefficients), in :data:`COEFFICIENTS` order:
    gen = [KV cache, decode logits, prefill attention scores, 1]; train = [activations, attention
    scores, log-prob chunk, 1] (the last: the constant's unit)."""
    shape, rl = shape_from_config(config), _rl(rl)
    s, b = _sizes(shape, rl, prompt_tokens), DTYPE_BYTES[dtype]
    if phase == "gen":
        kv = s["gen_rows"] * s["kv_tokens"] * shape.kv_heads * shape.head_dim * shape.layers * 2 * b
        logits = s["gen_rows"] * shape.vocab * 4
        # a prompt is prefilled once for its G samples (shared prefixes), up to 8 prompts together,
        # in steps of mlx-lm's 2048 tokens: one step's [heads x step x prompt] scores at a time
        prefill = min(rl.batch_size, PREFILL_BATCH) * shape.heads * min(prompt_tokens, PREFILL_STEP) * prompt_tokens * 4
        return [float(kv), float(logits), float(prefill), float(2**20)]
    if phase == "train":
        # the larger of a piece's backward (its rows' suffixes) and the prefix's own (once a block)
        tokens = max(s["mb_rows"] * s["suffix"], s["prefix"])
        act = tokens * shape.hidden * shape.layers * b
        # one layer's scores at a time: the CPU's attention vjp recomputes them in the backward
        # (measured: peak ~3.5x one [heads x L x L] score buffer, whatever the depth); a piece's
        # suffix queries see the prefix's keys too
        attn = max(s["mb_rows"] * s["suffix"] * s["seq"], s["prefix"] ** 2) * shape.heads * b
        chunk = s["chunk_tokens"] * shape.vocab * 4
        return [float(act), float(attn), float(chunk), float(2**20)]
    raise ValueError(f"phase must be gen or train, got {phase!r}")


def fixed_bytes(config: Mapping[str, Any], rl, *, phase: str, dtype: str = "float32") -> float:
    """The terms with no fitted coefficient: weights (a second copy for full fine-tuning with a KL
    reference), the trainable state (parameters, optimizer moments; gradients in the update:
    the micro-batch's and the accumulated sum) and, in generation with ``gen_fold_lora`` in
    float32, the folded copy of the adapted linear layers (bf16/fp16 layers are not folded:
    :func:`mlx_ssp.finetune.lora.foldable`; experts and quantization are refused above)."""
    shape, rl = shape_from_config(config), _rl(rl)
    b = DTYPE_BYTES[dtype]
    weights = shape.params * b
    moments = OPTIMIZERS[rl.optimizer].moments
    grads = 2 if phase == "train" else 0
    if rl.fine_tune_type == "lora":
        trainable = lora_params(shape, rl.lora.rank, rl.lora.num_layers, rl.lora.keys)
        state = trainable * 4 * (1 + moments + grads)  # LoRA arrays are float32 (mlx-lm's init)
        if phase == "gen" and rl.gen_fold_lora and dtype == "float32":  # only float32 layers are folded
            state += adapted_params(shape, rl.lora.num_layers, rl.lora.keys) * b
    else:
        state = shape.params * b * (moments + grads)
        if rl.beta > 0:
            weights *= 2  # the frozen reference copy (LoRA switches its adapters off instead)
    return float(weights + state)


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted MLX peak bytes of one RL step, per phase, with the terms that make them up."""

    dtype: str
    prompt_tokens: int
    weights: float
    gen_terms: dict
    train_terms: dict
    gen_bytes: float
    train_bytes: float

    @property
    def peak_bytes(self) -> float:
        return max(self.gen_bytes, self.train_bytes)

    def as_dict(self) -> dict:
        return {**asdict(self), "peak_bytes": self.peak_bytes}


GEN_TERMS = ("kv_cache", "decode_logits", "prefill_attention", "constant")
TRAIN_TERMS = ("activations", "attention", "logprob_chunk", "constant")


def predict(config: Mapping[str, Any], rl, *, prompt_tokens: int = 256, dtype: Optional[str] = None,
            device: str = "cpu", coefficients: Optional[Mapping[str, list[float]]] = None) -> MemoryEstimate:
    """Predicted peak of one step of ``rl`` (an RLConfig or its dict) on the model of ``config``
    (config.json as a dict) with prompts of ``prompt_tokens`` tokens; ``dtype`` defaults to the
    loop's training dtype on ``device`` ("cpu" or "gpu"). With ``auto_micro_batch`` the update's
    pieces are the ones :func:`auto_micro_batch` picks, as the trainer does."""
    rl = _rl(rl)
    shape = shape_from_config(config)
    dtype = dtype or train_dtype(rl, shape, device)
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    if rl.auto_micro_batch:
        rows = auto_micro_batch(config, rl, prompt_tokens=prompt_tokens, dtype=dtype, coefficients=coefficients)
        rl = rl.model_copy(update={"micro_batch_size": rows, "auto_micro_batch": False})
    coef = coefficients or COEFFICIENTS
    out = {}
    for phase, names in (("gen", GEN_TERMS), ("train", TRAIN_TERMS)):
        f = features(config, rl, phase=phase, prompt_tokens=prompt_tokens, dtype=dtype)
        # a negative fitted term (noise) would make a larger size predict less: clamp at zero
        out[phase] = {n: max(0.0, c * x) for n, c, x in zip(names, coef[phase], f)}
        out[phase]["weights_and_state"] = fixed_bytes(config, rl, phase=phase, dtype=dtype)
    return MemoryEstimate(dtype=dtype, prompt_tokens=prompt_tokens, weights=float(shape.params * DTYPE_BYTES[dtype]),
                          gen_terms=out["gen"], train_terms=out["train"], gen_bytes=sum(out["gen"].values()),
                          train_bytes=sum(out["train"].values()))


def auto_micro_batch(config: Mapping[str, Any], rl, *, prompt_tokens: int, dtype: str,
                     coefficients: Optional[Mapping[str, list[float]]] = None) -> int:
    """Rows per update piece (``rl.auto_micro_batch``): the largest number, at most
    ``rl.micro_batch_size``, whose predicted update peak stays within the step's floor, the larger
    of the generation's peak and a one-row piece's update. Pieces cannot lower the step's peak
    below that floor, and larger ones would only raise it; since the gradients accumulate, the
    update is the same whatever the rows per piece."""
    fixed = _rl(rl).model_copy(update={"auto_micro_batch": False})

    def at(n: int) -> MemoryEstimate:
        return predict(config, fixed.model_copy(update={"micro_batch_size": n}), prompt_tokens=prompt_tokens,
                       dtype=dtype, coefficients=coefficients)

    one = at(1)
    floor = max(one.gen_bytes, one.train_bytes)
    lo, hi = 1, fixed.micro_batch_size  # the update's peak does not fall as the rows grow: bisect
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if at(mid).train_bytes <= floor else (lo, mid - 1)
    return lo
