"""``python -m mlx_ssp.distributed``: check a cluster before a long run (hosts, an all_sum timed)."""

from __future__ import annotations

import platform
import sys
import time

import mlx.core as mx

import mlx_ssp  # noqa: F401  (OpenBLAS before mlx.core)
from mlx_ssp.distributed.collectives import all_sum, gather_per_rank
from mlx_ssp.distributed.world import is_main, world
from mlx_ssp.errors import UserError


def check(mb: float = 10.0, reps: int = 5) -> dict:
    """Every rank reports its host; an all_sum is checked for correctness and timed."""
    w = world()
    hosts = gather_per_rank({"rank": w.rank, "host": platform.node(), "device": str(mx.default_device())},
                            what="check: gather hosts")
    x = mx.full((max(1, int(mb * 1e6 / 4)),), float(w.rank + 1))
    expect = w.size * (w.size + 1) / 2
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        y = all_sum(x, what="check: all_sum")
        times.append(time.perf_counter() - t)
    ok = bool(mx.all(y == expect).item())
    best = min(times)
    return {"size": w.size, "hosts": hosts, "all_sum_ok": ok, "all_sum_mb": x.nbytes / 1e6,
            "all_sum_ms": round(best * 1000, 2), "algbw_gb_s": round(x.nbytes / best / 1e9, 3) if w.size > 1 else None}


def main() -> None:
    """Print the check on rank 0; exit 0 when the sum is right (2 on a one-line error)."""
    try:
        report = check()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if is_main():
        for h in report["hosts"]:
            print(f"rank {h['rank']}: {h['host']} ({h['device']})")
        print(f"{report['size']} rank(s); all_sum of {report['all_sum_mb']:.0f} MB: "
              f"{'correct' if report['all_sum_ok'] else 'WRONG'}, {report['all_sum_ms']} ms"
              + (f" ({report['algbw_gb_s']} GB/s)" if report["algbw_gb_s"] else ""))
    sys.exit(0 if report["all_sum_ok"] else 1)
