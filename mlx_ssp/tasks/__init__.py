"""Task records: the one format every source is turned into and every stage reads.

A task file is JSONL, one :class:`Task` per line. Sources (GSM8K, reasoning-gym, HumanEval, BFCL,
JSONL with a field mapping, Hugging Face datasets) live in :mod:`mlx_ssp.tasks.sources`.
"""

from __future__ import annotations

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
    from mlx_ssp.verify import VERIFIERS, check_task

    for t in tasks:
        if t.verifier not in VERIFIERS:
            raise UserError(
                f"{source}: task '{t.id}' names unknown verifier '{t.verifier}'; valid: {', '.join(sorted(VERIFIERS))}"
            )
        check_task(t)


def write_tasks(path: str | Path, tasks: list[Task]) -> None:
    write_jsonl_atomic(path, (t.model_dump(mode="json") for t in tasks))


def render_prompt(tokenizer, task: Task, system: str | None = None) -> list[int]:
    """Token ids of the task's prompt rendered with the model's own chat template, ending with
    the assistant generation prompt. A tokenizer without a chat template gets the raw text."""
    messages = task.messages()
    if system is not None and not any(m.get("role") == "system" for m in messages):
        messages = [{"role": "system", "content": system}] + messages
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict):  # transformers may return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
    text = "\n\n".join(m["content"] for m in messages)
    return list(tokenizer.encode(text))
