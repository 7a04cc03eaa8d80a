"""The reasoning-gym source: seeded procedural generators, one seed per split.

Each split (in :data:`~mlx_ssp.tasks.item.ORDER`) draws from its own seed derived from the run seed,
the domain and the split; duplicate problems within a split are skipped, and a problem already in
eval (then probe) is skipped for the later splits. If the generator cannot give enough distinct
problems the error says how many it found.
"""

from __future__ import annotations

import json
import re
import zlib
from typing import TYPE_CHECKING

from mlx_ssp.errors import UserError
from mlx_ssp.tasks.item import ORDER, Item

if TYPE_CHECKING:
    from mlx_ssp.tasks.sources import Source


def split_seed(seed: int, domain: str, split: str) -> int:
    """A distinct, stable seed per (run seed, domain, split)."""
    return zlib.crc32(f"{seed}:{domain}:{split}".encode()) & 0x7FFFFFFF


def _strip_outer_parens(s: str) -> str:
    while s.startswith("(") and s.endswith(")"):
        depth = 0
        for i, c in enumerate(s):
            depth += c == "("
            depth -= c == ")"
            if depth == 0 and i < len(s) - 1:
                return s  # "(a)+(b)": the outer pair is not one group
        s = s[1:-1]
    return s


def problem_key(entry: dict) -> str:
    """What makes two reasoning-gym entries the same problem: the expression when the dataset records
    one (so "( 5 + 3 )" and "5 + 3" are one problem), else the question up to case and whitespace."""
    expr = (entry.get("metadata") or {}).get("expression")
    if isinstance(expr, str) and expr.strip():
        return "expr:" + _strip_outer_parens(re.sub(r"\s+", "", expr))
    return "q:" + re.sub(r"\s+", " ", str(entry["question"]).strip().lower())


def _rg_generate(name: str, params: dict, seed: int, n: int, exclude: set[str], domain: str, split: str) -> list[Item]:
    try:
        import reasoning_gym
    except ImportError:
        raise UserError("source 'reasoning_gym' needs the reasoning-gym package") from None
    if n == 0:
        return []
    cap = max(64, 20 * n)
    cfg = {k: v for k, v in params.items() if k not in ("seed", "size")}
    try:
        ds = reasoning_gym.create_dataset(name, seed=seed, size=cap, **cfg)
    except Exception as e:  # unknown dataset or a config the dataset rejects: one line for the user
        raise UserError(f"reasoning_gym:{name}: {type(e).__name__}: {e}") from None
    items, seen = [], set()
    for idx in range(cap):
        e = ds[idx]
        q = e["question"]
        key = problem_key(e)
        if key in seen or key in exclude:
            continue
        seen.add(key)
        md = {
            "reasoning_gym": {
                "dataset": name,
                "config": cfg,
                "seed": seed,
                "size": cap,
                "question": q,
                "index": idx,
                "key": key,
                "entry_metadata": json.loads(json.dumps(e.get("metadata", {}), default=str)),
            }
        }
        items.append(Item(f"{split}-{idx}", q, e["answer"], md))
        if len(items) == n:
            return items
    raise UserError(
        f"domain '{domain}': reasoning_gym:{name} gave only {len(items)} distinct {split} questions "
        f"(not in earlier splits) out of {cap} draws; {n} requested. Widen the params or lower the sizes."
    )


def rg_items(src: Source, arg: str, domain: str, dcfg, seed: int, split: str) -> list[Item]:
    """Draw the splits in ORDER, each from its own seed, skipping problems of the splits before it."""
    taken: set[str] = set()
    for s in ORDER:
        n = dcfg.sizes.of(s)
        if n is None:
            raise UserError(f"domain '{domain}': sizes.{s} must be a number for {src.kind} sources")
        items = _rg_generate(arg, dcfg.params, split_seed(seed, domain, s), n, taken, domain, s)
        if s == split:
            return items
        taken.update(it.metadata["reasoning_gym"]["key"] for it in items)
    raise ValueError(split)  # unreachable: split is one of ORDER


def rg_catalogue() -> str:
    try:
        import reasoning_gym.factory as rgf
    except ImportError:
        return "reasoning_gym: not installed"
    return f"reasoning_gym datasets ({len(rgf.DATASETS)}): " + ", ".join(sorted(rgf.DATASETS))
