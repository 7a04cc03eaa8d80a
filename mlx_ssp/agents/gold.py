"""Gold episodes: BFCL's ground truth played through the environment ("teacher episodes").

For each turn, one assistant message makes the turn's ground-truth calls (in the ``<tool_call>``
format the prompts ask for, positional arguments named by the method's signature), the real results
come back as ``tool`` messages from a fresh environment, and a second assistant message ends the turn
in plain text (:data:`DONE`; an irrelevance turn, whose ground truth is empty, is answered with
:data:`CANNOT` and no call). The episode is then verified like any other (re-execution), so a gold
episode that did not pass would be reported, not used. These are distillation data when no stronger
teacher is at hand: they teach the call format and the multi-turn protocol, not the model's own
strategies (records say ``source: gold``).
"""

from __future__ import annotations

from typing import Any, Optional

from mlx_ssp.agents.calls import parse_ground_truth
from mlx_ssp.agents.checker import allowed_per_turn
from mlx_ssp.agents.environment import Environment, limits_of, world_of
from mlx_ssp.agents.episode import replay, tool_call_text
from mlx_ssp.errors import UserError
from mlx_ssp.tasks import Task
from mlx_ssp.verify import verify

DONE = "Done."
CANNOT = "None of the available functions can do that."


def gold_messages(task: Task, system: Optional[str] = None) -> list[dict]:
    """The gold conversation of an episode task, in OpenAI chat format."""
    ep = task.metadata["episode"]
    if ep.get("ground_truth") is None:
        raise UserError(f"task '{task.id}' has no ground truth: it has no gold episode")
    with Environment(world_of(ep), limits=limits_of(ep)) as env:
        allowed = allowed_per_turn(ep) or [env.method_names()] * len(ep["user_turns"])
        msgs = [dict(m) for m in task.messages()]
        if system is not None and not any(m.get("role") == "system" for m in msgs):
            msgs = [{"role": "system", "content": system}] + msgs
        for t, calls_text in enumerate(ep["ground_truth"]):
            if t > 0:
                msgs += [dict(m) for m in ep["user_turns"][t]]
            if not calls_text:
                msgs.append({"role": "assistant", "content": CANNOT})
                continue
            calls = [env.bind(parse_ground_truth(c)) for c in calls_text]
            text = ("\n".join(c.as_python() for c in calls) if ep.get("render") == "compact"
                    else tool_call_text([(c.name, c.arguments) for c in calls]))
            msgs.append({"role": "assistant", "content": text,
                         "tool_calls": [c.as_openai() for c in calls]})
            msgs += [{"role": "tool", "name": c.name, "content": r}
                     for c, r in zip(calls, env.execute(calls, allowed[t]))]
            msgs.append({"role": "assistant", "content": DONE})
    return msgs


def gold_record(task: Task, tokenizer, system: Optional[str] = None) -> dict[str, Any]:
    """A scored episode record (the rollout layout, ``source: gold``) of the task's gold episode."""
    msgs = gold_messages(task, system)
    prompt, ids, mask = replay(tokenizer, task, msgs, system)
    res = verify(msgs, task)
    return {
        "task_id": task.id, "domain": task.domain, "sample": 0, "kind": "episode", "source": "gold",
        "prompt": task.prompt, "prompt_token_ids": prompt, "messages": msgs,
        "completion": msgs[-1]["content"], "token_ids": ids, "model_mask": mask, "logprobs": None,
        "finish_reason": "done", "num_tokens": sum(mask),
        "num_messages": sum(1 for m in msgs if m["role"] == "assistant"),
        "reward": float(res.reward), "reason": res.reason, "detail": res.detail, **(res.extra or {}),
    }
