"""Build and calibrate the issue-21 testbed models (mlx_ssp.testbed).

    python scripts/testbed.py build --size small --seed 0      # pretrain (cached; prints the path)
    python scripts/testbed.py calibrate testbed:small:0         # pass@1 by domain and level, pass band, strategies

`build` prints the cache directory and the build report (steps, loss curve, wall time); `calibrate`
prints one JSON object (mlx_ssp.testbed.calibrate.calibrate) and a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import mlx_ssp  # noqa: F401  (OpenBLAS before mlx.core)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--size", default="small")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--steps", type=int, default=None, help="override the size's pretraining steps")
    b.add_argument("--out", default=None, help="directory (default: the cache)")
    c = sub.add_parser("calibrate")
    c.add_argument("model", help="a model spec: testbed[:SIZE[:SEED]] or a directory")
    c.add_argument("--n", type=int, default=48, help="held-out problems per domain")
    c.add_argument("--k", type=int, default=8)
    c.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.cmd == "build":
        from pathlib import Path

        from mlx_ssp.testbed.build import build, ensure_testbed, testbed_dir

        t0 = time.perf_counter()
        if args.out or args.steps:
            out = build(args.size, args.seed, Path(args.out) if args.out else testbed_dir(args.size, args.seed), steps=args.steps)
        else:
            out = ensure_testbed(f"testbed:{args.size}:{args.seed}")
        info = json.loads((out / "build.json").read_text())
        print(json.dumps({k: v for k, v in info.items() if k != "mix"}, indent=1))
        print(f"{out}  ({time.perf_counter() - t0:.0f} s)")
        return
    from mlx_ssp.models import load_model
    from mlx_ssp.testbed.calibrate import calibrate

    model, tok, path = load_model(args.model)
    t0 = time.perf_counter()
    res = calibrate(model, tok, n_per_domain=args.n, k=args.k, seed=args.seed)
    res["model"], res["seconds"] = str(path), round(time.perf_counter() - t0, 1)
    print(json.dumps(res, indent=1))
    print("\n| domain | pass@1 | by level | 30-70% band | at 0 | at 1 | strategies of correct samples |", file=sys.stderr)
    for d, r in res["domains"].items():
        print(f"| {d} | {r['pass@1']:.3f} | {r['by_level']} | {r['band_30_70']}/{r['n']} | {r['at_0']} | {r['at_1']} | "
              f"{r['strategies_of_correct']} |", file=sys.stderr)


if __name__ == "__main__":
    main()
