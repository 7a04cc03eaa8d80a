"""Task records: the one format every source is turned into and every stage reads.

A task file is JSONL, one :class:`Task` per line. Sources (GSM8K, reasoning-gym, HumanEval, BFCL,
JSONL with a field mapping, Hugging Face datasets) live in :mod:`mlx_ssp.tasks.sources`; the
``tasks:`` run-file section is :class:`~mlx_ssp.tasks.config.TasksConfig`, and
:func:`~mlx_ssp.tasks.build.build_split` turns it into the tasks of one of the three disjoint splits
(train, probe, eval); :func:`~mlx_ssp.tasks.build.export_source` does the same for one source
shorthand (``mlx_ssp tasks export``). This module holds the record and its file I/O only, so that
loading it never loads the source registry.
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
    from mlx_ssp.verify import (  # lazy: the verifiers (testbed.source among them) import this module
        VERIFIERS,
        check_task,
        unknown_verifier_message,
    )

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
