"""``code`` verifier: run the completion's Python against the task's tests in the sandbox.

Algorithm:
1. Extract the code: drop text before the last ``</think>``; take the last fenced code block (a
   ``python``/``py``/untagged fence; an unterminated last fence counts, for truncated samples) and,
   when the task names an ``entry_point``, prefer the last block that defines it; with no fence, the
   whole completion is the code.
2. Assemble the program. If the task has ``metadata["prompt_code"]`` (HumanEval: the signature and
   docstring) and the code does not define ``entry_point`` itself, the code is a body continuation and
   the program is ``prompt_code + code``; otherwise the import lines of ``prompt_code`` are prepended
   (a full function that forgot ``from typing import List`` still runs).
3. Tests, from the task's ``answer``: a string of test code (HumanEval's ``check`` function plus
   ``check(entry_point)``), run by the sandbox's harness in a process of its own after the
   program's top level, with the trusted ``prompt_code`` and proxies for the program's names (data
   in, data out); pass = the test code ran to its end, reported out of the program's reach, never an
   exit status (an early exit, a patched interpreter or an always-equal object scores 0); or a list of
   ``{"input": stdin, "output": expected stdout}`` cases, each run separately, pass = every case's
   stdout equals the expected one up to trailing whitespace on each line.
4. Run in :mod:`mlx_ssp.verify.sandbox` with default limits, changed per task by
   ``metadata["sandbox"]`` (keys of :class:`~mlx_ssp.verify.sandbox.Limits`) within the operator's
   :class:`~mlx_ssp.sandbox_policy.SandboxPolicy` (a request above it is refused).

Reward 1 if every test passes, else 0; the reason says why (``syntax_error``, ``failed``, ``timeout``,
``memory_limit``, ``output_limit``...). A syntax error is found by compiling in the parent (nothing
runs) to save a sandbox start. Registered as parallel: ``verify_many`` runs it on worker threads.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from mlx_ssp.sandbox_policy import Limits, task_limits
from mlx_ssp.verify import VerifyResult, register
from mlx_ssp.verify.extract import strip_thinking
from mlx_ssp.verify.sandbox import Harness, run_python
from mlx_ssp.text.work import charge, find

if TYPE_CHECKING:
    from mlx_ssp.tasks import Task

_FENCE = "```"
_LANG_RE = re.compile(r"[ \t]*+([A-Za-z0-9_+-]*+)")  # the tag after a fence opener
_CODE_LANGS = {"", "python", "py", "python3"}


def _fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language tag, body) of each fenced block, in linear time with ``str.find`` (a regex here
    backtracked quadratically on a long line after a fence): an opener is a fence with a newline
    later in the text; the body runs to the next fence or the end of the text."""
    blocks = []
    i = find(text, _FENCE)
    while i >= 0:
        nl = find(text, "\n", i + len(_FENCE))
        if nl < 0:
            break  # no later fence has a newline after it either
        lang = _LANG_RE.match(text, i + len(_FENCE), nl).group(1)
        end = find(text, _FENCE, nl + 1)
        blocks.append((lang, text[nl + 1:end if end >= 0 else len(text)]))
        charge(len(blocks[-1][1]))  # the copy
        if end < 0:
            break
        i = find(text, _FENCE, end + len(_FENCE))
    return blocks


def extract_code(completion: str, entry_point: str | None = None) -> str:
    text = strip_thinking(completion or "")
    blocks = [b for lang, b in _fenced_blocks(text) if lang.lower() in _CODE_LANGS]
    if not blocks:
        return text.strip("\n")
    if entry_point:
        charge(sum(map(len, blocks)))
        defining = [b for b in blocks if re.search(rf"\bdef\s+{re.escape(entry_point)}\s*\(", b)]
        if defining:
            return defining[-1]
    return blocks[-1]


def _imports(prompt_code: str) -> str:
    return "\n".join(l for l in prompt_code.splitlines() if re.match(r"(import|from)\s+\w", l))


def assemble(completion: str, task: "Task") -> str:
    md = task.metadata
    entry = md.get("entry_point")
    code = extract_code(completion, entry)
    prompt_code = md.get("prompt_code") or ""
    if prompt_code and entry and not re.search(rf"\bdef\s+{re.escape(entry)}\s*\(", code):
        return prompt_code + code
    if prompt_code:
        return _imports(prompt_code) + "\n" + code
    return code


def limits_for(task: "Task") -> Limits:
    """The task's limits within the operator's policy (ValueError for a refused request)."""
    return task_limits(task.metadata.get("sandbox"))


def _check(task: "Task") -> None:
    ans = task.answer
    if isinstance(ans, str):
        if not ans.strip():
            raise ValueError("missing 'answer' (test code)")
    elif isinstance(ans, list):
        if not ans or not all(isinstance(c, dict) and "input" in c and "output" in c for c in ans):
            raise ValueError("'answer' as a list must hold {input, output} test cases")
    else:
        raise ValueError("'answer' must be test code (a string) or a list of {input, output} cases")
    limits_for(task)  # unknown keys, bad values, above the operator's ceilings


def _last_line(s: str) -> str:
    lines = [l for l in s.strip().splitlines() if l.strip()]
    return lines[-1][:300] if lines else ""


_REASONS = {
    "error": "failed",
    "timeout": "timeout",
    "cpu_limit": "timeout",
    "memory_limit": "memory_limit",
    "file_size_limit": "file_size_limit",
    "output_limit": "output_limit",
    "killed": "killed",
    "sandbox_error": "sandbox_error",
}


def _norm_out(s: str) -> list[str]:
    return [l.rstrip() for l in s.strip().splitlines()]


@register("code", check=_check, parallel=True)
def verify_code(completion: str, task: "Task") -> VerifyResult:
    program = assemble(completion, task)
    if not program.strip():
        return VerifyResult(0.0, "no_code", "")
    try:
        compile(program, "prog.py", "exec")
    except SyntaxError as e:
        return VerifyResult(0.0, "syntax_error", f"line {e.lineno}: {e.msg}")
    except (ValueError, RecursionError, MemoryError, OverflowError) as e:
        return VerifyResult(0.0, "syntax_error", f"{type(e).__name__}: {e}"[:300])
    limits = limits_for(task)
    ans: Any = task.answer
    if isinstance(ans, str):
        md = task.metadata
        harness = Harness(tests=ans, trusted=md.get("prompt_code") or "", entry=md.get("entry_point"))
        res = run_python(program, limits, harness=harness)
        if res.passed:
            return VerifyResult(1.0, "passed", f"{res.wall_s:.2f}s")
        return VerifyResult(0.0, _REASONS.get(res.status, "failed"), _last_line(res.stderr) or res.status)
    for i, case in enumerate(ans):
        res = run_python(program, limits, stdin=str(case["input"]))
        if not res.ok:
            return VerifyResult(0.0, _REASONS.get(res.status, "failed"), f"case {i}: {_last_line(res.stderr) or res.status}")
        if _norm_out(res.stdout) != _norm_out(str(case["output"])):
            return VerifyResult(0.0, "wrong_output", f"case {i}: got {res.stdout.strip()[:100]!r}")
    return VerifyResult(1.0, "passed", f"{len(ans)} cases")
