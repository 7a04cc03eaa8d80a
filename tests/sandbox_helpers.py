"""Shared settings of the sandbox tests: the limits every hostile program runs under, and whether
this machine enforces the filesystem view."""

from __future__ import annotations

from mlx_ssp.verify.sandbox import Limits, capabilities

L = Limits(wall_s=4, cpu_s=2, memory_mb=512, nproc=16, fsize_mb=4, output_kb=64)


def _view_enforced() -> bool:
    return bool(capabilities().get("filesystem_view"))
