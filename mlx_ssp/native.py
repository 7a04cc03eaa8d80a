"""Our C kernels, built with the system C compiler on first use and cached (Linux x86_64).

Two libraries use it: the few-row matmul kernel (:mod:`mlx_ssp._small_gemm`) and the merge's
elementwise passes (:mod:`mlx_ssp.merge.native`). :func:`load` compiles a library's sources once
per source text, compiler binary, flags and CPU (its feature flags: a library built with
``-march=native`` on one machine is never loaded on another that shares the cache) into
``<cache>/native/<name>-<key>.so`` and loads it. A failed build leaves a ``.failed`` file beside
the library's path (the compiler's message), so that later imports do not try again; builds of
the same library that have not been used for :data:`STALE_S` (another checkout, an older version)
are removed.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import suppress
from pathlib import Path
from typing import Optional, Sequence

from mlx_ssp.io import cache_dir

#: builds of other sources (another checkout, an older version) are removed after this long unused
STALE_S = 7 * 24 * 3600


def linux_x86_64() -> bool:
    return sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (``/proc/cpuinfo``; empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def compiler() -> Optional[str]:
    """``$CC``, else the first of cc, gcc and clang on PATH."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        path = shutil.which(name) if name else None
        if path:
            return path
    return None


def library_path(name: str, sources: Sequence[Path], cc: str, flags: Sequence[str], libs: Sequence[str],
                 per_cpu: bool = False) -> Path:
    """One file per source text, compiler binary (its path, size and mtime: cheaper than running
    it) and flags; ``per_cpu``: and per CPU feature set (for ``-march=native`` builds)."""
    st = os.stat(cc)
    key = hashlib.sha256()
    for src in sources:
        key.update(src.name.encode() + b"\0" + src.read_bytes())
    key.update(f"{cc}|{st.st_size}|{st.st_mtime_ns}|{' '.join([*flags, *libs])}".encode())
    if per_cpu:
        key.update(" ".join(sorted(cpu_flags())).encode())
    return cache_dir() / "native" / f"{name}-{key.hexdigest()[:16]}.so"


def _build(name: str, sources: Sequence[Path], cc: str, flags: Sequence[str], libs: Sequence[str],
           out: Path) -> None:
    """Compile into a temporary file beside ``out``, then rename: a concurrent build or a killed one
    never leaves a half-written library under the final name. A failed build leaves ``out`` with
    ``.failed`` appended (the compiler's message)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f"tmp-{name}-", suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [cc, *flags, "-o", tmp, *[str(s) for s in sources if s.suffix == ".c"], *libs]
        run = subprocess.run(cmd, capture_output=True, timeout=300)
        if run.returncode != 0:
            msg = run.stderr.decode(errors="replace")[-2000:]
            Path(f"{out}.failed").write_text(f"{cc} exited {run.returncode}\n{msg}")
            raise OSError(f"{cc} exited {run.returncode} (see {out}.failed)")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    now = time.time()
    for old in out.parent.iterdir():  # other checkouts' builds stay while in use; a killed build's file goes
        if old != out and old.name.startswith((f"{name}-", f"tmp-{name}-")):
            with suppress(OSError):
                if now - old.stat().st_mtime > (STALE_S if old.name.startswith(f"{name}-") else 3600):
                    old.unlink()


def load(name: str, sources: Sequence[Path], cc: str, flags: Sequence[str], libs: Sequence[str] = (),
         per_cpu: bool = False) -> ctypes.CDLL:
    """The library built from ``sources`` (headers among them count for the key only), loaded with
    RTLD_LOCAL; built first if needed. Raises OSError when the build fails or failed before."""
    path = library_path(name, sources, cc, flags, libs, per_cpu)
    failed = Path(f"{path}.failed")
    if failed.exists():
        raise OSError(f"an earlier build failed (see {failed}; delete it to try again)")
    if not path.exists():
        _build(name, sources, cc, flags, libs, path)
    try:
        loaded = ctypes.CDLL(str(path), mode=ctypes.RTLD_LOCAL)
    except OSError:  # a file another process half-removed: once more
        path.unlink(missing_ok=True)
        _build(name, sources, cc, flags, libs, path)
        loaded = ctypes.CDLL(str(path), mode=ctypes.RTLD_LOCAL)
    os.utime(path)  # in use: keeps it from being pruned as stale
    return loaded
