"""MLX-quantized models as merge inputs and outputs (not part of the paper's recipe: step 4's merge
made usable on the ``mlx-community/...-4bit`` models most Macs hold).

**Inputs.** A model whose ``config.json`` has ``quantization`` stores each quantized module as a
packed ``uint32`` ``weight`` plus ``scales`` (and, in mlx's ``affine`` mode, ``biases``; the float
modes ``mxfp4`` / ``nvfp4`` / ``mxfp8`` have ``uint8`` scales and no biases). Such a module is
presented to the planner as one *logical* float tensor ``<module>.weight`` (affine: the scales'
dtype; float modes: bfloat16, mlx's default) of the unpacked shape, and is dequantized with
``mx.dequantize`` when it is read, one tensor at a time. Bits, group size and mode are the
module's entry in ``quantization`` (mlx-lm's per-module overrides, "mixed" quantization), else
the top-level ones; the stored shapes must agree with them.

**Outputs.** ``out_quantization: {bits, group_size, mode}`` quantizes the merged weights of the
modules mlx-lm would quantize: each module that has ``to_quantized`` in the mlx-lm model built
(lazily, no weights allocated) from the output's ``config.json``, whose input dimension the group
size divides, and that the model's own ``quant_predicate`` (if any) accepts, as
``mlx_lm.utils.quantize_model`` decides. The merged tensor is rounded to its output dtype first,
then ``mx.quantize``-d; the output's ``config.json`` gets ``quantization`` /
``quantization_config`` ``{group_size, bits, mode}``.

The stored shapes fix only ``bits * group_size``: a wrong entry with the same product (8 bits /
group 32 read as 4 / 64) unpacks to a wrong shape, which the planner's shape check against the
other models (or mlx-lm, loading the output) reports.

Deviations / limits: ``nvfp4`` with a per-tensor ``global_scale`` (mlx-lm's switch layers) is
refused naming the module; when mlx-lm cannot build the architecture, the 2-D ``*.weight`` tensors
whose last dimension the group size divides are quantized (every linear and embedding of the
architectures mlx-lm ships; another 2-D parameter would be quantized wrongly).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from mlx_ssp.errors import UserError
from mlx_ssp.merge import safetensors_io as sio


#: mode -> its default (bits, group_size); the float modes allow only that pair
MODE_PAIRS = {"affine": (4, 64), "mxfp4": (4, 32), "nvfp4": (4, 16), "mxfp8": (8, 32)}
#: the dtype a float-mode weight is dequantized to (its scales are uint8; mlx's default)
FP_MODE_CODE = "BF16"


@dataclass(frozen=True)
class QuantTensor:
    """One quantized module's stored tensors, its bits / group size and mode (``biases``: affine only)."""

    weight: sio.TensorInfo
    scales: sio.TensorInfo
    biases: Optional[sio.TensorInfo]
    bits: int
    group_size: int
    mode: str = "affine"


def module_quant(qconf: dict, module: str) -> Optional[dict]:
    """The (bits, group_size, mode) a module was quantized with: its own entry, else the top level;
    None when its entry is ``false`` (left in float)."""
    own = qconf.get(module)
    if own is False:
        return None
    base = {"bits": qconf.get("bits", 4), "group_size": qconf.get("group_size", 64), "mode": qconf.get("mode", "affine")}
    if isinstance(own, dict):
        base.update({k: own[k] for k in ("bits", "group_size", "mode") if k in own})
    return base


def dequantized_view(tensors: dict[str, sio.TensorInfo], qconf: dict,
                     ref: str) -> tuple[dict[str, sio.TensorInfo], dict[str, QuantTensor]]:
    """(the model's tensors with each quantized module as one logical float ``.weight``, the stored
    parts of each such weight). Shapes that disagree with the config are errors naming the module."""
    if not isinstance(qconf, dict):
        raise UserError(f"model {ref}: config.json 'quantization' must be an object, got {qconf!r}")
    logical = dict(tensors)
    quant: dict[str, QuantTensor] = {}
    for name in [n for n in tensors if n.endswith(".scales")]:
        stem = name[: -len(".scales")]
        w, s, b = tensors.get(stem + ".weight"), tensors[name], tensors.get(stem + ".biases")
        q = module_quant(qconf, stem)
        where = f"model {ref}: quantized module '{stem}'"
        if w is None or q is None:
            raise UserError(f"{where}: has scales but " + ("no weight" if w is None else "config.json says it is "
                                                           "not quantized"))
        mode, bits, gs = q["mode"], int(q["bits"]), int(q["group_size"])
        affine = mode == "affine"
        if mode not in MODE_PAIRS or stem + ".global_scale" in tensors:
            raise UserError(f"{where}: quantization mode {mode}{' with a global_scale' if mode in MODE_PAIRS else ''} "
                            f"is not supported (modes: {', '.join(MODE_PAIRS)}); dequantize it with mlx_lm.convert -d")
        if affine and b is None:
            raise UserError(f"{where}: affine quantization without biases")
        if not affine and b is not None:
            raise UserError(f"{where}: mode {mode} has no biases, but '{stem}.biases' is stored")
        if w.dtype != "U32" or not w.shape or (s.dtype not in sio.FLOAT_CODES if affine else s.dtype != "U8"):
            raise UserError(f"{where}: expected a uint32 weight and {'float' if affine else 'uint8'} scales, got "
                            f"{w.dtype} and {s.dtype}")
        cols = w.shape[-1] * 32 // bits
        want = (*w.shape[:-1], cols // gs)
        if (w.shape[-1] * 32) % bits or cols % gs or s.shape != want or (affine and (b.shape, b.dtype) != (s.shape, s.dtype)):
            raise UserError(f"{where}: stored shapes (weight {list(w.shape)}, scales {list(s.shape)}"
                            f"{f', biases {list(b.shape)}' if b else ''}) do not match {bits} bits with group size {gs}")
        shape = (*w.shape[:-1], cols)
        numel = 1
        for d in shape:
            numel *= d
        code = s.dtype if affine else FP_MODE_CODE
        logical[stem + ".weight"] = sio.TensorInfo(stem + ".weight", code, shape, w.file, w.start,
                                                   numel * sio.DTYPES[code][0])
        del logical[name]
        logical.pop(stem + ".biases", None)
        quant[stem + ".weight"] = QuantTensor(w, s, b, bits, gs, mode)
    return logical, quant


def dequantize(q: QuantTensor):
    """The float weight of one quantized module (affine: the scales' dtype; float modes: bfloat16)."""
    import mlx.core as mx

    biases = sio.read_tensor(q.biases) if q.biases is not None else None
    return mx.dequantize(sio.read_tensor(q.weight), sio.read_tensor(q.scales), biases,
                         group_size=q.group_size, bits=q.bits, mode=q.mode)


# ------------------------------------------------------------------ outputs


def _module_filter(conf: dict, group_size: int):
    """module path -> quantize? (mlx-lm's rule on a lazily built model), or None when mlx-lm cannot
    build the architecture."""
    try:
        import mlx.nn as nn
        from mlx.utils import tree_flatten
        from mlx_lm.utils import _get_classes

        model_class, args_class = _get_classes(conf)
        model = model_class(args_class.from_dict(conf))  # lazy arrays: nothing is allocated
    except Exception:  # noqa: BLE001  (any architecture mlx-lm cannot build: fall back to the shape rule)
        return None
    pred = getattr(model, "quant_predicate", None)
    ok = set()
    for path, m in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module):
        if hasattr(m, "to_quantized") and "weight" in m and m.weight.shape[-1] % group_size == 0:
            if pred is None or pred(path, m):
                ok.add(path)
    return ok


def quantized_names(names_shapes: list[tuple[str, tuple[int, ...]]], conf: dict, group_size: int) -> set[str]:
    """The ``.weight`` tensors to quantize (see the module docstring)."""
    ok = _module_filter(conf, group_size)
    out = set()
    for name, shape in names_shapes:
        if not name.endswith(".weight") or len(shape) != 2 or shape[-1] % group_size:
            continue
        if ok is None or name[: -len(".weight")] in ok:
            out.add(name)
    return out


def packed_tensors(name: str, shape: tuple[int, ...], code: str, bits: int, group_size: int,
                   mode: str = "affine") -> list[sio.PlannedTensor]:
    """The stored tensors of one quantized output weight: packed weight, scales (and affine biases)."""
    stem = name[: -len(".weight")]
    groups = (*shape[:-1], shape[-1] // group_size)
    out = [sio.PlannedTensor(name, "U32", (*shape[:-1], shape[-1] * bits // 32)),
           sio.PlannedTensor(stem + ".scales", code if mode == "affine" else "U8", groups)]
    return out + ([sio.PlannedTensor(stem + ".biases", code, groups)] if mode == "affine" else [])


def quantize_parts(name: str, parts: list, shape: tuple[int, ...], bits: int, group_size: int,
                   mode: str = "affine") -> dict:
    """The merged tensor (flat slices in its output dtype) -> {weight, scales[, biases]} arrays."""
    import mlx.core as mx

    w = (parts[0] if len(parts) == 1 else mx.concatenate(parts)).reshape(shape)
    stored = mx.quantize(w, group_size=group_size, bits=bits, mode=mode)
    stem = name[: -len(".weight")]
    return dict(zip([name, stem + ".scales", stem + ".biases"], stored))


def config_entry(bits: int, group_size: int, mode: str = "affine") -> dict:
    return {"group_size": group_size, "bits": bits, "mode": mode}
