"""``passthrough``: one input tensor, copied (optionally times ``scale``), as mergekit 0.1.5's
``merge_methods/passthrough.py`` does. Used with ``slices:`` (:mod:`.slices`) for layer surgery.

The method is registered into :data:`.methods.METHODS` from here (importing :mod:`.config` imports
this module), so the registry lists it with the other methods.

Deviation: none in the arithmetic. ``scale`` multiplies in float32 and rounds to the compute dtype,
as torch's bf16 * scalar does; without ``scale`` the tensor's bytes are passed through unchanged.
"""

from __future__ import annotations

import mlx_ssp  # noqa: F401
import mlx.core as mx

from mlx_ssp.merge.methods import METHODS, MethodSpec
from mlx_ssp.merge.params import TensorInputs

#: the most inputs a method takes per tensor (checked when planning, both config forms)
MAX_INPUTS = {"passthrough": 1}


def passthrough(x: mx.array, scale, cd, out) -> mx.array:
    """``x`` in ``cd`` then ``out`` (no arithmetic when ``scale`` is None: the bytes are kept)."""
    x = x.astype(cd)
    if scale is not None:
        x = (x.astype(mx.float32) * float(scale)).astype(cd)
    return x.astype(out)


def merge_passthrough(spec: MethodSpec, t: TensorInputs) -> list[mx.array]:
    return [passthrough(t.models[0](), t.per_model[0].get("scale"), t.cd, t.out)]


PASSTHROUGH = MethodSpec("passthrough", needs_base=False, model_params=("scale",), shared_params=(),
                         defaults=(("scale", None),), merge=merge_passthrough)
# the other engineer's methods.py may list it one day; theirs then wins
METHODS.setdefault("passthrough", PASSTHROUGH)
