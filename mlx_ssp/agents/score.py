"""The ``episode`` verifier (also registered as ``bfcl_multi_turn``, the name BFCL's tasks carry): a
finished episode is scored by re-executing its calls.

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

from typing import TYPE_CHECKING, Any

from mlx_ssp.agents.checker import (
    EpisodeFormatError,
    EpisodeSpec,
    allowed_per_turn,
    episode_messages,
    episode_turns,
    score_episode,
)
from mlx_ssp.agents.environment import MAX_STEPS, limits_of
from mlx_ssp.verify import VerifyResult, register

if TYPE_CHECKING:
    from mlx_ssp.tasks import Task

REWARDS = ("accuracy", "partial")


def _check(task: Task) -> None:
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


@register("episode", check=_check)
@register("bfcl_multi_turn", check=_check)
def verify_episode(completion: Any, task: Task) -> VerifyResult:
    ep = task.metadata["episode"]
    try:
        msgs = episode_messages(completion)
        turns, over = episode_turns(msgs, len(ep["user_turns"]), int(ep.get("max_steps", MAX_STEPS)))
    except EpisodeFormatError as e:
        return VerifyResult(0.0, "malformed_episode", str(e))
    verdict = score_episode(EpisodeSpec.from_task_metadata(ep), turns, step_limit_hit=over,
                            allowed_per_turn=allowed_per_turn(ep), limits=limits_of(ep))
    reward = verdict.partial if ep.get("reward", "accuracy") == "partial" else verdict.reward
    passed = sum(1 for t in verdict.turns if t.passed)
    if verdict.reward >= 1.0:
        reason = "correct"
    else:  # every turn passed but the environment's reward() is below 1: its own verdict
        reason = "reward_below_1" if verdict.env_reward is not None and verdict.reason == "" else "turn_failed"
    detail = f"{passed}/{len(verdict.turns)} turns passed" + (f"; {verdict.reason}" if verdict.reason else "")
    extra = {"turns": [t.to_json() for t in verdict.turns], "accuracy": verdict.reward, "partial": verdict.partial}
    return VerifyResult(float(reward), reason, detail[:500], extra=extra)
