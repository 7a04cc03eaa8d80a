"""Custom GPU kernels for the MGPO-GRPO hot spots, with one dispatcher and a plain-MLX reference.

Two kernels, each written twice (Metal for Apple silicon, a CUDA twin for ``mlx[cuda]``), shipped as
package data in :mod:`mlx_ssp.kernels` (``kernels/*.metal``, ``*.cu``, ``*.h`` in the repository) and
built with ``mx.fast.metal_kernel`` / ``mx.fast.cuda_kernel`` once per process, following the pattern
of mlx-lm's ``tuner/losses.py`` (kernel body as source, ``mx.custom_function`` with an explicit vjp,
plain-MLX fallback):

1. **Fused selective log-softmax** (:func:`selective_log_softmax`): for each row of ``logits [n, V]``
   one threadgroup walks the vocabulary once with an online (max, sum of exp) pair in float32, merges
   the per-thread pairs with threadgroup reductions, and writes ``logp = x[t] - lse`` and ``lse``
   (``x = logits / T``). The backward kernel reads the saved ``lse`` and writes
   ``(softmax(x) - onehot) * (-g / T)`` in one pass. Used per chunk by
   :func:`mlx_ssp.rl.logprobs.token_logprobs`, so neither direction holds more than one chunk of
   [tokens x vocab]. This is the "selective log-softmax" of cut-cross-entropy (Wijmans et al., 2024)
   at chunk granularity; the math is the reference in :mod:`mlx_ssp.rl.logprobs`.
2. **Grouped MGPO advantages** (:func:`grouped_advantages`): one launch computes the per-group
   count, mean, sample std, p, ``D_ME(p || 0.5)`` and MGPO weight ``w = exp(-lambda * D_ME)``, then
   per sample the weighted normalized advantage ``w * (r - mean) / (std + eps)`` (VibeThinker-1.5B,
   arXiv:2511.06221, section 3.4), with exactly the conventions of
   :func:`mlx_ssp.rl.mgpo.mgpo_advantages` (sample std, all-equal groups get 0, ``scale_rewards``
   group / batch / none) and the same ``MGPOAdvantages`` result.

Dispatch (:func:`backend`): the Metal kernels when ``mx.metal.is_available()`` and the default device
is the GPU, the CUDA twins when ``mx.cuda.is_available()``, the reference otherwise (Linux CPU, CI).
``MLX_SSP_KERNELS=reference`` (or :func:`set_mode` / :func:`use_mode`, for a config key) forces the
reference; ``metal`` / ``cuda`` demand that backend and fail if it cannot run; ``auto`` is the default.

Deviations and limits (also in docs/kernels.md):

- A target id outside ``[0, V)`` is clamped inside the kernels (a kernel must not read out of
  bounds); the reference's result is undefined there. Callers pass valid ids (masked positions
  carry a valid id and a zero cotangent).
- The grouped-advantage kernel is one threadgroup; each thread scans the reward vector for the
  groups it owns, O(G * N / TG): fine for a batch of rollouts (hundreds to thousands); above
  ``ADV_KERNEL_MAX_N`` samples, or with group ids outside [0, G), the reference runs instead. Its
  vjp (never needed by the loss: advantages are constants) is the reference's vjp, in plain MLX.
- Kernel math uses ``exp``/``log`` in float32; results equal the reference to float32 rounding, not
  bit for bit (summation order differs).
- Verified where: see docs/kernels.md. On Linux CPU only the reference and the Python plumbing run
  (the plumbing through a plain-MLX statement of the kernel's outputs); the kernel source text is
  executed by a CPU thread emulator in tests/test_kernels_emulated.py, and the CUDA text compiles
  with NVRTC (scripts/check_cuda_kernels.py). Neither is a run on Metal or CUDA hardware.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
from collections import Counter
from dataclasses import dataclass
from importlib import resources
from typing import Callable, Iterator

import mlx.core as mx

from mlx_ssp.errors import UserError

ENV = "MLX_SSP_KERNELS"
MODES = ("auto", "reference", "metal", "cuda")
BACKENDS = ("metal", "cuda")
SUFFIX = {"metal": ".metal", "cuda": ".cu"}
KERNELS = ("selective_log_softmax_fwd", "selective_log_softmax_bwd", "grouped_advantages")
PACKAGE = "mlx_ssp.kernels"

SLS_M = 4  # contiguous elements per thread per block (vector-friendly loads)
SLS_MAX_TG = 1024  # threads per threadgroup / block (32 SIMD groups or warps)
SLS_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
ADV_KERNEL_MAX_N = 65536
SCALE_CODES = {"none": 0, "group": 1, "batch": 2}

_mode_override: str | None = None


# -- kernel sources -----------------------------------------------------------------------------


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


@functools.lru_cache(maxsize=None)
def load_source(name: str, backend: str) -> KernelSource:
    """Read ``kernels/<name>.metal`` or ``.cu`` (and its header) from the installed package."""
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


def _factory(backend: str) -> Callable:
    return {"metal": lambda: mx.fast.metal_kernel, "cuda": lambda: mx.fast.cuda_kernel}[backend]()


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


def _template(name: str, backend: str, values: dict) -> list[tuple[str, object]]:
    """Template arguments in the order the source declares; names must match exactly."""
    declared = load_source(name, backend).template
    if set(values) != set(declared):
        raise ValueError(f"{name}{SUFFIX[backend]} declares template {declared}, wrapper passes {sorted(values)}")
    return [(k, values[k]) for k in declared]


# -- dispatch -----------------------------------------------------------------------------------


def _mode() -> str:
    mode = (_mode_override or os.environ.get(ENV, "") or "auto").strip().lower()
    if mode not in MODES:
        raise UserError(f"{ENV}={mode!r} is not a kernel mode; choose from {', '.join(MODES)}")
    return mode


def set_mode(mode: str | None) -> None:
    """Force a kernel mode for this process (a config key maps here); ``None`` returns to the env/auto."""
    global _mode_override
    if mode is not None and mode.strip().lower() not in MODES:
        raise UserError(f"kernel mode {mode!r} is not one of {', '.join(MODES)}")
    _mode_override = None if mode is None else mode.strip().lower()


@contextlib.contextmanager
def use_mode(mode: str | None) -> Iterator[None]:
    """``with use_mode("reference"):`` runs the block with that kernel mode."""
    global _mode_override
    old = _mode_override
    set_mode(mode)
    try:
        yield
    finally:
        _mode_override = old


def _gpu_default() -> bool:
    return mx.default_device() == mx.gpu


def metal_available() -> bool:
    return bool(mx.metal.is_available()) and _gpu_default()


def cuda_available() -> bool:
    cuda = getattr(mx, "cuda", None)
    return bool(cuda is not None and cuda.is_available()) and _gpu_default()


_PROBES = {"metal": metal_available, "cuda": cuda_available}


def backend() -> str:
    """What runs now: ``"metal"``, ``"cuda"`` or ``"reference"``."""
    mode = _mode()
    if mode == "reference":
        return "reference"
    if mode in BACKENDS:
        if not _PROBES[mode]():
            raise UserError(f"{ENV}={mode} but the {mode} back-end is not available here; use auto or reference")
        return mode
    for name in BACKENDS:
        if _PROBES[name]():
            return name
    return "reference"


def kernel_available() -> bool:
    """True when a custom kernel (not the reference) will run."""
    return backend() != "reference"


def available() -> dict:
    """A description of what will run and why (for logs, ``mlx_ssp doctor`` and bug reports)."""
    mode = (_mode_override or os.environ.get(ENV, "") or "auto").strip().lower()
    info = {
        "mode": mode,
        "env": ENV,
        "metal": metal_available(),
        "cuda": cuda_available(),
        "default_device": str(mx.default_device()),
        "sources": str(source_dir()),
        "kernels": list(KERNELS),
        "built": {f"{b}:{n}": c for (b, n), c in BUILD_COUNTS.items()},
    }
    try:
        info["backend"] = backend()
        if info["backend"] == "reference":
            info["reason"] = (
                "forced by mode" if mode == "reference" else "no Metal or CUDA device (or default device is CPU)"
            )
        else:
            info["reason"] = f"{info['backend']} device available"
    except UserError as e:
        info["backend"], info["reason"] = "unavailable", str(e)
    return info


# -- kernel 1: fused selective log-softmax ------------------------------------------------------


def sls_threadgroup(vocab: int) -> int:
    """Threads per row: enough for one block of M-element reads to cover V, a multiple of 32, <= 1024."""
    need = -(-vocab // SLS_M)
    tg = 32
    while tg < need and tg < SLS_MAX_TG:
        tg *= 2
    return tg


def _sls_templates(backend: str, dtype, vocab: int) -> dict[str, list]:
    values = {"T": dtype, "V": int(vocab), "TG": sls_threadgroup(vocab), "M": SLS_M}
    return {
        "fwd": _template("selective_log_softmax_fwd", backend, values),
        "bwd": _template("selective_log_softmax_bwd", backend, values),
    }


def _sls_fwd_gpu(backend: str, logits: mx.array, targets: mx.array, inv_t: mx.array):
    n, vocab = logits.shape
    tg = sls_threadgroup(vocab)
    out = get_kernel("selective_log_softmax_fwd", backend)(
        inputs=[logits, targets, inv_t],
        template=_sls_templates(backend, logits.dtype, vocab)["fwd"],
        grid=(tg * n, 1, 1),
        threadgroup=(tg, 1, 1),
        output_shapes=[(n,), (n,)],
        output_dtypes=[mx.float32, mx.float32],
    )
    return out[0], out[1]


def _sls_bwd_gpu(backend: str, logits, targets, inv_t, lse, cotan):
    n, vocab = logits.shape
    tg = sls_threadgroup(vocab)
    return get_kernel("selective_log_softmax_bwd", backend)(
        inputs=[logits, targets, inv_t, lse, cotan],
        template=_sls_templates(backend, logits.dtype, vocab)["bwd"],
        grid=(tg * n, 1, 1),
        threadgroup=(tg, 1, 1),
        output_shapes=[logits.shape],
        output_dtypes=[logits.dtype],
    )[0]


def _sls_fwd_emulated(backend, logits, targets, inv_t):
    """Plain-MLX statement of the forward kernel's outputs (logp, lse): exercises the wrapper on CPU."""
    x = logits.astype(mx.float32) * inv_t[0]
    lse = mx.logsumexp(x, axis=-1)
    t = mx.clip(targets, 0, logits.shape[-1] - 1)
    return mx.take_along_axis(x, t[:, None], axis=-1)[:, 0] - lse, lse


def _sls_bwd_emulated(backend, logits, targets, inv_t, lse, cotan):
    """Plain-MLX statement of the backward kernel: (exp(x - lse) - onehot) * (-g / T) from the saved lse."""
    x = logits.astype(mx.float32) * inv_t[0]
    t = mx.clip(targets, 0, logits.shape[-1] - 1)
    onehot = (mx.arange(logits.shape[-1])[None, :] == t[:, None]).astype(mx.float32)
    return ((mx.exp(x - lse[:, None]) - onehot) * (-cotan * inv_t[0])[:, None]).astype(logits.dtype)


# backend -> (forward launcher, backward launcher). "emulate" is for tests of the wrapper on CPU.
SLS_LAUNCHERS: dict[str, tuple[Callable, Callable]] = {
    "metal": (_sls_fwd_gpu, _sls_bwd_gpu),
    "cuda": (_sls_fwd_gpu, _sls_bwd_gpu),
    "emulate": (_sls_fwd_emulated, _sls_bwd_emulated),
}


@functools.lru_cache(maxsize=None)
def _sls_op(backend: str):
    fwd, bwd = SLS_LAUNCHERS[backend]

    @mx.custom_function
    def sls(logits: mx.array, targets: mx.array, inv_t: mx.array):
        logp, lse = fwd(backend, logits, targets, inv_t)
        return logp, mx.stop_gradient(lse)

    @sls.vjp
    def sls_vjp(primals, cotangents, outputs):
        logits, targets, inv_t = primals
        g = cotangents[0].astype(mx.float32)
        d = bwd(backend, logits, targets, inv_t, outputs[1], g)
        return d, mx.zeros_like(targets), mx.zeros_like(inv_t)

    return sls


def _sls_kernel_ok(logits: mx.array) -> bool:
    return logits.ndim == 2 and logits.shape[0] > 0 and logits.shape[1] > 0 and logits.dtype in SLS_DTYPES


def selective_log_softmax_on(
    backend_name: str, logits: mx.array, targets: mx.array, temperature: float = 1.0
) -> mx.array:
    """:func:`selective_log_softmax` on a named backend (``metal``, ``cuda``, ``emulate``, ``reference``)."""
    from mlx_ssp.rl.logprobs import selective_log_softmax_reference

    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    targets = targets.astype(mx.int32)
    if logits.ndim == 2 and logits.shape[0] == 0:
        return mx.zeros((0,), dtype=mx.float32)
    if backend_name == "reference" or not _sls_kernel_ok(logits):
        return selective_log_softmax_reference(logits, targets, temperature)
    inv_t = mx.array([1.0 / float(temperature)], dtype=mx.float32)
    return _sls_op(backend_name)(logits, targets, inv_t)[0]


def selective_log_softmax(logits: mx.array, targets: mx.array, temperature: float = 1.0) -> mx.array:
    """``log_softmax(logits.astype(float32) / T)[i, targets[i]]`` -> [n] float32, on the best backend.

    Same signature, result and vjp (``g * (onehot - softmax(logits / T)) / T`` in logits' dtype) as
    :func:`mlx_ssp.rl.logprobs.selective_log_softmax_reference`, which runs wherever no kernel can
    (and for dtypes other than float32 / float16 / bfloat16)."""
    return selective_log_softmax_on(backend(), logits, targets, temperature)


# -- kernel 2: grouped MGPO advantages ----------------------------------------------------------

ADV_OUTPUTS = ("adv", "raw", "weight", "gp", "gd", "gw", "gmean", "gstd", "gcount", "gequal")


def _mgpo():
    from mlx_ssp.rl import mgpo

    return mgpo


def _adv_threadgroup(n: int) -> int:
    return min(1024, max(32, -(-n // 32) * 32))


def _adv_gpu(backend: str, rewards, group_ids, params, sizes, scale: str, num_groups: int):
    n = rewards.shape[0]
    tg = _adv_threadgroup(max(n, num_groups))
    return get_kernel("grouped_advantages", backend)(
        inputs=[rewards, group_ids, params, sizes],
        template=_template("grouped_advantages", backend, {"TG": tg, "SCALE": SCALE_CODES[scale]}),
        grid=(tg, 1, 1),
        threadgroup=(tg, 1, 1),
        output_shapes=[(n,)] * 3 + [(num_groups,)] * 7,
        output_dtypes=[mx.float32] * 10,
    )


# backend -> launcher(backend, rewards, group_ids, params, sizes, scale, num_groups) -> the 10 outputs
ADV_LAUNCHERS: dict[str, Callable] = {"metal": _adv_gpu, "cuda": _adv_gpu}


@functools.lru_cache(maxsize=None)
def _adv_op(backend: str, scale: str, num_groups: int):
    launch = ADV_LAUNCHERS[backend]

    @mx.custom_function
    def adv_op(rewards: mx.array, group_ids: mx.array, params: mx.array, sizes: mx.array):
        outs = list(launch(backend, rewards, group_ids, params, sizes, scale, num_groups))
        return tuple(outs[:2]) + tuple(mx.stop_gradient(o) for o in outs[2:])

    @adv_op.vjp
    def adv_vjp(primals, cotangents, outputs):
        # Advantages are constants of the loss (the RL loop never differentiates them); for
        # completeness the vjp is the reference's, differentiated in plain MLX on the small vector.
        rewards, group_ids, params, sizes = primals
        lam, eps = (float(v) for v in params.tolist())
        ref = _mgpo().mgpo_advantages

        def f(r):
            out = ref(r, group_ids, lam=lam, scale_rewards=scale, eps=eps, num_groups=num_groups)
            return [out.advantages, out.raw_advantages]

        _, (dr,) = mx.vjp(f, [rewards], list(cotangents[:2]))
        return dr, mx.zeros_like(group_ids), mx.zeros_like(params), mx.zeros_like(sizes)

    return adv_op


def grouped_advantages_on(
    backend_name: str,
    rewards,
    group_ids,
    *,
    lam: float = 1.0,
    scale_rewards: str = "group",
    eps: float = 1e-6,
    num_groups: int | None = None,
):
    """:func:`grouped_advantages` on a named backend (``metal``, ``cuda``, ``reference`` or a test launcher)."""
    mgpo = _mgpo()
    if scale_rewards not in SCALE_CODES:
        raise ValueError(f"scale_rewards must be one of {', '.join(SCALE_CODES)}, got {scale_rewards!r}")
    r = mx.array(rewards, dtype=mx.float32)
    gid = mx.array(group_ids).astype(mx.int32)

    def reference():
        return mgpo.mgpo_advantages(r, gid, lam=lam, scale_rewards=scale_rewards, eps=eps, num_groups=num_groups)

    if backend_name == "reference" or r.ndim != 1 or gid.shape != r.shape or not 0 < r.size <= ADV_KERNEL_MAX_N:
        return reference()
    lo, hi = mx.stack([gid.min(), gid.max()]).tolist()  # one sync; the reference needs G too
    n_groups = int(num_groups) if num_groups is not None else hi + 1
    if lo < 0 or hi >= n_groups:  # ids outside [0, G): leave it to the reference, never index out of bounds
        return reference()
    params = mx.array([float(lam), float(eps)], dtype=mx.float32)
    sizes = mx.array([r.size, n_groups], dtype=mx.int32)
    outs = _adv_op(backend_name, scale_rewards, n_groups)(r, gid, params, sizes)
    return mgpo.MGPOAdvantages(*outs[:9])  # the 10th output (all-equal flag per group) is internal


def grouped_advantages(
    rewards,
    group_ids,
    *,
    lam: float = 1.0,
    scale_rewards: str = "group",
    eps: float = 1e-6,
    num_groups: int | None = None,
):
    """MGPO-weighted group-relative advantages on the best backend -> ``MGPOAdvantages``.

    Same signature and result as :func:`mlx_ssp.rl.mgpo.mgpo_advantages` (the reference, used
    wherever no kernel runs and for more than ``ADV_KERNEL_MAX_N`` samples)."""
    return grouped_advantages_on(backend(), rewards, group_ids, lam=lam, scale_rewards=scale_rewards, eps=eps,
                                 num_groups=num_groups)


__all__ = [
    "ENV",
    "MODES",
    "available",
    "backend",
    "kernel_available",
    "set_mode",
    "use_mode",
    "load_source",
    "get_kernel",
    "selective_log_softmax",
    "grouped_advantages",
]
