"""Compile the CUDA kernel twins with NVRTC, as mlx[cuda] would, on a machine without a GPU.

mlx's ``mx.fast.cuda_kernel`` wraps the kernel body in a generated ``__global__`` function (inputs
as ``const T*``, outputs as ``T*``, template arguments as ``constexpr int`` / ``using``), prepends
mlx's device headers and compiles with NVRTC at first launch. This script builds the same translation
unit for every instantiation mlx_ssp's wrappers launch (float32 / float16 / bfloat16, several vocab
sizes, every advantage scaling mode) and compiles it with NVRTC for --arch. Compiling needs no GPU,
so a syntax or type error in a ``.cu`` file shows up here rather than on the cluster.

It needs three things that do not come with mlx[cpu]; all are plain downloads from PyPI:

    pip download --no-deps -d /tmp/cuda "mlx-cuda-12==$(python -c 'import mlx.core as m; print(m.__version__)')" \
        nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12
    cd /tmp/cuda && for w in *.whl; do unzip -q -o "$w"; done
    python scripts/check_cuda_kernels.py --root /tmp/cuda

(--root is where the wheels were unpacked: it holds mlx/lib/libmlx.so, mlx/include/cccl and
nvidia/cuda_nvrtc, nvidia/cuda_runtime.) mlx embeds its device headers in libmlx.so as strings;
the script extracts the three the kernels include (utils.cuh, complex.cuh, config.h) from there.

What it proves: the CUDA sources compile for the target architecture with the real mlx headers.
What it does not: that they run correctly (tests/test_kernels_emulated.py runs their text on the CPU;
tests/test_kernels.py runs them on a GPU when one is present).
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import sys
import tempfile
from pathlib import Path

import mlx_ssp  # noqa: F401
import mlx.core as mx

from mlx_ssp.rl import kernels as K
from mlx_ssp.rl.kernels import advantages as KA, log_softmax as KL, sources as KS

# the generated source, mirroring mlx/backend/cuda/custom_kernel.cpp (mlx 0.32)
DEFAULT_HEADER = (
    '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
    "#define inf cuda::std::numeric_limits<float>::infinity()\n\n"
)
CUDA_TYPE = {mx.float32: "float", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.int32: "int32_t"}
HEADER_MARKERS = {  # file name -> a line only that embedded header contains
    "utils.cuh": b"using Shape = cuda::std::array",
    "config.h": b"#define MAX_NDIM",
    "complex.cuh": b"using complex_t = cuda::std::complex<T>",
}


def generated_source(src: K.KernelSource, in_dtypes, out_dtypes, template, fname: str) -> str:
    s = DEFAULT_HEADER + src.header + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
    s += f"__global__ void {fname}(\n"
    s += "".join(f"    const {CUDA_TYPE[d]}* {n},\n" for n, d in zip(src.inputs, in_dtypes))
    s += ",\n".join(f"    {CUDA_TYPE[d]}* {n}" for n, d in zip(src.outputs, out_dtypes)) + ") {\n"
    for k, v in template:
        if isinstance(v, mx.Dtype):
            s += f"  using {k} = {CUDA_TYPE[v]};\n"
        elif isinstance(v, bool):
            s += f"  constexpr bool {k} = {str(v).lower()};\n"
        else:
            s += f"  constexpr int {k} = {v};\n"
    return s + "\n" + src.body + "\n}\n\n} // namespace mlx::core::cu\n"


def extract_headers(libmlx: Path, out: Path) -> None:
    data = libmlx.read_bytes()
    dest = out / "mlx" / "backend" / "cuda" / "device"
    dest.mkdir(parents=True, exist_ok=True)
    for name, marker in HEADER_MARKERS.items():
        i = data.find(marker)
        if i < 0:
            raise SystemExit(f"{libmlx}: embedded {name} not found (another mlx version?)")
        start = data.rfind(b"\x00", 0, i) + 1
        (dest / name).write_bytes(data[start : data.find(b"\x00", i)])


class Nvrtc:
    def __init__(self, libdir: Path):
        builtins = sorted(libdir.glob("libnvrtc-builtins.so.*"))
        if builtins:
            ctypes.CDLL(str(builtins[-1]), mode=ctypes.RTLD_GLOBAL)
        (lib,) = sorted(libdir.glob("libnvrtc.so.*"))[:1] or [None]
        if lib is None:
            raise SystemExit(f"no libnvrtc.so.* in {libdir}")
        self.lib = ctypes.CDLL(str(lib))

    def compile(self, code: str, name: str, options: list[str]) -> tuple[int, str]:
        nv = self.lib
        prog = ctypes.c_void_p()
        if nv.nvrtcCreateProgram(ctypes.byref(prog), code.encode(), f"{name}.cu".encode(), 0, None, None):
            raise RuntimeError("nvrtcCreateProgram failed")
        nv.nvrtcAddNameExpression(prog, f"mlx::core::cu::{name}".encode())
        arr = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        rc = nv.nvrtcCompileProgram(prog, len(options), arr)
        size = ctypes.c_size_t()
        nv.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value + 1)
        nv.nvrtcGetProgramLog(prog, log)
        nv.nvrtcDestroyProgram(ctypes.byref(prog))
        return rc, log.value.decode(errors="replace")


def instantiations():
    for dtype, vocab in itertools.product([mx.float32, mx.float16, mx.bfloat16], [7, 1000, 50257, 151936]):
        t = KL._sls_templates("cuda", dtype, vocab)
        yield ("selective_log_softmax_fwd", [dtype, mx.int32, mx.float32], [mx.float32, mx.float32], t["fwd"],
               f"{dtype}-{vocab}")
        yield ("selective_log_softmax_bwd", [dtype, mx.int32, mx.float32, mx.float32, mx.float32], [dtype], t["bwd"],
               f"{dtype}-{vocab}")
    for scale, n in itertools.product(KA.SCALE_CODES, [5, 1000, 5000]):
        t = KS.template_args("grouped_advantages", "cuda", {"TG": KA._adv_threadgroup(n), "SCALE": KA.SCALE_CODES[scale]})
        yield "grouped_advantages", [mx.float32, mx.int32, mx.float32, mx.int32], [mx.float32] * 10, t, f"{scale}-{n}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", type=Path, required=True, help="folder with the unpacked mlx-cuda and nvidia wheels")
    ap.add_argument("--arch", default="sm_90", help="NVRTC --gpu-architecture (sm_90: H100/H200)")
    a = ap.parse_args()
    nvrtc = Nvrtc(a.root / "nvidia" / "cuda_nvrtc" / "lib")
    with tempfile.TemporaryDirectory() as tmp:
        extract_headers(a.root / "mlx" / "lib" / "libmlx.so", Path(tmp))
        options = [
            f"--gpu-architecture={a.arch}",
            f"--include-path={a.root / 'mlx' / 'include' / 'cccl'}",
            f"--include-path={a.root / 'nvidia' / 'cuda_runtime' / 'include'}",
            f"--include-path={tmp}",
        ]
        failures = 0
        for i, (name, ins, outs, template, what) in enumerate(instantiations()):
            src = K.load_source(name, "cuda")
            fname = f"custom_kernel_mlx_ssp_{name}_{i}"
            rc, log = nvrtc.compile(generated_source(src, ins, outs, template, fname), fname, options)
            print(f"{'ok  ' if rc == 0 else 'FAIL'} {name:28s} {what}")
            if rc:
                failures += 1
                print(log.strip())
    print(f"{failures} failure(s); NVRTC {a.arch}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
