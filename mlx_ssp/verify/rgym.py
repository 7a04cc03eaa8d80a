"""``reasoning_gym`` verifier: delegate to the generating dataset's own ``score_answer``.

Algorithm: extract the final answer (:mod:`mlx_ssp.verify.extract`, the task's
``answer_extraction``; the lenient last resort is the last non-empty line), rebuild the dataset entry
``{"question", "answer", "metadata"}`` and call ``score_answer(answer, entry)`` on a dataset object
built from the same name and configuration. Everything needed is stored in the task
(``metadata["reasoning_gym"]``: dataset name, config, seed, size, index, the raw question and a JSON
copy of the entry's metadata), so a task file re-scores without the original dataset object.

Choices:
- The entry is regenerated from (config, seed, index), which keeps metadata types such as tuples
  and arrays that some scorers compare (ARC grids). If this reasoning-gym version generates a
  different question at that index, the stored JSON copy is used instead.
- Dataset objects and entries are cached, because building some datasets is slow and a rollout
  scores thousands of completions.
- A score is clipped to [0, 1]. Partial credit from a scorer is passed through.
- If the completion has a period right after the extracted answer, the answer is also scored with
  the period kept and the higher score wins, for answers that are sentences.
- Answers that span several lines (grids) are read when written as a block under a line that holds
  only ``Answer:``.
"""

from __future__ import annotations

import json
import threading
from typing import TYPE_CHECKING, Any


from mlx_ssp.verify import VerifyResult, register
from mlx_ssp.verify.extract import DEFAULT_MODE, MODES, extract, unclean_period

if TYPE_CHECKING:
    from mlx_ssp.tasks import Task

_CACHE: dict[str, Any] = {}
_LOCK = threading.Lock()


def dataset_for(name: str, config: dict[str, Any]):
    """A cached reasoning-gym dataset object (its ``score_answer`` may read its config)."""
    key = name + "\0" + json.dumps(config, sort_keys=True, default=str)
    ds = _CACHE.get(key)
    if ds is None:
        with _LOCK:
            ds = _CACHE.get(key)
            if ds is None:
                # reasoning-gym imports every dataset module it has (~0.9 s): only runs that score its tasks load it
                import reasoning_gym

                ds = reasoning_gym.create_dataset(name, **config)
                _CACHE[key] = ds
    return ds


def _spec(task: "Task") -> dict[str, Any]:
    spec = task.metadata.get("reasoning_gym")
    if not isinstance(spec, dict) or "dataset" not in spec:
        raise ValueError("metadata.reasoning_gym {dataset, config, entry_metadata, question} is missing")
    return spec


def _config(spec: dict[str, Any]) -> dict[str, Any]:
    cfg = dict(spec.get("config") or {})
    for k in ("seed", "size"):
        if spec.get(k) is not None:
            cfg[k] = spec[k]
    return cfg


def _check(task: "Task") -> None:
    spec = _spec(task)  # the answer may be None: some datasets score by checking the solution
    mode = task.metadata.get("answer_extraction", DEFAULT_MODE)
    if mode not in MODES:
        raise ValueError(f"metadata.answer_extraction '{mode}' is not one of {', '.join(MODES)}")
    dataset_for(spec["dataset"], _config(spec))  # unknown dataset / bad config fails here


_ENTRIES: dict[tuple[int, int], dict] = {}


def _entry(ds, spec: dict[str, Any], task: "Task") -> dict[str, Any]:
    """The dataset entry, regenerated from (dataset, config, seed, index) so that metadata keeps its
    original Python types (tuples, numpy arrays) that a JSON round trip would change. If this
    reasoning-gym version generates a different question there, the stored copy is used."""
    question = spec.get("question", task.prompt if isinstance(task.prompt, str) else "")
    idx = spec.get("index")
    if isinstance(idx, int):
        key = (id(ds), idx)
        e = _ENTRIES.get(key)
        if e is None:
            try:
                e = ds[idx]
            except Exception:
                e = None
            if e is not None and len(_ENTRIES) < 100_000:
                _ENTRIES[key] = e
        if e is not None and e.get("question") == question:
            return e
    return {"question": question, "answer": task.answer, "metadata": spec.get("entry_metadata") or {}}


def _score(ds, answer: str, entry: dict[str, Any]) -> float:
    score = float(ds.score_answer(answer, entry))
    return min(1.0, max(0.0, score)) if score == score else 0.0


@register("reasoning_gym", check=_check)
def verify_rgym(completion: str, task: "Task") -> VerifyResult:
    spec = _spec(task)
    mode = task.metadata.get("answer_extraction", DEFAULT_MODE)
    ex = extract(completion or "", mode, last_resort="last_line")
    if ex is None or not ex.text:
        return VerifyResult(0.0, "no_answer", "")
    ds = dataset_for(spec["dataset"], _config(spec))
    entry = _entry(ds, spec, task)
    score = _score(ds, ex.text, entry)
    alt = unclean_period(completion, ex)
    if score < 1.0 and alt is not None:  # "...paragraph 1." where the period is part of the answer
        score = max(score, _score(ds, alt, entry))
    reason = "correct" if score >= 0.999 else ("partial" if score > 0 else "wrong_answer")
    return VerifyResult(score, reason, f"{ex.method}: {ex.text[:200]}")
