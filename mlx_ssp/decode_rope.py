"""The rotary position embedding of decoding steps as one compiled MLX function on the CPU, bit for
bit MLX's own op.

On the CPU ``mx.fast.rope`` has no kernel of its own: it expands into its reference graph (MLX's
``fast.cpp``: positions, inverse frequencies, ``cos`` and ``sin``, two products per half, a
concatenation), about 17 small ops per call. A decoding step makes two calls per layer (queries
and keys) on tensors of a few hundred elements, so the cost is op overhead, the same at 1 row as
at 4: 60 calls of the demo model (SmolLM2-135M, 30 layers) take 3.4 ms of CPU per step. The same
call under ``mx.compile`` fuses the elementwise ops into one kernel that does the same float32
operation per element, so the outputs are the same bits, in 1.7 ms.

:func:`installed` swaps every ``mlx.nn.RoPE`` of a model (the rope mlx-lm builds for unscaled
rotary embeddings) for :class:`DecodeRoPE` while a generation pass runs and puts the originals
back afterwards. A decoding step (one position per row, per-row offsets as an array, as mlx-lm's
batched KV cache passes them) goes through the compiled function; everything else (prefill, a
plain integer offset, scaled ropes, a GPU) calls the original module. :func:`exact_here` compares
the compiled function with ``mx.fast.rope`` once per process and configuration; where they differ
(an MLX whose compiled kernels round differently) the original op stays in place.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn
import numpy as np

#: (dims, traditional, base, scale) -> the compiled rope of that configuration (one per process:
#: every layer and every generation pass shares its traces)
_COMPILED: dict[tuple, object] = {}
#: (configuration, device) -> whether the compiled rope equals mx.fast.rope there
_EXACT: dict[tuple, bool] = {}


def _config(rope: nn.RoPE) -> tuple:
    return (rope.dims, bool(rope.traditional), rope.base, rope.scale)


def compiled_rope(config: tuple):
    """``(x, offset) -> mx.fast.rope(x, dims, traditional=, base=, scale=, offset=offset)``, compiled."""
    f = _COMPILED.get(config)
    if f is None:
        dims, traditional, base, scale = config
        def rope(x, offset):
            return mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=offset)

        f = _COMPILED[config] = mx.compile(rope)
    return f


def exact_here(config: tuple) -> bool:
    """Whether the compiled rope of ``config`` gives ``mx.fast.rope``'s bits on this MLX and device
    (checked once, on decoding-step shapes with offsets from 0 to past 100k)."""
    key = (config, str(mx.default_device()))
    if key not in _EXACT:
        try:
            _EXACT[key] = _compare(config)
        except Exception:  # noqa: BLE001 - MLX could not compile here (no g++, a noexec TMPDIR): keep its op
            _EXACT[key] = False
    return _EXACT[key]


def _compare(config: tuple) -> bool:
    """The compiled rope against mx.fast.rope, contiguous and as strided views (queries and keys are
    transposed views), with the head wider than the rotated part as well."""
    dims, traditional, base, scale = config
    rng = np.random.default_rng(0)
    ok = True
    for rows, heads, head in ((4, 9, max(dims, 2)), (1, 3, max(dims, 2)), (2, 4, max(dims, 2) + 6)):
        base_x = mx.array(rng.normal(0, 2, (rows, 1, heads, head)).astype(np.float32))
        for x in (mx.contiguous(base_x.transpose(0, 2, 1, 3)), base_x.transpose(0, 2, 1, 3)):
            offset = mx.array(rng.integers(-5, 131072, rows).astype(np.int32))
            want = mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=offset)
            got = compiled_rope(config)(x, offset)
            ok = ok and np.array_equal(np.array(got).view(np.uint32), np.array(want).view(np.uint32))
    return ok


class DecodeRoPE(nn.Module):
    """An ``nn.RoPE`` whose decoding steps go through :func:`compiled_rope` (see the module docstring)."""

    def __init__(self, rope: nn.RoPE):
        super().__init__()
        self.rope = rope
        self._fn = compiled_rope(_config(rope))

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        if isinstance(offset, mx.array) and x.ndim == 4 and x.shape[2] == 1 and x.dtype == mx.float32:
            return self._fn(x, offset)
        return self.rope(x, offset=offset)


def _rope_slots(model) -> list[tuple[nn.Module, str, nn.RoPE]]:
    """(parent module, attribute name, rope) for every ``nn.RoPE`` child in ``model`` (exact type:
    mlx-lm's scaled ropes subclass nothing here and are left alone)."""
    slots = []
    for _, parent in model.named_modules():
        for name, child in parent.children().items():
            if type(child) is nn.RoPE:
                slots.append((parent, name, child))
    return slots


@contextmanager
def installed(model) -> Iterator[int]:
    """Within the block, the model's ``nn.RoPE`` modules compute decoding steps with the compiled
    rope (on the CPU, where it is exact); yields how many were swapped. The originals are back on exit."""
    slots = []
    if mx.default_device() == mx.cpu and isinstance(model, nn.Module):
        slots = [s for s in _rope_slots(model) if exact_here(_config(s[2]))]
    for parent, name, rope in slots:
        setattr(parent, name, DecodeRoPE(rope))
    try:
        yield len(slots)
    finally:
        for parent, name, rope in slots:
            setattr(parent, name, rope)
