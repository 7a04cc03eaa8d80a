"""Worker for tests/test_distributed.py, run on each rank by
``mlx.launch -n 2 --backend ring -- python tests/distributed_worker.py SCENARIO OUTDIR``.

Each scenario writes ``OUTDIR/rank<R>.json`` with what the rank saw; the test compares ranks.
UserError -> "error: ..." on stderr and exit 2, as the CLI does.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import zlib
from pathlib import Path

import mlx_ssp  # noqa: F401
import mlx.core as mx

from mlx_ssp import distributed as dist
from mlx_ssp.errors import UserError


def collectives(out: Path) -> dict:
    w = dist.world()
    res: dict = {"rank": w.rank, "size": w.size}
    # shard + gather restores the global order for uneven, empty and tiny lists
    for n in (0, 1, 2, 7, 10):
        items = [{"i": i, "text": "é" * (i % 3) + "x" * i, "v": i / 3} for i in range(n)]
        mine = dist.shard(items)
        res[f"shard_{n}"] = [it["i"] for it in mine]
        res[f"gather_{n}"] = dist.all_gather_records(mine)
    # records of very different byte lengths per rank
    res["uneven"] = dist.all_gather_records([{"r": w.rank, "blob": "y" * (1000 * w.rank)}] * (w.rank + 1))
    res["per_rank"] = dist.gather_per_rank({"rank": w.rank})
    res["bcast"] = dist.broadcast_object({"from": w.rank, "seed": 1234} if w.rank == 0 else None)
    # gradients: rank r holds (r+1) * base; mean = base * (size+1)/2
    base = {"a": mx.arange(6, dtype=mx.float32).reshape(2, 3), "b": [mx.array([1.5, -2.0])]}
    grads = {"a": base["a"] * (w.rank + 1), "b": [base["b"][0] * (w.rank + 1)]}
    avg = dist.average_gradients(grads)
    tot = dist.sum_gradients(grads)
    res["avg"] = {"a": avg["a"].tolist(), "b": avg["b"][0].tolist()}
    res["sum"] = {"a": tot["a"].tolist(), "b": tot["b"][0].tolist()}
    res["all_sum"] = dist.all_sum(w.rank + 1).item()
    tree = dist.broadcast_tree({"w": mx.full((3,), float(w.rank + 7))})
    res["bcast_tree"] = tree["w"].tolist()
    res["on_main"] = dist.run_on_main(lambda: {"written_by": dist.rank()})
    with dist.main_first("write") as do_it:
        if do_it:
            (out / "main_first.txt").write_text("x")
    res["main_first_seen"] = (out / "main_first.txt").exists()
    dist.barrier()
    return res


def fake_run(subset: dict, stats: dict):
    """Stands in for a rollout engine: one group per task, records that depend only on (task, sample)."""
    stats.update(gen_tokens=0, gen_s=0.01, skipped=[])
    for tid, ss in subset.items():
        if tid == "t3":
            stats["skipped"].append(tid)  # as if its prompt did not fit
            continue
        stats["gen_tokens"] += 10 * len(ss)
        yield [{"task_id": tid, "sample": s, "tokens": [zlib.crc32(f"{tid}:{s}".encode()) % 97] * (s + 1), "rank": dist.rank()} for s in sorted(ss)]


def sharded(out: Path) -> dict:
    samples = {f"t{i}": list(range(i % 4 + 1)) for i in range(9)}  # uneven groups, 22 samples
    res = {}
    for name, rs in (("one_round", None), ("rounds_of_5", 5), ("rounds_of_1", 1)):
        stats: dict = {}
        groups = list(dist.iter_sharded_groups(fake_run, samples, stats=stats, round_size=rs))
        res[name] = {"groups": groups, "stats": stats}
    return res


def die(out: Path) -> dict:
    w = dist.world()
    dist.barrier("first barrier")
    if w.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # a killed rank: no cleanup, no message
    time.sleep(0.5)
    dist.all_gather_records([{"r": w.rank}], what="gather after the crash")
    return {"unexpected": "survived"}


def freeze(out: Path) -> dict:
    w = dist.world()
    dist.barrier("first barrier")
    if w.rank == 1:
        time.sleep(8)  # alive but late: rank 0 (timeout 3 s) gives up first
    dist.all_gather_records([{"r": w.rank}], what="gather with a frozen peer")
    return {"unexpected": "survived"}


def raw_sum(w):
    # a collective we do not wrap (as inside mlx-lm's trainer)
    mx.eval(mx.distributed.all_sum(mx.ones(3), group=w.group, stream=mx.cpu))


def watch_alive(out: Path) -> dict:
    """Heartbeats keep a long block alive past the timeout (MLX_SSP_DIST_TIMEOUT=2)."""
    w = dist.world()
    with dist.watch("training") as beat:
        for _ in range(5):
            time.sleep(1.0)
            raw_sum(w)
            beat()
    return {"ok": True}


def watch_freeze(out: Path) -> dict:
    w = dist.world()
    with dist.watch("training") as beat:
        raw_sum(w)
        beat()
        if w.rank == 1:
            time.sleep(8)
        raw_sum(w)
    return {"unexpected": "survived"}


def watch_die(out: Path) -> dict:
    w = dist.world()
    with dist.watch("training"):
        raw_sum(w)
        if w.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.5)
        raw_sum(w)
    return {"unexpected": "survived"}


def rl_steps(out: Path) -> dict:
    """Two MGPO-GRPO steps of a tiny LoRA policy (model dir in MLX_SSP_TEST_MODEL); the same
    script runs as one process or under mlx.launch, and rank 0 writes OUT/rl."""
    from mlx_ssp.models import load_model
    from mlx_ssp.rl.config import RLConfig
    from mlx_ssp.rl.policy import setup_model
    from mlx_ssp.rl.trainer import train
    from mlx_ssp.tasks import Task
    from mlx_ssp.verify import VerifyResult, register

    @register("dist_test_vowels")
    def _vowels(completion: str, task) -> VerifyResult:  # mixed rewards from a random model
        ok = sum(ch in "aeiou" for ch in completion) % 2 == 0
        return VerifyResult(1.0 if ok else 0.0, "correct" if ok else "wrong_answer")

    tasks = [Task(id=f"p{i}", domain="toy", prompt=f"Say something about {i} apples.", answer="-",
                  verifier="dist_test_vowels") for i in range(6)]
    cfg = RLConfig(steps=2, batch_size=3, group_size=3, sampling={"temperature": 1.0, "max_tokens": 6},
                   learning_rate=5e-3, progress=False, checkpoint_every=1, micro_batch_size=2, gen_batch_size=4,
                   aggregation=os.environ.get("AGG", "seq-mean-token-mean"), optimizer=os.environ.get("OPT", "adam"))
    model, tok, path = load_model(os.environ["MLX_SSP_TEST_MODEL"])
    setup_model(model, cfg)
    summary = train(model, tok, tasks, cfg, out / "rl", seed=5, model_path=str(path))
    return {"steps": summary["steps"], "size": dist.size()}


def main_error(out: Path) -> dict:
    def fail():
        raise UserError("disk full while saving")

    dist.run_on_main(fail, what="save checkpoint")
    return {"unexpected": "survived"}


def init_only(out: Path) -> dict:
    return {"size": dist.world().size}


def trackers_missing(out: Path) -> dict:
    """Every rank opens a tracker whose package is not installed (tests/test_trackers.py)."""
    from mlx_ssp import trackers

    trackers.TRACKERS["nope"] = type("Nope", (trackers.TensorBoardSink,), {
        "name": "nope", "module": "mlx_ssp_no_such_tracker", "package": "nope-tracker"})
    with trackers.session(["nope"], dir=out, project="p", command="run"):
        dist.barrier()
    return {"unexpected": "survived"}


def pipeline_upload(out: Path) -> dict:
    """`mlx_ssp run` on OUT/run.yaml (it sets upload.repo) with fake stages that write, on rank 0 as the
    real ones do, a specialist, the merge and the RL model with our cards and the eval table; the driver
    itself runs on every rank, as under mlx.launch."""
    from dataclasses import replace

    from mlx_ssp import pipeline
    from mlx_ssp.card import Card, write_card

    def model(d: Path, kind: str) -> str:
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text('{"model_type": "llama"}\n')
        (d / "model.safetensors").write_bytes(bytes(range(256)))
        write_card(d, Card(kind, ("Org/base",)))
        return str(d)

    def fake(name):
        def fn(run):
            d = run.stage_dir(name)
            if dist.is_main():
                d.mkdir(parents=True, exist_ok=True)
                if name == "sft":
                    spec = model(d / "specialists" / "addition", "lora")
                    (d / "summary.json").write_text(json.dumps({"domains": {"addition": {"specialist": spec}}}))
                elif name in ("merge", "rl"):
                    model(d / "model", {"merge": "merge", "rl": "grpo"}[name])
                elif name == "eval":
                    (d / "table.json").write_text(json.dumps({"k": 2, "domains": ["addition"], "rows": [
                        {"stage": "rl", "overall": {"pass@1": 0.5, "pass@2": 0.5},
                         "domains": {"addition": {"pass@1": 0.5, "pass@2": 0.5}}}]}))
            dist.barrier(f"fake {name}")  # the real stages' collectives keep the ranks in step
            return {}

        return fn

    # in place: every module of the pipeline holds this one registry
    pipeline.STAGE_REGISTRY.update({s: replace(st, run=fake(s)) for s, st in pipeline.STAGE_REGISTRY.items()})
    lines: list[str] = []
    pipeline.run_pipeline(out / "run.yaml", echo=lines.append, progress=False)
    return {"upload_lines": [x for x in lines if x.startswith("[upload]")]}


SCENARIOS = {f.__name__: f for f in (collectives, sharded, rl_steps, watch_alive, watch_freeze, watch_die, die, freeze,
                                     main_error, init_only, trackers_missing, pipeline_upload)}


if __name__ == "__main__":
    scenario, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    try:
        res = SCENARIOS[scenario](out)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    r = dist.rank()
    (out / f"rank{r}.json").write_text(json.dumps(res))
