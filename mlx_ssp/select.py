"""Diversity-exploring selection: from K verified rollouts per prompt to SFT data (SSP step 2).

Algorithm (VibeThinker-1.5B, arXiv:2511.06221, section 3.2: the Spectrum phase keeps *many distinct*
correct solutions per problem, not the first win). Per prompt, with the ``diverse`` policy:

1. keep the correct completions (reward >= ``min_reward``; by default also drop ones cut off by
   ``max_tokens``, which would teach the model not to stop);
2. drop exact duplicates (after whitespace normalisation), then near duplicates: walking the
   samples in index order, a completion within ``near_duplicate`` distance of one already kept is
   dropped;
3. greedy farthest-point selection up to M (``per_prompt``): start from the earliest kept sample
   (sample order is random, so this is a seeded random start), then repeatedly add the candidate
   whose distance to its nearest selected solution is largest (ties: lowest sample index).

Distances (a registry, :data:`DISTANCES`): ``ngram`` = Jaccard distance between the sets of word
n-grams (default n=3), ``edit`` = word-level Levenshtein distance / the longer length. Both are in
[0, 1]. For an episode the compared text is its call sequence (:func:`strategy_text`), so distinct
strategies are distinct call sequences, not distinct wording (issue 17). ``first`` keeps the first correct sample per prompt (the single-path baseline SSP argues
against) and ``all`` keeps every correct one.

Output: ``OUT_DIR/<domain>/train.jsonl`` and ``valid.jsonl`` in mlx-lm's chat format
(``{"messages": [...prompt..., {"role": "assistant", "content": completion}]}``), so
``mlx_lm.tuner`` reads the directory as is, and ``OUT_DIR/spectrum.json``: per prompt and per domain,
correct / distinct correct / selected counts, mean pairwise distance of the selected and of the
distinct correct solutions, and the prompts with no correct solution. The valid split holds out
whole prompts (``valid_fraction``, at least one); a domain with a single prompt gets valid = train
(mlx-lm needs a non-empty valid set), flagged ``valid_is_train`` in the report. Deviation: the paper
does not say how diversity is measured; n-gram Jaccard is our documented default.

Input integrity: a (task, sample) that appears more than once (two runs wrote one file, or files
were concatenated) is kept once when the copies agree and refused when they differ; records
stamped with different ``run_fingerprint`` values (other model, seed or sampling) are refused, so
one selection never mixes two runs.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import defaultdict
from itertools import combinations
from pathlib import Path
from typing import Callable, Literal, Optional

import numpy as np
from pydantic import Field

from mlx_ssp.config import StrictModel
from mlx_ssp.errors import UserError


class SelectConfig(StrictModel):
    """The ``select:`` section of a run file."""

    OMIT_AT_DEFAULT = frozenset({"gold"})  # added for episodes (issue 18)

    policy: Literal["diverse", "first", "all"] = "diverse"
    per_prompt: int = Field(4, ge=1)  # M: most solutions kept per prompt (diverse)
    distance: Literal["ngram", "edit"] = "ngram"
    ngram: int = Field(3, ge=1)  # n of the n-gram distance
    near_duplicate: float = Field(0.1, ge=0.0, lt=1.0)  # distance at or below which two are duplicates
    min_reward: float = Field(1.0, gt=0.0, le=1.0)  # a completion is correct at reward >= this
    drop_truncated: bool = True  # drop completions cut by max_tokens
    valid_fraction: float = Field(0.1, ge=0.0, lt=1.0)  # prompts held out for valid.jsonl
    seed: int = 0  # of the valid split
    #: episode tasks: also offer each task's gold episode (its ground truth played through the
    #: environment, ``source: gold``) as a candidate; needs the task file and the student's tokenizer
    gold: bool = False
    input: Optional[str] = None  # rollouts JSONL (the positional argument beats it)
    output: Optional[str] = None  # OUT_DIR (-o beats it)


# -- distances (pure) -------------------------------------------------------------------------

_WORD = re.compile(r"\w+|[^\w\s]")


def normalize(text: str) -> str:
    """Whitespace-collapsed text: the key of exact-duplicate removal."""
    return " ".join(text.split())


def words(text: str) -> list[str]:
    return _WORD.findall(text)


def ngrams(text: str, n: int = 3) -> frozenset:
    """Set of word n-grams (a text shorter than n words is one gram)."""
    w = words(text)
    if len(w) < n:
        return frozenset([tuple(w)]) if w else frozenset()
    return frozenset(tuple(w[i : i + n]) for i in range(len(w) - n + 1))


def jaccard_distance(a: frozenset, b: frozenset) -> float:
    if not a and not b:
        return 0.0
    return 1.0 - len(a & b) / len(a | b)


def levenshtein(a: list, b: list) -> int:
    """Edit distance between two sequences; one vectorised row per element of ``a``."""
    if len(a) < len(b):
        a, b = b, a
    if not b:
        return len(a)
    vocab: dict = {}
    ai = np.array([vocab.setdefault(x, len(vocab)) for x in a])
    bi = np.array([vocab.setdefault(x, len(vocab)) for x in b])
    idx = np.arange(len(bi) + 1)
    prev = idx.copy()
    for i, x in enumerate(ai, 1):
        cur = np.empty_like(prev)
        cur[0] = i
        # deletion and substitution from the previous row ...
        cur[1:] = np.minimum(prev[1:] + 1, prev[:-1] + (bi != x))
        # ... then insertions: cur[j] = min_k<=j cur[k] + (j - k), a running minimum
        cur = np.minimum.accumulate(cur - idx) + idx
        prev = cur
    return int(prev[-1])


def ngram_distance_fn(n: int) -> Callable[[list[str]], np.ndarray]:
    def matrix(texts: list[str]) -> np.ndarray:
        feats = [ngrams(t, n) for t in texts]
        return _matrix(feats, jaccard_distance)

    return matrix


def edit_distance(a: str, b: str) -> float:
    """Word-level Levenshtein distance normalised by the longer length (in [0, 1])."""
    wa, wb = words(a), words(b)
    m = max(len(wa), len(wb))
    return levenshtein(wa, wb) / m if m else 0.0


def edit_distance_fn(n: int) -> Callable[[list[str]], np.ndarray]:  # n unused: one signature for the registry
    def matrix(texts: list[str]) -> np.ndarray:
        feats = [words(t) for t in texts]

        def d(a, b):
            m = max(len(a), len(b))
            return levenshtein(a, b) / m if m else 0.0

        return _matrix(feats, d)

    return matrix


def _matrix(feats: list, d: Callable) -> np.ndarray:
    m = np.zeros((len(feats), len(feats)))
    for i, j in combinations(range(len(feats)), 2):
        m[i, j] = m[j, i] = d(feats[i], feats[j])
    return m


#: name -> (n -> texts -> symmetric distance matrix)
DISTANCES: dict[str, Callable[[int], Callable[[list[str]], np.ndarray]]] = {
    "ngram": ngram_distance_fn,
    "edit": edit_distance_fn,
}


# -- selection (pure) -------------------------------------------------------------------------


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
    from mlx_ssp.agents.calls import CallSyntaxError, calls_from_message

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


def select_prompt(recs: list[dict], cfg: SelectConfig) -> tuple[list[dict], dict]:
    """One prompt's selected records and its spectrum row. ``recs`` are all its samples."""
    recs = sorted(recs, key=lambda r: r["sample"])
    correct = [
        r for r in recs
        if r.get("reward") is not None and r["reward"] >= cfg.min_reward - 1e-6
        and not (cfg.drop_truncated and r.get("finish_reason") == "length")
    ]
    texts = [strategy_text(r) for r in correct]
    dist = DISTANCES[cfg.distance](cfg.ngram)(texts)
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
    }
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


def select(records: list[dict], cfg: SelectConfig, system: Optional[str] = None) -> tuple[dict, dict]:
    """All records -> ({domain: {"train": [...], "valid": [...]}}, spectrum report). Pure."""
    by_task: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by_task[r["task_id"]].append(r)
    rows_by_domain: dict[str, list[dict]] = defaultdict(list)
    picked: dict[str, dict[str, list[dict]]] = defaultdict(dict)
    for tid, recs in by_task.items():
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
        domains[dom] = {
            "n_prompts": n,
            "prompts_with_correct": n - len(no_correct),
            "prompts_no_correct": len(no_correct),
            "no_correct_ids": no_correct,
            "mean_correct_per_prompt": sum(r["n_correct"] for r in rows) / n,
            "mean_distinct_correct_per_prompt": sum(r["n_distinct_correct"] for r in rows) / n,
            "mean_selected_per_prompt": sum(r["n_selected"] for r in rows) / n,
            "mean_pairwise_distance": (sum(with_pairs) / len(with_pairs)) if with_pairs else None,
            "n_train": len(train),
            "n_valid": len(valid),
            "valid_is_train": valid_is_train and bool(train),
            "prompts": rows,
        }
    report = {"policy": cfg.policy, "config": cfg.model_dump(), "domains": domains}
    return data, report


def dedupe_records(records: list[dict], source: str | Path) -> tuple[list[dict], int]:
    """(records with each (task, sample) once, copies dropped). Copies must agree on what selection
    reads (prompt, completion, reward, finish reason, task fingerprint); records from different
    runs (``run_fingerprint``) or disagreeing copies are a UserError naming them."""
    runs = {r["run_fingerprint"] for r in records if r.get("run_fingerprint") is not None}
    if len(runs) > 1:
        raise UserError(f"{source}: records from {len(runs)} different runs (model, seed or sampling) are mixed in one file; "
                        "select from one run's rollouts")
    first: dict[tuple, tuple[int, tuple]] = {}
    keep = []
    for i, r in enumerate(records, 1):
        key = (r["task_id"], r["sample"])
        body = (json.dumps(r["prompt"], sort_keys=True), r["completion"], r["reward"], r.get("finish_reason"),
                r.get("task_fingerprint"))
        if key in first:
            j, seen = first[key]
            if seen != body:
                raise UserError(f"{source}: records {j} and {i} are both task '{key[0]}' sample {key[1]} but differ; "
                                "the file mixes two runs")
            continue
        first[key] = (i, body)
        keep.append(r)
    return keep, len(records) - len(keep)


def gold_records(tasks: list, tokenizer, system: Optional[str] = None) -> list[dict]:
    """The gold episode of every episode task, as a candidate record after the sampled ones (sample
    index -1: the farthest-point walk starts from it, the canonical strategy)."""
    from mlx_ssp.agents.episode import is_episode
    from mlx_ssp.agents.gold import gold_record

    return [{**gold_record(t, tokenizer, system), "sample": -1} for t in tasks if is_episode(t)]


def safe_dirname(domain: str) -> str:
    name = re.sub(r"[^\w.\-]+", "_", domain).strip("._")
    return name or "domain"


def run_select(rollouts: str | Path, cfg: SelectConfig, out_dir: str | Path, *, overwrite: bool = False,
               gold: Optional[list[dict]] = None) -> dict:
    """Read rollouts, select, write OUT_DIR/<domain>/{train,valid}.jsonl + spectrum.json atomically.
    ``gold``: gold episode records (:func:`gold_records`) offered beside the sampled ones."""
    from mlx_ssp.io import atomic_dir, read_jsonl, write_json_atomic, write_jsonl_atomic

    rollouts = Path(rollouts)
    records = read_jsonl(rollouts, what="rollouts")
    if not records:
        raise UserError(f"{rollouts}: no rollout records")
    need = ("task_id", "domain", "sample", "prompt", "completion", "reward")
    for i, r in enumerate(records, 1):
        miss = [k for k in need if k not in r]
        if miss:
            raise UserError(f"{rollouts}: record {i} lacks {', '.join(miss)} (not an mlx_ssp rollouts file?)")
    if all(r["reward"] is None for r in records):
        raise UserError(f"{rollouts}: no record has a reward (generated without verification?)")
    records, repeated = dedupe_records(records, rollouts)
    if cfg.gold and gold is None:
        raise UserError("select.gold needs the task file and the model's tokenizer (--tasks and --model)")
    records += gold or []
    from mlx_ssp.rollout.resume import read_meta, sidecar

    meta = read_meta(sidecar(rollouts, "meta"))  # a corrupt meta file is one line, not a traceback
    system = meta.get("system") if meta else None
    data, report = select(records, cfg, system=system)
    report["input"] = str(rollouts)
    report["repeated_records_dropped"] = repeated
    names: dict[str, str] = {}
    with atomic_dir(out_dir, overwrite=overwrite) as tmp:
        for dom, parts in data.items():
            name = safe_dirname(dom)
            if name in names.values():
                name = f"{name}_{hashlib.blake2b(dom.encode(), digest_size=3).hexdigest()}"
            names[dom] = name
            if not parts["train"]:
                continue
            write_jsonl_atomic(tmp / name / "train.jsonl", parts["train"])
            write_jsonl_atomic(tmp / name / "valid.jsonl", parts["valid"])
        for dom, row in report["domains"].items():
            row["dir"] = names[dom] if data[dom]["train"] else None
        write_json_atomic(tmp / "spectrum.json", report)
    return report


def format_report(report: dict) -> str:
    head = ["domain", "prompts", "no_correct", "distinct/prompt", "selected/prompt", "mean_dist", "train", "valid"]
    rows = []
    for dom, d in report["domains"].items():
        md = d["mean_pairwise_distance"]
        rows.append([dom, str(d["n_prompts"]), str(d["prompts_no_correct"]), f"{d['mean_distinct_correct_per_prompt']:.2f}",
                     f"{d['mean_selected_per_prompt']:.2f}", "-" if md is None else f"{md:.3f}", str(d["n_train"]),
                     str(d["n_valid"]) + (" (=train)" if d["valid_is_train"] else "")])
    w = [max(len(head[i]), *(len(r[i]) for r in rows)) if rows else len(head[i]) for i in range(len(head))]
    fmt = lambda cells: "  ".join(c.ljust(x) if i == 0 else c.rjust(x) for i, (c, x) in enumerate(zip(cells, w)))  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * x for x in w]), *(fmt(r) for r in rows)])
