"""The held-out eval table of a run (pure): pass@1 / pass@k per model and domain, overall and breadth,
and its Markdown form."""

from __future__ import annotations


def eval_table(results: dict[str, dict], k: int) -> dict:
    """{"k": K, "domains": [...], "rows": [{"stage", "overall": {...}, "domains": {D: {...}}}]}."""
    key_k = f"pass@{k}"
    domains: list[str] = []
    rows = []
    for name, res in results.items():
        for d in res.get("domains", {}):
            if d not in domains:
                domains.append(d)
        rows.append(
            {
                "stage": name,
                "overall": {m: res.get("overall", {}).get(m) for m in ("pass@1", key_k)},
                "domains": {
                    d: {m: v.get(m) for m in ("pass@1", key_k)} for d, v in res.get("domains", {}).items()
                },
            }
        )
    for r in rows:  # breadth: every domain counts once, whatever its size (the negative-transfer figure)
        r["breadth"] = {m: _mean([r["domains"].get(d, {}).get(m) for d in domains]) for m in ("pass@1", key_k)}
    table = {"k": k, "domains": domains, "rows": rows}
    base = next((r for r in rows if r["stage"] == "base"), None)
    last = rows[-1] if rows else None
    if base and last and last is not base:
        table["gain"] = {
            "from": "base",
            "to": last["stage"],
            **{m: _sub(last["overall"].get(m), base["overall"].get(m)) for m in ("pass@1", key_k)},
        }
    return table


def _mean(xs: list):
    return None if not xs or any(x is None for x in xs) else sum(xs) / len(xs)


def _sub(a, b):
    return None if a is None or b is None else a - b


def _fmt(x) -> str:
    return "  -  " if x is None else f"{x:.3f}"


def format_eval_table(table: dict) -> str:
    """A Markdown table: one row per stage model, pass@1 / pass@k per domain, overall (the mean over
    tasks) and breadth (the mean over domains)."""
    k = table["k"]
    key_k = f"pass@{k}"
    cols = [f"{d} p@1 | {d} p@{k}" for d in table["domains"]] + [f"overall p@1 | overall p@{k}"]
    cols += [f"breadth p@1 | breadth p@{k}"]
    lines = ["| model | " + " | ".join(cols) + " |", "|---|" + "---|---|" * (len(table["domains"]) + 2)]
    for r in table["rows"]:
        cells = []
        for d in table["domains"]:
            v = r["domains"].get(d, {})
            cells += [_fmt(v.get("pass@1")), _fmt(v.get(key_k))]
        cells += [_fmt(r["overall"].get("pass@1")), _fmt(r["overall"].get(key_k))]
        b = r.get("breadth", {})
        cells += [_fmt(b.get("pass@1")), _fmt(b.get(key_k))]
        lines.append(f"| {r['stage']} | " + " | ".join(cells) + " |")
    g = table.get("gain")
    if g:
        lines.append("")
        lines.append(
            f"gain {g['to']} vs {g['from']}: pass@1 {_signed(g.get('pass@1'))}, pass@{k} {_signed(g.get(key_k))}"
        )
    return "\n".join(lines)


def _signed(x) -> str:
    return "n/a" if x is None else f"{x:+.3f}"

