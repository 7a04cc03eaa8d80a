"""The one kernel dispatcher: which back-end runs the custom ops now (``metal``, ``cuda`` or ``reference``).

The requested mode is, first found: :func:`set_mode` / :func:`use_mode` (the ``rl.kernels`` config key
maps here), the ``MLX_SSP_KERNELS`` environment variable, ``auto``. ``auto`` takes the first back-end in
:data:`BACKENDS` whose probe says it can run (Metal when ``mx.metal.is_available()`` and the default device
is the GPU, then CUDA when ``mx.cuda.is_available()``), else the plain-MLX reference (Linux CPU, CI).
``reference`` forces the reference; ``metal`` / ``cuda`` demand that back-end and fail if it cannot run.
Every op (:mod:`.log_softmax`, :mod:`.advantages`) and the chunked log-prob op ask :func:`backend`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import mlx.core as mx

from mlx_ssp.errors import UserError
from mlx_ssp.rl.kernels import sources

ENV = "MLX_SSP_KERNELS"
MODES = ("auto", "reference", "metal", "cuda")
BACKENDS = ("metal", "cuda")  # the order auto tries them in

_mode_override: str | None = None


def _requested() -> str:
    """The mode as asked for (override, then env, then auto), not yet validated."""
    return (_mode_override or os.environ.get(ENV, "") or "auto").strip().lower()


def _mode() -> str:
    mode = _requested()
    if mode not in MODES:
        raise UserError(f"{ENV}={mode!r} is not a kernel mode; choose from {', '.join(MODES)}")
    return mode


def set_mode(mode: str | None) -> None:
    """Force a kernel mode for this process (a config key maps here); ``None`` returns to the env/auto."""
    global _mode_override
    if mode is not None and mode.strip().lower() not in MODES:
        raise UserError(f"kernel mode {mode!r} is not one of {', '.join(MODES)}")
    _mode_override = None if mode is None else mode.strip().lower()


@contextlib.contextmanager
def use_mode(mode: str | None) -> Iterator[None]:
    """``with use_mode("reference"):`` runs the block with that kernel mode."""
    global _mode_override
    old = _mode_override
    set_mode(mode)
    try:
        yield
    finally:
        _mode_override = old


def _gpu_default() -> bool:
    return mx.default_device() == mx.gpu


def metal_available() -> bool:
    return bool(mx.metal.is_available()) and _gpu_default()


def cuda_available() -> bool:
    cuda = getattr(mx, "cuda", None)
    return bool(cuda is not None and cuda.is_available()) and _gpu_default()


# back-end -> can it run here (tests pretend a device by patching an entry)
_PROBES = {"metal": metal_available, "cuda": cuda_available}


def runnable_backends() -> list[str]:
    """The GPU back-ends that can run here, in the order ``auto`` tries them (none on a CPU-only machine)."""
    return [name for name in BACKENDS if _PROBES[name]()]


def backend() -> str:
    """What runs now: ``"metal"``, ``"cuda"`` or ``"reference"``."""
    mode = _mode()
    if mode == "reference":
        return "reference"
    if mode in BACKENDS:
        if not _PROBES[mode]():
            raise UserError(f"{ENV}={mode} but the {mode} back-end is not available here; use auto or reference")
        return mode
    return next(iter(runnable_backends()), "reference")


def kernel_available() -> bool:
    """True when a custom kernel (not the reference) will run."""
    return backend() != "reference"


def available() -> dict:
    """A description of what will run and why (for logs, ``mlx_ssp doctor`` and bug reports)."""
    mode = _requested()
    info = {
        "mode": mode,
        "env": ENV,
        "metal": metal_available(),
        "cuda": cuda_available(),
        "default_device": str(mx.default_device()),
        "sources": str(sources.source_dir()),
        "kernels": list(sources.KERNELS),
        "built": {f"{b}:{n}": c for (b, n), c in sources.BUILD_COUNTS.items()},
    }
    try:
        info["backend"] = backend()
        if info["backend"] == "reference":
            info["reason"] = (
                "forced by mode" if mode == "reference" else "no Metal or CUDA device (or default device is CPU)"
            )
        else:
            info["reason"] = f"{info['backend']} device available"
    except UserError as e:
        info["backend"], info["reason"] = "unavailable", str(e)
    return info
