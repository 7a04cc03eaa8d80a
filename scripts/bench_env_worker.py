"""What running every episode's tools in a worker process costs: BFCL ground-truth replays through the
checker (two environments per episode: the model's and the ground truth's twin), side by side with
another checkout of the code (e.g. one from before the workers, where calls ran in a thread).

    python scripts/bench_env_worker.py [--compare TREE] [--rounds 3] [--category base]

Each round runs both trees in fresh processes, alternating, and times ``score_episode`` on every
entry of the category (environment start, calls, state reads and stop included); the ratio is the
median over rounds of (this tree / the other). Also prints this tree's per-environment start and
per-call round trip.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
from pathlib import Path
import bfcl_eval
from mlx_ssp.agents.calls import parse_ground_truth
import mlx_ssp.agents.checker as checker
cat = sys.argv[1]
d = Path(bfcl_eval.__file__).parent / "data"
entries = [json.loads(x) for x in open(d / f"BFCL_v4_multi_turn_{cat}.json")]
gts = {g["id"]: g["ground_truth"] for g in map(json.loads, open(d / "possible_answer" / f"BFCL_v4_multi_turn_{cat}.json"))}
def spec(e):
    gt = gts[e["id"]]
    try:
        from mlx_ssp.agents.environment import bfcl_world
        return checker.EpisodeSpec(bfcl_world(e["initial_config"], e["involved_classes"], cat == "long_context"), gt)
    except ImportError:  # a checkout from before the environment contract
        return checker.EpisodeSpec(e["initial_config"], e["involved_classes"], gt, cat == "long_context")
specs = [spec(e) for e in entries]
checker.score_episode(specs[0], [[[parse_ground_truth(c) for c in t]] for t in specs[0].ground_truth])  # warm up
t0 = time.perf_counter()
passed = 0
for s in specs:
    v = checker.score_episode(s, [[[parse_ground_truth(c) for c in t]] for t in s.ground_truth])
    passed += v.reward == 1.0
print(json.dumps({"s": time.perf_counter() - t0, "n": len(specs), "passed": passed}))
"""

MICRO = r"""
import json, time
from mlx_ssp.agents.calls import Call
from mlx_ssp.agents.environment import Environment, bfcl_world
w = bfcl_world({}, ["MathAPI"])
Environment(w).close()
t0 = time.perf_counter()
for _ in range(50):
    Environment(w).close()
start = (time.perf_counter() - t0) / 50
with Environment(w) as env:
    names = env.method_names()
    t0 = time.perf_counter()
    for _ in range(500):
        env.execute([Call("add", {"a": 1, "b": 2})], names)
    call = (time.perf_counter() - t0) / 500
print(json.dumps({"start_ms": start * 1e3, "call_ms": call * 1e3}))
"""


def run(tree: Path, code: str, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"{tree}: the timed child failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compare", type=Path, default=None, help="another checkout to time beside this one")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--category", default="base")
    args = ap.parse_args()
    print("this tree, per environment and per call:", run(ROOT, MICRO))
    ratios = []
    for r in range(args.rounds):
        ours = run(ROOT, CHILD, args.category)
        line = f"round {r}: this tree {ours['s']:.2f} s for {ours['n']} episodes ({ours['passed']} pass)"
        if args.compare:
            theirs = run(args.compare, CHILD, args.category)
            ratios.append(ours["s"] / theirs["s"])
            line += f"; other {theirs['s']:.2f} s ({theirs['passed']} pass); ratio {ratios[-1]:.2f}"
        print(line, flush=True)
    if ratios:
        print(f"median ratio (this / other): {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
