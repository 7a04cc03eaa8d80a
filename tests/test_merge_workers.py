"""mlx_ssp merge: worker threads (byte-identical output), the positional sharded writer, the parallel
schedule and the CPU buffer cache."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import yaml

import mlx_ssp  # noqa: F401
import mlx.core as mx

from mlx_ssp.errors import UserError
from mlx_ssp.merge import safetensors_io as sio
from mlx_ssp.merge.engine import run_merge
from mlx_ssp.merge.config import MergeStageConfig

from merge_helpers import cfg_of


# ------------------------------------------------------------------ threads and the positional writer


@pytest.mark.parametrize("method", ["ties", "dare_ties", "linear", "breadcrumbs_ties"])
def test_workers_do_not_change_a_byte(trio, tmp_path, method):
    """Tensors merged side by side on 1, 2 or 3 threads give byte-identical shard files."""
    m = trio["bfloat16"]
    kw = dict(merge_method=method,
              models=[{"model": str(m[1]), "parameters": {"weight": 0.7, "density": 0.4}},
                      {"model": str(m[2]), "parameters": {"weight": 0.4, "density": 0.6}}])
    if method == "linear":
        for e in kw["models"]:
            del e["parameters"]["density"]
    else:
        kw["base_model"] = str(m[0])
    files = []
    for w in (1, 2, 3):
        out = tmp_path / f"w{w}"
        res = run_merge(cfg_of(**kw), out, progress=False, seed=5, workers=w, out_shard_size="700")
        assert res["workers"] == w and res["shards"] > 1
        files.append({p.name: p.read_bytes() for p in sorted(out.glob("*.safetensors*"))})
    assert files[0] == files[1] == files[2]


def test_sharded_writer_any_order_and_checks(tmp_path):
    """The writer puts each tensor at its planned offset whatever the order; it refuses a tensor
    outside the plan, a wrong size, a second write, and closing with a tensor missing."""
    rng = np.random.default_rng(0)
    arrays = {f"t{i}": rng.standard_normal((3, i + 1)).astype(np.float32) for i in range(6)}
    plan = [sio.PlannedTensor(n, "F32", a.shape) for n, a in arrays.items()]
    outs = []
    for order in (list(arrays), list(arrays)[::-1]):
        d = tmp_path / f"o{len(outs)}"
        d.mkdir()
        w = sio.ShardedWriter(d, plan, max_shard_bytes=100)
        for n in order:
            w.write(n, arrays[n].tobytes())
        w.close()
        outs.append({p.name: p.read_bytes() for p in sorted(d.iterdir())})
        got = {}
        for f in d.glob("*.safetensors"):
            got.update({k: np.array(v) for k, v in mx.load(str(f)).items()})
        assert set(got) == set(arrays) and all(np.array_equal(got[n], arrays[n]) for n in arrays)
    assert outs[0] == outs[1] and len([n for n in outs[0] if n.endswith(".safetensors")]) > 1
    d = tmp_path / "bad"
    d.mkdir()
    w = sio.ShardedWriter(d, plan, max_shard_bytes=100)
    with pytest.raises(RuntimeError, match="not in the plan"):
        w.write("nope", b"")
    with pytest.raises(RuntimeError, match="bytes"):
        w.write("t0", b"123")
    w.write("t0", arrays["t0"].tobytes())
    with pytest.raises(RuntimeError, match="twice"):
        w.write("t0", arrays["t0"].tobytes())
    with pytest.raises(RuntimeError, match="5 of 6 tensors unwritten"):
        w.close()
    w.abort()


def test_worker_error_stops_the_merge_and_leaves_nothing(trio, tmp_path, monkeypatch):
    """An error on a merging thread reaches the caller; the half-built output is removed."""
    from mlx_ssp.merge import engine

    m = trio["float32"]
    real = engine.merge_tensor

    def boom(job, p, seed):
        if p.name == "model.layers.1.mlp.down_proj.weight":
            raise OSError("disk on fire")
        return real(job, p, seed)

    monkeypatch.setattr(engine, "merge_tensor", boom)
    with pytest.raises(OSError, match="disk on fire"):
        run_merge(cfg_of(merge_method="ties", base_model=str(m[0]),
                         models=[{"model": str(m[1]), "parameters": {"weight": 1, "density": 0.5}}]),
                  tmp_path / "out", progress=False, workers=3)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_threaded_cli_exits_cleanly(trio, tmp_path):
    """Merging threads release their mlx streams before they end: without that, mlx aborts the
    process at exit (exit code 134) after a complete merge, which scripts and CI read as failure."""
    m = trio["bfloat16"]
    cfg = tmp_path / "t.yml"
    cfg.write_text(yaml.safe_dump({"merge_method": "ties", "base_model": str(m[0]), "models": [
        {"model": str(m[i]), "parameters": {"weight": 0.5, "density": 0.5}} for i in (1, 2)]}))
    outs = []
    for i in range(4):  # the abort was a race at exit: several runs
        out = tmp_path / f"o{i}"
        r = subprocess.run([sys.executable, "-m", "mlx_ssp.cli", "merge", str(cfg), str(out), "--quiet", "--workers", "3"],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
        assert json.loads(r.stdout)["workers"] == 3
        outs.append((out / "model.safetensors").read_bytes())
    assert all(o == outs[0] for o in outs)


def test_parallel_schedule_largest_first_within_budget():
    """Threads take the largest pending tensor that fits the in-flight budget: two of the large
    (vocabulary-sized) tensors are never in flight together, everything runs exactly once, the
    large ones start first (the run ends on small ones), and same-size tensors run side by side.
    The order is checked on the schedule step by step: on threads it depends on how long each
    tensor takes, which the load of the machine changes."""
    import threading

    from mlx_ssp.merge.parallel import Schedule, inflight_budget, run_parallel

    sizes = [64, 8, 8, 8, 8, 8, 8, 1, 8, 64]  # embed first, lm_head last, as in a file
    assert inflight_budget(sizes, 2) == 64 + 8 and inflight_budget(sizes, 3) == 64 + 16
    assert inflight_budget([8] * 5, 3) == 24 and inflight_budget([], 2) == 0
    s = Schedule(sizes, 3)
    unblock = threading.Timer(60, s.stop)  # a take() that waits with room in the budget returns None
    unblock.start()
    try:
        assert [s.take(), s.take(), s.take()] == [0, 1, 2]
        s.done(1)
        assert s.take() == 3  # the lm_head does not fit beside the embedding
        s.done(0)
        assert s.take() == 9  # and goes next once it does, before the small ones left
        s.done(2)
        s.done(3)
        assert [s.take(), s.take()] == [4, 5]
        for i in (9, 4, 5):
            s.done(i)
        assert [s.take(), s.take(), s.take()] == [6, 8, 7]
        for i in (6, 8, 7):
            s.done(i)
        assert s.take() is None
    finally:
        unblock.cancel()
    for workers in (2, 3):
        lock, live, seen = threading.Lock(), [], []
        peak = {"n": 0, "elems": 0}
        # the first hand-outs (the embedding and small ones beside it) wait for each other: every
        # worker is busy at once, whatever the timing
        together = threading.Barrier(workers, timeout=60)

        def fn(i):
            with lock:
                live.append(i)
                peak["n"] = max(peak["n"], len(live))
                peak["elems"] = max(peak["elems"], sum(sizes[j] for j in live))
                assert sum(sizes[j] >= 64 for j in live) <= 1
            if i < workers:
                together.wait()
            with lock:
                live.remove(i)
                seen.append(i)

        run_parallel(list(range(len(sizes))), fn, workers, lambda: None, sizes=sizes)
        assert sorted(seen) == list(range(len(sizes)))
        assert peak["n"] == workers and peak["elems"] <= inflight_budget(sizes, workers)
    # equal sizes: file order, all workers busy
    order = []
    run_parallel(list(range(6)), order.append, 2, lambda: None, sizes=[5] * 6)
    assert sorted(order) == list(range(6))


def test_merge_raises_the_cpu_buffer_cache_and_restores_it(trio, tmp_path, monkeypatch):
    """During a CPU merge mlx keeps up to 1 GiB of freed buffers for reuse (the 32 MiB default
    sends every large one back to the OS, to be faulted in and zeroed again for the next tensor);
    the caller's limit is back afterwards."""
    from mlx_ssp.merge import engine

    def current():
        lim = mx.set_cache_limit(0)
        mx.set_cache_limit(lim)
        return lim

    seen, real = [], engine.merge_tensor

    def spy(job, p, seed):
        seen.append(current())
        return real(job, p, seed)

    monkeypatch.setattr(engine, "merge_tensor", spy)
    before = mx.set_cache_limit(32 << 20)
    try:
        m = trio["float32"]
        run_merge(cfg_of(merge_method="linear", models=[{"model": str(m[i]), "parameters": {"weight": 1}} for i in (1, 2)]),
                  tmp_path / "out", progress=False, workers=1)
        assert seen and all(v == engine._CPU_BUFFER_CACHE for v in seen)
        assert current() == 32 << 20
    finally:
        mx.set_cache_limit(before)


def test_workers_setting_is_validated():
    from mlx_ssp.config import validate

    with pytest.raises(UserError, match="workers"):
        validate(MergeStageConfig, {"workers": 0}, source="run.yaml", prefix="merge")
    assert validate(MergeStageConfig, {"workers": 3}, source="run.yaml", prefix="merge").workers == 3
