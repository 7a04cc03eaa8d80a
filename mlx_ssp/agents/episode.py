"""One multi-turn tool-use episode: its conversation, the tokens the model saw, which of them are the
model's, their behaviour log-probs, and the environment its calls run in.

The loop of an episode, BFCL's multi-turn inference loop in our words: the first user turn is
rendered with the model's chat template (:func:`mlx_ssp.tasks.render_prompt`: the template's own
``tools`` support when it has one, else the schemas and the call format in the system prompt). The
model answers; its calls are parsed as data (:func:`mlx_ssp.agents.calls.parse_assistant_text`),
run against this episode's own :class:`~mlx_ssp.agents.environment.Environment` (restricted to the
functions offered so far), and the results are appended as ``tool`` messages; this repeats until
the model answers without a call (the turn ends) or ``max_steps`` messages with calls were made in
the turn (BFCL's force-quit: the episode ends there and that turn fails). Then the next user turn.
A call over its time limit stops the environment's worker and ends the episode (``call_timeout``;
the tool message says which call); the other episodes of the batch go on.
A message that tries to call but cannot be parsed gets the parse error back as the tool's text.

Tokens are appended, never re-rendered: the conversation's ids are the prompt, then each generated
message exactly as sampled, then the template's rendering of what follows it (:class:`Deltas`:
the text the template puts after an assistant message for the new ``tool``/``user`` messages and the
next generation prompt, found by rendering them after a placeholder assistant message and cutting
at the placeholder). So the ids the trainer later scores are the ids the model was conditioned
on, and the KV cache of one message is the prefix of the next (:mod:`mlx_ssp.agents.engine`).
Deviation: templates that rewrite history (Qwen3 drops earlier ``<think>`` blocks when re-rendering
a conversation) see the history as generated, not as the template would re-render it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

from mlx_ssp.agents.calls import CallSyntaxError, parse_assistant_text
from mlx_ssp.agents.checker import allowed_per_turn
from mlx_ssp.agents.environment import MAX_STEPS, Environment, limits_of, world_of
from mlx_ssp.errors import UserError
from mlx_ssp.tasks import Task, render_prompt

_PLACEHOLDER = "\u2063mlx_ssp:placeholder\u2063"


def is_episode(task: Task) -> bool:
    """A task whose samples are multi-turn episodes (it carries ``metadata["episode"]``)."""
    return isinstance(task.metadata.get("episode"), dict)


class Deltas:
    """Token ids of the messages that follow a generated assistant message, in the model's template."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.template = getattr(tokenizer, "chat_template", None)

    def _after(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The template's text after a placeholder assistant message followed by ``messages``."""
        base = [{"role": "user", "content": "."}, {"role": "assistant", "content": _PLACEHOLDER}]
        full = self.tokenizer.apply_chat_template(base + messages, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False)
        return full[full.index(_PLACEHOLDER) + len(_PLACEHOLDER):]

    def text(self, messages: list[dict], ended_with: Optional[str]) -> str:
        """What comes after the assistant message's last generated token: ``ended_with`` is the text of
        that token when it was an end-of-message token (the template's own end then is not repeated)."""
        if not self.template:
            return "\n\n" + "\n\n".join(m["content"] for m in messages) + "\n\n"
        try:
            rest = self._after(messages)
        except Exception:  # noqa: BLE001 - templates that reject a 'tool' role get the results as a user turn
            rest = self._after([_as_user(m) for m in messages])
        if ended_with and rest.startswith(ended_with):
            rest = rest[len(ended_with):]
        return rest

    def ids(self, messages: list[dict], ended_with: Optional[str]) -> list[int]:
        return list(self.tokenizer.encode(self.text(messages, ended_with), add_special_tokens=False))

    def end_of_message(self) -> tuple[Optional[int], Optional[str]]:
        """The end-of-sequence token the template closes an assistant message with (id, text); None
        when it uses none of the tokenizer's EOS tokens (then the delta carries the template's end)."""
        if not self.template:
            return None, None
        rest = self._after([], add_generation_prompt=False)
        eos = getattr(self.tokenizer, "eos_token_ids", None)
        eos = eos if eos is not None else self.tokenizer.eos_token_id
        for tid in sorted([eos] if isinstance(eos, int) else eos):
            text = self.tokenizer.decode([tid])
            if text and rest.startswith(text):
                return tid, text
        return None, None


def _as_user(m: dict) -> dict:
    if m.get("role") != "tool":
        return m
    return {"role": "user", "content": f"Result of {m.get('name', 'the call')}:\n{m['content']}"}


@dataclass
class Episode:
    """One sample of an episode task, advanced one model message at a time by :meth:`on_message`."""

    task: Task
    sample: int
    prompt_ids: list[int]
    max_steps: int = MAX_STEPS
    messages: list[dict] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # every token after the prompt
    mask: list[int] = field(default_factory=list)  # 1: sampled by the model
    logprobs: list[float] = field(default_factory=list)  # behaviour log-probs (0.0 where mask is 0)
    turn: int = 0
    steps: int = 0  # messages in the current turn that tried to call (made calls, or failed to parse)
    n_messages: int = 0
    end: Optional[str] = None  # "done" | "step_limit" | "context" | "call_timeout" | "environment_error"

    def __post_init__(self) -> None:
        ep = self.task.metadata["episode"]
        self.user_turns: list[list[dict]] = ep["user_turns"]
        self.max_steps = int(ep.get("max_steps", self.max_steps))
        self.env = Environment(world_of(ep), limits=limits_of(ep))
        # the same per-turn rule the verifier re-executes with
        self.allowed_by_turn = allowed_per_turn(ep) or [self.env.method_names()] * len(self.user_turns)
        self.messages = [dict(m) for m in self.task.messages()]

    @property
    def done(self) -> bool:
        return self.end is not None

    def on_message(self, tokens: list[int], lps: list[float], text: str, deltas: Deltas,
                   ended_with: Optional[str]) -> Optional[list[int]]:
        """Take one generated assistant message; the ids to feed next (tool results or the next user turn,
        then the generation prompt), or None when the episode is over."""
        self.ids += tokens
        self.mask += [1] * len(tokens)
        self.logprobs += lps
        self.n_messages += 1
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        try:
            calls = [self.env.bind(c) for c in self.parse_calls(text)]
            error = None
        except CallSyntaxError as e:
            calls, error = [], str(e)
        if calls and not any(c.positional for c in calls):  # else the text is re-parsed the same way
            msg["tool_calls"] = [c.as_openai() for c in calls]
        self.messages.append(msg)
        if error is not None:
            new = [{"role": "tool", "name": "error", "content": f"Error during parsing: {error}"}]
        elif calls:
            results = self.env.execute(calls, self.allowed_by_turn[self.turn])
            new = [{"role": "tool", "name": c.name, "content": r} for c, r in zip(calls, results)]
            if self.env.broken:  # a call over its time limit, or the worker died: the world is gone
                self.messages += new
                self.stop("call_timeout" if self.env.timed_out else "environment_error")
                return None
        else:
            return self._next_turn(deltas, ended_with)
        self.steps += 1
        if self.steps >= self.max_steps:
            self.messages += new
            self.stop("step_limit")
            return None
        return self._feed(new, deltas, ended_with)

    def parse_calls(self, text: str) -> list:
        """The calls of one generated message (:func:`mlx_ssp.agents.calls.parse_assistant_text`)."""
        return parse_assistant_text(text)

    def _next_turn(self, deltas: Deltas, ended_with: Optional[str]) -> Optional[list[int]]:
        self.turn += 1
        self.steps = 0
        if self.turn >= len(self.user_turns):
            self.stop("done")
            return None
        return self._feed([dict(m) for m in self.user_turns[self.turn]], deltas, ended_with)

    def _feed(self, new: list[dict], deltas: Deltas, ended_with: Optional[str]) -> list[int]:
        ids = deltas.ids(new, ended_with)
        self.messages += new
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        return ids

    def stop(self, reason: str) -> None:
        """End the episode (early with ``context``: the next message would not fit) and stop its
        environment's worker."""
        self.end = reason
        self.env.close()

    def record(self, logprob_temperature: float) -> dict[str, Any]:
        """The episode's record (unscored: ``reward``/``reason``/``detail`` None)."""
        assistant = [m for m in self.messages if m.get("role") == "assistant"]
        return {
            "task_id": self.task.id,
            "domain": self.task.domain,
            "sample": self.sample,
            "kind": "episode",
            "prompt": self.task.prompt,
            "prompt_token_ids": self.prompt_ids,
            "messages": self.messages,
            "completion": assistant[-1]["content"] if assistant else "",
            "token_ids": self.ids,
            "model_mask": self.mask,
            "logprobs": self.logprobs,
            "logprob_temperature": logprob_temperature,
            "finish_reason": self.end,
            "stop": None,
            "num_tokens": sum(self.mask),
            "num_messages": self.n_messages,
            "turns_reached": min(self.turn + 1, len(self.user_turns)),
            "reward": None,
            "reason": None,
            "detail": None,
        }


def assistant_text(message: dict) -> str:
    """The text of an assistant message as the model writes it: its content, or, for a message that
    carries only ``tool_calls`` (an imported trace), the calls in the ``<tool_call>`` format."""
    content = message.get("content") or ""
    if content.strip() or not message.get("tool_calls"):
        return content
    calls = []
    for tc in message["tool_calls"]:
        fn = tc.get("function", tc)
        args = fn.get("arguments", {})
        calls.append((fn["name"], json.loads(args) if isinstance(args, str) else args))
    return tool_call_text(calls)


def tool_call_text(calls: list[tuple[str, dict]]) -> str:
    """Calls written as the prompts ask for them: one ``<tool_call>`` JSON block per call."""
    return "\n".join("<tool_call>\n" + json.dumps({"name": n, "arguments": a}, ensure_ascii=False) + "\n</tool_call>"
                     for n, a in calls)


def replay(tokenizer, task: Task, messages: list[dict], system: Optional[str] = None) -> tuple[list[int], list[int], list[int]]:
    """Token ids of a finished conversation as an episode would have produced them: ``(prompt ids, ids
    after the prompt, model mask)``. The prompt is the task's rendered first turn (its messages must
    open ``messages``); each assistant message is its text's tokens and the template's end-of-message
    token (mask 1); what follows it is the template's delta (mask 0). Used for episodes that were not
    sampled token by token here: gold episodes, imported traces, selected conversations."""
    head = [dict(m) for m in task.messages()]
    if system is not None and not any(m.get("role") == "system" for m in head):
        head = [{"role": "system", "content": system}] + head
    if [(m.get("role"), m.get("content")) for m in messages[: len(head)]] != [(m["role"], m["content"]) for m in head]:
        raise UserError(f"task '{task.id}': the conversation does not open with the task's prompt")
    prompt = render_prompt(tokenizer, task, system=system)
    deltas = Deltas(tokenizer)
    end_id, end_text = deltas.end_of_message()
    ids: list[int] = []
    mask: list[int] = []
    pending: Optional[list[dict]] = None  # messages since the last assistant message (None: none yet)
    for m in messages[len(head):]:
        if m.get("role") != "assistant":
            if pending is None:
                raise UserError(f"task '{task.id}': a {m.get('role')} message before the first assistant message")
            pending.append(m)
            continue
        if pending is not None:
            d = deltas.ids(pending, end_text)
            ids += d
            mask += [0] * len(d)
        t = list(tokenizer.encode(assistant_text(m), add_special_tokens=False)) + ([end_id] if end_id is not None else [])
        ids += t
        mask += [1] * len(t)
        pending = []
    return prompt, ids, mask
