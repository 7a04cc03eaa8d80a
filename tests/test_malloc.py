"""glibc keeps freed heap memory (mlx_ssp._malloc): large per-step buffers reuse pages instead of faulting new ones."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt: Linux only")

# allocate and free a 32 MB buffer (numpy and MLX) a few times after a warm-up; print the minor faults
PROBE = """
import resource
import mlx_ssp, mlx_ssp._malloc as m
import mlx.core as mx, numpy as np
def once():
    a = np.ones((2000, 4000), dtype=np.float32); b = np.array(mx.array(a) * 2.0); del a, b
once()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    once()
print(f"{m.status}|{resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}")
"""


def _probe(disable: bool) -> tuple[str, int]:
    env = dict(os.environ)
    env.pop("MLX_SSP_NO_MALLOC_TUNING", None)
    if disable:
        env["MLX_SSP_NO_MALLOC_TUNING"] = "1"
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    status, faults = out.stdout.strip().splitlines()[-1].split("|")
    return status, int(faults)


def test_freed_buffers_are_reused_without_page_faults():
    status, faults = _probe(disable=False)
    assert status == "tuned"
    assert faults < 2000, faults  # 5 rounds of 32 MB buffers would be ~40,000+ faults without reuse
    off_status, off_faults = _probe(disable=True)
    assert off_status == "disabled by MLX_SSP_NO_MALLOC_TUNING"
    assert off_faults > 10 * max(faults, 100), (faults, off_faults)  # the same work, untuned, faults fresh pages
