"""Custom kernels (mlx_ssp.rl.kernels): dispatch, packaging, source well-formedness, and equality with
the plain-MLX reference.

Where a kernel can run (Metal on a Mac, CUDA with mlx[cuda]) the `*_on_device` tests compare it with
the reference, forward and vjp; elsewhere they are skipped with the reason. What runs everywhere:
the dispatcher, the env override, packaging (importlib.resources, the wheel), build-once caching,
source/interface consistency, and the custom_function plumbing through a plain-MLX emulation of
each kernel's outputs (the "emulate" backend) and a NumPy port of the advantage kernel.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

import mlx_ssp  # noqa: F401
import mlx.core as mx

from mlx_ssp.errors import UserError
from mlx_ssp.rl import kernels as K
from mlx_ssp.rl.kernels import advantages as KA, dispatch as KD, log_softmax as KL, sources as KS
from mlx_ssp.rl.logprobs import chunk_impl_name, naive_token_logprobs, selective_log_softmax_reference, token_logprobs

ROOT = Path(__file__).resolve().parents[1]

VOCABS = [7, 1000, 50257, 151936]  # tiny, non-multiples of 32 * 4, GPT-2, Qwen3
TEMPS = [1.0, 0.7, 1.3]


@pytest.fixture(autouse=True)
def _clean_mode(monkeypatch):
    monkeypatch.delenv(K.ENV, raising=False)
    K.set_mode(None)
    yield
    K.set_mode(None)


def _rows_for(vocab: int) -> int:
    return 3 if vocab > 100_000 else 9  # keep [n x V] small on CPU


def _case(vocab, dtype, seed=0):
    mx.random.seed(seed)
    n = _rows_for(vocab)
    logits = (mx.random.normal((n, vocab)) * 3.0).astype(dtype)
    targets = mx.random.randint(0, vocab, (n,)).astype(mx.int32)
    # ragged mask: padded positions carry a valid id and a zero cotangent
    mask = mx.array([1.0 if i % 4 != 3 else 0.0 for i in range(n)])
    g = mx.random.normal((n,)) * mask
    return logits, targets, g


def _fwd_vjp(fn, logits, targets, g, temperature):
    (out,), (d,) = mx.vjp(lambda x: fn(x, targets, temperature), [logits], [g])
    mx.eval(out, d)
    return out, d


def _tol(dtype, vocab):
    # float32: the reference's own logsumexp error grows with V (~5e-5 at V = 50257 on CPU vs float64)
    if dtype == mx.float32:
        return dict(rtol=1e-5 + 2e-9 * vocab, atol=1e-5 + 2e-9 * vocab)
    return dict(rtol=2e-2, atol=2e-2)  # bf16 / fp16 inputs (and gradients), float32 accumulation


def _close(a, b, dtype, what, vocab):
    a = np.array(a.astype(mx.float32))
    b = np.array(b.astype(mx.float32))
    np.testing.assert_allclose(a, b, err_msg=what, **_tol(dtype, vocab))


# -- dispatch -----------------------------------------------------------------------------------


def test_dispatcher_picks_reference_on_this_machine():
    if mx.metal.is_available() or K.cuda_available():
        pytest.skip("this machine has a GPU back-end; the CPU dispatch case does not apply")
    assert K.backend() == "reference"
    assert K.kernel_available() is False
    info = K.available()
    assert info["backend"] == "reference" and info["metal"] is False and info["cuda"] is False
    assert "no Metal or CUDA" in info["reason"]
    logits, targets, _ = _case(1000, mx.float32)
    a = K.selective_log_softmax(logits, targets, 0.7)
    b = selective_log_softmax_reference(logits, targets, 0.7)
    assert mx.array_equal(a, b)


def test_env_var_forces_reference(monkeypatch):
    monkeypatch.setitem(KD._PROBES, "metal", lambda: True)  # pretend a Mac
    assert K.backend() == "metal"
    monkeypatch.setenv(K.ENV, "reference")
    assert K.backend() == "reference"
    assert K.available()["reason"] == "forced by mode"
    monkeypatch.setenv(K.ENV, "Reference ")  # case / whitespace tolerant
    assert K.backend() == "reference"


def test_mode_override_and_context(monkeypatch):
    monkeypatch.setitem(KD._PROBES, "cuda", lambda: True)
    monkeypatch.setitem(KD._PROBES, "metal", lambda: False)
    assert K.backend() == "cuda"
    with K.use_mode("reference"):
        assert K.backend() == "reference"
    assert K.backend() == "cuda"
    K.set_mode("reference")
    monkeypatch.setenv(K.ENV, "auto")  # the programmatic override (config key) wins over the env
    assert K.backend() == "reference"


def test_metal_preferred_over_cuda(monkeypatch):
    monkeypatch.setitem(KD._PROBES, "metal", lambda: True)
    monkeypatch.setitem(KD._PROBES, "cuda", lambda: True)
    assert K.backend() == "metal"


def test_bad_or_unavailable_mode_is_a_user_error(monkeypatch):
    monkeypatch.setenv(K.ENV, "fast")
    with pytest.raises(UserError, match="auto, reference, metal, cuda"):
        K.backend()
    assert K.available()["backend"] == "unavailable"
    monkeypatch.setitem(KD._PROBES, "cuda", lambda: False)
    monkeypatch.setenv(K.ENV, "cuda")
    with pytest.raises(UserError, match="not available"):
        K.backend()
    with pytest.raises(UserError):
        K.set_mode("turbo")


def test_logprobs_chunk_dispatch_follows_kernels(monkeypatch):
    """token_logprobs picks our selective_log_softmax exactly when a kernel would run."""
    from mlx_ssp.rl import logprobs

    expected = K.selective_log_softmax if K.kernel_available() else selective_log_softmax_reference
    assert logprobs._chunk_impl() is expected
    monkeypatch.setitem(KD._PROBES, "metal", lambda: True)
    assert logprobs._chunk_impl() is K.selective_log_softmax
    monkeypatch.setenv(K.ENV, "reference")
    assert logprobs._chunk_impl() is selective_log_softmax_reference


def _imported_modules(tree) -> set[str]:
    import ast

    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            out |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.module:
            out |= {n.module} | {f"{n.module}.{a.name}" for a in n.names}
    return out


def test_one_dispatcher_and_no_import_circle():
    """The kernel package never imports the chunked op built on it; only dispatch.py reads the env var."""
    import ast

    pkg = ROOT / "mlx_ssp"
    for f in (pkg / "rl" / "kernels").glob("*.py"):
        mods = _imported_modules(ast.parse(f.read_text()))
        op = ("mlx_ssp.rl.logprobs", "mlx_ssp.rl.chunked_op", "mlx_ssp.rl.chunk_engines", "mlx_ssp.rl.lm_heads")
        assert not any(m.startswith(op) for m in mods), f"{f.name} imports the log-prob op"
    readers = sorted(
        f.relative_to(pkg).as_posix() for f in pkg.rglob("*.py")
        if any(isinstance(n, ast.Constant) and n.value == K.ENV for n in ast.walk(ast.parse(f.read_text())))
    )
    assert readers == ["rl/kernels/dispatch.py"]


# -- packaging and sources ----------------------------------------------------------------------


def test_sources_load_from_installed_package():
    d = K.source_dir()
    names = {p.name for p in d.iterdir()}
    for kernel in K.KERNELS:
        for backend, suffix in K.SUFFIX.items():
            assert kernel + suffix in names
            src = K.load_source(kernel, backend)
            assert src.header_file in names and src.header.strip()
            assert src.body.startswith("// @kernel")


def test_kernel_folder_files_are_all_package_data():
    import tomllib

    setuptools_cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = setuptools_cfg["package-data"]["mlx_ssp.rl.kernels"]
    suffixes = {p.lstrip("*") for p in patterns}
    for f in (ROOT / "mlx_ssp" / "rl" / "kernels").iterdir():
        if f.is_file() and f.suffix not in (".py", ".pyc"):  # Python modules ship as the package itself
            assert f.suffix in suffixes, f"{f.name} would not ship in the wheel"


@pytest.mark.slow
def test_wheel_contains_kernel_sources(tmp_path):
    # build from a copy: an in-tree build would leave build/ and egg-info behind in the shared checkout
    src = tmp_path / "src"
    skip = shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__", ".pytest_cache", "runs")
    shutil.copytree(ROOT, src, ignore=skip)
    r = subprocess.run(
        # an isolated build gets the setuptools that pyproject.toml asks for (a fresh venv's may be older)
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "-q", "-w", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    if r.returncode != 0:
        pytest.skip(f"could not build a wheel here: {r.stderr.strip()[-300:]}")
    (whl,) = tmp_path.glob("mlx_ssp-*.whl")
    names = set(zipfile.ZipFile(whl).namelist())
    for kernel in K.KERNELS:
        for suffix in K.SUFFIX.values():
            assert f"mlx_ssp/rl/kernels/{kernel}{suffix}" in names
    shipped = {f"mlx_ssp/rl/kernels/{f}" for f in ("ssp_metal.h", "ssp_cuda.h", "__init__.py", "dispatch.py")}
    assert shipped <= names


_METAL_ATTRS = {
    "thread_position_in_grid", "threadgroup_position_in_grid", "thread_index_in_threadgroup",
    "thread_index_in_simdgroup", "simdgroup_index_in_threadgroup", "threads_per_threadgroup",
    "thread_position_in_threadgroup", "threadgroups_per_grid", "threads_per_simdgroup", "simdgroups_per_threadgroup",
}


def _code(text: str) -> str:
    """Source without comments."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


@pytest.mark.parametrize("kernel", K.KERNELS)
def test_sources_are_well_formed_and_twins_agree(kernel):
    metal, cuda = K.load_source(kernel, "metal"), K.load_source(kernel, "cuda")
    assert (metal.inputs, metal.outputs, metal.template) == (cuda.inputs, cuda.outputs, cuda.template)
    for src in (metal, cuda):
        code = _code(src.body)
        assert code.count("{") == code.count("}") and code.count("(") == code.count(")")
        for name in src.inputs + src.outputs:
            assert re.search(rf"\b{name}\b", code), f"{kernel}{K.SUFFIX[src.backend]}: {name} is declared but unused"
        for name in src.inputs:  # mlx would append extra shape/stride parameters the wrapper does not expect
            assert not re.search(rf"\b{name}_(shape|strides|ndim)\b", src.body)
        assert len(set(src.inputs + src.outputs + src.template)) == len(src.inputs + src.outputs + src.template)
    for name in metal.template:  # a Metal body may leave T to the signature (input dtypes are in it)
        assert re.search(rf"\b{name}\b", _code(metal.body) + _code(cuda.body)), f"template {name} unused"
    mcode, ccode = _code(metal.body + metal.header), _code(cuda.body + cuda.header)
    assert "__syncthreads" not in mcode and "blockIdx" not in mcode and "__shared__" not in mcode
    assert "threadgroup_barrier" not in ccode and "simd_" not in ccode and "metal::" not in ccode
    used = set(re.findall(r"\b(thread\w*|simdgroup\w*)\b", _code(metal.body))) - {"threadgroup", "threadgroup_barrier"}
    assert used <= _METAL_ATTRS, used - _METAL_ATTRS


def test_wrapper_templates_match_sources():
    for backend in K.BACKENDS:
        for vocab in VOCABS:
            for dtype in KL.SLS_DTYPES:
                t = KL._sls_templates(backend, dtype, vocab)
                assert [k for k, _ in t["fwd"]] == list(K.load_source("selective_log_softmax_fwd", backend).template)
                assert [k for k, _ in t["bwd"]] == list(K.load_source("selective_log_softmax_bwd", backend).template)
        with pytest.raises(ValueError, match="declares template"):
            KS.template_args("grouped_advantages", backend, {"TG": 32})


@pytest.mark.parametrize("vocab", VOCABS + [1, 32, 128, 129, 4096, 4097])
def test_threadgroup_width(vocab):
    tg = KL.sls_threadgroup(vocab)
    assert tg % 32 == 0 and 32 <= tg <= 1024 and (tg & (tg - 1)) == 0
    assert tg * KL.SLS_M >= vocab or tg == 1024
    assert 32 <= KA._adv_threadgroup(vocab) <= 1024 and KA._adv_threadgroup(vocab) % 32 == 0


def test_kernels_built_once_per_process(monkeypatch):
    monkeypatch.setattr(KS, "_KERNEL_CACHE", {})
    monkeypatch.setattr(KS, "BUILD_COUNTS", type(KS.BUILD_COUNTS)())
    calls = []

    def fake_cuda(**kw):
        calls.append(kw)
        return object()

    real_factory = KS._factory
    monkeypatch.setattr(KS, "_factory", lambda b: fake_cuda if b == "cuda" else real_factory(b))
    for _ in range(3):
        # Metal kernel objects can be created (not run) without Metal: this is the real mlx call
        a = K.get_kernel("selective_log_softmax_fwd", "metal")
        b = K.get_kernel("selective_log_softmax_fwd", "cuda")
    assert K.get_kernel("selective_log_softmax_fwd", "metal") is a
    assert K.get_kernel("selective_log_softmax_fwd", "cuda") is b
    assert KS.BUILD_COUNTS[("metal", "selective_log_softmax_fwd")] == 1
    assert KS.BUILD_COUNTS[("cuda", "selective_log_softmax_fwd")] == 1
    (kw,) = calls
    src = K.load_source("selective_log_softmax_fwd", "cuda")
    assert kw["input_names"] == list(src.inputs) and kw["output_names"] == list(src.outputs)
    assert kw["source"] == src.body and kw["header"] == src.header


def test_metal_kernel_objects_build_for_every_kernel(monkeypatch):
    monkeypatch.setattr(KS, "_KERNEL_CACHE", {})
    for kernel in K.KERNELS:
        assert K.get_kernel(kernel, "metal") is not None


# -- the custom_function plumbing, through plain-MLX statements of each kernel --------------------


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_emulated_sls_forward_and_vjp_equal_reference(vocab, dtype):
    logits, targets, g = _case(vocab, dtype)
    for t in TEMPS:
        ref_out, ref_d = _fwd_vjp(selective_log_softmax_reference, logits, targets, g, t)
        out, d = _fwd_vjp(lambda x, y, T: K.selective_log_softmax_on("emulate", x, y, T), logits, targets, g, t)
        assert out.dtype == mx.float32 and d.dtype == dtype and d.shape == logits.shape
        _close(out, ref_out, mx.float32, f"forward V={vocab} T={t}", vocab)
        _close(d, ref_d, dtype, f"vjp V={vocab} T={t}", vocab)
        masked = np.array(g) == 0
        assert np.all(np.array(d.astype(mx.float32))[masked] == 0)


def test_dispatch_to_a_kernel_backend_runs_through_token_logprobs(monkeypatch):
    """With a (pretend) Metal device, token_logprobs goes through our custom_function: equal to naive."""
    import mlx.nn as nn

    monkeypatch.setitem(KD._PROBES, "metal", lambda: True)
    monkeypatch.setitem(KL.SLS_LAUNCHERS, "metal", KL.SLS_LAUNCHERS["emulate"])
    KL._sls_op.cache_clear()
    try:
        mx.random.seed(1)
        head = nn.Linear(16, 1000, bias=False)
        h = mx.random.normal((2, 5, 16))
        tg = mx.random.randint(0, 1000, (2, 5))
        g = mx.random.normal((2, 5))
        lp, (dh,) = mx.vjp(lambda x: token_logprobs(x, head, tg, 0.8, chunk_size=3), [h], [g])[0:2]
        lp_n, (dh_n,) = mx.vjp(lambda x: naive_token_logprobs(x, head, tg, 0.8), [h], [g])[0:2]
        # float32 matmuls of different shapes (3-row chunks vs naive) round differently on a GPU (1.7e-4 on an H200)
        atol = 5e-4 if mx.default_device() == mx.gpu else 1e-5
        np.testing.assert_allclose(np.array(lp), np.array(lp_n), rtol=1e-5, atol=atol)
        np.testing.assert_allclose(np.array(dh), np.array(dh_n), rtol=1e-4, atol=atol)
    finally:
        KL._sls_op.cache_clear()


def test_kernel_path_keeps_a_trained_head_gradient_on_the_device(monkeypatch):
    """Full fine-tuning through a kernel back-end (emulated): the [V x D] head gradient is summed over
    the chunks on the helper thread, never copied through NumPy (_detach) once per chunk, which made
    the chunked op 26-37x slower than the reference on an H200; only the per-token chunk inputs are.
    The gradients into the hidden states and the head equal the reference path's."""
    import mlx.nn as nn

    from mlx_ssp.rl import chunked_op as LP

    monkeypatch.setitem(KD._PROBES, "metal", lambda: True)
    bwd_calls = []

    def bwd(*a):
        bwd_calls.append(1)
        return KL._sls_bwd_emulated(*a)

    monkeypatch.setitem(KL.SLS_LAUNCHERS, "metal", (KL._sls_fwd_emulated, bwd))
    copied = []

    def counting_detach(x):
        copied.append(x.nbytes)
        return detach(x)

    detach = LP._detach
    monkeypatch.setattr(LP, "_detach", counting_detach)
    KL._sls_op.cache_clear()
    try:
        mx.random.seed(4)
        V, D, n = 8000, 64, 16  # 4 chunks of 4 tokens; the head gradient is 2 MiB
        head = nn.Linear(D, V, bias=False)
        w = head.weight
        h, tg, g = mx.random.normal((n, D)), mx.random.randint(0, V, (n,)), mx.random.normal((n,))
        mx.eval(w, h, tg, g)

        def run(mode):
            def f(x, weight):
                head.weight = weight
                return token_logprobs(x, head, tg, 0.8, chunk_size=4)

            with K.use_mode(mode):
                lp, (dh, dw) = mx.vjp(f, [h, w], [g])[0:2]
            mx.eval(lp, dh, dw)
            head.weight = w
            return lp, dh, dw

        copied.clear()
        got = run("auto")
        assert len(bwd_calls) == 4  # the kernel's backward ran, once per chunk
        assert sum(copied) < w.nbytes / 4, f"{sum(copied)} bytes through NumPy for a {w.nbytes}-byte head"
        for a, b in zip(got, run("reference")):
            np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-6)
    finally:
        KL._sls_op.cache_clear()


@pytest.mark.parametrize("chunk", [4, 64])  # several chunks (helper thread), one chunk (lazy)
@pytest.mark.parametrize("entropy", [False, True])
def test_kernel_path_with_save_grad_matches_reference(monkeypatch, chunk, entropy):
    """save_grad (frozen head: the RL training path) through a kernel back-end (emulated) equals the
    reference path; KernelEngine.saved once lacked the entropy_grad argument make_saved_op passes (found on an H200)."""
    import mlx.nn as nn

    monkeypatch.setitem(KD._PROBES, "metal", lambda: True)
    monkeypatch.setitem(KL.SLS_LAUNCHERS, "metal", KL.SLS_LAUNCHERS["emulate"])
    KL._sls_op.cache_clear()
    try:
        mx.random.seed(5)
        head = nn.Linear(16, 300, bias=False)
        head.freeze()
        h, tg, g = mx.random.normal((12, 16)), mx.random.randint(0, 300, (12,)), mx.random.normal((12,))

        def run(mode):
            def f(x):
                out = token_logprobs(x, head, tg, 0.7, chunk, return_entropy=entropy, save_grad=True)
                return out[0] if entropy else out

            with K.use_mode(mode):
                assert (mode == "reference") == (chunk_impl_name() == "reference")
                lp, (dh,) = mx.vjp(f, [h], [g])[0:2]
            return lp[0], dh

        for a, b in zip(run("auto"), run("reference")):
            np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-6)
    finally:
        KL._sls_op.cache_clear()


def test_unsupported_inputs_fall_back_to_reference(monkeypatch):
    monkeypatch.setitem(KD._PROBES, "metal", lambda: True)

    def boom(*a, **k):
        raise AssertionError("kernel launched for an unsupported input")

    monkeypatch.setitem(KL.SLS_LAUNCHERS, "metal", (boom, boom))
    KL._sls_op.cache_clear()
    try:
        logits = mx.zeros((0, 10))
        assert K.selective_log_softmax(logits, mx.zeros((0,), dtype=mx.int32)).shape == (0,)
        with pytest.raises(ValueError):
            K.selective_log_softmax(mx.zeros((2, 10)), mx.zeros((2,), dtype=mx.int32), 0.0)
    finally:
        KL._sls_op.cache_clear()


# -- grouped advantages -------------------------------------------------------------------------

@pytest.fixture
def mgpo():
    return pytest.importorskip("mlx_ssp.rl.mgpo", reason="mlx_ssp.rl.mgpo not present")


def _adv_cases():
    rng = np.random.default_rng(0)
    binary = rng.integers(0, 2, 24).astype(np.float32)
    yield "binary, groups of 4", binary, np.repeat(np.arange(6), 4)
    yield "groups of one", rng.integers(0, 2, 5).astype(np.float32), np.arange(5)
    yield "all equal rewards", np.ones(8, np.float32), np.repeat(np.arange(2), 4)
    yield "all equal non-binary", np.full(6, 0.1, np.float32), np.repeat(np.arange(2), 3)
    ids = np.array([4, 1, 4, 5, 1, 1, 4, 5, 0, 1, 4])  # group 2 and 3 are empty
    yield "unsorted ids, ragged sizes, empty groups", rng.integers(0, 2, 11).astype(np.float32), ids
    yield "continuous rewards", rng.normal(0.4, 0.5, 12).astype(np.float32), np.repeat(np.arange(3), 4)
    yield "one group", rng.integers(0, 2, 16).astype(np.float32), np.zeros(16, np.int64)


def assert_same_advantages(out, ref, what=""):
    assert type(out) is type(ref)
    for name in ref._fields:
        a, b = getattr(out, name), getattr(ref, name)
        assert a.shape == b.shape and a.dtype == mx.float32, f"{what}: {name} {a.shape} {a.dtype} vs {b.shape}"
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=2e-5, atol=2e-5, err_msg=f"{what}: {name}")


def _reference_launcher(mgpo):
    """A launcher with the kernel's interface that computes its 10 outputs with the reference."""

    def launch(backend, rewards, group_ids, params, sizes, scale, num_groups):
        lam, eps = params.tolist()
        o = mgpo.mgpo_advantages(rewards, group_ids, lam=lam, scale_rewards=scale, eps=eps, num_groups=num_groups)
        return (*o, mx.zeros((num_groups,)))

    return launch


def test_advantage_wrapper_plumbing(mgpo, monkeypatch):
    """Dispatch, MGPOAdvantages assembly and the vjp of the kernel wrapper (kernel outputs stated by the reference)."""
    monkeypatch.setitem(KD._PROBES, "cuda", lambda: True)
    monkeypatch.setitem(KA.ADV_LAUNCHERS, "cuda", _reference_launcher(mgpo))
    KA._adv_op.cache_clear()
    try:
        for what, r, gid in _adv_cases():
            for scale in ("group", "batch", "none"):
                ref = mgpo.mgpo_advantages(mx.array(r), mx.array(gid), lam=1.5, scale_rewards=scale)
                out = K.grouped_advantages(mx.array(r), mx.array(gid), lam=1.5, scale_rewards=scale)
                assert_same_advantages(out, ref, f"{what} {scale}")
        r, gid = mx.array([1.0, 0.0, 1.0, 1.0, 0.0, 0.0]), mx.array([0, 0, 0, 1, 1, 1])
        cot = mx.arange(6).astype(mx.float32)

        def vjp_of(fn):
            return mx.vjp(lambda x: fn(x, gid, lam=1.0, scale_rewards="group").advantages, [r], [cot])[1][0]

        np.testing.assert_allclose(
            np.array(vjp_of(K.grouped_advantages)), np.array(vjp_of(mgpo.mgpo_advantages)), rtol=1e-5, atol=1e-6
        )
    finally:
        KA._adv_op.cache_clear()


def test_advantage_dispatch_falls_back_to_reference(mgpo, monkeypatch):
    monkeypatch.setitem(KD._PROBES, "metal", lambda: True)

    def boom(*a, **k):
        raise AssertionError("kernel launched for an input it must not take")

    monkeypatch.setitem(KA.ADV_LAUNCHERS, "metal", boom)
    monkeypatch.setattr(KA, "ADV_KERNEL_MAX_N", 8)
    KA._adv_op.cache_clear()
    try:
        r, gid = mx.zeros((16,)), mx.repeat(mx.arange(4), 4)  # above ADV_KERNEL_MAX_N
        assert_same_advantages(K.grouped_advantages(r, gid, lam=1.0), mgpo.mgpo_advantages(r, gid, lam=1.0))
        r, gid = mx.ones((4,)), mx.array([0, 1, 2, 3])
        out = K.grouped_advantages(r, gid, lam=1.0, num_groups=2)  # ids outside [0, num_groups)
        assert out.advantages.shape == (4,)
        with pytest.raises(ValueError, match="scale_rewards"):
            K.grouped_advantages(r, gid, lam=1.0, scale_rewards="sample")
    finally:
        KA._adv_op.cache_clear()


# -- on the real kernels (Metal on a Mac, CUDA with mlx[cuda]); skipped elsewhere ------------------

_DEVICE_REASON = {
    "metal": "Metal back-end not available here (needs Apple silicon with the GPU as default device)",
    "cuda": "CUDA back-end not available here (needs mlx[cuda] and an NVIDIA GPU)",
}


@pytest.fixture(params=list(K.BACKENDS))
def device_backend(request):
    b = request.param
    if not KD._PROBES[b]():
        pytest.skip(_DEVICE_REASON[b])
    return b


@pytest.mark.parametrize("vocab", VOCABS + [50000, 32000])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_sls_kernel_on_device(device_backend, vocab, dtype):
    n = 64 if vocab < 100_000 else 16
    mx.random.seed(vocab)
    logits = (mx.random.normal((n, vocab)) * 4.0).astype(dtype)
    targets = mx.random.randint(0, vocab, (n,)).astype(mx.int32)
    g = mx.random.normal((n,)) * (mx.arange(n) % 5 != 4)
    for t in TEMPS:
        ref_out, ref_d = _fwd_vjp(selective_log_softmax_reference, logits, targets, g, t)
        out, d = _fwd_vjp(lambda x, y, T: K.selective_log_softmax_on(device_backend, x, y, T), logits, targets, g, t)
        what = f"{device_backend} V={vocab} T={t} {dtype}"
        _close(out, ref_out, mx.float32 if dtype == mx.float32 else dtype, f"forward {what}", vocab)
        _close(d, ref_d, dtype, f"vjp {what}", vocab)


def test_token_logprobs_with_kernel_on_device(device_backend):
    import mlx.nn as nn

    mx.random.seed(3)
    head = nn.Linear(64, 151936, bias=False)
    h = mx.random.normal((300, 64))
    tg = mx.random.randint(0, 151936, (300,))
    g = mx.random.normal((300,))
    with K.use_mode(device_backend):
        lp, (dh,) = mx.vjp(lambda x: token_logprobs(x, head, tg, 0.9, chunk_size=128), [h], [g])[0:2]
    with K.use_mode("reference"):
        lp_r, (dh_r,) = mx.vjp(lambda x: token_logprobs(x, head, tg, 0.9, chunk_size=128), [h], [g])[0:2]
    np.testing.assert_allclose(np.array(lp), np.array(lp_r), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.array(dh), np.array(dh_r), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantage_kernel_on_device(mgpo, device_backend, scale):
    rng = np.random.default_rng(1)
    cases = list(_adv_cases()) + [("large", rng.integers(0, 2, 3000).astype(np.float32), np.repeat(np.arange(375), 8))]
    assert_backend_matches_reference(mgpo, device_backend, cases, scale)


def assert_backend_matches_reference(mgpo, backend, cases, scale):
    """grouped_advantages_on(backend) equals mgpo_advantages on each case, for lambda 0, 1 and 2.5."""
    for lam in (0.0, 1.0, 2.5):
        for what, r, gid in cases:
            ref = mgpo.mgpo_advantages(mx.array(r), mx.array(gid), lam=lam, scale_rewards=scale, eps=1e-6)
            out = K.grouped_advantages_on(backend, mx.array(r), mx.array(gid), lam=lam, scale_rewards=scale, eps=1e-6)
            assert_same_advantages(out, ref, f"{backend} {what} {scale} lam={lam}")
