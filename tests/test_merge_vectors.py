"""Task vectors (mlx_ssp.merge.vectors): norms and cosines of fine-tunes' offsets from their base,
checked against numpy on whole models, and the identities they must hold."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import mlx_ssp  # noqa: F401
import mlx.core as mx

from mlx_ssp.merge.vectors import task_vectors


def _model(d: Path, tensors: dict[str, np.ndarray]) -> str:
    d.mkdir(parents=True)
    mx.save_safetensors(str(d / "model.safetensors"), {k: mx.array(v) for k, v in tensors.items()})
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return str(d)


def test_norms_and_cosines_match_numpy_and_hold_their_identities(tmp_path):
    rng = np.random.default_rng(0)
    base = {"a.weight": rng.normal(size=(4, 6)).astype(np.float32), "b.bias": rng.normal(size=(5,)).astype(np.float32)}
    t1 = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in base.items()}
    t2 = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in base.items()}
    paths = [_model(tmp_path / "base", base),
             _model(tmp_path / "m1", {k: base[k] + t1[k] for k in base}),
             _model(tmp_path / "m2", {k: base[k] + t2[k] for k in base}),
             _model(tmp_path / "m3", {k: base[k] + 2 * t1[k] for k in base})]  # m1's direction, twice as far
    got = task_vectors(paths[0], paths[1:])
    flat = [np.concatenate([(t[k]).ravel() for k in base]).astype(np.float64) for t in (t1, t2)]
    assert got["tensors"] == 2 and got["elements"] == 29 and got["skipped"] == 0
    assert got["norms"][0] == pytest.approx(np.linalg.norm(flat[0]), rel=1e-5)
    assert got["norms"][2] == pytest.approx(2 * got["norms"][0], rel=1e-5)
    c = got["cosine"]
    assert c[0][1] == pytest.approx(flat[0] @ flat[1] / np.linalg.norm(flat[0]) / np.linalg.norm(flat[1]), rel=1e-5)
    assert c[0][2] == pytest.approx(1.0, abs=1e-6) and c[1][0] == c[0][1] and c[1][1] == pytest.approx(1.0)


def test_a_model_equal_to_its_base_has_no_direction(tmp_path):
    base = {"w": np.ones((3, 3), np.float32)}
    got = task_vectors(_model(tmp_path / "b", base), [_model(tmp_path / "same", base)])
    assert got["norms"] == [0.0] and np.isnan(got["cosine"][0][0])
