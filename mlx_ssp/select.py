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
n-grams (default n=3), ``edit`` = word-level Levenshtein distance / the longer length, and the
strategy distances of :mod:`mlx_ssp.strategy` (``steps``, ``ast``, ``calls``; ``auto`` picks one per
prompt, :func:`strategy_kind`). All are in [0, 1]; the report counts each prompt's distinct
strategies whatever distance selects. For an episode the compared text is its call sequence (:func:`strategy_text`), so distinct
strategies are distinct call sequences, not distinct wording. ``first`` keeps the first correct sample per prompt (the single-path baseline SSP argues
against) and ``all`` keeps every correct one.

Output: ``OUT_DIR/<domain>/train.jsonl`` and ``valid.jsonl`` in mlx-lm's chat format
(``{"messages": [...prompt..., {"role": "assistant", "content": completion}]}``), so
``mlx_lm.tuner`` reads the directory as is, and ``OUT_DIR/spectrum.json``: per prompt and per domain,
correct / distinct correct / selected counts, mean pairwise distance of the selected and of the
distinct correct solutions, and the prompts with no correct solution. The valid split holds out
whole prompts (``valid_fraction``, at least one); a domain with a single prompt gets valid = train
(mlx-lm needs a non-empty valid set), flagged ``valid_is_train`` in the report. Deviation: the paper
does not say how diversity is measured; n-gram Jaccard is our documented default.

Data quality (VibeThinker-3B technical report, section 2.1.1), each off by default and
counted per reason in the report when on (:mod:`mlx_ssp.quality` holds the pure functions):
``repetition`` drops degenerate (looping) samples before the diversity walk; ``decontaminate`` leaves
out whole training prompts that share an n-gram with a held-out, probe or benchmark prompt;
``pseudo_label`` writes ``OUT_DIR/pseudo_labels.jsonl``, the tasks labelled by the majority answer of
their samples. The report's LLM judge of query quality is not implemented. Deviations (thresholds,
template handling, vote equality) are listed in :mod:`mlx_ssp.quality`.

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

from mlx_ssp import trackers
from mlx_ssp.config import StrictModel
from mlx_ssp.errors import UserError


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
    # strategy-level (mlx_ssp.strategy): what a solution does, not its wording
    "steps": lambda n: _strategy("steps")(n),
    "ast": lambda n: _strategy("ast")(n),
    "calls": lambda n: _strategy("calls")(n),
}

#: what ``select.distance`` and ``--distance`` accept: a registry name, or ``auto`` (one per prompt,
#: :func:`strategy_kind`)
DISTANCE_CHOICES: tuple[str, ...] = (*DISTANCES, "auto")


def _strategy(kind: str):
    from mlx_ssp.strategy import distance_fn

    return distance_fn(kind)


# -- configuration ------------------------------------------------------------------------------


class RepetitionConfig(StrictModel):
    """``select.repetition``: drop degenerate traces (:func:`mlx_ssp.quality.repetition_stats`)."""

    n: int = Field(8, ge=2)  # words per n-gram
    #: a trace whose share of n-grams repeating earlier ones is above this is degenerate (None: no limit)
    max_repeated_fraction: Optional[float] = Field(0.5, gt=0.0, lt=1.0)
    #: ... or which copies one stretch of this many words or more (None: no limit)
    max_repeated_span: Optional[int] = Field(200, ge=2)


class DecontaminateConfig(StrictModel):
    """``select.decontaminate``: drop training prompts sharing an n-gram with held-out prompts
    (:func:`mlx_ssp.quality.find_contaminated`)."""

    #: benchmark files (JSONL) whose prompts must not be trained on, besides the held-out task files
    against: list[str] = Field(default_factory=list)
    n: int = Field(13, ge=1)  # words per n-gram
    #: compare with the run's held-out task files (``mlx_ssp run``: eval and probe; the CLI: --held-out)
    held_out: bool = True
    #: an n-gram in at least this share of a domain's training prompts (and 2 of them) is template text
    boilerplate_fraction: float = Field(0.5, gt=0.0, le=1.0)
    #: the field of a benchmark row holding its prompt: the first of these that the row has
    fields: list[str] = Field(default_factory=lambda: ["prompt", "question", "problem"], min_length=1)


class PseudoLabelConfig(StrictModel):
    """``select.pseudo_label``: write tasks labelled by the majority vote of their K samples
    (:func:`mlx_ssp.quality.majority_vote`) to ``OUT_DIR/pseudo_labels.jsonl``."""

    #: the least share of the K samples that must agree for a label to be written
    min_agreement: float = Field(0.5, gt=0.0, le=1.0)
    min_votes: int = Field(2, ge=1)  # ... and the least number of samples
    #: label only tasks without an answer (those with one are still voted on: the report measures
    #: how often the vote equals their answer); false: every votable task, its answer replaced
    only_unlabelled: bool = True


class SelectConfig(StrictModel):
    """The ``select:`` section of a run file."""

    # added after runs existed (gold, the quality filters): left out of dumps while unset, so fingerprints hold
    OMIT_AT_DEFAULT = frozenset({"gold", "repetition", "decontaminate", "pseudo_label"})

    policy: Literal["diverse", "first", "all"] = "diverse"
    per_prompt: int = Field(4, ge=1)  # M: most solutions kept per prompt (diverse)
    #: ngram | edit (wording) | steps | ast | calls (strategy: mlx_ssp.strategy) | auto (per prompt,
    #: from its solutions: strategy_kind). ngram stays the default so existing runs keep their outputs.
    distance: Literal[DISTANCE_CHOICES] = "ngram"
    ngram: int = Field(3, ge=1)  # n of the n-gram distance
    near_duplicate: float = Field(0.1, ge=0.0, lt=1.0)  # distance at or below which two are duplicates
    min_reward: float = Field(1.0, gt=0.0, le=1.0)  # a completion is correct at reward >= this
    drop_truncated: bool = True  # drop completions cut by max_tokens
    valid_fraction: float = Field(0.1, ge=0.0, lt=1.0)  # prompts held out for valid.jsonl
    seed: int = 0  # of the valid split
    #: episode tasks: also offer each task's gold episode (its ground truth played through the
    #: environment, ``source: gold``) as a candidate; needs the task file and the student's tokenizer
    gold: bool = False
    repetition: Optional[RepetitionConfig] = None  # None: no repetition filter
    decontaminate: Optional[DecontaminateConfig] = None  # None: no decontamination
    pseudo_label: Optional[PseudoLabelConfig] = None  # None: no pseudo-labels
    input: Optional[str] = None  # rollouts JSONL (the positional argument beats it)
    output: Optional[str] = None  # OUT_DIR (-o beats it)


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
        from mlx_ssp.quality import degenerate_reason, repetition_stats, trace_text

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
        from mlx_ssp.strategy import distinct_strategies

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


def reference_prompts(paths: list[str | Path], fields: list[str]) -> list[str]:
    """The prompts of held-out task files and benchmark files (JSONL): each row's first field of
    ``fields`` that it has (a string or chat messages)."""
    from mlx_ssp.io import iter_jsonl_numbered
    from mlx_ssp.quality import prompt_text

    out = []
    for p in paths:
        for line, row in iter_jsonl_numbered(p, what="benchmark"):
            f = next((f for f in fields if row.get(f) is not None), None)
            if f is None:
                raise UserError(f"{p}:{line}: no prompt field (looked for {', '.join(fields)}; "
                                "set select.decontaminate.fields)")
            out.append(prompt_text(row[f]))
    return out


def contamination(records: list[dict], cfg: DecontaminateConfig, held_out: list[str | Path]) -> tuple[dict, dict]:
    """(task id -> shared n-gram, the report's ``decontamination`` entry) for the training prompts of
    ``records`` against the held-out files (when ``cfg.held_out``) and ``cfg.against``."""
    from mlx_ssp.quality import find_contaminated, prompt_text

    files = [str(p) for p in (held_out if cfg.held_out else [])] + list(cfg.against)
    if not files:
        raise UserError("select.decontaminate has nothing to compare with: name benchmark files in "
                        "select.decontaminate.against (or held-out task files: --held-out)")
    ref = reference_prompts(files, cfg.fields)
    train, domain = {}, {}
    for r in records:
        train.setdefault(r["task_id"], prompt_text(r.get("prompt")))
        domain.setdefault(r["task_id"], r["domain"])
    found = find_contaminated(train, ref, cfg.n, cfg.boilerplate_fraction, groups=domain)
    return found, {"n": cfg.n, "against": files, "reference_prompts": len(ref), "train_prompts": len(train),
                   "contaminated_prompts": len(found)}


def pseudo_labels(records: list[dict], tasks: list, cfg: PseudoLabelConfig,
                  skip: frozenset | set = frozenset()) -> tuple[list[dict], dict]:
    """(task records labelled by majority vote, the report's ``pseudo_labels`` entry per domain).
    Votes are over every sample of a task (its verifier's answer rule, :data:`mlx_ssp.quality.ANSWER_RULES`);
    a label is written when at least ``min_votes`` samples and ``min_agreement`` of all agree. Tasks
    in ``skip`` (decontaminated), episodes and tasks whose verifier has no answer rule are not voted on."""
    from mlx_ssp.quality import ANSWER_RULES, vote_task

    by_task: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        if r.get("sample", 0) >= 0:  # gold episodes (sample -1) are not samples
            by_task[r["task_id"]].append(r)
    out: list[dict] = []
    stats: dict[str, dict] = {}
    for t in tasks:
        recs = sorted(by_task.get(t.id, []), key=lambda r: r["sample"])
        if not recs or t.id in skip or t.verifier not in ANSWER_RULES or any(r.get("kind") == "episode" for r in recs):
            continue
        st = stats.setdefault(t.domain, {"voted": 0, "written": 0, "below_threshold": 0, "agreement_sum": 0.0,
                                         "with_answer": 0, "vote_equals_answer": 0})
        v = vote_task([r["completion"] for r in recs], t.verifier, t.metadata)
        st["voted"] += 1
        st["agreement_sum"] += v.agreement
        has_answer = t.answer is not None and str(t.answer).strip() != ""
        if has_answer and v.answer is not None:
            st["with_answer"] += 1
            st["vote_equals_answer"] += bool(ANSWER_RULES[t.verifier].same(str(t.answer).strip(), v.answer))
        elif has_answer:
            st["with_answer"] += 1
        if has_answer and cfg.only_unlabelled:
            continue
        if v.answer is None or v.votes < cfg.min_votes or v.agreement < cfg.min_agreement - 1e-9:
            st["below_threshold"] += 1
            continue
        label = {"agreement": v.agreement, "votes": v.votes, "k": v.k, "n_distinct": v.n_distinct}
        if has_answer:
            label["replaced_answer"] = t.answer
        task = t.model_dump(mode="json")
        task["answer"] = v.answer
        task["metadata"] = {**task["metadata"], "pseudo_label": label}
        out.append(task)
        st["written"] += 1
    report = {}
    for dom, st in sorted(stats.items()):
        report[dom] = {"voted": st["voted"], "written": st["written"], "below_threshold": st["below_threshold"],
                       "mean_agreement": st["agreement_sum"] / st["voted"],
                       "with_answer": st["with_answer"],
                       "vote_accuracy": st["vote_equals_answer"] / st["with_answer"] if st["with_answer"] else None}
    return out, report


def safe_dirname(domain: str) -> str:
    name = re.sub(r"[^\w.\-]+", "_", domain).strip("._")
    return name or "domain"


#: the pseudo-labelled task file in OUT_DIR (``select.pseudo_label``)
PSEUDO_LABELS = "pseudo_labels.jsonl"


def run_select(rollouts: str | Path, cfg: SelectConfig, out_dir: str | Path, *, overwrite: bool = False,
               gold: Optional[list[dict]] = None, held_out: Optional[list[str | Path]] = None,
               tasks_path: Optional[str | Path] = None) -> dict:
    """Read rollouts, select, write OUT_DIR/<domain>/{train,valid}.jsonl + spectrum.json atomically.
    ``gold``: gold episode records (:func:`gold_records`) offered beside the sampled ones.
    ``held_out``: task files whose prompts training must not overlap (``select.decontaminate``).
    ``tasks_path``: the task file the rollouts came from (``select.pseudo_label``: the tasks labelled
    into OUT_DIR/pseudo_labels.jsonl)."""
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
    if all(r["reward"] is None for r in records) and cfg.pseudo_label is None:
        raise UserError(f"{rollouts}: no record has a reward (generated without verification?)")
    records, repeated = dedupe_records(records, rollouts)
    if cfg.gold and gold is None:
        raise UserError("select.gold needs the task file and the model's tokenizer (--tasks and --model)")
    records += gold or []
    from mlx_ssp.rollout.resume import read_meta, sidecar

    meta = read_meta(sidecar(rollouts, "meta"))  # a corrupt meta file is one line, not a traceback
    system = meta.get("system") if meta else None
    contaminated, decon_report = None, None
    if cfg.decontaminate is not None:
        contaminated, decon_report = contamination(records, cfg.decontaminate, list(held_out or []))
    labelled, label_report = None, None
    if cfg.pseudo_label is not None:
        if tasks_path is None:
            raise UserError("select.pseudo_label needs the task file the rollouts came from (--tasks)")
        from mlx_ssp.tasks import load_tasks

        # tasks without an answer are what pseudo-labels are for: do not ask the verifiers for one
        labelled, label_report = pseudo_labels(records, load_tasks(tasks_path, check_verifiers=False),
                                               cfg.pseudo_label, skip=set(contaminated or ()))
    data, report = select(records, cfg, system=system, contaminated=contaminated)
    report["input"] = str(rollouts)
    report["repeated_records_dropped"] = repeated
    if decon_report is not None:
        report["decontamination"] = decon_report
    if label_report is not None:
        report["pseudo_labels"] = {"output": PSEUDO_LABELS, "written": len(labelled), "domains": label_report}
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
        if labelled is not None:
            write_jsonl_atomic(tmp / PSEUDO_LABELS, labelled)
        for dom, row in report["domains"].items():
            row["dir"] = names[dom] if data[dom]["train"] else None
        write_json_atomic(tmp / "spectrum.json", report)
    trackers.log("", trackers.without(report, "config"), step=0)  # `mlx_ssp run`: select/domains/<domain>/n_train...
    return report


def format_report(report: dict) -> str:
    head = ["domain", "prompts", "no_correct", "distinct/prompt", "strategies/prompt", "selected/prompt", "mean_dist",
            "train", "valid"]
    # samples dropped per reason: only in reports made with a quality option (select.repetition ...)
    drops = any("dropped" in d for d in report["domains"].values())
    if drops:
        head += [*DROP_REASONS, "decontaminated"]
    rows = []
    for dom, d in report["domains"].items():
        md = d["mean_pairwise_distance"]
        rows.append([dom, str(d["n_prompts"]), str(d["prompts_no_correct"]), f"{d['mean_distinct_correct_per_prompt']:.2f}",
                     f"{d.get('mean_strategies_per_prompt', 0):.2f}", f"{d['mean_selected_per_prompt']:.2f}", "-" if md is None else f"{md:.3f}", str(d["n_train"]),
                     str(d["n_valid"]) + (" (=train)" if d["valid_is_train"] else "")])
        if drops:
            dr = d.get("dropped", {})
            rows[-1] += [str(dr.get(k, 0)) for k in DROP_REASONS]
            rows[-1].append(f"{dr.get('decontaminated', 0)} ({d.get('decontaminated_prompts', 0)} prompts)")
    w = [max(len(head[i]), *(len(r[i]) for r in rows)) if rows else len(head[i]) for i in range(len(head))]
    fmt = lambda cells: "  ".join(c.ljust(x) if i == 0 else c.rjust(x) for i, (c, x) in enumerate(zip(cells, w)))  # noqa: E731
    lines = [fmt(head), fmt(["-" * x for x in w]), *(fmt(r) for r in rows)]
    pl = report.get("pseudo_labels")
    if pl:
        for dom, st in pl["domains"].items():
            acc = "-" if st["vote_accuracy"] is None else f"{st['vote_accuracy']:.3f}"
            lines.append(f"pseudo-labels {dom}: {st['written']} written of {st['voted']} voted "
                         f"({st['below_threshold']} below threshold), mean agreement {st['mean_agreement']:.3f}, "
                         f"vote = answer on {acc} of {st['with_answer']} labelled")
        lines.append(f"pseudo-labels: {pl['written']} tasks -> {pl['output']}")
    return "\n".join(lines)
