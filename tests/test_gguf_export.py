"""GGUF export through mlx-lm's converter, read back with the ``gguf`` package."""

from __future__ import annotations

import json

import numpy as np
import pytest
from gguf import GGUFReader
from safetensors.numpy import load_file

from mlx_ssp.errors import UserError
from mlx_ssp.gguf_export import DEFAULT_NAME, export_gguf
from mlx_ssp.testing import make_tiny_model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama") / "m", arch="llama", tie_word_embeddings=False)


def _field(reader: GGUFReader, key: str):
    return reader.fields[key].contents()


def test_export_writes_every_tensor_with_llama_names_and_shapes(tiny_llama, tmp_path):
    out = export_gguf(tiny_llama, tmp_path / "tiny.gguf")
    assert out == tmp_path / "tiny.gguf" and out.is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["tiny.gguf"]  # no temporary left behind
    reader = GGUFReader(out)
    config = json.loads((tiny_llama / "config.json").read_text())
    assert _field(reader, "general.architecture") == "llama"
    assert _field(reader, "llama.block_count") == config["num_hidden_layers"]
    assert _field(reader, "llama.embedding_length") == config["hidden_size"]
    assert len(_field(reader, "tokenizer.ggml.tokens")) == config["vocab_size"]
    tensors = {t.name: t for t in reader.tensors}
    hf = load_file(str(tiny_llama / "model.safetensors"))
    expected = {"token_embd.weight", "output.weight", "output_norm.weight"} | {
        f"blk.{i}.{n}.weight" for i in range(config["num_hidden_layers"])
        for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "attn_norm", "ffn_norm")}
    assert set(tensors) == expected
    assert len(hf) == len(expected)
    # GGUF lists dimensions innermost first; a tensor not permuted by the converter keeps its values
    assert tuple(tensors["blk.0.ffn_up.weight"].shape) == hf["model.layers.0.mlp.up_proj.weight"].shape[::-1]
    assert tuple(tensors["token_embd.weight"].shape) == hf["model.embed_tokens.weight"].shape[::-1]
    assert tuple(tensors["blk.1.attn_k.weight"].shape) == hf["model.layers.1.self_attn.k_proj.weight"].shape[::-1]
    got = np.asarray(tensors["blk.1.attn_v.weight"].data).reshape(hf["model.layers.1.self_attn.v_proj.weight"].shape)
    np.testing.assert_array_equal(got, hf["model.layers.1.self_attn.v_proj.weight"])


def test_default_path_is_beside_the_weights(tiny_llama, tmp_path):
    import shutil

    d = shutil.copytree(tiny_llama, tmp_path / "m")
    assert export_gguf(d) == d / DEFAULT_NAME
    assert GGUFReader(d / DEFAULT_NAME).tensors


def test_unsupported_architecture_is_one_line_and_writes_nothing(tmp_path):
    d = make_tiny_model(tmp_path / "qwen", arch="qwen3", num_layers=1)
    before = sorted(p.name for p in d.iterdir())
    with pytest.raises(UserError, match="qwen3") as e:
        export_gguf(d)
    assert "\n" not in str(e.value) and "llama" in str(e.value)
    assert sorted(p.name for p in d.iterdir()) == before


def test_quantized_model_is_refused(tiny_llama, tmp_path):
    import shutil

    d = shutil.copytree(tiny_llama, tmp_path / "q")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization"] = {"group_size": 64, "bits": 4}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="unquantized"):
        export_gguf(d)
    assert not (d / DEFAULT_NAME).exists()
