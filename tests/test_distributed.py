"""mx.distributed primitives: sharding, record gathering, gradient averaging, failure handling.

The launch tests start 2 real local processes on the ring backend (mlx.launch, or the same
environment mlx.launch sets, when a test needs to see the ranks' own exit codes).
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import mlx_ssp  # noqa: F401
from mlx_ssp import distributed as dist
from mlx_ssp.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "distributed_worker.py"


# -- in-process (size 1) -------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 2, 3, 7])
def test_shard_covers_every_item_once_balanced_and_in_order(size):
    for n in range(0, 40):
        items = list(range(n))
        blocks = [dist.shard(items, r, size) for r in range(size)]
        assert sum(blocks, []) == items  # exactly once, global order restored by concatenation
        lens = [len(b) for b in blocks]
        assert max(lens) - min(lens) <= 1
        assert lens == sorted(lens, reverse=True)  # the extra items go to the first ranks
        for r in range(size):
            a, b = dist.shard_bounds(n, r, size)
            assert items[a:b] == blocks[r]


def test_shard_rejects_bad_rank():
    with pytest.raises(ValueError):
        dist.shard_bounds(4, 2, 2)
    with pytest.raises(ValueError):
        dist.shard_bounds(4, 0, 0)


def test_single_process_world_is_identity():
    w = dist.world()
    assert (w.rank, w.size, w.is_main) == (0, 1, True)
    recs = [{"a": 1}, {"b": [1.5, None]}]
    assert dist.shard(recs) == recs
    assert dist.all_gather_records(recs) == recs
    assert dist.broadcast_object({"x": 3}) == {"x": 3}
    assert dist.run_on_main(lambda: 5) == 5
    dist.barrier()
    g = {"w": mx_ones()}
    assert dist.average_gradients(g) is g
    with dist.main_first() as do_it:
        assert do_it


def mx_ones():
    import mlx.core as mx

    return mx.ones((2,))


def test_config_validation_and_env_override(monkeypatch):
    from mlx_ssp.config import load_section

    with pytest.raises(UserError, match="timeout"):
        load_section({"distributed": {"timeouts": 3}}, "distributed")
    with pytest.raises(UserError, match="backend"):
        load_section({"distributed": {"backend": "tcp"}}, "distributed")
    with pytest.raises(UserError, match="timeout_s"):
        load_section({"distributed": {"timeout_s": 0}}, "distributed")
    cfg = load_section({"distributed": {"timeout_s": 60}}, "distributed")
    assert isinstance(cfg, dist.DistributedConfig) and cfg.timeout_s == 60
    monkeypatch.setenv("MLX_SSP_DIST_TIMEOUT", "7.5")
    try:
        assert dist.configure(cfg).timeout_s == 7.5
        monkeypatch.setenv("MLX_SSP_DIST_TIMEOUT", "soon")
        with pytest.raises(UserError, match="MLX_SSP_DIST_TIMEOUT"):
            dist.configure(cfg)
    finally:
        monkeypatch.delenv("MLX_SSP_DIST_TIMEOUT")
        dist.configure(None)


# -- 2 real processes ------------------------------------------------------------------------------


def free_ports(n: int) -> int:
    """A base port with ``n`` consecutive free ports (other engineers run launches too)."""
    for _ in range(200):
        base = random.randint(20000, 60000)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


def launch(scenario: str, out: Path, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``mlx.launch -n 2 --backend ring -- python tests/distributed_worker.py SCENARIO OUT``."""
    cmd = ["mlx.launch", "-n", "2", "--backend", "ring", "-p", str(free_ports(2))]
    for k, v in (env or {}).items():
        cmd += ["--env", f"{k}={v}"]
    cmd += ["--", sys.executable, str(WORKER), scenario, str(out)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def spawn_ranks(scenario: str, out: Path, tmp: Path, env: dict | None = None, ranks=(0, 1), size: int = 2):
    """The ranks started by hand with the environment mlx.launch sets (no launcher killing peers),
    as a scheduler or mpirun-less cluster script would."""
    base = free_ports(size)
    hostfile = tmp / f"hosts-{scenario}.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{base + i}"] for i in range(size)]))
    procs = {}
    for r in ranks:
        e = dict(os.environ, MLX_HOSTFILE=str(hostfile), MLX_RANK=str(r), **(env or {}))
        procs[r] = subprocess.Popen(
            [sys.executable, str(WORKER), scenario, str(out)], cwd=ROOT, env=e,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
        )
    return procs


def finish(procs, timeout: float = 180):
    """Each rank's (exit code, stdout, stderr). ``timeout`` only catches a rank that hangs (the
    fallbacks the tests tell apart take 300 s or more); start-up alone is slow on a busy machine."""
    res = {}
    for r, p in procs.items():
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs.values():
                q.kill()
            pytest.fail(f"rank {r} hung (did not exit within {timeout}s)")
        res[r] = (p.returncode, out, err)
    return res


@pytest.mark.slow
def test_two_ranks_collectives(tmp_path):
    res = launch("collectives", tmp_path)
    assert "Traceback" not in res.stderr, res.stderr
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    assert (r0["size"], r1["size"], r0["rank"], r1["rank"]) == (2, 2, 0, 1)
    for n in (0, 1, 2, 7, 10):
        expect = [{"i": i, "text": "é" * (i % 3) + "x" * i, "v": i / 3} for i in range(n)]
        assert r0[f"gather_{n}"] == expect and r1[f"gather_{n}"] == expect
        assert r0[f"shard_{n}"] + r1[f"shard_{n}"] == list(range(n))
    for key in ("uneven", "per_rank", "bcast", "avg", "sum", "all_sum", "bcast_tree", "on_main"):
        assert r0[key] == r1[key], key
    assert [x["r"] for x in r0["uneven"]] == [0, 1, 1] and len(r0["uneven"][2]["blob"]) == 1000
    assert r0["per_rank"] == [{"rank": 0}, {"rank": 1}]
    assert r0["bcast"] == {"from": 0, "seed": 1234}
    base_a = [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert r0["avg"]["a"] == [[v * 1.5 for v in row] for row in base_a]  # mean of 1x and 2x
    assert r0["avg"]["b"] == [2.25, -3.0]
    assert r0["sum"]["a"] == [[v * 3 for v in row] for row in base_a]
    assert r0["all_sum"] == 3
    assert r0["bcast_tree"] == [7.0, 7.0, 7.0]  # rank 0's values everywhere
    assert r0["on_main"] == {"written_by": 0}
    assert r0["main_first_seen"] and r1["main_first_seen"]


@pytest.mark.slow
def test_killed_rank_stops_the_other_with_a_clear_error(tmp_path):
    # without a launcher: the survivor itself must notice, say so, and exit non-zero (the message
    # tells it from a wait on distributed.timeout_s)
    res = finish(spawn_ranks("die", tmp_path, tmp_path))
    rc0, _, err0 = res[0]
    assert res[1][0] == -9
    assert rc0 == 2, err0
    assert "rank 0/2: gather after the crash failed" in err0 and "Another rank died" in err0
    assert "Traceback" not in err0
    assert not (tmp_path / "rank0.json").exists()


@pytest.mark.slow
def test_killed_rank_under_mlx_launch_ends_the_run(tmp_path):
    res = launch("die", tmp_path, timeout=180)  # rank 0 would wait distributed.timeout_s (1800 s) alone
    assert "rank 1 exited with code -9" in res.stderr
    assert not (tmp_path / "rank0.json").exists()  # rank 0 did not carry on


@pytest.mark.slow
def test_frozen_rank_times_out_with_a_clear_error(tmp_path):
    res = finish(spawn_ranks("freeze", tmp_path, tmp_path, env={"MLX_SSP_DIST_TIMEOUT": "3"}))
    rc0, _, err0 = res[0]
    assert rc0 == dist.EXIT_TIMEOUT, err0
    assert "rank 0/2: gather with a frozen peer waited 3s" in err0 and "distributed.timeout_s" in err0
    # rank 1 (still sleeping) loses its peer at its next collective and stops too
    assert res[1][0] == 2 and "Another rank died" in res[1][2]


@pytest.mark.slow
def test_error_on_rank0_is_reported_on_every_rank(tmp_path):
    res = launch("main_error", tmp_path)
    assert "error: disk full while saving" in res.stderr
    assert "error: rank 1/2: save checkpoint failed on rank 0: UserError: disk full while saving" in res.stderr
    assert "exited with code 2" in res.stderr


@pytest.mark.slow
def test_missing_peer_at_startup_times_out(tmp_path):
    res = finish(spawn_ranks("init_only", tmp_path, tmp_path, env={"MLX_SSP_DIST_INIT_TIMEOUT": "2"}, ranks=(0,)))
    rc, _, err = res[0]
    assert rc != 0
    assert "did not all connect within 2s (distributed.init_timeout_s)" in err


@pytest.mark.slow
def test_one_rank_launch_is_a_single_process(tmp_path):
    # mlx.launch -n 1 exports an empty hostfile on which plain mx.distributed.init fails
    cmd = ["mlx.launch", "-n", "1", "--backend", "ring", "--", sys.executable, str(WORKER), "init_only", str(tmp_path)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert json.loads((tmp_path / "rank0.json").read_text()) == {"size": 1}, res.stderr


@pytest.mark.slow
def test_sharded_generation_equals_one_process(tmp_path):
    sys.path.insert(0, str(ROOT / "tests"))
    from distributed_worker import fake_run

    samples = {f"t{i}": list(range(i % 4 + 1)) for i in range(9)}
    single_stats: dict = {}
    single = [r for g in dist.iter_sharded_groups(fake_run, samples, stats=single_stats) for r in g]
    strip = lambda recs: [{k: v for k, v in r.items() if k != "rank"} for r in recs]  # noqa: E731

    launch("sharded", tmp_path)
    for rank in (0, 1):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for name, got in res.items():
            recs = [r for g in got["groups"] for r in g]
            # same records; per round the groups come in global task order
            key = lambda r: (int(r["task_id"][1:]), r["sample"])  # noqa: E731
            assert sorted(strip(recs), key=key) == sorted(strip(single), key=key), name
            assert [key(r) for r in recs] == sorted(key(r) for r in recs), name
            for g in got["groups"]:
                assert len({r["task_id"] for r in g}) == 1
            assert {r["rank"] for r in recs} == {0, 1}, name  # both ranks really worked
            assert got["stats"]["gen_tokens"] == single_stats["gen_tokens"] == 10 * (len(single))
            assert got["stats"]["skipped"] == ["t3"]
        one = res["one_round"]["groups"]
        assert len(one) == 8  # t3 skipped, one group per task in a single round


@pytest.mark.slow
def test_liveness_watch_around_foreign_collectives(tmp_path):
    # heartbeats keep a block alive longer than the timeout
    res = finish(spawn_ranks("watch_alive", tmp_path / "a", tmp_path, env={"MLX_SSP_DIST_TIMEOUT": "2.5"}))
    assert [res[r][0] for r in (0, 1)] == [0, 0], res
    # no heartbeat while a peer is stuck: exit 75 with the message
    res = finish(spawn_ranks("watch_freeze", tmp_path / "f", tmp_path, env={"MLX_SSP_DIST_TIMEOUT": "3"}))
    assert res[0][0] == dist.EXIT_TIMEOUT and "rank 0/2: training made no progress for 3s" in res[0][2]
    # a killed peer inside an unwrapped collective: one clear line, exit 2
    res = finish(spawn_ranks("watch_die", tmp_path / "d", tmp_path))
    assert res[0][0] == 2 and "error: rank 0/2: training failed: [ring] connection to a peer was lost" in res[0][2]
    assert "Traceback" not in res[0][2]


@pytest.mark.slow
def test_cluster_check_command(tmp_path):
    cmd = ["mlx.launch", "-n", "2", "--backend", "ring", "-p", str(free_ports(2)), "--",
           sys.executable, "-m", "mlx_ssp.distributed"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert "2 rank(s); all_sum of 10 MB: correct" in res.stdout, res.stdout + res.stderr
    assert "rank 1:" in res.stdout


@pytest.mark.slow
def test_run_under_two_ranks_uploads_once(tmp_path):
    """Under mlx.launch every rank runs the driver; rank 0 alone adds the table to the cards and
    uploads the final model (one commit on the stand-in Hub, one [upload] line)."""
    from test_hub import TOKEN, FakeHub, _handler
    import threading
    from http.server import ThreadingHTTPServer

    hub = FakeHub()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        (tmp_path / "run.yaml").write_text(
            f"run_dir: {tmp_path / 'run'}\nseed: 0\nmodel: Org/base\nupload: {{repo: org/final}}\n"
            "tasks:\n  domains:\n    addition:\n      source: reasoning_gym:basic_arithmetic\n"
            "      sizes: {train: 2, probe: 1, eval: 1}\n")
        env = {"HF_ENDPOINT": f"http://127.0.0.1:{server.server_address[1]}", "HF_TOKEN": TOKEN, "HF_HUB_OFFLINE": "0"}
        res = launch("pipeline_upload", tmp_path, env=env, timeout=180)
    finally:
        server.shutdown()
        server.server_close()
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "rank0.json").exists() and (tmp_path / "rank1.json").exists(), res.stdout + res.stderr
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    assert len(r0["upload_lines"]) == 1 and r1["upload_lines"] == []
    assert sum(1 for m, path, _, _ in hub.requests if m == "POST" and "/commit/" in path) == 1
    assert "## Held-out evaluation" in hub.repos["org/final"]["files"]["README.md"].decode()
