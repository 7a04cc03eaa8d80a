"""``mlx_ssp.merge.torch_math`` against torch's own float32 ``acos``, ``sin``, ``cos`` and ``dot``
(tests/goldens/torch_math/, written by scripts/make_torch_math_goldens.py with torch 2.14.1 on an
x86_64 CPU): bit for bit with oneMKL installed, within one ulp (the dot: 1e-5 relative) with NumPy's
values, on edge cases and thousands of spread inputs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mlx_ssp.merge import torch_math as TM
from merge_helpers import RECORDED_MKL_BRANCH, mkl_parity_skip

GOLD = np.load(Path(__file__).resolve().parent / "goldens" / "torch_math" / "torch_float32.npz")
CASES = [("acos", "acos_x"), ("sin", "trig_x"), ("cos", "trig_x")]


def _ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Distance in float32 ulps (signed bit patterns made monotonic)."""
    ia, ib = (np.where(v.view(np.int32) < 0, np.int64(-(2 ** 31)) - v.view(np.int32), v.view(np.int32))
              for v in (a, b))
    return np.abs(ia.astype(np.int64) - ib.astype(np.int64))


def _dots() -> list[tuple[np.ndarray, np.ndarray, np.float32]]:
    out, lo = [], 0
    for n, d in zip(GOLD["dot_sizes"], GOLD["dot"]):
        out.append((GOLD["dot_x"][lo:lo + n], GOLD["dot_y"][lo:lo + n], d))
        lo += n
    return out


def test_reference_is_x86_torch():
    meta = json.loads(str(GOLD["meta"]))
    assert meta["torch"].startswith("2.14.1") and meta["cpu_capability"].startswith("AVX")
    # the inputs reach the edges: +-1, signed zeros, subnormals, huge arguments
    assert {1.0, -1.0} <= set(GOLD["acos_x"].tolist()) and np.signbit(GOLD["trig_x"]).any()
    assert np.abs(GOLD["trig_x"]).max() > 1e30 and (np.abs(GOLD["acos_x"]) < 1e-38).any()


@pytest.mark.skipif(mkl_parity_skip() is not None, reason=str(mkl_parity_skip()))
@pytest.mark.parametrize("op, x", CASES)
def test_mkl_is_torch_bit_for_bit(op, x, monkeypatch):
    got = getattr(TM, op)(GOLD[x])
    assert got.dtype == np.float32 and not (got.view(np.int32) != GOLD[f"{op}_y"].view(np.int32)).any()
    # the reference tells the two apart: NumPy's correctly rounded values differ in a few percent
    monkeypatch.setenv(TM.ENV, "numpy")
    assert TM.backend() == "numpy"
    assert (getattr(TM, op)(GOLD[x]).view(np.int32) != GOLD[f"{op}_y"].view(np.int32)).mean() > 0.01


@pytest.mark.skipif(mkl_parity_skip() is not None, reason=str(mkl_parity_skip()))
def test_mkl_dot_is_torch_bit_for_bit():
    for x, y, want in _dots():
        assert TM.dot(x, y) == want, x.size


def test_mkl_branch_is_recorded_and_reported():
    assert isinstance(RECORDED_MKL_BRANCH, int) and RECORDED_MKL_BRANCH >= 1
    b = TM.mkl_branch()
    assert (b is None) == (TM.backend() == "numpy") and (b is None or b >= 1)
    reason = mkl_parity_skip()
    assert reason is None or (str(b) in reason and str(RECORDED_MKL_BRANCH) in reason)


@pytest.mark.parametrize("op, x", CASES)
def test_numpy_values_within_one_ulp(op, x, monkeypatch):
    monkeypatch.setenv(TM.ENV, "numpy")
    got = getattr(TM, op)(GOLD[x])
    ok = np.isfinite(GOLD[f"{op}_y"])
    assert (np.isfinite(got) == ok).all() and _ulps(got[ok], GOLD[f"{op}_y"][ok]).max() <= 1
    for x_, y_, want in _dots():
        assert abs(TM.dot(x_, y_) - want) <= 1e-5 * max(1.0, abs(float(want)))


def test_scalars_and_shapes():
    v = TM.acos(np.float32(0.25))
    assert isinstance(v, np.float32) and abs(float(v) - np.arccos(0.25)) < 1e-6
    a = np.linspace(0, 3, 12, dtype=np.float32).reshape(3, 4)
    assert TM.sin(a).shape == (3, 4) and TM.cos(a[:0]).shape == (0, 4)
    assert TM.dot(np.zeros(0, np.float32), np.zeros(0, np.float32)) == 0
