"""Custom kernels (mlx_ssp.rl.kernels): the dispatcher and its env override, packaging (importlib
resources, the wheel), the well-formedness of the sources and build-once caching; all of it runs
without a kernel device. Equality with the reference: test_kernels.py.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import mlx_ssp  # noqa: F401
import mlx.core as mx

from mlx_ssp.errors import UserError
from mlx_ssp.rl import kernels as K
from mlx_ssp.rl.kernels import advantages as KA, dispatch as KD, log_softmax as KL, sources as KS
from mlx_ssp.rl.logprobs import selective_log_softmax_reference

from kernels_helpers import VOCABS, _case
from kernels_helpers import _clean_mode  # noqa: F401  (an autouse fixture: every test starts in auto mode)

ROOT = Path(__file__).resolve().parents[1]


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
