"""What a merge method receives for one tensor: its inputs (:class:`TensorInputs`, as the engine
hands them over) and the resolved parameters of ``linear`` (:class:`LinearParams`) and of the
task-vector methods (:class:`TaskVectorParams`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import mlx_ssp  # noqa: F401  (OpenBLAS before mlx.core)
import mlx.core as mx


def load_input(x):
    """An array, or the array a zero-argument loader reads (one model's tensor, only when needed)."""
    return x() if callable(x) else x


@dataclass(frozen=True)
class TensorInputs:
    """One tensor as the engine hands it to a method: zero-argument loaders of the flat inputs (and
    of the base), the resolved parameters (per model and shared), the DARE seed of each model, the
    compute and output dtypes."""

    models: list[Callable[[], mx.array]]
    base: Optional[Callable[[], mx.array]]
    per_model: list[dict[str, Any]]
    shared: dict[str, Any]
    seeds: list[int]
    cd: Any
    out: Any
    #: the tensor's shape (None: the engine did not pass it; shape-dependent steps then see one row)
    shape: Optional[tuple[int, ...]] = None


@dataclass(frozen=True)
class LinearParams:
    """``linear``: one weight per model; divide by their sum when ``normalize``."""

    weights: tuple[float, ...]
    normalize: bool

    @classmethod
    def of(cls, t: TensorInputs) -> "LinearParams":
        return cls(tuple(pm["weight"] for pm in t.per_model), t.shared["normalize"])


@dataclass(frozen=True)
class TaskVectorParams:
    """A task-vector method's parameters for one tensor: per model (weight, density, gamma, DARE
    seed) and shared (normalize, rescale, lambda, sign_vote, rescale_mode)."""

    weights: tuple[float, ...]
    densities: tuple[float, ...]
    gammas: tuple[float, ...]
    seeds: tuple[int, ...]
    normalize: bool
    rescale: bool = False
    lam: float = 1.0
    sign_vote: str = "weighted"
    rescale_mode: str = "l1"
    epsilons: tuple[float, ...] = ()
    shape: Optional[tuple[int, ...]] = None

    @classmethod
    def of(cls, t: TensorInputs) -> "TaskVectorParams":
        pm, sh = t.per_model, t.shared
        return cls(weights=tuple(m["weight"] for m in pm), densities=tuple(m.get("density", 1.0) for m in pm),
                   gammas=tuple(m.get("gamma", 0.01) for m in pm), seeds=tuple(t.seeds),
                   normalize=sh["normalize"], rescale=bool(sh.get("rescale", False)), lam=sh.get("lambda", 1.0),
                   sign_vote=sh.get("sign_vote", "weighted"), rescale_mode=sh.get("rescale_mode", "l1"),
                   epsilons=tuple(m.get("epsilon", 0.15) for m in pm), shape=t.shape)
