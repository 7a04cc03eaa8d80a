"""Input models of a merge: a reference (a directory, a hub id, ``demo``, or ``path+adapter_dir``)
opened as a :class:`Source` whose safetensors headers are scanned (no tensor data is read). A LoRA
adapter is fused on the fly when a tensor is read (``W + scale * B^T A^T`` in the weight's dtype,
as ``mlx_lm fuse`` does). An MLX-quantized model (``quantization`` in its ``config.json``) shows
each quantized module as one float ``.weight``, dequantized when read (:mod:`.quant`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import mlx.core as mx

import mlx_ssp  # noqa: F401
from mlx_ssp.errors import UserError
from mlx_ssp.io import read_json
from mlx_ssp.merge import safetensors_io as sio
from mlx_ssp.merge.quant import QuantTensor, dequantize, dequantized_view
from mlx_ssp.models import resolve_model


@dataclass
class Source:
    """One input model: its directory, tensors and (optional) LoRA adapter to fuse on the fly."""

    ref: str
    path: Path
    tensors: dict[str, sio.TensorInfo]
    adapter: Optional[dict[str, sio.TensorInfo]] = None
    lora_scale: float = 1.0
    adapter_path: Optional[Path] = None
    given: Optional[Path] = None  # the model directory as written (before symlinks are resolved)
    quant: Optional[dict[str, QuantTensor]] = None  # logical weight name -> its packed parts

    def load(self, name: str) -> mx.array:
        q = self.quant.get(name) if self.quant else None
        x = dequantize(q) if q is not None else sio.read_tensor(self.tensors[name])
        if self.adapter is not None and name.endswith(".weight"):
            stem = name[: -len(".weight")]
            a, b = self.adapter.get(stem + ".lora_a"), self.adapter.get(stem + ".lora_b")
            if a is not None and b is not None:
                la, lb = sio.read_tensor(a).astype(mx.float32), sio.read_tensor(b).astype(mx.float32)
                delta = (self.lora_scale * lb.T) @ la.T
                if delta.shape != x.shape:
                    raise UserError(f"adapter {self.adapter_path}: tensor '{name}': LoRA delta shape "
                                    f"{tuple(delta.shape)} does not match the weight {tuple(x.shape)}")
                x = x + delta.astype(x.dtype)
        return x


def open_source(ref: str) -> Source:
    """``dir``, hub id, ``demo``, or ``model+adapter_dir`` -> Source (headers scanned)."""
    model_spec, adapter_spec = ref, None
    if "+" in ref and not Path(ref).expanduser().exists():
        model_spec, _, adapter_spec = ref.rpartition("+")
    path = resolve_model(model_spec)
    given = Path(model_spec).expanduser()
    given = given if given.exists() and given.resolve() == path.resolve() else None  # not 'demo' or a hub id
    src = Source(ref=ref, path=path, tensors=sio.scan_model(path), given=given)
    qconf = read_model_config(src).get("quantization")
    if qconf is not None:
        src.tensors, src.quant = dequantized_view(src.tensors, qconf, ref)
    else:
        check_not_quantized(src)
    if adapter_spec:
        attach_adapter(src, Path(adapter_spec).expanduser())
    return src


def check_not_quantized(src: Source) -> None:
    """Packed weights without ``quantization`` in config.json would be merged as raw numbers: an error."""
    for n, info in src.tensors.items():
        if info.dtype == "U32" and n.endswith(".weight") and n[: -len(".weight")] + ".scales" in src.tensors:
            raise UserError(f"model {src.ref}: tensor '{n}' is a packed quantized weight (uint32 with scales), but "
                            f"{src.path / 'config.json'} has no 'quantization' entry to dequantize it with")


def read_adapter_dir(ad: Path, who: str, instead: str) -> tuple[dict, dict[str, sio.TensorInfo]]:
    """An mlx-lm LoRA adapter directory's ``adapter_config.json`` and tensor headers, checked: both
    files there, a JSON object, ``fine_tune_type`` lora, and every tensor one of a ``lora_a`` /
    ``lora_b`` pair. Errors are one line starting with ``who``; ``instead`` says what to do with an
    adapter that is not plain LoRA."""
    cfg_file, weights = ad / "adapter_config.json", ad / "adapters.safetensors"
    if not cfg_file.is_file() or not weights.is_file():
        raise UserError(f"{who}: {ad} is not an mlx-lm adapter directory "
                        "(needs adapter_config.json and adapters.safetensors)")
    acfg = read_json(cfg_file)
    if not isinstance(acfg, dict):
        raise UserError(f"{cfg_file}: expected a JSON object")
    kind = acfg.get("fine_tune_type", "lora")
    if kind != "lora":
        raise UserError(f"{who}: fine_tune_type '{kind}' is not plain LoRA; {instead}")
    tensors = sio.scan_file(weights)
    for k in tensors:
        stem, _, leaf = k.rpartition(".")
        if leaf not in ("lora_a", "lora_b"):
            raise UserError(f"{who}: adapter tensor '{k}' is not a LoRA matrix (lora_a / lora_b); {instead}")
        pair = stem + (".lora_b" if leaf == "lora_a" else ".lora_a")
        if pair not in tensors:
            raise UserError(f"{who}: adapter tensor '{k}' has no '{pair}' to pair with")
    return acfg, tensors


def attach_adapter(src: Source, ad: Path) -> None:
    """Read an mlx-lm LoRA adapter directory into ``src`` (fused when a tensor is read); anything
    that cannot be fused on the fly is an error naming the model."""
    acfg, src.adapter = read_adapter_dir(ad, f"model {src.ref}",
                                         "it cannot be fused on the fly (run `mlx_lm fuse` first)")
    src.adapter_path = ad
    src.lora_scale = float(acfg.get("lora_parameters", {}).get("scale", 20.0))
    for k in src.adapter:  # every adapter tensor is used: anything else would be silently left out
        stem = k.rpartition(".")[0]
        if stem + ".weight" not in src.tensors:
            raise UserError(f"model {src.ref}: adapter tensor '{k}' has no matching weight '{stem}.weight'")


def read_model_config(src: Source) -> dict:
    """The model's ``config.json`` ({} if it has none); corrupt JSON is a UserError."""
    path = src.path / "config.json"
    if not path.is_file():
        return {}
    conf = read_json(path, f"{path} (the config of model {src.ref})")
    if not isinstance(conf, dict):
        return {}
    for key in _COUNT_KEYS:  # the merge plans with them: a string or a float here is a corrupt config
        n = conf.get(key)
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise UserError(f"{path}: {key} is {n!r}, not a non-negative integer (the config of model {src.ref})")
    return conf


#: the config.json counts the merge reads
_COUNT_KEYS = ("vocab_size", "num_hidden_layers", "n_layer")

