"""`mlx_ssp doctor --kernels` (mlx_ssp.rl.kernels.selfcheck): on a machine without Metal or CUDA it
says so and exits 0; the comparison and its pass/fail verdicts are exercised here on CPU through
kernel launchers plugged into the ops' launcher registries: the plain-MLX statement of the kernels'
outputs ("emulate"), a wrong one and one that fails to build."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

import mlx_ssp  # noqa: F401
import mlx.core as mx

from mlx_ssp.cli import main
from mlx_ssp.doctor import backends, kernel_check, no_kernel_line
from mlx_ssp.rl import kernels as K
from mlx_ssp.rl.kernels import advantages as KA, dispatch as KD, log_softmax as KL, selfcheck as S
from mlx_ssp.rl.mgpo import mgpo_advantages

SMALL_SLS = (S.SLSCase(5, 1000, "float32", 0.7), S.SLSCase(3, 7, "bfloat16"))
SMALL_ADV = (S.AdvCase(6, 4), S.AdvCase(5, 4, "none", ragged=True, continuous=True))


@pytest.fixture(autouse=True)
def _fresh_ops():
    KL._sls_op.cache_clear()
    KA._adv_op.cache_clear()
    yield
    KL._sls_op.cache_clear()
    KA._adv_op.cache_clear()


def _adv_by_reference(backend, rewards, group_ids, params, sizes, scale, num_groups):
    """A launcher with the advantage kernel's interface whose outputs the reference computes."""
    lam, eps = params.tolist()
    o = mgpo_advantages(rewards, group_ids, lam=lam, scale_rewards=scale, eps=eps, num_groups=num_groups)
    return (*o, mx.zeros((num_groups,)))


def test_doctor_kernels_without_a_device_says_so_and_exits_0():
    if K.runnable_backends():
        pytest.skip("this machine has a GPU back-end: the no-device case does not apply")
    res = CliRunner().invoke(main, ["doctor", "--kernels"])
    assert res.exit_code == 0, res.output
    assert "no Metal or CUDA device" in res.output and "nothing to check" in res.output
    assert "matmul" not in res.output  # only the kernel check runs


def test_compare_verdicts():
    ref = np.array([1.0, -2.0, 3.0])
    assert S.compare(ref, ref, 1e-5, 1e-5) == (0.0, True)
    err, ok = S.compare(ref + np.array([0, 5e-4, 0]), ref, 1e-5, 1e-5)
    assert not ok and err == pytest.approx(5e-4)
    assert S.compare(ref + np.array([0, 5e-4, 0]), ref, 1e-3, 1e-3)[1]  # within a looser tolerance
    assert S.compare(np.array([1.0, np.nan, 3.0]), ref, 1, 1) == (float("inf"), False)  # a NaN where the reference has none
    assert S.compare(ref[:2], ref, 1, 1) == (float("inf"), False)
    inf = np.array([-np.inf, 0.5])
    assert S.compare(inf, inf, 1e-5, 1e-5) == (0.0, True)  # the same -inf (a masked logit) is no error
    assert not S.compare(np.array([np.inf, 0.5]), inf, 1e-5, 1e-5)[1]
    assert S.compare(mx.array([1.0, 2.0], dtype=mx.bfloat16), mx.array([1.0, 2.0]), 0, 0) == (0.0, True)


def test_a_correct_kernel_passes_forward_and_backward(monkeypatch):
    monkeypatch.setitem(KA.ADV_LAUNCHERS, "emulate", _adv_by_reference)
    checks = S.check_backend("emulate", SMALL_SLS, SMALL_ADV, repeats=1)
    assert [c.kernel for c in checks] == ["selective_log_softmax"] * 2 + ["grouped_advantages"] * 2
    assert all(c.ok and not c.error for c in checks), checks
    assert all(c.forward_err < 1e-5 and c.backward_err < 1e-5 and c.speedup > 0 for c in checks)
    lines = S.format_checks("emulate", checks)
    assert len(lines) == 4 and all(line.startswith("PASS") and "fwd err" in line and "x (" in line for line in lines)


def test_a_wrong_kernel_fails_with_its_worst_error(monkeypatch):
    fwd, bwd = KL.SLS_LAUNCHERS["emulate"]

    def off_fwd(backend, logits, targets, inv_t):  # log-probs off by 1e-3 on one row
        logp, lse = fwd(backend, logits, targets, inv_t)
        return logp + mx.where(mx.arange(logp.shape[0]) == 1, 1e-3, 0.0), lse

    def off_bwd(*a):  # the gradient's sign flipped
        return -bwd(*a)

    monkeypatch.setitem(KL.SLS_LAUNCHERS, "wrong_fwd", (off_fwd, bwd))
    monkeypatch.setitem(KL.SLS_LAUNCHERS, "wrong_bwd", (fwd, off_bwd))
    case = SMALL_SLS[0]
    c = S.check_sls("wrong_fwd", case, repeats=1)
    assert not c.ok and c.forward_err == pytest.approx(1e-3, rel=1e-2) and c.backward_err < 1e-6
    c = S.check_sls("wrong_bwd", case, repeats=1)
    assert not c.ok and c.forward_err < 1e-6 and c.backward_err > 1e-3

    def off_adv(*a):  # advantages of every sample off by 0.01
        outs = list(_adv_by_reference(*a))
        outs[0] = outs[0] + 0.01
        return tuple(outs)

    monkeypatch.setitem(KA.ADV_LAUNCHERS, "wrong_adv", off_adv)
    c = S.check_advantages("wrong_adv", SMALL_ADV[0], repeats=1)
    assert not c.ok and c.forward_err == pytest.approx(0.01, rel=1e-3)
    assert S.format_checks("wrong_adv", [c])[0].startswith("FAIL")


def test_a_kernel_that_does_not_build_fails_with_the_error(monkeypatch):
    def no_build(*a):
        raise RuntimeError("[metal_kernel] Unable to build metal library from source")

    monkeypatch.setitem(KL.SLS_LAUNCHERS, "broken", (no_build, no_build))
    monkeypatch.setitem(KA.ADV_LAUNCHERS, "broken", no_build)
    checks = S.check_backend("broken", SMALL_SLS[:1], SMALL_ADV[:1], repeats=1)
    assert [c.ok for c in checks] == [False, False]
    assert all("RuntimeError: [metal_kernel] Unable to build" in c.error for c in checks)
    assert all("Unable to build" in line and line.startswith("FAIL") for line in S.format_checks("broken", checks))


def test_doctor_kernels_on_a_device_reports_each_check_and_fails_on_a_wrong_kernel(monkeypatch):
    """Pretend a Metal device whose kernels are the emulated ones: the command prints one line per
    check and a summary, exits 0; with a wrong backward kernel it exits 1."""
    monkeypatch.setitem(KD._PROBES, "metal", lambda: True)
    monkeypatch.setitem(KD._PROBES, "cuda", lambda: False)
    monkeypatch.setitem(KL.SLS_LAUNCHERS, "metal", KL.SLS_LAUNCHERS["emulate"])
    monkeypatch.setitem(KA.ADV_LAUNCHERS, "metal", _adv_by_reference)
    monkeypatch.setattr(S, "SLS_CASES", SMALL_SLS)
    monkeypatch.setattr(S, "ADV_CASES", SMALL_ADV)
    res = CliRunner().invoke(main, ["doctor", "--kernels"])
    assert res.exit_code == 0, res.output
    lines = res.output.strip().splitlines()
    assert lines[0].startswith("kernels vs their plain-MLX reference") and "Metal: " in lines[0]
    assert sum(line.startswith("PASS  metal") for line in lines) == 4 and lines[-1] == "4 of 4 checks pass"
    fwd, bwd = KL.SLS_LAUNCHERS["emulate"]
    monkeypatch.setitem(KL.SLS_LAUNCHERS, "metal", (fwd, lambda *a: bwd(*a) * 2))
    KL._sls_op.cache_clear()
    res = CliRunner().invoke(main, ["doctor", "--kernels"])
    assert res.exit_code == 1 and "2 of 4 checks pass, 2 FAIL" in res.output


def test_doctor_kernels_refuses_a_run_file_instead_of_ignoring_it(tmp_path):
    run = tmp_path / "run.yaml"
    run.write_text("model: {path: demo}\n")
    for args in (["doctor", "--kernels", str(run)], ["doctor", "--kernels", "--set", "rl.group_size=4"]):
        res = CliRunner().invoke(main, args)
        assert res.exit_code == 2, res.output
        msg = res.output.strip()
        assert "\n" not in msg and "--kernels" in msg and "takes no CONFIG_PATH or --set" in msg
        assert "kernels vs" not in msg and "no Metal or CUDA" not in msg  # refused before any check runs


def test_a_gpu_back_end_with_the_cpu_as_default_device_is_named_as_such():
    """With Metal (or CUDA) present but the CPU as MLX's default device the kernels do not run: the
    line says the default device is the CPU, not that there is no GPU device."""
    where = "Darwin arm64, default device Device(cpu, 0), Metal: yes, CUDA: no"
    line = no_kernel_line({"cpu": True, "metal": True, "cuda": False}, True, where)
    assert "the default device is the CPU" in line and "no Metal or CUDA" not in line and where in line
    assert "no Metal or CUDA device" in no_kernel_line({"cpu": True, "metal": False, "cuda": False}, True, where)
    if not (backends()["metal"] or backends()["cuda"]):
        return  # the end-to-end half needs a GPU back-end
    old = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        lines, ok = kernel_check()
    finally:
        mx.set_default_device(old)
    assert ok and len(lines) == 1 and "the default device is the CPU" in lines[0], lines
