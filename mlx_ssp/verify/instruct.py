"""``instruct`` verifier: rule-based checks of the explicit constraints an instruction states.

VibeThinker-3B technical report (arXiv:2606.16140), section 2.4: the instruct RL pass rewards
format-sensitive prompts with rule-based validators for explicit constraints (format, ordering, item
count, keywords, completion). A task lists its constraints in ``metadata["constraints"]``, each a
dict with a ``kind`` (:data:`CONSTRAINTS`) and that kind's fields, validated when the task is loaded:

- ``json``: the response is JSON (one optional ```json fence around it); ``type`` object | array | any;
  ``keys``: keys an object must have.
- ``bullet_list``: every non-empty line is a bullet (``-``, ``*`` or ``•``; ``marker`` picks one).
- ``numbered_list``: every non-empty line is ``1.`` / ``1)``, numbered 1, 2, 3... in order.
- ``item_count``: the number of list lines (bullets or numbered) is within ``min`` .. ``max``.
- ``order``: every keyword occurs, and their first occurrences are in the listed order.
- ``include``: every keyword occurs at least ``min_count`` times (whole words; case-insensitive
  unless ``case_sensitive``).
- ``forbid``: no keyword occurs.
- ``length``: ``min`` .. ``max`` words | chars | lines (``unit``).
- ``starts_with`` / ``ends_with``: the response (stripped) starts / ends with ``text``.
- ``case``: the response has no upper-case (``lower``) or no lower-case (``upper``) letter.

Reward: 1 when every constraint holds, else 0; ``detail`` gives the satisfied fraction and the first
failures (so a partial score is visible without being the reward: a partial reward would pay the
policy for ignoring the hardest constraint). Text before the last ``</think>`` is not the response.

Deviations: the report names the constraint families but not their rules; the kinds and their exact
rules above are ours. Rubric reward models for open-ended prompts (the report's other half) are not
implemented. Bounded work: only the first :data:`MAX_RESPONSE_CHARS` characters are checked (a longer
response fails ``length`` limits it could not meet anyway), and every check is linear-time (keyword
patterns are escaped literals).
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Callable, Literal, Optional

from pydantic import Field, ValidationError, model_validator

from mlx_ssp.config import StrictModel
from mlx_ssp.verify import VerifyResult, register
from mlx_ssp.verify.extract import strip_thinking

if TYPE_CHECKING:
    from mlx_ssp.tasks import Task

MAX_RESPONSE_CHARS = 200_000
_BULLET = re.compile(r"\s*([-*•])\s+\S")
_NUMBERED = re.compile(r"\s*(\d{1,6})[.)]\s+\S")
_FENCE = re.compile(r"\A```[A-Za-z]*[ \t]*\n(.*)\n```\Z", re.DOTALL)


class Response:
    """The part of a completion the constraints read: after ``</think>``, stripped, bounded."""

    def __init__(self, completion: str):
        self.text = strip_thinking(completion or "")[:MAX_RESPONSE_CHARS].strip()
        self.lines = [ln for ln in self.text.splitlines() if ln.strip()]

    def items(self) -> list[str]:
        return [ln for ln in self.lines if _BULLET.match(ln) or _NUMBERED.match(ln)]


def _kw_pattern(kw: str, case_sensitive: bool) -> re.Pattern:
    # whole words: "cat" is not found in "concatenate"; a keyword's own punctuation is literal
    return re.compile(r"(?<!\w)" + re.escape(kw) + r"(?!\w)", 0 if case_sensitive else re.IGNORECASE)


class _Keywords(StrictModel):
    keywords: list[str] = Field(min_length=1)
    case_sensitive: bool = False

    @model_validator(mode="after")
    def _nonempty(self):
        if any(not k.strip() for k in self.keywords):
            raise ValueError("keywords must be non-empty strings")
        return self


class JsonC(StrictModel):
    kind: Literal["json"]
    type: Literal["object", "array", "any"] = "any"
    keys: list[str] = Field(default_factory=list)  # keys an object must have


class BulletListC(StrictModel):
    kind: Literal["bullet_list"]
    marker: Literal["any", "-", "*", "•"] = "any"


class NumberedListC(StrictModel):
    kind: Literal["numbered_list"]


class ItemCountC(StrictModel):
    kind: Literal["item_count"]
    min: Optional[int] = Field(None, ge=0)
    max: Optional[int] = Field(None, ge=0)

    @model_validator(mode="after")
    def _bounds(self):
        if self.min is None and self.max is None:
            raise ValueError("item_count needs min or max")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"item_count min {self.min} > max {self.max}")
        return self


class OrderC(_Keywords):
    kind: Literal["order"]

    @model_validator(mode="after")
    def _two(self):
        if len(self.keywords) < 2:
            raise ValueError("order needs at least two keywords")
        return self


class IncludeC(_Keywords):
    kind: Literal["include"]
    min_count: int = Field(1, ge=1)


class ForbidC(_Keywords):
    kind: Literal["forbid"]


class LengthC(StrictModel):
    kind: Literal["length"]
    unit: Literal["words", "chars", "lines"] = "words"
    min: Optional[int] = Field(None, ge=0)
    max: Optional[int] = Field(None, ge=0)

    @model_validator(mode="after")
    def _bounds(self):
        if self.min is None and self.max is None:
            raise ValueError("length needs min or max")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"length min {self.min} > max {self.max}")
        return self


class AffixC(StrictModel):
    kind: Literal["starts_with", "ends_with"]
    text: str = Field(min_length=1)
    case_sensitive: bool = False


class CaseC(StrictModel):
    kind: Literal["case"]
    case: Literal["lower", "upper"]


def _check_json(c: JsonC, r: Response) -> Optional[str]:
    m = _FENCE.match(r.text)
    try:
        value = json.loads(m.group(1) if m else r.text)  # data, never evaluated
    except (ValueError, RecursionError):
        return "not valid JSON"
    want = {"object": dict, "array": list}.get(c.type)
    if want is not None and not isinstance(value, want):
        return f"JSON is not an {c.type}"
    if c.keys:
        if not isinstance(value, dict):
            return "JSON is not an object (keys required)"
        missing = [k for k in c.keys if k not in value]
        if missing:
            return f"JSON lacks keys {', '.join(missing)}"
    return None


def _check_bullets(c: BulletListC, r: Response) -> Optional[str]:
    if not r.lines:
        return "empty response"
    for ln in r.lines:
        m = _BULLET.match(ln)
        if m is None or (c.marker != "any" and m.group(1) != c.marker):
            return f"line is not a bullet: {ln.strip()[:60]!r}"
    return None


def _check_numbered(c: NumberedListC, r: Response) -> Optional[str]:
    if not r.lines:
        return "empty response"
    for i, ln in enumerate(r.lines, 1):
        m = _NUMBERED.match(ln)
        if m is None:
            return f"line is not numbered: {ln.strip()[:60]!r}"
        if int(m.group(1)) != i:
            return f"item {i} is numbered {m.group(1)}"
    return None


def _within(n: int, lo: Optional[int], hi: Optional[int]) -> bool:
    return (lo is None or n >= lo) and (hi is None or n <= hi)


def _bounds_text(lo: Optional[int], hi: Optional[int]) -> str:
    return f"{'' if lo is None else lo}..{'' if hi is None else hi}"


def _check_item_count(c: ItemCountC, r: Response) -> Optional[str]:
    n = len(r.items())
    return None if _within(n, c.min, c.max) else f"{n} items, want {_bounds_text(c.min, c.max)}"


def _check_order(c: OrderC, r: Response) -> Optional[str]:
    pos = []
    for kw in c.keywords:
        m = _kw_pattern(kw, c.case_sensitive).search(r.text)
        if m is None:
            return f"'{kw}' missing"
        pos.append(m.start())
    for a, b, pa, pb in zip(c.keywords, c.keywords[1:], pos, pos[1:]):
        if pa >= pb:
            return f"'{b}' comes before '{a}'"
    return None


def _check_include(c: IncludeC, r: Response) -> Optional[str]:
    for kw in c.keywords:
        n = len(_kw_pattern(kw, c.case_sensitive).findall(r.text))
        if n < c.min_count:
            return f"'{kw}' occurs {n} times, want at least {c.min_count}"
    return None


def _check_forbid(c: ForbidC, r: Response) -> Optional[str]:
    for kw in c.keywords:
        if _kw_pattern(kw, c.case_sensitive).search(r.text):
            return f"'{kw}' occurs"
    return None


_UNITS: dict[str, Callable[[Response], int]] = {
    "words": lambda r: len(r.text.split()),
    "chars": lambda r: len(r.text),
    "lines": lambda r: len(r.lines),
}


def _check_length(c: LengthC, r: Response) -> Optional[str]:
    n = _UNITS[c.unit](r)
    return None if _within(n, c.min, c.max) else f"{n} {c.unit}, want {_bounds_text(c.min, c.max)}"


def _check_affix(c: AffixC, r: Response) -> Optional[str]:
    text, want = (r.text, c.text) if c.case_sensitive else (r.text.lower(), c.text.lower())
    ok = text.startswith(want) if c.kind == "starts_with" else text.endswith(want)
    return None if ok else f"does not {c.kind.replace('_', ' ')} {c.text[:40]!r}"


def _check_case(c: CaseC, r: Response) -> Optional[str]:
    bad = r.text != r.text.lower() if c.case == "lower" else r.text != r.text.upper()
    return f"not all {c.case} case" if bad else None


#: kind -> (its validated model, check(constraint, response) -> None if it holds, else why not)
CONSTRAINTS: dict[str, tuple[type[StrictModel], Callable]] = {
    "json": (JsonC, _check_json),
    "bullet_list": (BulletListC, _check_bullets),
    "numbered_list": (NumberedListC, _check_numbered),
    "item_count": (ItemCountC, _check_item_count),
    "order": (OrderC, _check_order),
    "include": (IncludeC, _check_include),
    "forbid": (ForbidC, _check_forbid),
    "length": (LengthC, _check_length),
    "starts_with": (AffixC, _check_affix),
    "ends_with": (AffixC, _check_affix),
    "case": (CaseC, _check_case),
}


def parse_constraints(raw) -> list[StrictModel]:
    """The task's constraints, validated; ValueError naming the bad one and the valid kinds."""
    if not isinstance(raw, list) or not raw:
        raise ValueError("metadata.constraints must be a non-empty list of {kind: ..., ...}")
    out = []
    for i, c in enumerate(raw):
        kind = c.get("kind") if isinstance(c, dict) else None
        if kind not in CONSTRAINTS:
            raise ValueError(f"metadata.constraints[{i}]: kind {kind!r} is not one of {', '.join(CONSTRAINTS)}")
        try:
            out.append(CONSTRAINTS[kind][0].model_validate(c))
        except ValidationError as e:
            first = e.errors()[0]
            key = ".".join(str(x) for x in first["loc"]) or kind
            raise ValueError(f"metadata.constraints[{i}] ({kind}): {key}: {first['msg']}") from None
    return out


def check_all(completion: str, constraints: list[StrictModel]) -> list[Optional[str]]:
    """Per constraint: None if it holds, else why not. Pure."""
    r = Response(completion)
    return [CONSTRAINTS[c.kind][1](c, r) for c in constraints]


def _check(task: "Task") -> None:
    parse_constraints(task.metadata.get("constraints"))


@register("instruct", check=_check)
def verify_instruct(completion: str, task: "Task") -> VerifyResult:
    constraints = parse_constraints(task.metadata.get("constraints"))
    fails = [(c.kind, why) for c, why in zip(constraints, check_all(completion, constraints)) if why is not None]
    n = len(constraints)
    frac = (n - len(fails)) / n
    detail = f"satisfied {n - len(fails)}/{n} ({frac:.2f})"
    if fails:
        detail += "; failed: " + "; ".join(f"{k}: {w}" for k, w in fails[:4])
        return VerifyResult(0.0, "constraint_failed", detail[:500])
    return VerifyResult(1.0, "correct", detail)
