"""Data-quality filters of the selection stage, and majority-vote pseudo-labels (pure functions).

What the VibeThinker-3B technical report (arXiv:2606.16140, section 2.1.1) asks of SFT data, and
what this module implements of it:

1. **n-gram filters.** (a) *Repeated segments / templated degeneration* in a trace:
   :func:`repetition_stats` walks the trace's word n-grams and counts those that already occurred
   earlier in it (``repeated_fraction`` = repeated / all n-grams) and the longest run of consecutive
   repeated n-grams, as a span of words (``longest_repeated_span`` = run + n - 1: a stretch of text
   that copies earlier text). A looping trace ("so x = 3. so x = 3. so x = 3. ...") has both near
   their maximum; a normal one has few repeated 8-grams. (b) *Decontamination*: a training prompt
   whose word n-grams (lower-cased words, punctuation ignored; default n = 13, the usual
   benchmark-decontamination n) meet any n-gram of a held-out, probe or benchmark prompt is
   contaminated (:func:`find_contaminated`).
2. *Query quality judged by an LLM*: not implemented (no judge model here).
3. *Trace correctness*: the verifiers' reward, as the selection always did (:mod:`mlx_ssp.select`);
   *majority vote*: :func:`majority_vote`, the answer most of K samples agree on, used to
   pseudo-label tasks without an answer ("synthetic queries get pseudo-labels by majority vote").

Deviations (the report gives no numbers or procedure beyond the above; all are configuration in
:class:`mlx_ssp.select.SelectConfig`, defaults documented in docs/rollout.md):

- Thresholds are ours: a trace is degenerate when more than half its 8-grams repeat earlier ones, or
  when one copied stretch reaches 200 words. Words are :func:`mlx_ssp.select.text.words` tokens
  (punctuation counts as a word), so that equations that differ only in their numbers differ.
- Template text: every task of a domain carries the same instruction ("Give your final answer on
  the last line ..."), long enough to share 13-grams with every held-out prompt. An n-gram found in
  at least ``boilerplate_fraction`` (default half, and at least 2) of one domain's training prompts
  is template, not contamination: its words are cut out of every prompt before comparing, and no
  compared n-gram straddles a cut. A problem copied into a few prompts is therefore found; one copied
  into most of a domain's prompts is not, and a domain with one training prompt has no template
  detection (its instruction alone would match a held-out prompt of the same domain).
- A prompt (after the cut) shorter than n words is one gram per piece left: it matches only an
  identical short problem text, never a longer prompt that contains it.
- Votes: an answer is what the task's verifier would extract (:data:`ANSWER_RULES`, one entry per
  verifier that has a single final answer); two answers are one vote when the verifier would call
  them equal (math: mathematical equivalence, via the math verifier; others: equal after
  whitespace normalisation). Agreement is votes / K, where samples with no answer count in K.
  Ties go to the answer that appeared first (sample order).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

from mlx_ssp.select.text import words
from mlx_ssp.verify.extract import DEFAULT_MODE, extract

#: the default least number of prompts an n-gram must be in to count as template text
MIN_BOILERPLATE_PROMPTS = 2

# words, and the arithmetic operators: "6 + 3" and "6 - 3" are different problems
_DECON_WORD = re.compile(r"\w+|[-+*/^=<>×÷]")


# -- repetition (a trace that loops) ----------------------------------------------------------


@dataclass(frozen=True)
class RepetitionStats:
    n_words: int
    repeated_fraction: float  # n-grams that occurred earlier in the text / all n-grams
    longest_repeated_span: int  # words in the longest stretch made of repeated n-grams (0: none)


def repetition_stats(text: str, n: int = 8) -> RepetitionStats:
    """How much of ``text`` repeats itself, over word n-grams (one pass, linear in its length)."""
    w = words(text)
    total = len(w) - n + 1
    if total <= 0:
        return RepetitionStats(len(w), 0.0, 0)
    seen: set[tuple] = set()
    repeated = run = best = 0
    for i in range(total):
        g = tuple(w[i : i + n])
        if g in seen:
            repeated += 1
            run += 1
            best = max(best, run)
        else:
            seen.add(g)
            run = 0
    return RepetitionStats(len(w), repeated / total, best + n - 1 if best else 0)


def degenerate_reason(stats: RepetitionStats, max_repeated_fraction: Optional[float],
                      max_repeated_span: Optional[int]) -> Optional[str]:
    """Why a trace with these stats is degenerate (``repeated_fraction`` | ``repeated_span``), or None."""
    if max_repeated_fraction is not None and stats.repeated_fraction > max_repeated_fraction:
        return "repeated_fraction"
    if max_repeated_span is not None and stats.longest_repeated_span >= max_repeated_span:
        return "repeated_span"
    return None


def trace_text(rec: dict) -> str:
    """The model's own text in a rollout record: the completion, or an episode's assistant turns."""
    if rec.get("kind") == "episode":
        return "\n".join(_content(m.get("content")) for m in rec.get("messages", []) if m.get("role") == "assistant")
    return rec.get("completion") or ""


# -- decontamination (n-gram overlap of prompts) ----------------------------------------------


def _content(c: Any) -> str:
    if isinstance(c, str):
        return c
    if isinstance(c, list):  # multimodal-style content parts
        return " ".join(_content(p.get("text", "")) if isinstance(p, dict) else _content(p) for p in c)
    return "" if c is None else str(c)


def prompt_text(prompt: Any) -> str:
    """The words of a prompt that can be contaminated: a string, or the non-system messages' contents."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return "\n".join(_content(m.get("content")) for m in prompt if isinstance(m, dict) and m.get("role") != "system")
    return _content(prompt)


def _tokens(text: str) -> list[str]:
    return _DECON_WORD.findall(text.lower())


def overlap_ngrams(text: str, n: int, template: frozenset | set = frozenset()) -> frozenset:
    """Lower-cased word n-grams of ``text`` (punctuation and spacing ignored, arithmetic operators
    kept as words: ``6 + 3`` and ``6 - 3`` do not collide), template text left out:
    the words covered by an n-gram of ``template`` are cut out, and n-grams are taken within the
    pieces left (none straddles a cut). When no piece has n words, each piece is one gram."""
    w = _tokens(text)
    keep = [True] * len(w)
    if template:
        for i in range(len(w) - n + 1):
            if tuple(w[i : i + n]) in template:
                keep[i : i + n] = [False] * n
    pieces, cur = [], []
    for t, k in zip(w, keep):
        if k:
            cur.append(t)
        elif cur:
            pieces.append(cur)
            cur = []
    if cur:
        pieces.append(cur)
    long = [p for p in pieces if len(p) >= n]
    if not long:
        return frozenset(tuple(p) for p in pieces)
    return frozenset(tuple(p[i : i + n]) for p in long for i in range(len(p) - n + 1))


def boilerplate(gram_sets: Sequence[frozenset], fraction: float,
                min_prompts: int = MIN_BOILERPLATE_PROMPTS) -> set:
    """The n-grams in at least ``fraction`` of ``gram_sets`` and in at least ``min_prompts`` of them."""
    if not gram_sets:
        return set()
    need = max(min_prompts, math.ceil(fraction * len(gram_sets)))
    counts = Counter(g for s in gram_sets for g in s)
    return {g for g, c in counts.items() if c >= need}


def find_contaminated(train: dict[str, str], reference: Iterable[str], n: int = 13,
                      boilerplate_fraction: float = 0.5, groups: Optional[dict[str, str]] = None) -> dict[str, str]:
    """``{train id: one shared n-gram (as text)}`` for every training prompt that shares an n-gram
    with some reference prompt (held-out, probe, benchmark), template text left out. Template: the
    n-grams in at least ``boilerplate_fraction`` (and 2) of the training prompts of one group
    (``groups``: id -> domain, since each domain has its own instruction; None: one group), found
    once on the whole prompts and once more on what is left of them. Pure; deterministic (the
    reported gram is the smallest shared one)."""
    by_group: dict[str, list[str]] = {}
    for tid in train:
        by_group.setdefault((groups or {}).get(tid, ""), []).append(tid)
    template: set = set()
    for ids in by_group.values():
        template |= boilerplate([overlap_ngrams(train[t], n) for t in ids], boilerplate_fraction, MIN_BOILERPLATE_PROMPTS)
    grams = {t: overlap_ngrams(text, n, template) for t, text in train.items()}
    for ids in by_group.values():  # short pieces (prefixes, labels) common to a domain are template too
        template |= boilerplate([grams[t] for t in ids], boilerplate_fraction, MIN_BOILERPLATE_PROMPTS)
    ref_all = set()
    for text in reference:
        ref_all |= overlap_ngrams(text, n, template)
    ref_all -= template
    out = {}
    for tid, g in grams.items():
        shared = (g - template) & ref_all
        if shared:
            out[tid] = " ".join(min(shared))
    return out


# -- majority vote ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Vote:
    answer: Optional[str]  # the plurality answer (its first-seen spelling); None: no sample had one
    votes: int  # samples that gave it (or an answer equal to it)
    k: int  # samples voting, those with no answer included
    agreement: float  # votes / k (0 when k = 0)
    n_distinct: int  # distinct answers (after equality)


def majority_vote(answers: Sequence[Optional[str]], same: Callable[[str, str], bool] = lambda a, b: a == b) -> Vote:
    """The answer most of ``answers`` agree on (None: a sample with no answer, which votes for
    nothing but counts in K). ``same`` groups equal answers; ties: the earliest answer wins."""
    groups: list[list] = []  # [representative, count]
    for a in answers:
        if a is None:
            continue
        for g in groups:
            if g[0] == a or same(g[0], a):
                g[1] += 1
                break
        else:
            groups.append([a, 1])
    k = len(answers)
    if not groups:
        return Vote(None, 0, k, 0.0, 0)
    best = max(groups, key=lambda g: g[1])  # max keeps the first of equal counts: the earliest answer
    return Vote(best[0], best[1], k, best[1] / k, len(groups))


def _norm(s: str) -> str:
    return " ".join(s.split())


def _math_answer(completion: str, metadata: dict) -> Optional[str]:
    # lazy: mlx_ssp.verify.math loads math_verify (sympy, seconds); only pseudo-labels of math need it
    from mlx_ssp.verify.math import (  # lazy: math_verify (sympy) loads in seconds
        MAX_ANSWER_CHARS,
        reduce_grouping,
        too_complex,
    )

    ex = extract(completion or "", metadata.get("answer_extraction", DEFAULT_MODE), last_resort="last_number")
    if ex is None or not ex.text or len(ex.text) > MAX_ANSWER_CHARS:
        return None
    ans = reduce_grouping(ex.text.strip())
    return None if too_complex(ans) else ans  # what the math verifier would refuse cannot be a label


_INT = re.compile(r"[+-]?[0-9]{1,15}\Z")


def _math_same(a: str, b: str) -> bool:
    if _INT.match(a) and _INT.match(b):  # the math verifier's verdict on two plain integers, without sympy
        return int(a) == int(b)
    from mlx_ssp.verify.math import equivalent  # lazy: math_verify (sympy) loads in seconds

    return equivalent(a, b)


def _rgym_answer(completion: str, metadata: dict) -> Optional[str]:
    ex = extract(completion or "", metadata.get("answer_extraction", DEFAULT_MODE), last_resort="last_line")
    return _norm(ex.text) if ex is not None and ex.text.strip() else None


def _exact_answer(completion: str, metadata: dict) -> Optional[str]:
    text = completion.rsplit("Answer:", 1)[-1].strip() if "Answer:" in completion else completion.strip()
    return text or None


@dataclass(frozen=True)
class AnswerRule:
    """How a verifier reads a final answer from a completion and when two answers are one vote."""

    extract: Callable[[str, dict], Optional[str]]  # (completion, task metadata) -> answer or None
    same: Callable[[str, str], bool]


#: verifier -> its answer rule; tasks of other verifiers (code, tool calls, episodes) have no single
#: final answer to vote on and are not pseudo-labelled
ANSWER_RULES: dict[str, AnswerRule] = {
    "math": AnswerRule(_math_answer, _math_same),
    "reasoning_gym": AnswerRule(_rgym_answer, lambda a, b: _norm(a) == _norm(b)),
    "exact": AnswerRule(_exact_answer, lambda a, b: a == b),
}


def vote_task(completions: Sequence[str], verifier: str, metadata: Optional[dict] = None) -> Vote:
    """The majority vote of one task's K completions under its verifier's answer rule."""
    rule = ANSWER_RULES[verifier]
    md = metadata or {}
    return majority_vote([rule.extract(c, md) for c in completions], rule.same)
