"""Task records: the one format every source is turned into and every stage reads.

A task file is JSONL, one :class:`Task` per line. Sources (GSM8K, reasoning-gym, HumanEval, BFCL,
JSONL with a field mapping, Hugging Face datasets) live in :mod:`mlx_ssp.tasks.sources`; the
``tasks:`` run-file section is :class:`TasksConfig` (:mod:`mlx_ssp.tasks.config`), and
:func:`build_split` turns it into the tasks of one of the three disjoint splits (train, probe, eval).
:func:`export_source` does the same for one source shorthand (``mlx_ssp tasks export``).
See docs/tasks.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from mlx_ssp.errors import UserError
from mlx_ssp.io import iter_jsonl, write_jsonl_atomic

Messages = list[dict[str, Any]]


class Task(BaseModel):
    """One verifiable problem.

    ``prompt`` is either a plain string (rendered as a single user turn with the model's chat
    template) or a list of chat ``messages``. ``answer`` is whatever the verifier needs as the
    reference: a number, an expression, test code, expected calls. ``metadata`` carries
    source-specific extras (a reasoning-gym entry, an entry point, tool schemas).
    """

    model_config = ConfigDict(extra="forbid")

    id: str
    domain: str
    prompt: Union[str, Messages]
    answer: Any = None
    verifier: str
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("id", "domain", "verifier")
    @classmethod
    def _nonempty(cls, v: str) -> str:
        if not v or not v.strip():
            raise ValueError("must be a non-empty string")
        return v

    @field_validator("prompt")
    @classmethod
    def _prompt_ok(cls, v: Any) -> Any:
        if isinstance(v, str):
            if not v.strip():
                raise ValueError("prompt is empty")
            return v
        for i, m in enumerate(v):
            if "role" not in m or "content" not in m:
                raise ValueError(f"message {i} needs 'role' and 'content'")
        if not v:
            raise ValueError("prompt has no messages")
        return v

    def messages(self) -> Messages:
        """The prompt as chat messages."""
        if isinstance(self.prompt, str):
            return [{"role": "user", "content": self.prompt}]
        return list(self.prompt)


def load_tasks(path: str | Path, *, check_verifiers: bool = True) -> list[Task]:
    """Read a task JSONL file. Malformed lines, duplicate ids, an empty file or (by default) an
    unknown verifier are UserErrors naming the file and line, raised before any generation."""
    tasks: list[Task] = []
    seen: dict[str, int] = {}
    for lineno, rec in enumerate(iter_jsonl(path, what="task"), 1):
        try:
            t = Task.model_validate(rec)
        except ValidationError as e:
            first = e.errors()[0]
            key = ".".join(str(x) for x in first["loc"]) or "(record)"
            raise UserError(f"{path}: task record {lineno}: {key}: {first['msg']}") from None
        if t.id in seen:
            raise UserError(f"{path}: task record {lineno}: duplicate id '{t.id}' (first at record {seen[t.id]})")
        seen[t.id] = lineno
        tasks.append(t)
    if not tasks:
        raise UserError(f"{path}: the task file is empty")
    if check_verifiers:
        check_tasks(tasks, source=str(path))
    return tasks


def check_tasks(tasks: list[Task], source: str = "tasks") -> None:
    """Every task names a registered verifier and has what that verifier needs."""
    from mlx_ssp.verify import VERIFIERS, check_task, unknown_verifier_message

    for t in tasks:
        if t.verifier not in VERIFIERS:
            raise UserError(f"{source}: task '{t.id}': {unknown_verifier_message(t.verifier)}")
        check_task(t)


def write_tasks(path: str | Path, tasks: list[Task]) -> None:
    write_jsonl_atomic(path, (t.model_dump(mode="json") for t in tasks))


def _tools_text(tools: list) -> str:
    return "You can call these functions (JSON schemas):\n" + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)


def render_prompt(tokenizer, task: Task, system: str | None = None) -> list[int]:
    """Token ids of the task's prompt rendered with the model's own chat template, ending with
    the assistant generation prompt. A tokenizer without a chat template gets the raw text.

    Tool schemas in ``task.metadata["tools"]`` (BFCL tasks) go to the template's ``tools`` argument
    when the template uses tools; otherwise they are described in a system message."""
    messages = task.messages()
    if system is not None and not any(m.get("role") == "system" for m in messages):
        messages = [{"role": "system", "content": system}] + messages
    tools = task.metadata.get("tools") or None
    template = getattr(tokenizer, "chat_template", None)
    if tools and not (isinstance(template, str) and "tools" in template):
        text = _tools_text(tools)
        if messages and messages[0].get("role") == "system":
            messages = [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}] + messages[1:]
        else:
            messages = [{"role": "system", "content": text}] + messages
        tools = None
    if template:
        kw = {"tools": tools} if tools else {}
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kw)
        if hasattr(ids, "keys") and "input_ids" in ids:  # transformers may return a BatchEncoding (a UserDict)
            ids = ids["input_ids"]
        return list(ids)
    text = "\n\n".join(m["content"] for m in messages)
    return list(tokenizer.encode(text))


# -- the ``tasks:`` config section and its splits -------------------------------------------------

from mlx_ssp.tasks.config import SPLITS, DomainConfig, SplitSizes, TasksConfig  # noqa: E402
from mlx_ssp.tasks.sources import default_domain_name  # noqa: E402  (its home is the source registry)


def _to_task(domain: str, dcfg: DomainConfig, item, split: str) -> Task:
    from mlx_ssp.tasks.sources import parse_source

    src, _ = parse_source(dcfg.source)
    md = dict(item.metadata)
    verifier = dcfg.verifier or md.pop("verifier", None) or src.verifier
    if verifier is None:
        raise UserError(f"domain '{domain}': source '{dcfg.source}' needs 'verifier:' (e.g. math, code, exact)")
    instruction = src.instruction if dcfg.instruction is None else dcfg.instruction
    prompt = item.prompt
    if instruction:
        if isinstance(prompt, str):
            prompt = f"{prompt}\n\n{instruction}"
        else:
            prompt = [dict(m) for m in prompt]
            last = max(i for i, m in enumerate(prompt) if m.get("role") == "user") if any(
                m.get("role") == "user" for m in prompt) else len(prompt) - 1
            prompt[last]["content"] = f"{prompt[last]['content']}\n\n{instruction}"
    system = src.system if dcfg.system is None else dcfg.system
    if system:
        msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if not any(m.get("role") == "system" for m in msgs):
            prompt = [{"role": "system", "content": system}] + msgs
    md.update({"split": split, "source": dcfg.source})
    if verifier in ("math", "reasoning_gym"):
        md["answer_extraction"] = dcfg.answer_extraction
    if dcfg.sandbox:
        md["sandbox"] = dict(dcfg.sandbox)
    if item.domain is not None:
        domain = f"{domain}_{item.domain}"
    return Task(id=f"{domain}-{item.key}", domain=domain, prompt=prompt, answer=item.answer, verifier=verifier, metadata=md)


def build_split(cfg: TasksConfig, split: str) -> list[Task]:
    """The tasks of one split (``train`` | ``probe`` | ``eval``) over every domain, deterministic from
    ``cfg.seed``; the three splits of a domain never share a problem (see tasks/sources.py)."""
    from mlx_ssp.tasks.sources import domain_items

    if split not in SPLITS:
        raise UserError(f"unknown split '{split}'; valid: {', '.join(SPLITS)}")
    if not cfg.domains:
        raise UserError("tasks.domains is empty: configure at least one domain")
    tasks = []
    for name, dcfg in cfg.domains.items():
        tasks += [_to_task(name, dcfg, it, split) for it in domain_items(name, dcfg, cfg.seed, split)]
    check_tasks(tasks, source=f"tasks ({split})")
    return tasks


def export_source(
    source: str,
    *,
    size: int | None = None,
    seed: int | None = None,
    split: str = "train",
    params: dict | None = None,
    domain: str | None = None,
    **domain_options,
) -> list[Task]:
    """Tasks from one source shorthand (``gsm8k:PATH``, ``reasoning_gym:NAME``, ``humaneval``,
    ``bfcl:CAT``, ``jsonl:PATH``, ``hf:ID``): ``size`` tasks of ``split`` (default: every row of a
    file source; the source's default_size for procedural ones). ``seed`` None: ``tasks.seed``'s default
    (:class:`TasksConfig`). ``domain_options`` are DomainConfig keys (instruction, system, verifier,
    answer_extraction, sandbox)."""
    from mlx_ssp.config import validate
    from mlx_ssp.tasks.sources import parse_source

    if split not in SPLITS:
        raise UserError(f"unknown split '{split}'; valid: {', '.join(SPLITS)}")
    try:
        src, _ = parse_source(source)
    except ValueError as e:
        raise UserError(str(e)) from None
    if size is None:
        if src.default_size is not None:
            size = src.default_size
        elif split != "train":
            raise UserError(f"--size is needed with --split {split}")
    sizes = {"train": 0} if split != "train" else {}
    sizes[split] = size
    name = domain or default_domain_name(source)
    opts = {k: v for k, v in domain_options.items() if v is not None}
    cfg = validate(
        TasksConfig,
        {**({} if seed is None else {"seed": seed}),
         "domains": {name: {"source": source, "params": params or {}, "sizes": sizes, **opts}}},
        source="tasks export",
        prefix="tasks",
    )
    return build_split(cfg, split)
