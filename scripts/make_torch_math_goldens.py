"""Write torch's float32 ``acos``, ``sin``, ``cos`` and ``dot`` of fixed inputs
(tests/goldens/torch_math/torch_float32.npz), the reference of ``mlx_ssp.merge.torch_math``.

Run once by a developer in a venv with torch (the one scripts/make_merge_goldens.py uses), one
thread; ``tests/test_torch_math.py`` compares with the stored values without torch::

    /tmp/mkvenv/bin/python scripts/make_torch_math_goldens.py

The inputs: edge cases (signed zeros, subnormals, +-1 and their neighbours, multiples of pi, huge
arguments), values spread over the ranges slerp's angles take and far beyond, and random vectors
of 1 to 5000 elements for ``dot``. The npz also records torch's version and CPU capability: the
values are those of that build on that CPU (x86_64 builds take them from oneMKL). oneMKL's code
path for the CPU goes beside them by hand, measured with the project's oneMKL on the same machine
(``mlx_ssp.merge.torch_math.mkl_branch()``) into tests/goldens/torch_math/mkl_branch.json: the
bit-identity tests run only on that path.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

OUT = Path(__file__).resolve().parents[1] / "tests" / "goldens" / "torch_math" / "torch_float32.npz"
DOT_SIZES = (1, 2, 3, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 255, 256, 1000, 4800, 5000)


def _near(v: float, k: int) -> np.ndarray:
    """The ``k`` float32 values on each side of ``v``."""
    b = np.array([v], np.float32).view(np.int32)[0]
    return np.arange(b - k, b + k + 1, dtype=np.int32).view(np.float32)


def acos_inputs(rng) -> np.ndarray:
    tiny = np.float32(np.finfo(np.float32).smallest_subnormal)
    edge = [0.0, -0.0, tiny, -tiny, 1e-30, -1e-30, 1.0, -1.0, 0.5, -0.5, 0.9995, -0.9995]
    parts = [np.array(edge, np.float32), _near(1.0, 64), _near(-1.0, 64), _near(0.5, 16),
             rng.uniform(-1, 1, 6000), 1 - np.float32(10.0) ** -rng.uniform(0, 7, 1000),
             rng.uniform(-1e-3, 1e-3, 500)]
    x = np.concatenate([np.asarray(p, np.float32) for p in parts])
    return x[np.abs(x) <= 1]


def trig_inputs(rng) -> np.ndarray:
    tiny = np.float32(np.finfo(np.float32).smallest_subnormal)
    edge = [0.0, -0.0, tiny, -tiny, 1e-30, np.pi / 2, np.pi, 2 * np.pi, 3 * np.pi / 2, 1e4, 1e6, 1e30, -1e30,
            float(np.finfo(np.float32).max)]
    mag = np.float32(10.0) ** rng.uniform(-8, 8, 1500)
    parts = [np.array(edge, np.float32), _near(float(np.float32(np.pi)), 16), rng.uniform(0, 3.2, 5000),
             rng.uniform(-100, 100, 1000), mag, -mag]
    return np.concatenate([np.asarray(p, np.float32) for p in parts])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(20261207)
    out = {"acos_x": acos_inputs(rng), "trig_x": trig_inputs(rng)}
    out["acos_y"] = torch.acos(torch.from_numpy(out["acos_x"])).numpy()
    out["sin_y"] = torch.sin(torch.from_numpy(out["trig_x"])).numpy()
    out["cos_y"] = torch.cos(torch.from_numpy(out["trig_x"])).numpy()
    # 0-d tensors, as mergekit's karcher takes them: the same function (checked, not stored twice)
    for k in range(0, out["acos_x"].size, 97):
        assert torch.acos(torch.tensor(out["acos_x"][k])).numpy().view(np.int32) == out["acos_y"][k:k + 1].view(np.int32)
    xs, ys, dots = [], [], []
    for n in DOT_SIZES:
        x, y = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
        xs.append(x)
        ys.append(y)
        dots.append(torch.dot(torch.from_numpy(x), torch.from_numpy(y)).item())
    out.update(dot_sizes=np.array(DOT_SIZES), dot_x=np.concatenate(xs), dot_y=np.concatenate(ys),
               dot=np.array(dots, np.float32))
    meta = {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "generator": "scripts/make_torch_math_goldens.py"}
    out["meta"] = np.array(json.dumps(meta))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **out)
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes): {meta}")


if __name__ == "__main__":
    main()
