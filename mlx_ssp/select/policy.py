"""Per-prompt selection and the whole selection of a rollouts file (pure): drop reasons, exact and
near duplicates, the policies (:data:`POLICIES`: diverse farthest-point, first, all), the spectrum
report's rows, and the mlx-lm chat records written for SFT. The algorithm is the package's
docstring (:mod:`mlx_ssp.select`)."""

from __future__ import annotations

import hashlib
import re
from collections import defaultdict
from itertools import combinations
from typing import Optional

import numpy as np

from mlx_ssp.agents.calls import CallSyntaxError, calls_from_message
from mlx_ssp.select.config import SelectConfig
from mlx_ssp.select.distance import DISTANCES
from mlx_ssp.select.quality import degenerate_reason, repetition_stats, trace_text
from mlx_ssp.select.strategy import distinct_strategies
from mlx_ssp.select.text import normalize


def dedupe(texts: list[str], dist: np.ndarray, threshold: float) -> list[int]:
    """Indices kept after dropping exact duplicates (normalised text) and near duplicates
    (distance <= ``threshold`` to an earlier kept text), in order."""
    kept: list[int] = []
    seen: set[str] = set()
    for i, t in enumerate(texts):
        key = normalize(t)
        if key in seen:
            continue
        if any(dist[i, j] <= threshold for j in kept):
            continue
        seen.add(key)
        kept.append(i)
    return kept


def farthest_point(dist: np.ndarray, candidates: list[int], m: int) -> list[int]:
    """Greedy farthest-point subset of ``candidates`` (size <= m), starting from ``candidates[0]``;
    each step adds the candidate farthest from its nearest selected point (ties: earliest)."""
    if not candidates or m <= 0:
        return []
    chosen = [candidates[0]]
    rest = list(candidates[1:])
    while rest and len(chosen) < m:
        best = max(rest, key=lambda c: (min(dist[c, s] for s in chosen), -candidates.index(c)))
        chosen.append(best)
        rest.remove(best)
    return chosen


def mean_pairwise(dist: np.ndarray, idx: list[int]) -> Optional[float]:
    if len(idx) < 2:
        return None
    return float(np.mean([dist[i, j] for i, j in combinations(idx, 2)]))


def _select_diverse(correct: list[dict], dist, distinct: list[int], cfg: SelectConfig) -> list[int]:
    return farthest_point(dist, distinct, cfg.per_prompt)


def _select_first(correct, dist, distinct, cfg) -> list[int]:
    return [0] if correct else []


def _select_all(correct, dist, distinct, cfg) -> list[int]:
    return list(range(len(correct)))


#: policy -> fn(correct records (sample order), distance matrix, distinct indices, cfg) -> indices
POLICIES = {"diverse": _select_diverse, "first": _select_first, "all": _select_all}


def strategy_text(rec: dict) -> str:
    """What two solutions must differ in to count as two strategies: the completion's text, or for
    an episode its call sequence: one word per call (a digest of its canonical form, so that the
    n-gram and edit distances count calls, not the punctuation inside them), a ``|`` between turns;
    wording, tool results and the model's prose do not count."""
    if rec.get("kind") != "episode":
        return rec["completion"]
    lines: list[str] = []
    turn: Optional[list[str]] = None  # the calls of the current turn (None: before the first user message)
    for m in rec["messages"]:
        if m.get("role") == "user":
            if turn is not None:  # every turn keeps its place, one without calls too
                lines.append(" ".join(turn))
            turn = []
        elif m.get("role") == "assistant" and turn is not None:
            try:
                turn += ["call_" + hashlib.blake2b(c.key().encode(), digest_size=6).hexdigest()
                         for c in calls_from_message(m)]
            except CallSyntaxError:
                turn.append("<unparsed>")
    return " | ".join(lines + ([" ".join(turn)] if turn is not None else []))


def _quality_on(cfg: SelectConfig) -> bool:
    """Whether the report counts drops per reason (only then, so that the report of a run without
    the quality options stays what it was)."""
    return any(x is not None for x in (cfg.repetition, cfg.decontaminate, cfg.pseudo_label))


def drop_reason(rec: dict, cfg: SelectConfig) -> Optional[str]:
    """Why a sample cannot be SFT data (``incorrect`` | ``truncated`` | ``repetition``), or None.
    The first reason in that order is the one counted."""
    if rec.get("reward") is None or rec["reward"] < cfg.min_reward - 1e-6:
        return "incorrect"
    if cfg.drop_truncated and rec.get("finish_reason") == "length":
        return "truncated"
    rep = cfg.repetition
    if rep is not None:
        if degenerate_reason(repetition_stats(trace_text(rec), rep.n), rep.max_repeated_fraction,
                             rep.max_repeated_span) is not None:
            return "repetition"
    return None


#: the reasons :func:`drop_reason` gives, in its order (the report's columns)
DROP_REASONS = ("incorrect", "truncated", "repetition")


_EQUATION = re.compile(r"\d\s*=\s*-?\d")


def strategy_kind(correct: list[dict]) -> str:
    """The strategy distance a prompt's solutions call for (``distance: auto``). Rollout records do
    not carry their verifier, so this reads the solutions: episodes -> ``ngram`` over their call
    sequence (:func:`strategy_text`), tool calls -> ``calls``, Python code -> ``ast``, equations ->
    ``steps``, anything else -> ``ngram``."""
    if any(r.get("kind") == "episode" for r in correct):
        return "ngram"
    texts = [r.get("completion") or "" for r in correct]
    if any("<tool_call>" in t for t in texts):
        return "calls"
    if any("```python" in t or t.lstrip().startswith(("def ", "import ", "from ")) for t in texts):
        return "ast"
    if any(_EQUATION.search(t) for t in texts):
        return "steps"
    return "ngram"


def _n_strategies(texts: list[str], kind: str) -> int:
    if kind in ("steps", "ast", "calls"):
        return distinct_strategies(texts, kind)
    return len({normalize(t) for t in texts})  # wording is all there is to compare


def select_prompt(recs: list[dict], cfg: SelectConfig) -> tuple[list[dict], dict]:
    """One prompt's selected records and its spectrum row. ``recs`` are all its samples."""
    recs = sorted(recs, key=lambda r: r["sample"])
    reasons = [drop_reason(r, cfg) for r in recs]
    correct = [r for r, why in zip(recs, reasons) if why is None]
    texts = [strategy_text(r) for r in correct]
    kind = strategy_kind(correct)
    dist = DISTANCES[kind if cfg.distance == "auto" else cfg.distance](cfg.ngram)(texts)
    distinct = dedupe(texts, dist, cfg.near_duplicate)
    chosen = POLICIES[cfg.policy](correct, dist, distinct, cfg)
    row = {
        "task_id": recs[0]["task_id"],
        "n_samples": len(recs),
        "n_correct": len(correct),
        "n_distinct_correct": len(distinct),
        "n_selected": len(chosen),
        "selected_samples": [correct[i]["sample"] for i in chosen],
        "mean_pairwise_distance": mean_pairwise(dist, chosen),
        "mean_pairwise_distance_distinct": mean_pairwise(dist, distinct),
        # what the solutions *do*: distinct feature sets of the prompt's kind of solution
        "strategy_kind": kind,
        "n_strategies": _n_strategies(texts, kind),
    }
    if _quality_on(cfg):
        row["dropped"] = {k: reasons.count(k) for k in DROP_REASONS}
    return [correct[i] for i in chosen], row


def to_chat(rec: dict, system: Optional[str] = None) -> dict:
    """An mlx-lm chat training example from a rollout record. An episode is its whole conversation
    as token ids with the mask of the model's tokens (the multi-turn SFT format, docs/sft.md), the
    messages beside them for people, and where it came from (``sampled`` or ``gold``)."""
    if rec.get("kind") == "episode":
        prompt = list(rec["prompt_token_ids"])
        return {"token_ids": prompt + list(rec["token_ids"]), "mask": [0] * len(prompt) + list(rec["model_mask"]),
                "messages": [dict(m) for m in rec["messages"]], "source": rec.get("source", "sampled"),
                "task_id": rec["task_id"]}
    prompt = rec["prompt"]
    msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    if system and not any(m.get("role") == "system" for m in msgs):
        msgs.insert(0, {"role": "system", "content": system})
    return {"messages": msgs + [{"role": "assistant", "content": rec["completion"]}]}


def _split_prompts(task_ids: list[str], frac: float, seed: int) -> tuple[set[str], bool]:
    """Held-out prompt ids (stable: ordered by a seeded hash) and whether valid must equal train."""
    if len(task_ids) < 2 or frac <= 0:
        return set(), True
    order = sorted(task_ids, key=lambda t: hashlib.blake2b(f"{seed}\x1f{t}".encode(), digest_size=8).digest())
    n_valid = min(len(task_ids) - 1, max(1, round(frac * len(task_ids))))
    return set(order[:n_valid]), False


def select(records: list[dict], cfg: SelectConfig, system: Optional[str] = None,
           contaminated: Optional[dict[str, str]] = None) -> tuple[dict, dict]:
    """All records -> ({domain: {"train": [...], "valid": [...]}}, spectrum report). Pure.
    ``contaminated``: task id -> the n-gram it shares with a held-out prompt; those tasks are left
    out (counted per domain as ``decontaminated``)."""
    by_task: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by_task[r["task_id"]].append(r)
    rows_by_domain: dict[str, list[dict]] = defaultdict(list)
    picked: dict[str, dict[str, list[dict]]] = defaultdict(dict)
    decon: dict[str, dict[str, tuple[str, int]]] = defaultdict(dict)  # domain -> id -> (gram, records)
    for tid, recs in by_task.items():
        if contaminated and tid in contaminated:
            decon[recs[0]["domain"]][tid] = (contaminated[tid], len(recs))
            rows_by_domain[recs[0]["domain"]]  # the domain keeps its report entry (and says why it is empty)
            continue
        chosen, row = select_prompt(recs, cfg)
        dom = recs[0]["domain"]
        rows_by_domain[dom].append(row)
        if chosen:
            picked[dom][tid] = chosen
    data: dict[str, dict] = {}
    domains: dict[str, dict] = {}
    for dom, rows in sorted(rows_by_domain.items()):
        ids = sorted(picked[dom])
        held, valid_is_train = _split_prompts(ids, cfg.valid_fraction, cfg.seed)
        train = [to_chat(r, system) for t in ids if t not in held for r in picked[dom][t]]
        valid = train if valid_is_train else [to_chat(r, system) for t in ids if t in held for r in picked[dom][t]]
        data[dom] = {"train": train, "valid": valid}
        with_pairs = [r["mean_pairwise_distance"] for r in rows if r["mean_pairwise_distance"] is not None]
        no_correct = [r["task_id"] for r in rows if r["n_correct"] == 0]
        n = len(rows)
        den = max(n, 1)  # a domain whose every prompt was decontaminated has no rows
        domains[dom] = {
            "n_prompts": n,
            "prompts_with_correct": n - len(no_correct),
            "prompts_no_correct": len(no_correct),
            "no_correct_ids": no_correct,
            "mean_correct_per_prompt": sum(r["n_correct"] for r in rows) / den,
            "mean_distinct_correct_per_prompt": sum(r["n_distinct_correct"] for r in rows) / den,
            "mean_strategies_per_prompt": sum(r["n_strategies"] for r in rows) / den,
            "mean_selected_per_prompt": sum(r["n_selected"] for r in rows) / den,
            "mean_pairwise_distance": (sum(with_pairs) / len(with_pairs)) if with_pairs else None,
            "n_train": len(train),
            "n_valid": len(valid),
            "valid_is_train": valid_is_train and bool(train),
            "prompts": rows,
        }
        if _quality_on(cfg):
            dropped = {k: sum(r["dropped"][k] for r in rows) for k in DROP_REASONS}
            dropped["decontaminated"] = sum(c for _, c in decon[dom].values())
            domains[dom]["dropped"] = dropped
            domains[dom]["decontaminated_prompts"] = len(decon[dom])
            domains[dom]["decontaminated_ids"] = {t: g for t, (g, _) in sorted(decon[dom].items())}
    report = {"policy": cfg.policy, "config": cfg.model_dump(), "domains": domains}
    return data, report
