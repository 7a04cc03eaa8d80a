"""The kernel sources shipped beside this module (``*.metal``, ``*.cu``, ``*.h``) and their build.

Each kernel body is written twice, Metal for Apple silicon and a CUDA twin for ``mlx[cuda]``; its first
line declares the interface (``// @kernel inputs=... outputs=... template=... header=...``), so the
Python wrapper and the source cannot drift apart silently (:func:`template_args` checks the names).
:func:`get_kernel` hands body and header to ``mx.fast.metal_kernel`` / ``mx.fast.cuda_kernel`` the first
time a (back-end, kernel) pair is asked for and keeps the object for the rest of the process.
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources

import mlx.core as mx

PACKAGE = "mlx_ssp.rl.kernels"
SUFFIX = {"metal": ".metal", "cuda": ".cu"}
KERNELS = ("selective_log_softmax_fwd", "selective_log_softmax_bwd", "grouped_advantages")


@dataclass(frozen=True)
class KernelSource:
    """One kernel body as shipped, with the interface declared on its ``// @kernel`` first line."""

    name: str
    backend: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    template: tuple[str, ...]
    header_file: str
    body: str
    header: str


_SPEC = re.compile(r"^//\s*@kernel\s+(?P<fields>.+)$")


def source_dir():
    """The installed kernel sources (an importlib.resources Traversable)."""
    return resources.files(PACKAGE)


def _parse_spec(line: str, where: str) -> dict[str, str]:
    m = _SPEC.match(line.strip())
    if not m:
        raise ValueError(f"{where}: first line must be '// @kernel inputs=... outputs=... template=... header=...'")
    fields = dict(kv.split("=", 1) for kv in m.group("fields").split())
    missing = {"inputs", "outputs", "template", "header"} - fields.keys()
    if missing:
        raise ValueError(f"{where}: @kernel line lacks {sorted(missing)}")
    return fields


@functools.cache
def load_source(name: str, backend: str) -> KernelSource:
    """Read ``<name>.metal`` or ``<name>.cu`` (and its header) from the installed package."""
    if backend not in SUFFIX:
        raise ValueError(f"unknown kernel backend {backend!r}; choose from {sorted(SUFFIX)}")
    fname = name + SUFFIX[backend]
    res = source_dir() / fname
    if not res.is_file():
        raise FileNotFoundError(f"kernel source {fname} is not in the installed package {PACKAGE}")
    text = res.read_text(encoding="utf-8")
    fields = _parse_spec(text.splitlines()[0], fname)
    header = (source_dir() / fields["header"]).read_text(encoding="utf-8")

    def names(key):
        return tuple(x for x in fields[key].split(",") if x)

    return KernelSource(
        name, backend, names("inputs"), names("outputs"), names("template"), fields["header"], text, header
    )


# -- building (once per process) ----------------------------------------------------------------

BUILD_COUNTS: Counter = Counter()  # (backend, name) -> times built; tests assert it stays at 1
_KERNEL_CACHE: dict[tuple[str, str], object] = {}
# back-end -> the mlx constructor of its kernel objects (looked up late: mx.fast.cuda_kernel may be absent)
FACTORIES: dict[str, Callable[[], Callable]] = {
    "metal": lambda: mx.fast.metal_kernel,
    "cuda": lambda: mx.fast.cuda_kernel,
}


def _factory(backend: str) -> Callable:
    return FACTORIES[backend]()


def get_kernel(name: str, backend: str):
    """The compiled-on-first-call kernel object for (name, backend), created once per process."""
    key = (backend, name)
    kernel = _KERNEL_CACHE.get(key)
    if kernel is None:
        src = load_source(name, backend)
        kernel = _factory(backend)(
            name=f"mlx_ssp_{name}",
            input_names=list(src.inputs),
            output_names=list(src.outputs),
            source=src.body,
            header=src.header,
            ensure_row_contiguous=True,
        )
        _KERNEL_CACHE[key] = kernel
        BUILD_COUNTS[key] += 1
    return kernel


def template_args(name: str, backend: str, values: dict) -> list[tuple[str, object]]:
    """Template arguments in the order the source declares; names must match exactly."""
    declared = load_source(name, backend).template
    if set(values) != set(declared):
        raise ValueError(f"{name}{SUFFIX[backend]} declares template {declared}, wrapper passes {sorted(values)}")
    return [(k, values[k]) for k in declared]
