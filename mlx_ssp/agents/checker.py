"""BFCL's multi-turn checker semantics, by re-execution (our implementation).

:func:`score_episode` runs the model's calls in a fresh :class:`~mlx_ssp.agents.environment.Environment`
and the ground-truth calls in a fresh twin, turn by turn, and judges each turn:

- ground truth not empty: the model made at least one call in the turn; STATE: every public attribute
  of every instance equals the twin's after the turn; RESPONSE: the twin's result texts of this turn
  are an unordered sub-multiset of the model's result texts of all turns so far (a result the model
  already got in an earlier turn counts, as in BFCL);
- ground truth empty (irrelevance): the turn passes iff the model's calls in it changed no state;
- a turn in ``step_limit_hit`` fails ("step limit"): BFCL force-quits such an entry;
- a call over its time limit stops its environment (:mod:`mlx_ssp.agents.worker`): that turn and
  every later one fail, saying which call and whose environment (the model's or the ground truth's).

Reward = 1 iff every turn passes (BFCL's accuracy); ``partial`` = the fraction of turns passed.

Deviations from BFCL's ``multi_turn_checker``:
- BFCL stops at the first failing turn; we keep executing so every turn has a verdict (the partial
  score). The episode reward is the same.
- Irrelevance: BFCL's separate irrelevance checker fails a turn with empty ground truth if the model
  made any call at all; we fail it only if a call changed state (a read-only look before
  answering "I cannot do that" is not penalised).
- The state check compares the union of both sides' public attributes (BFCL iterates the ground
  truth's), and compares uncut result texts (the model saw them cut at ``max_result_chars``).
- Calls are restricted to the functions offered in each turn (``allowed_per_turn``; default: every
  method of the involved classes, which is what BFCL's eval run allows); the twin may call anything.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
import json
from typing import Any, Collection, Sequence

from mlx_ssp.agents.calls import Call, CallSyntaxError, calls_from_message, parse_ground_truth
from mlx_ssp.agents.environment import CallLimits, Environment, EnvironmentBroken, World, world_of
from mlx_ssp.errors import UserError


@dataclass(frozen=True)
class TurnVerdict:
    turn: int
    passed: bool
    state_ok: bool
    response_ok: bool
    irrelevance: bool
    reason: str

    def to_json(self) -> dict:
        return {
            "turn": self.turn,
            "passed": self.passed,
            "state_ok": self.state_ok,
            "response_ok": self.response_ok,
            "irrelevance": self.irrelevance,
            "reason": self.reason,
        }


@dataclass(frozen=True)
class EpisodeVerdict:
    turns: tuple[TurnVerdict, ...]
    env_reward: float | None = None  # the environment's reward() (tasks without ground truth)

    @property
    def reward(self) -> float:
        if not (self.turns and all(t.passed for t in self.turns)):
            return 0.0
        return 1.0 if self.env_reward is None else self.env_reward

    @property
    def partial(self) -> float:
        if self.env_reward is not None:
            return self.reward
        return sum(t.passed for t in self.turns) / len(self.turns) if self.turns else 0.0

    @property
    def reason(self) -> str:
        return next((f"turn {t.turn}: {t.reason}" for t in self.turns if not t.passed), "")

    def to_json(self) -> dict:
        return {
            "reward": self.reward,
            "partial": self.partial,
            "reason": self.reason,
            "turns": [t.to_json() for t in self.turns],
        }


@dataclass(frozen=True)
class EpisodeSpec:
    """What the checker needs of an episode task: its world, the ground-truth calls per turn (None:
    the environment's ``reward()`` decides) and the number of user turns."""

    world: World
    ground_truth: list[list[str]] | None
    n_turns: int = -1  # -1: as many as the ground truth has

    def __post_init__(self) -> None:
        if self.n_turns < 0:
            if self.ground_truth is None:
                raise UserError("an episode without ground truth needs its number of turns")
            object.__setattr__(self, "n_turns", len(self.ground_truth))

    @classmethod
    def from_task_metadata(cls, md: dict) -> EpisodeSpec:
        """From ``Task.metadata["episode"]``: a user environment (``environment``, ``config``,
        ``user_turns``, optional ``ground_truth``) or BFCL's (``initial_config``, ``involved_classes``,
        ``ground_truth``, ``long_context``)."""
        if not isinstance(md, dict):
            raise UserError("task metadata 'episode' must be an object")
        required = ("user_turns",) if "environment" in md else ("initial_config", "involved_classes", "ground_truth")
        missing = [k for k in required if k not in md]
        if missing:
            raise UserError(f"task metadata 'episode' lacks {', '.join(missing)}")
        if "environment" not in md:
            classes = md["involved_classes"]
            if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
                raise UserError("episode involved_classes must be a list of class names")
        gt = md.get("ground_truth")
        if gt is not None and (not isinstance(gt, list) or not all(
            isinstance(t, list) and all(isinstance(s, str) for s in t) for t in gt
        )):
            raise UserError("episode ground_truth must be a list (per turn) of lists of call strings")
        n = len(md["user_turns"]) if "user_turns" in md else len(gt)
        if gt is not None and len(gt) != n:
            raise UserError(f"episode: {n} user turns but {len(gt)} ground-truth turns")
        return cls(world_of(md), None if gt is None else [list(t) for t in gt], n)


def _parse_gt(ground_truth: list[list[str]]) -> list[list[Call]]:
    try:
        return [[parse_ground_truth(s) for s in turn] for turn in ground_truth]
    except CallSyntaxError as e:
        raise UserError(f"ground truth call does not parse: {e}") from None


def _missing(expected: list[str], got: list[str]) -> list[str]:
    """The expected texts not in ``got`` as a multiset (each got text matches at most once)."""
    pool = Counter(got)
    out = []
    for e in expected:
        if pool[e] > 0:
            pool[e] -= 1
        else:
            out.append(e)
    return out


def _short(s: str, n: int = 80) -> str:
    return s if len(s) <= n else s[:n] + "..."


def score_episode(
    spec: EpisodeSpec,
    turns: list[list[list[Call]]],
    *,
    step_limit_hit: Collection[int] = (),
    limits: CallLimits = CallLimits(),
    allowed_per_turn: Sequence[Collection[str]] | None = None,
) -> EpisodeVerdict:
    """Re-execute the model's calls (``turns[t]``: one list of calls per assistant message of turn t)
    and the ground truth, and judge every turn (module docstring). A turn the episode never reached
    (``turns`` shorter than the ground truth: it ended at a step or context limit) fails as "not
    reached", whatever its ground truth (an empty one would otherwise pass as irrelevance); more
    turns than the ground truth has is an error."""
    n = spec.n_turns
    if len(turns) > n:
        raise UserError(f"the episode has {len(turns)} turns, the task {n}")
    if spec.ground_truth is None:
        return _score_by_reward(spec, turns, set(step_limit_hit), limits, allowed_per_turn)
    gt = _parse_gt(spec.ground_truth)
    with Environment(spec.world, limits=limits) as model, Environment(spec.world, limits=limits) as twin:
        verdicts = judge_turns(gt, turns, model, twin, set(step_limit_hit), allowed_per_turn)
    return EpisodeVerdict(tuple(verdicts))


def judge_turns(gt: list[list[Call]], turns: list[list[list[Call]]], model: Environment, twin: Environment,
                 limit_hit: set[int], allowed_per_turn: Sequence[Collection[str]] | None) -> list[TurnVerdict]:
    """Every turn's verdict, ``model`` running the model's calls and ``twin`` the ground truth (any
    objects with an Environment's execute_full/state/state_difference/method_names/broken: the tool
    testbed judges its variants with in-process twins)."""
    n = len(gt)
    everything = twin.method_names()
    so_far: list[str] = []  # the model's result texts of all turns so far
    verdicts = []
    for t in range(n):
        steps = turns[t] if t < len(turns) else []
        allowed = everything if allowed_per_turn is None else allowed_per_turn[t]
        irrelevance = not gt[t]
        try:
            before = model.state() if irrelevance and not model.broken else None
        except EnvironmentBroken:
            before = None  # judged below: the broken environment fails the turn
        n_calls = 0
        for step in steps:
            so_far.extend(model.execute_full(list(step), allowed))
            n_calls += len(step)
        expected = twin.execute_full(gt[t], everything)
        try:
            state_ok, response_ok, reason = _judge(model, twin, before, expected, so_far, n_calls)
        except EnvironmentBroken as e:
            state_ok, response_ok, reason = False, False, str(e)
        if model.broken or twin.broken:  # a call over its time limit: nothing after it can be judged
            who = "the model's" if model.broken else "the ground truth's"
            state_ok = response_ok = False
            reason = f"{who} environment was stopped: {model.broken or twin.broken}"
        if t >= len(turns):
            reason = "not reached"
        if t in limit_hit:
            reason = "step limit" + (f"; {reason}" if reason else "")
        passed = not reason
        verdicts.append(TurnVerdict(t, passed, state_ok, response_ok, irrelevance, reason))
    return verdicts


def _judge(model: Environment, twin: Environment, before: dict | None, expected: list[str], so_far: list[str],
           n_calls: int) -> tuple[bool, bool, str]:
    """One turn's (state ok, response ok, failure reason) after its calls ran; ``before`` (the model's
    state at the turn's start) marks an irrelevance turn."""
    if before is not None:
        diff = model.state_difference(before)
        return not diff, True, f"irrelevance: the model's calls changed state ({diff})" if diff else ""
    diff = model.state_difference(twin)
    missing = _missing(expected, so_far)
    if n_calls == 0:
        reason = "no call in a turn that needs one"
    elif diff:
        reason = f"state: {diff} from the ground truth's"
    elif missing:
        reason = f"response: {len(missing)} ground-truth result(s) missing, e.g. {_short(missing[0])!r}"
    else:
        reason = ""
    return not diff, not missing, reason


def _score_by_reward(spec: EpisodeSpec, turns: list[list[list[Call]]], limit_hit: set[int], limits: CallLimits,
                     allowed_per_turn: Sequence[Collection[str]] | None) -> EpisodeVerdict:
    """A task without ground truth: the model's calls run turn by turn, then the environment's
    ``reward()`` is the episode's reward (0 when a turn was not reached, hit the step limit, or a
    call was stopped)."""
    if spec.n_turns < 1:
        raise UserError("an episode needs at least one turn")
    verdicts = []
    with Environment(spec.world, limits=limits) as env:
        if not env.has_reward:
            raise UserError("an episode task without ground truth needs an environment with a reward() method")
        everything = env.method_names()
        for t in range(spec.n_turns):
            allowed = everything if allowed_per_turn is None else allowed_per_turn[t]
            for step in turns[t] if t < len(turns) else []:
                env.execute_full(list(step), allowed)
            reason = "not reached" if t >= len(turns) else ""
            if env.broken:
                reason = f"the model's environment was stopped: {env.broken}"
            if t in limit_hit:
                reason = "step limit" + (f"; {reason}" if reason else "")
            verdicts.append(TurnVerdict(t, not reason, not reason, True, False, reason))
        try:
            value = env.reward()
        except EnvironmentBroken as e:
            last = verdicts[-1]
            reason = f"{last.reason}; {e}" if last.reason else str(e)
            verdicts[-1] = TurnVerdict(last.turn, False, False, False, False, reason)
            value = 0.0
    return EpisodeVerdict(tuple(verdicts), env_reward=value)


# ------------------------------------------------------------------ a recorded conversation's turns


class EpisodeFormatError(ValueError):
    pass


def episode_messages(completion: Any) -> list[dict]:
    """An episode's conversation: a list of message objects, or its JSON text."""
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
