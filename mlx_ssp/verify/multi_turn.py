"""``bfcl_multi_turn`` verifier: a finished episode is scored by re-executing its calls.

The "completion" is the episode's conversation in OpenAI chat format (a list of messages, or its
JSON text): ``user`` messages delimit the turns in the task's order (the first one is turn 0;
``system`` messages are skipped), each ``assistant`` message is one step whose calls are its
``tool_calls`` or, without them, the calls parsed from its text, and ``tool`` messages are ignored
(the calls are re-run; results recorded elsewhere are never trusted). The calls go through
:func:`mlx_ssp.agents.checker.score_episode`: a fresh environment and a ground-truth twin, state and
response checks per turn (BFCL's multi-turn checker semantics; see that module).

A step that tried to call but could not be parsed runs nothing. A turn with ``max_steps``
messages that tried to call (``metadata.episode.max_steps``, default 20, BFCL's
``MAXIMUM_STEP_LIMIT``) hit the step limit and fails, as BFCL force-quits such an entry.

Reward: ``metadata["episode"]["reward"]`` selects ``accuracy`` (default; 1 iff every turn passed,
BFCL's metric) or ``partial`` (the fraction of turns passed). Both, and every turn's verdict, are in
the result's ``extra`` (``turns``, ``accuracy``, ``partial``).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from mlx_ssp.verify import VerifyResult, register

if TYPE_CHECKING:
    from mlx_ssp.tasks import Task

REWARDS = ("accuracy", "partial")


def _check(task: "Task") -> None:
    ep = task.metadata.get("episode")
    if not isinstance(ep, dict):
        raise ValueError("missing metadata.episode (an episode task record)")
    needed = ("user_turns", "environment") if "environment" in ep else ("user_turns", "involved_classes", "ground_truth")
    for key in needed:
        if key not in ep:
            raise ValueError(f"metadata.episode needs '{key}'")
    if ep.get("ground_truth") is not None and len(ep["user_turns"]) != len(ep["ground_truth"]):
        raise ValueError("metadata.episode: user_turns and ground_truth differ in length")
    if ep.get("reward", "accuracy") not in REWARDS:
        raise ValueError(f"metadata.episode.reward must be one of {', '.join(REWARDS)}")


class EpisodeFormatError(ValueError):
    pass


def _messages(completion: Any) -> list[dict]:
    if isinstance(completion, str):
        try:
            completion = json.loads(completion)
        except json.JSONDecodeError as e:
            raise EpisodeFormatError(f"the episode is not a JSON list of messages ({e.msg})") from None
    if not isinstance(completion, list) or not all(isinstance(m, dict) for m in completion):
        raise EpisodeFormatError("the episode must be a list of message objects")
    return completion


def episode_turns(messages: list[dict], n_turns: int, max_steps: int) -> tuple[list[list[list]], list[int]]:
    """The calls of each turn the episode reached, one list per assistant message, and the turns that
    hit the step limit:
    ``max_steps`` messages that tried to call (made calls, or failed to parse), the rule the episode
    engine stops a turn by."""
    from mlx_ssp.agents.calls import CallSyntaxError, calls_from_message

    turns: list[list[list]] = [[] for _ in range(n_turns)]
    attempts = [0] * n_turns
    turn = -1
    for m in messages:
        role = m.get("role")
        if role == "user":
            turn += 1
            if turn >= n_turns:
                raise EpisodeFormatError(f"the episode has more user turns than the task's {n_turns}")
        elif role == "assistant":
            if turn < 0:
                raise EpisodeFormatError("an assistant message comes before the first user message")
            try:
                calls = calls_from_message(m)
            except CallSyntaxError:
                calls, attempts[turn] = [], attempts[turn] + 1  # the model was told the parse error; nothing ran
            else:
                attempts[turn] += bool(calls)
            turns[turn].append(calls)
        elif role not in ("system", "tool"):
            raise EpisodeFormatError(f"unknown message role {role!r}")
    over = [t for t in range(n_turns) if attempts[t] >= max_steps]
    return turns[: turn + 1], over  # only the turns whose user message the episode reached


def allowed_per_turn(ep: dict) -> list[set[str]] | None:
    """The functions the model may call in each turn: those offered from the start, plus each held-back
    one from the turn that brings it (None: every method of the involved classes)."""
    if "offered" not in ep:
        return None
    allowed, out = set(ep["offered"]), []
    held = {int(t): names for t, names in (ep.get("held_out") or {}).items()}
    for t in range(len(ep["user_turns"])):
        allowed = allowed | set(held.get(t, []))
        out.append(allowed)
    return out


@register("episode", check=_check)
@register("bfcl_multi_turn", check=_check)
def verify_episode(completion: Any, task: "Task") -> VerifyResult:
    from mlx_ssp.agents.backends import limits_of
    from mlx_ssp.agents.checker import EpisodeSpec, score_episode
    from mlx_ssp.agents.episode import MAX_STEPS

    ep = task.metadata["episode"]
    try:
        msgs = _messages(completion)
        turns, over = episode_turns(msgs, len(ep["user_turns"]), int(ep.get("max_steps", MAX_STEPS)))
    except EpisodeFormatError as e:
        return VerifyResult(0.0, "malformed_episode", str(e))
    verdict = score_episode(EpisodeSpec.from_task_metadata(ep), turns, step_limit_hit=over,
                            allowed_per_turn=allowed_per_turn(ep), limits=limits_of(ep))
    reward = verdict.partial if ep.get("reward", "accuracy") == "partial" else verdict.reward
    passed = sum(1 for t in verdict.turns if t.passed)
    reason = "correct" if verdict.reward >= 1.0 else "turn_failed"
    detail = f"{passed}/{len(verdict.turns)} turns passed" + (f"; {verdict.reason}" if verdict.reason else "")
    extra = {"turns": [t.to_json() for t in verdict.turns], "accuracy": verdict.reward, "partial": verdict.partial}
    return VerifyResult(float(reward), reason, detail[:500], extra=extra)
