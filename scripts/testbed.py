"""Build and calibrate the testbed models (mlx_ssp.testbed).

    python scripts/testbed.py build --size small --seed 0      # pretrain (cached; prints the path)
    python scripts/testbed.py calibrate testbed:small:0         # pass@1 by domain and level, pass band, strategies
    python scripts/testbed.py spread --seeds 0-9                # the learning round's gain over training seeds

`spread` builds (or loads from the cache) ``testbed:ci:BUILD_SEED``, runs one learning round
(mlx_ssp.testbed.learning; ``--stage rl``: MGPO-GRPO, ``--stage sft``: rollout, select, LoRA SFT;
then the held-out eval) per training seed, and prints each gain, their mean and standard deviation,
and ``mean - 4 SD``, the rule the CI learning test's margin comes from (EXPERIMENTS.md, "The
learning regression test"). ``--build-seeds`` also varies the build seed (one round per build seed,
training seed 0).

`build` prints the cache directory and the build report (steps, loss curve, wall time); `calibrate`
prints one JSON object (mlx_ssp.testbed.calibrate.calibrate) and a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

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
    sp = sub.add_parser("spread")
    sp.add_argument("--size", default="ci")
    sp.add_argument("--stage", choices=("rl", "sft"), default=None, help="the round's phase (default: LearningConfig's)")
    sp.add_argument("--build-seed", type=int, default=0)
    sp.add_argument("--seeds", default="0-4", help="training seeds: A-B or a comma list")
    sp.add_argument("--build-seeds", default=None, help="also vary the build seed (A-B or a comma list; training seed 0)")
    sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a LearningConfig field (JSON value; dotted for a stage's), e.g. --set rl.steps=30")
    sp.add_argument("-o", "--output", default=None, help="write the per-seed results and the summary as JSON")
    sp.add_argument("--keep", default=None, metavar="DIR",
                    help="keep each round's directory as DIR/build-B-seed-S (with learning.json; a kept round is "
                         "reused by a rerun, one without it redone): `mlx_ssp report LABEL=DIR/build-0-seed-0 ...` "
                         "draws their curves with a band across seeds")
    args = ap.parse_args()
    if args.cmd == "spread":
        spread(args)
        return
    if args.cmd == "build":
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
    levels = None
    if (Path(path) / "build.json").is_file():  # a testbed build: the domains and levels it was pretrained on
        from mlx_ssp.testbed.problems import DOMAINS, LEVELS

        built = json.loads((Path(path) / "build.json").read_text())
        levels = {d: tuple(built.get("levels", {}).get(d, LEVELS[d])) for d in built.get("domains", DOMAINS)}
    t0 = time.perf_counter()
    res = calibrate(model, tok, n_per_domain=args.n, k=args.k, seed=args.seed, levels=levels)
    res["model"], res["seconds"] = str(path), round(time.perf_counter() - t0, 1)
    print(json.dumps(res, indent=1))
    print("\n| domain | pass@1 | by level | 30-70% band | at 0 | at 1 | strategies of correct samples |", file=sys.stderr)
    for d, r in res["domains"].items():
        print(f"| {d} | {r['pass@1']:.3f} | {r['by_level']} | {r['band_30_70']}/{r['n']} | {r['at_0']} | {r['at_1']} | "
              f"{r['strategies_of_correct']} |", file=sys.stderr)


def _seeds(text: str) -> list[int]:
    if "-" in text:
        a, b = text.split("-", 1)
        return list(range(int(a), int(b) + 1))
    return [int(x) for x in text.split(",") if x.strip()]


def spread(args) -> None:
    import shutil
    import statistics
    import tempfile
    from pathlib import Path

    from mlx_ssp.config import validate
    from mlx_ssp.io import write_json_atomic
    from mlx_ssp.testbed.build import ensure_testbed
    from mlx_ssp.testbed.learning import LearningConfig, learning_round

    raw: dict = {"stage": args.stage} if args.stage else {}
    for kv in args.set:
        key, sep, value = kv.partition("=")
        try:
            value = json.loads(value) if sep else None
        except json.JSONDecodeError:
            value = None
        if value is None:
            raise SystemExit(f"--set {kv!r}: expected KEY=VALUE with a JSON value (strings quoted: "
                             f"--set train_space='\"held_out\"')")
        *parents, leaf = key.split(".")
        node = raw
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    cfg = validate(LearningConfig, raw, source="--set")
    runs = [(args.build_seed, s) for s in _seeds(args.seeds)]
    if args.build_seeds:
        runs += [(b, 0) for b in _seeds(args.build_seeds) if b != args.build_seed]
    rows = []
    for bseed, tseed in runs:
        t0 = time.perf_counter()
        model = ensure_testbed(f"testbed:{args.size}:{bseed}", progress=False)
        build_s = json.loads((model / "build.json").read_text())["seconds"]
        kept = Path(args.keep) / f"build-{bseed}-seed-{tseed}" if args.keep else None
        done = json.loads((kept / "learning.json").read_text()) if kept and (kept / "learning.json").is_file() else None
        if done is not None and (done.get("config"), done.get("size")) != (cfg.model_dump(mode="json"), args.size):
            raise SystemExit(f"{kept} was kept from another size or config: use another --keep directory")
        if done is not None:
            r = done
        else:
            with tempfile.TemporaryDirectory() as tmp:
                work = kept or Path(tmp)
                if kept:
                    shutil.rmtree(kept, ignore_errors=True)  # a round that did not finish starts over
                work.mkdir(parents=True, exist_ok=True)
                r = learning_round(model, work, cfg, seed=tseed)
                r.update(build_seed=bseed, build_seconds=build_s, round_seconds=round(time.perf_counter() - t0, 1),
                         size=args.size, config=cfg.model_dump(mode="json"))
                if kept:
                    write_json_atomic(kept / "learning.json", r)  # last: its presence means the round finished
        rows.append(r)
        after = "no training data" if r["gain"] is None else f"{r['trained']:.3f}  gain {r['gain']:+.3f}"
        data = f"{r['sft_records']} SFT records" if "sft_records" in r else f"reward {r['rewards'][0]:.2f} -> {r['rewards'][-1]:.2f}"
        print(f"build {bseed} seed {tseed}: base {r['base']:.3f} -> {after}  ({data}, {r['round_seconds']} s)",
              file=sys.stderr, flush=True)

    def stats(rs):
        g = [r["gain"] for r in rs if r["gain"] is not None]  # rounds with too little SFT data have none
        nan = float("nan")
        sd = statistics.stdev(g) if len(g) > 1 else nan
        mean = statistics.fmean(g) if g else nan
        return {"n": len(g), "no_data": len(rs) - len(g), "mean": mean, "sd": sd, "min": min(g) if g else nan,
                "mean_minus_4sd": mean - 4 * sd}

    summary = {"config": cfg.model_dump(mode="json"), "size": args.size,
               "training_seeds": stats([r for r in rows if r["build_seed"] == args.build_seed])}
    if args.build_seeds:
        summary["build_seeds"] = stats([r for r in rows if r["seed"] == 0])
    print(json.dumps(summary, indent=1))
    if args.output:
        write_json_atomic(args.output, {"summary": summary, "runs": rows})


if __name__ == "__main__":
    main()
