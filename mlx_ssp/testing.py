"""Tiny models and tokenizers built in seconds, offline: for tests, benchmarks and examples.

``make_tiny_model`` writes an HF-layout directory (config.json, model.safetensors, tokenizer
files) that ``mlx_lm.load`` reads, using mlx-lm's own model classes with random float32 weights.
The tokenizer is either a byte-level BPE trained here on a small built-in corpus (ChatML chat
template, eos and pad set) or a real tokenizer directory (e.g. Qwen3's) copied in.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from mlx_ssp.agents.gold import gold_messages
from mlx_ssp.tasks.build import export_source

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_CORPUS = [
    "What is 2 + 3? Answer: 5",
    "What is 7 - 4? Answer: 3",
    "Compute 12 + 30. The answer is 42.",
    "Give your final answer on the last line in the form: Answer: <your answer>",
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "Let x = 4. Then 2 * x = 8, so the answer is 8.",
    "You are a helpful assistant. Think step by step.",
    "system user assistant tool call function arguments name",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 100 1000",
    "Question: How many apples are left? Solution: 10 - 3 = 7. #### 7",
]


def train_tokenizer(out_dir: str | Path, vocab_size: int = 512, corpus: list[str] | None = None) -> Path:
    """Train a byte-level BPE on the built-in corpus (plus ``corpus``: e.g. tool schemas, so that
    long prompts tokenize short) and save tokenizer files with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20 + list(corpus or []), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "bos_token": None,
                "unk_token": None,
                "add_bos_token": False,
                "model_max_length": 4096,
                "chat_template": CHATML_TEMPLATE,
            },
            indent=2,
        )
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, indent=2)
    )
    return out


def _tokenizer_vocab_size(tok_dir: Path) -> int:
    data = json.loads((tok_dir / "tokenizer.json").read_text())
    ids = list(data["model"]["vocab"].values()) + [t["id"] for t in data.get("added_tokens", [])]
    return max(ids) + 1


def _eos_id(tok_dir: Path) -> int:
    data = json.loads((tok_dir / "tokenizer.json").read_text())
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    eos = cfg.get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    for t in data.get("added_tokens", []):
        if t["content"] == eos:
            return t["id"]
    return data["model"]["vocab"].get(eos, 0)


def make_tiny_model(
    out_dir: str | Path,
    arch: str = "qwen3",
    *,
    tokenizer_dir: str | Path | None = None,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = True,
    seed: int = 0,
    dtype: str = "float32",
    vocab_size: int = 512,
    corpus: list[str] | None = None,
    config_overrides: dict | None = None,
) -> Path:
    """Write a random ``arch`` model (``qwen3`` or ``llama``) in HF layout and return its path. The
    trained tokenizer has ``vocab_size`` tokens learnt from the built-in corpus and ``corpus``.
    ``config_overrides``: config.json keys that replace the derived ones (a real model's
    ``head_dim``, ``rope_theta`` or a ``vocab_size`` larger than the tokenizer's, whose extra ids
    decode to nothing)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import save_config

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_dir is None:
        train_tokenizer(out, vocab_size=vocab_size, corpus=corpus)
    else:
        src = Path(tokenizer_dir)
        for f in src.iterdir():
            if f.is_file() and (f.name.startswith(("tokenizer", "special_tokens")) or f.suffix in (".jinja", ".txt")):
                shutil.copy(f, out / f.name)
    vocab = _tokenizer_vocab_size(out)
    head_dim = hidden_size // num_heads
    config = {
        "model_type": arch,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "intermediate_size": intermediate_size,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": tie_word_embeddings,
        "head_dim": head_dim,
        "eos_token_id": _eos_id(out),
        "torch_dtype": dtype,
        **(config_overrides or {}),
    }
    if arch == "qwen3":
        from mlx_lm.models.qwen3 import Model, ModelArgs
    elif arch == "llama":
        from mlx_lm.models.llama import Model, ModelArgs
    else:
        raise ValueError(f"arch must be qwen3 or llama, got {arch}")
    args = ModelArgs.from_dict(config)
    mx.random.seed(seed)
    model = Model(args)
    # default inits are fine for a random model; scale embeddings so logits are not flat
    model.set_dtype(getattr(mx, dtype))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    save_config(config, out / "config.json")
    return out


def make_tiny_agent_model(out_dir: str | Path, n_tasks: int = 80) -> Path:
    """A tiny random model whose tokenizer (4096 tokens) was trained on BFCL multi-turn tool schemas
    and gold conversations, so an episode prompt is ~650 tokens instead of ~4k: for agents tests and
    ``--tiny`` experiments (needs ``bfcl-eval``)."""
    corpus = []
    for t in export_source("bfcl_multi_turn:base", params={"tools": "used"})[:n_tasks]:
        corpus += [json.dumps(x) for x in t.metadata["tools"]] + [m["content"] for m in gold_messages(t)]
    return make_tiny_model(out_dir, vocab_size=4096, corpus=corpus)


def run_cpu_bounded(fn, *args, cpu_s: int = 2, backstop_s: float = 120.0):
    """``fn(*args)`` in a forked child under a CPU-time limit (``RLIMIT_CPU``): its result, or an
    AssertionError when the child used more than ``cpu_s`` CPU seconds, raised or died. For tests of
    work that no counter sees (a regex backtracking inside C): CPU time, unlike wall time, is not
    stretched by the other processes of a loaded machine. ``backstop_s`` of wall time is no bound on
    speed, only on a child blocked on something. The result must pickle."""
    import os
    import pickle
    import resource
    import select
    import signal

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: run, send the pickled result, exit without cleanup (never return)
        try:
            os.close(r)
            try:
                resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
                resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))  # SIGXCPU, then SIGKILL
                out = pickle.dumps(("ok", fn(*args)))
            except BaseException as e:  # noqa: BLE001 - report anything to the parent
                out = pickle.dumps(("err", repr(e)))
            with os.fdopen(w, "wb") as f:
                f.write(out)
        finally:
            os._exit(0)
    os.close(w)
    name = getattr(fn, "__name__", fn)
    chunks = []
    try:
        if not select.select([r], [], [], backstop_s)[0]:
            os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"{name} was still running after {backstop_s:g} s of wall time")
        while chunk := os.read(r, 1 << 16):
            chunks.append(chunk)
    finally:
        os.close(r)
        _, status, _ = os.wait4(pid, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig in (signal.SIGXCPU, signal.SIGKILL):
            raise AssertionError(f"{name} used more than {cpu_s} s of CPU")
        raise AssertionError(f"{name} died of signal {sig}")
    kind, value = pickle.loads(b"".join(chunks))
    if kind != "ok":
        raise AssertionError(f"{name} raised {value}")
    return value
