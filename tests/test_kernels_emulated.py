"""Run the shipped Metal and CUDA kernel *source text* on the CPU, through a thread-level emulator.

No Metal or CUDA device is needed. Each kernel body (and its header) is compiled with g++ inside a small
shim: every GPU thread of a threadgroup / block becomes an OS thread; `threadgroup` / `__shared__`
arrays become statics shared by the group (filled with 1e30 first); barriers are a pthread
barrier; SIMD / warp reductions and `__shfl_xor_sync` exchange values through a shared slot
array between two barriers; bfloat16 is
stored as 16 bits with round-to-nearest-even. Threadgroups run one after another. The outputs are
compared with the plain-MLX reference, forward and backward.

What this shows: the kernel text as shipped computes the reference's values (indexing, tail
handling for vocab sizes that are not multiples of the threadgroup width, the online max/sum merge,
the reductions, the backward formula, the advantage semantics). What it cannot show: compilation
by the Metal compiler, Metal/CUDA-specific semantics beyond the shim (lockstep execution, memory
model, fast-math), or speed. Skipped where g++ (C++20) is missing.
"""

from __future__ import annotations

import ctypes
import hashlib
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

import mlx_ssp  # noqa: F401
import mlx.core as mx

from mlx_ssp.rl import kernels as K
from mlx_ssp.rl.kernels import advantages as KA, log_softmax as KL, sources as KS
from mlx_ssp.rl.logprobs import selective_log_softmax_reference

CXX = shutil.which("g++") or shutil.which("c++")
# slow: the first run compiles ~40 small C++ libraries (cached under the temp dir afterwards)
pytestmark = [pytest.mark.slow, pytest.mark.skipif(CXX is None, reason="no C++ compiler (g++) for the kernel emulator")]

SHIM = r"""
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

typedef unsigned int uint;
typedef unsigned long ulong;
struct uint3 { uint x, y, z; };
struct dim3 { uint x, y, z; };

struct emu_bf16 {
  uint16_t bits;
  emu_bf16() : bits(0) {}
  emu_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);  // round to nearest even
    bits = uint16_t(u >> 16);
  }
  operator float() const { uint32_t u = uint32_t(bits) << 16; float f; memcpy(&f, &u, 4); return f; }
};

namespace emu {
inline pthread_barrier_t bar;
inline float slots[1024];
inline thread_local int tid = 0;
inline void sync() { pthread_barrier_wait(&bar); }
inline float exchange(float v, int src) { slots[tid] = v; sync(); float r = slots[src]; sync(); return r; }
inline void poison(float* a, int n) { if (tid == 0) { for (int i = 0; i < n; ++i) a[i] = 1e30f; } sync(); }
template <class F> inline float simd_reduce(float v, F f) {
  slots[tid] = v; sync();
  int base = tid & ~31; float r = slots[base];
  for (int i = 1; i < 32; ++i) r = f(r, slots[base + i]);
  sync(); return r;
}
}  // namespace emu
"""

METAL_SHIM = r"""
#define device
#define constant
#define threadgroup
typedef emu_bf16 bfloat16_t;
namespace metal {
enum class mem_flags { mem_none, mem_threadgroup, mem_device };  // every barrier also orders memory here
inline void threadgroup_barrier(mem_flags) { emu::sync(); }
inline float simd_max(float v) { return emu::simd_reduce(v, [](float a, float b) { return a > b ? a : b; }); }
inline float simd_sum(float v) { return emu::simd_reduce(v, [](float a, float b) { return a + b; }); }
inline float exp(float x) { return ::expf(x); }
inline float log(float x) { return ::logf(x); }
inline float sqrt(float x) { return ::sqrtf(x); }
template <class A> inline A max(A a, A b) { return a > b ? a : b; }
template <class A> inline A min(A a, A b) { return a < b ? a : b; }
template <class A> inline A clamp(A x, A lo, A hi) { return x < lo ? lo : (x > hi ? hi : x); }
}  // namespace metal
"""

CUDA_SHIM = r"""
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
typedef emu_bf16 __nv_bfloat16;
inline thread_local dim3 blockIdx, threadIdx;
inline void __syncthreads() { emu::sync(); }
inline float __shfl_xor_sync(unsigned, float v, int o) { return emu::exchange(v, emu::tid ^ o); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
"""

CTYPE = {mx.float32: "float", mx.bfloat16: "emu_bf16", mx.int32: "int32_t"}
NPTYPE = {mx.float32: np.float32, mx.bfloat16: np.uint16, mx.int32: np.int32}
METAL_ATTRS = ["threadgroup_position_in_grid", "thread_index_in_threadgroup", "thread_index_in_simdgroup",
               "simdgroup_index_in_threadgroup"]

_BUILD = Path(tempfile.gettempdir()) / "mlx_ssp_kernel_emu"
_LIBS: dict[str, ctypes.CDLL] = {}


def _cpp(backend, name, in_dtypes, out_dtypes, template):
    src = K.load_source(name, backend)
    body = src.body
    # group-shared arrays become statics, filled with 1e30 before use (GPU memory starts as garbage;
    # NaN would hide in fmaxf)
    shared = r"^threadgroup\s+" if backend == "metal" else r"^__shared__\s+"
    body = re.sub(shared + r"float\s+(\w+)\[(\d+)\];", r"static float \1[\2]; emu::poison(\1, \2);", body, flags=re.M)
    params = [f"const {CTYPE[d]}* {n}" for n, d in zip(src.inputs, in_dtypes)]
    params += [f"{CTYPE[d]}* {n}" for n, d in zip(src.outputs, out_dtypes)]
    consts = ""
    for k, v in template:
        if isinstance(v, mx.Dtype):
            consts += f"  using {k} = {CTYPE[v]};\n"
        else:
            consts += f"  constexpr int {k} = {int(v)};\n"
    if backend == "metal":
        params += ["uint3 threadgroup_position_in_grid", "uint thread_index_in_threadgroup",
                   "uint thread_index_in_simdgroup", "uint simdgroup_index_in_threadgroup"]
        call_attrs = ", uint3{uint(g), 0, 0}, uint(t), uint(t % 32), uint(t / 32)"
        set_ids = ""
    else:
        call_attrs = ""
        set_ids = "blockIdx = dim3{uint(g), 0, 0}; threadIdx = dim3{uint(t), 0, 0};"
    n_in, n_out = len(src.inputs), len(src.outputs)
    args = [f"(const {CTYPE[d]}*)ins[{i}]" for i, d in enumerate(in_dtypes)]
    args += [f"({CTYPE[d]}*)outs[{i}]" for i, d in enumerate(out_dtypes)]
    return (
        SHIM + (METAL_SHIM if backend == "metal" else CUDA_SHIM) + src.header
        + "\nvoid kernel_fn(" + ", ".join(params) + ") {\n" + consts + body + "\n}\n"
        + "struct Job { void** ins; void** outs; int g; int t; };\n"
        + "static void* work(void* p) {\n  Job* j = (Job*)p; void** ins = j->ins; void** outs = j->outs;\n"
        + "  int g = j->g, t = j->t; emu::tid = t; " + set_ids + "\n"
        + "  kernel_fn(" + ", ".join(args) + call_attrs + ");\n  return nullptr;\n}\n"
        + 'extern "C" int run(void** ins, void** outs, int groups, int tg) {\n'
        + "  pthread_t th[1024]; Job jobs[1024];\n"
        + "  for (int g = 0; g < groups; ++g) {\n"
        + "    pthread_barrier_init(&emu::bar, nullptr, tg);\n"
        + "    for (int t = 0; t < tg; ++t) { jobs[t] = Job{ins, outs, g, t};\n"
        + "      if (pthread_create(&th[t], nullptr, work, &jobs[t]) != 0) return -1; }\n"
        + "    for (int t = 0; t < tg; ++t) pthread_join(th[t], nullptr);\n"
        + "    pthread_barrier_destroy(&emu::bar);\n  }\n  return 0;\n}\n"
        + f"// inputs {n_in} outputs {n_out}\n"
    )


def _lib(code: str) -> ctypes.CDLL:
    key = hashlib.sha1(code.encode()).hexdigest()[:16]
    if key not in _LIBS:
        _BUILD.mkdir(exist_ok=True)
        so = _BUILD / f"emu_{key}.so"
        if not so.exists():
            cpp = _BUILD / f"emu_{key}.cpp"
            cpp.write_text(code)
            r = subprocess.run([CXX, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-Wno-unknown-pragmas",
                                "-o", str(so) + ".tmp", str(cpp)], capture_output=True, text=True)
            if r.returncode != 0:
                pytest.fail(f"kernel source does not compile in the emulator:\n{r.stderr[-3000:]}")
            Path(str(so) + ".tmp").rename(so)
        _LIBS[key] = ctypes.CDLL(str(so))
    return _LIBS[key]


def _np(a: mx.array) -> np.ndarray:
    if a.dtype == mx.bfloat16:
        return np.ascontiguousarray(np.array(a.view(mx.uint16)))
    return np.ascontiguousarray(np.array(a))


def _from_np(x: np.ndarray, dtype) -> mx.array:
    return mx.array(x).view(mx.bfloat16) if dtype == mx.bfloat16 else mx.array(x)


def emulate(backend, name, inputs, out_shapes, out_dtypes, template, groups, tg):
    code = _cpp(backend, name, [a.dtype for a in inputs], out_dtypes, template)
    lib = _lib(code)
    ins = [_np(a) for a in inputs]
    outs = [np.zeros(s, dtype=NPTYPE[d]) for s, d in zip(out_shapes, out_dtypes)]
    in_ptrs = (ctypes.c_void_p * len(ins))(*[x.ctypes.data for x in ins])
    out_ptrs = (ctypes.c_void_p * len(outs))(*[x.ctypes.data for x in outs])
    assert lib.run(in_ptrs, out_ptrs, int(groups), int(tg)) == 0, "could not start the emulated threads"
    return [_from_np(o, d) for o, d in zip(outs, out_dtypes)]


# -- launchers with the same interface as the GPU ones, plugged into the real wrapper --------------


def _sls_fwd(backend, logits, targets, inv_t):
    n, vocab = logits.shape
    tg = KL.sls_threadgroup(vocab)
    t = KL._sls_templates(backend, logits.dtype, vocab)["fwd"]
    logp, lse = emulate(backend, "selective_log_softmax_fwd", [logits, targets, inv_t], [(n,), (n,)],
                        [mx.float32, mx.float32], t, n, tg)
    return logp, lse


def _sls_bwd(backend, logits, targets, inv_t, lse, cotan):
    n, vocab = logits.shape
    tg = KL.sls_threadgroup(vocab)
    t = KL._sls_templates(backend, logits.dtype, vocab)["bwd"]
    mx.eval(lse, cotan)
    (d,) = emulate(backend, "selective_log_softmax_bwd", [logits, targets, inv_t, lse, cotan], [logits.shape],
                   [logits.dtype], t, n, tg)
    return d


def _adv(backend, rewards, group_ids, params, sizes, scale, num_groups):
    n = rewards.shape[0]
    tg = KA._adv_threadgroup(max(n, num_groups))
    t = KS.template_args("grouped_advantages", backend, {"TG": tg, "SCALE": KA.SCALE_CODES[scale]})
    return emulate(backend, "grouped_advantages", [rewards, group_ids, params, sizes],
                   [(n,)] * 3 + [(num_groups,)] * 7, [mx.float32] * 10, t, 1, tg)


@pytest.fixture(params=["metal", "cuda"])
def emu_backend(request, monkeypatch):
    """The real wrapper (custom_function, vjp, dispatch) with the launchers running the emulated source."""
    b = request.param
    name = f"emu-{b}"
    monkeypatch.setitem(KL.SLS_LAUNCHERS, name, (lambda _b, *a: _sls_fwd(b, *a), lambda _b, *a: _sls_bwd(b, *a)))
    monkeypatch.setitem(KA.ADV_LAUNCHERS, name, lambda _b, *a: _adv(b, *a))
    yield name
    KL._sls_op.cache_clear()
    KA._adv_op.cache_clear()


def float32_tol(vocab: int) -> dict:
    """The reference's own float32 logsumexp error grows with V (vs float64: ~5e-5 at V = 50257 on
    CPU), so the comparison tolerance does too; against float64 the kernel stays within 2e-6."""
    return dict(rtol=1e-5 + 2e-9 * vocab, atol=1e-5 + 2e-9 * vocab)


def truth_logp(logits: mx.array, targets: mx.array, t: float) -> np.ndarray:
    x = np.array(logits.astype(mx.float32)).astype(np.float64) * np.float64(np.float32(1.0 / t))
    m = x.max(axis=1, keepdims=True)
    lse = np.log(np.exp(x - m).sum(axis=1)) + m[:, 0]
    return x[np.arange(x.shape[0]), np.array(targets)] - lse


@pytest.mark.parametrize("vocab,n", [(7, 3), (1000, 5), (50257, 2), (151936, 2)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_sls_kernel_source_forward_and_vjp(emu_backend, vocab, n, dtype):
    mx.random.seed(vocab + 1)
    logits = (mx.random.normal((n, vocab)) * 3.0).astype(dtype)
    targets = mx.random.randint(0, vocab, (n,)).astype(mx.int32)
    g = mx.random.normal((n,))
    g = mx.where(mx.arange(n) == n - 1, 0.0, g)  # a masked (padded) position
    tol = float32_tol(vocab) if dtype == mx.float32 else dict(rtol=2e-2, atol=2e-2)
    for t in (1.0, 0.7) if vocab > 10_000 else (1.0, 0.7, 1.3):
        (ref,), (dref,) = mx.vjp(lambda x: selective_log_softmax_reference(x, targets, t), [logits], [g])
        (out,), (d,) = mx.vjp(lambda x: K.selective_log_softmax_on(emu_backend, x, targets, t), [logits], [g])
        np.testing.assert_allclose(np.array(out), np.array(ref), **float32_tol(vocab))
        # against float64 ground truth the kernel is tight at every vocab size
        np.testing.assert_allclose(np.array(out), truth_logp(logits, targets, t), rtol=2e-6, atol=2e-6)
        assert d.dtype == dtype
        np.testing.assert_allclose(np.array(d.astype(mx.float32)), np.array(dref.astype(mx.float32)), **tol)
        assert np.all(np.array(d.astype(mx.float32))[n - 1] == 0)


def test_sls_kernel_source_extreme_rows(emu_backend):
    """A row with one huge logit, a row of equal logits, a row with -inf entries."""
    vocab = 1000
    rows = np.zeros((3, vocab), np.float32)
    rows[0, 17] = 80.0
    rows[2, ::3] = -np.inf
    logits = mx.array(rows)
    targets = mx.array([17, 500, 1], dtype=mx.int32)
    g = mx.ones((3,))
    (ref,), (dref,) = mx.vjp(lambda x: selective_log_softmax_reference(x, targets, 1.0), [logits], [g])
    (out,), (d,) = mx.vjp(lambda x: K.selective_log_softmax_on(emu_backend, x, targets, 1.0), [logits], [g])
    np.testing.assert_allclose(np.array(out), np.array(ref), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.array(d), np.array(dref), rtol=1e-5, atol=1e-6)


@pytest.fixture
def mgpo():
    return pytest.importorskip("mlx_ssp.rl.mgpo", reason="mlx_ssp.rl.mgpo not present")


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantage_kernel_source(mgpo, emu_backend, scale):
    from test_kernels import _adv_cases, assert_backend_matches_reference

    rng = np.random.default_rng(0)
    cases = list(_adv_cases()) + [
        ("more samples than threads", rng.integers(0, 2, 1100).astype(np.float32), np.repeat(np.arange(275), 4)),
        ("more groups than threads", rng.integers(0, 2, 2100).astype(np.float32), np.arange(2100) % 1050),
    ]
    assert_backend_matches_reference(mgpo, emu_backend, cases, scale)


def test_doctor_selfcheck_passes_on_the_kernel_source(mgpo, emu_backend):
    """`mlx_ssp doctor --kernels`'s checks, on the shipped kernel text run by the emulator: all pass."""
    from mlx_ssp.rl.kernels import selfcheck as S

    sls = (S.SLSCase(3, 1000, "float32", 0.7), S.SLSCase(2, 300, "bfloat16", 1.3))
    adv = (S.AdvCase(6, 4), S.AdvCase(9, 5, "batch", ragged=True, continuous=True))
    checks = S.check_backend(emu_backend, sls, adv, repeats=1)
    assert len(checks) == 4 and all(c.ok and not c.error for c in checks), S.format_checks(emu_backend, checks)
