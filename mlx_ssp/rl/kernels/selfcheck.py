"""The kernels' self-check (``mlx_ssp doctor --kernels``): every custom kernel against its plain-MLX
reference on this machine's GPU back-end, forward and backward, on a few shapes, with the worst
error and the speedup.

Each check runs an op through ``*_on(backend)`` (the same wrapper, ``mx.custom_function`` and vjp as
training uses) and through the reference, and compares them elementwise with the tolerances of
tests/test_kernels.py: float32 ``|a - b| <= tol + tol * |b|`` with ``tol = 1e-5 + 2e-9 * V`` (the
reference's own float32 ``logsumexp`` error grows with V), 2e-2 for float16 / bfloat16 inputs, 2e-5
for the advantages. A kernel that fails to build or raises is a failed check carrying the error. The
speedup is the reference's time over the kernel's, forward + backward, best of a few repeats after a
warm-up (which also builds the kernel). The cases are small enough for the whole check to take
seconds on an M-series GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_ssp.rl.kernels.advantages import grouped_advantages_on
from mlx_ssp.rl.kernels.dispatch import runnable_backends
from mlx_ssp.rl.kernels.log_softmax import selective_log_softmax_on, selective_log_softmax_reference
from mlx_ssp.rl.mgpo import mgpo_advantages

REPEATS = 5


@dataclass(frozen=True)
class SLSCase:
    """A selective log-softmax case: ``rows x vocab`` logits of ``dtype`` at ``temperature``."""

    rows: int
    vocab: int
    dtype: str  # float32 | float16 | bfloat16
    temperature: float = 1.0

    def __str__(self) -> str:
        return f"n={self.rows} V={self.vocab} {self.dtype} T={self.temperature:g}"


@dataclass(frozen=True)
class AdvCase:
    """A grouped-advantages case: ``groups`` groups of ``size`` samples (``ragged``: sizes 1..size,
    some groups empty), binary or continuous rewards."""

    groups: int
    size: int
    scale: str = "group"
    ragged: bool = False
    continuous: bool = False
    lam: float = 1.0

    def __str__(self) -> str:
        kind = "continuous" if self.continuous else "binary"
        return f"G={self.groups} x {'<=' if self.ragged else ''}{self.size} {kind} scale={self.scale}"


SLS_CASES = (SLSCase(64, 32000, "float32"), SLSCase(64, 151936, "bfloat16", 0.7), SLSCase(128, 50257, "float16", 1.3),
             SLSCase(16, 1000, "float32", 0.7))
ADV_CASES = (AdvCase(512, 8), AdvCase(64, 16, "batch", continuous=True), AdvCase(40, 6, "none", ragged=True),
             AdvCase(1, 64, lam=2.5))


@dataclass(frozen=True)
class Check:
    """One kernel on one case: the worst absolute errors (forward, backward), pass/fail, timings."""

    kernel: str
    case: str
    ok: bool
    forward_err: float = float("nan")
    backward_err: float = float("nan")
    kernel_s: float = float("nan")  # forward + backward, best of REPEATS
    reference_s: float = float("nan")
    error: str = ""  # why the kernel did not run (build failure, exception)

    @property
    def speedup(self) -> float:
        return self.reference_s / self.kernel_s if self.kernel_s > 0 else float("nan")


def compare(out: Any, ref: Any, rtol: float, atol: float) -> tuple[float, bool]:
    """(worst absolute error, all within ``atol + rtol * |ref|``) of two arrays of the same shape;
    a shape mismatch or a NaN where the reference has none fails (worst error inf)."""
    a = np.asarray(out.astype(mx.float32) if isinstance(out, mx.array) else out, dtype=np.float64)
    b = np.asarray(ref.astype(mx.float32) if isinstance(ref, mx.array) else ref, dtype=np.float64)
    if a.shape != b.shape:
        return float("inf"), False
    if a.size == 0:
        return 0.0, True
    same_special = (np.isnan(a) & np.isnan(b)) | (np.isinf(a) & (a == b))
    with np.errstate(invalid="ignore"):  # inf - inf: NaN, counted as an infinite error below
        diff = np.where(same_special, 0.0, np.abs(a - b))
    diff = np.where(np.isnan(diff), np.inf, diff)
    bound = atol + rtol * np.where(same_special, 0.0, np.abs(b))
    ok = bool(np.all(np.isfinite(diff) & (diff <= bound)))
    return float(diff.max()), ok


def best_time(fn: Callable[[], Any], repeats: int = REPEATS) -> float:
    """Seconds of the fastest of ``repeats`` evaluations of ``fn()`` (after one warm-up run)."""
    mx.eval(fn())
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(fn())
        best = min(best, time.perf_counter() - t)
    return best


def _sls_tol(case: SLSCase) -> float:
    return 1e-5 + 2e-9 * case.vocab if case.dtype == "float32" else 2e-2


def check_sls(backend: str, case: SLSCase, seed: int = 0, repeats: int = REPEATS) -> Check:
    """Selective log-softmax on ``backend`` vs the reference: values and vjp w.r.t. the logits."""
    name = "selective_log_softmax"
    mx.random.seed(seed)
    logits = (mx.random.normal((case.rows, case.vocab)) * 3.0).astype(getattr(mx, case.dtype))
    targets = mx.random.randint(0, case.vocab, (case.rows,)).astype(mx.int32)
    g = mx.random.normal((case.rows,))

    def fwd_bwd(fn):
        def run():
            (out,), (d,) = mx.vjp(lambda x: [fn(x, targets, case.temperature)], [logits], [g])
            return out, d
        return run

    kernel = fwd_bwd(lambda x, t, temp: selective_log_softmax_on(backend, x, t, temp))
    reference = fwd_bwd(selective_log_softmax_reference)
    try:
        out, d = kernel()
        mx.eval(out, d)
        k_s = best_time(kernel, repeats)
    except Exception as e:  # a build failure or a launch error is this check's verdict, not a crash
        return Check(name, str(case), False, error=f"{type(e).__name__}: {str(e)[:300]}")
    ref_out, ref_d = reference()
    tol = _sls_tol(case)
    f_err, f_ok = compare(out, ref_out, tol, tol)
    b_err, b_ok = compare(d, ref_d, tol, tol)
    return Check(name, str(case), f_ok and b_ok, f_err, b_err, k_s, best_time(reference, repeats))


def _adv_inputs(case: AdvCase, seed: int) -> tuple[mx.array, mx.array]:
    rng = np.random.default_rng(seed)
    if case.ragged:
        sizes = rng.integers(0, case.size + 1, case.groups)  # 0: an empty group
        sizes[0] = max(sizes[0], 1)
        ids = np.repeat(np.arange(case.groups), sizes)
        rng.shuffle(ids)  # unsorted ids
    else:
        ids = np.repeat(np.arange(case.groups), case.size)
    n = ids.shape[0]
    r = rng.normal(0.4, 0.5, n) if case.continuous else rng.integers(0, 2, n)
    return mx.array(r.astype(np.float32)), mx.array(ids.astype(np.int32))


def check_advantages(backend: str, case: AdvCase, seed: int = 0, repeats: int = REPEATS) -> Check:
    """Grouped MGPO advantages on ``backend`` vs :func:`mgpo_advantages`: every output field, and the
    vjp of the advantages w.r.t. the rewards."""
    name = "grouped_advantages"
    r, gid = _adv_inputs(case, seed)
    groups = case.groups
    cot = mx.array(np.random.default_rng(seed + 1).normal(size=r.shape[0]).astype(np.float32))

    def fwd_bwd(fn):
        def run():
            kw = {"lam": case.lam, "scale_rewards": case.scale, "eps": 1e-6, "num_groups": groups}
            out = fn(r, gid, **kw)
            _, (d,) = mx.vjp(lambda x: [fn(x, gid, **kw).advantages], [r], [cot])
            return (*out, d)
        return run

    kernel = fwd_bwd(lambda *a, **k: grouped_advantages_on(backend, *a, **k))
    reference = fwd_bwd(mgpo_advantages)
    try:
        outs = kernel()
        mx.eval(outs)
        k_s = best_time(kernel, repeats)
    except Exception as e:  # as for the log-softmax: the check fails with the error
        return Check(name, str(case), False, error=f"{type(e).__name__}: {str(e)[:300]}")
    refs = reference()
    fwd = [compare(a, b, 2e-5, 2e-5) for a, b in zip(outs[:-1], refs[:-1])]
    b_err, b_ok = compare(outs[-1], refs[-1], 1e-5, 1e-6)
    f_err = max(e for e, _ in fwd)
    ok = all(o for _, o in fwd) and b_ok
    return Check(name, str(case), ok, f_err, b_err, k_s, best_time(reference, repeats))


def check_backend(backend: str, sls_cases: Sequence[SLSCase] | None = None,
                  adv_cases: Sequence[AdvCase] | None = None, repeats: int = REPEATS) -> list[Check]:
    """Every kernel of ``backend`` (``metal``, ``cuda``, or a launcher name the ops know) on its cases
    (default: :data:`SLS_CASES`, :data:`ADV_CASES`)."""
    sls_cases = SLS_CASES if sls_cases is None else sls_cases
    adv_cases = ADV_CASES if adv_cases is None else adv_cases
    return ([check_sls(backend, c, i, repeats) for i, c in enumerate(sls_cases)]
            + [check_advantages(backend, c, i, repeats) for i, c in enumerate(adv_cases)])


def selfcheck(backends: Sequence[str] | None = None) -> dict[str, list[Check]]:
    """backend -> its checks, for each GPU back-end that runs here (none: an empty dict)."""
    return {b: check_backend(b) for b in (runnable_backends() if backends is None else backends)}


def format_checks(backend: str, checks: Sequence[Check]) -> list[str]:
    """One line per check: verdict, kernel, case, worst forward / backward error, speedup (or the error)."""
    lines = []
    for c in checks:
        head = f"{'PASS' if c.ok else 'FAIL'}  {backend:<5} {c.kernel:<22} {c.case:<34}"
        if c.error:
            lines.append(f"{head} {c.error}")
        else:
            lines.append(f"{head} fwd err {c.forward_err:.1e}  bwd err {c.backward_err:.1e}  "
                         f"{c.speedup:.2f}x ({c.kernel_s * 1e3:.2f} ms vs {c.reference_s * 1e3:.2f} ms)")
    return lines
