"""A teacher behind an OpenAI-compatible chat-completions server (SSP step 1, "Spectrum", with a
strong remote teacher): K completions per task asked of ``mlx_lm.server``, llama.cpp's server,
vLLM or a hosted API, verified and written as rollout records like local ones.

VibeThinker-1.5B (arXiv:2511.06221, section 3.2) distils many traces per query from a strong
teacher; on a laptop such a teacher runs behind a server. The ``teacher:`` section of a run file
(or ``mlx_ssp rollout --endpoint URL --model NAME``) selects it::

    teacher: {endpoint: http://127.0.0.1:8080, model: my-teacher, api_key_env: TEACHER_KEY, concurrency: 8}

How: every task's messages (its prompt, the rollout system prompt when it has none) are sent with the
rollout's sampling settings (or ``teacher.sampling``); the K samples of a task go in one request
with ``n: K`` where the server honours ``n`` and as K parallel requests where it does not (auto:
the first request tells; ``use_n`` forces either way); at most ``concurrency`` requests are in
flight. Each request carries a ``seed`` derived from (seed, task id, first sample index), which
servers may ignore. Retries and errors: :mod:`.endpoint_client`. Verification runs on the main
thread beside the requests (:mod:`.scoring`), and a task's records come out together once all its
samples are scored, so the file stage (:mod:`.stage`) appends whole tasks and a resume after a kill
asks only for the tasks that are not in the file.

Records have the keys of local ones (:mod:`mlx_ssp.rollout`) plus ``teacher`` (``{"endpoint",
"model"}``: who produced them). Deviations, all forced by a server returning text only:
- ``completion`` is the reply's ``content``, preceded by its separately returned reasoning
  (``reasoning_content``, or mlx-lm's ``reasoning``) as ``<think>\\nREASONING\\n</think>\\n\\n``,
  the form Qwen3-style templates write, so the trace is verified and distilled whole.
- ``logprobs`` and ``logprob_temperature`` are None: there are no behaviour log-probs of another
  model to keep (RL samples its own rollouts). ``stop`` is None: servers do not say which stop
  string ended a completion; ``finish_reason`` is "length" when the server says so, else "stop".
- ``prompt_token_ids``/``token_ids`` are the *student's* tokens when a tokenizer is given
  (``teacher.tokenizer``; the run's ``model:`` by default in ``mlx_ssp run``): the prompt rendered
  with its chat template and the completion encoded, plus its EOS when the completion ended
  naturally and no stop strings are set. Without one they are None and ``num_tokens`` is the
  server's ``usage.completion_tokens`` (shared evenly among the choices of an ``n`` request).
- Multi-turn (episode) tasks are refused: an episode needs token ids and an environment per turn.
- One process only (no data-parallel ranks): the server does the parallel work.
- The API key is read from the environment variable ``api_key_env`` names, when the run starts;
  it is never written to a record, the meta file, the resolved config or a log line.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import re
import threading
import time
from collections import Counter, deque
from typing import Any, Iterator, Optional
from urllib.parse import parse_qsl, unquote, urlsplit

from pydantic import Field, field_validator, model_validator

from mlx_ssp.agents.episode import is_episode
from mlx_ssp.config import StrictModel, load_section, validate
from mlx_ssp.errors import UserError
from mlx_ssp.progress import bar as progress_bar
from mlx_ssp.rollout.config import RolloutConfig, SamplingConfig
from mlx_ssp.rollout.endpoint_client import DEFAULT_MAX_RESPONSE_BYTES, ChatClient
from mlx_ssp.rollout.records import TaskGroups
from mlx_ssp.rollout.request import RolloutRequest
from mlx_ssp.rollout.scoring import Scorer
from mlx_ssp.sampling import sample_stream_seed
from mlx_ssp.tasks import _tools_text, render_prompt

log = logging.getLogger("mlx_ssp.rollout")

#: body keys the client sets itself (``extra_body`` may not override them)
RESERVED_BODY = frozenset({"model", "messages", "n", "stream", "seed", "temperature", "top_p", "top_k", "min_p",
                           "max_tokens", "stop"})
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: query parameter names that hold credentials (api_key, apikey, key, access_token, token, secret,
#: password, auth, signature, ...); api-version and the like pass
_CREDENTIAL_PARAM = re.compile(r"key|token|secret|pass|pwd|auth|cred|sig", re.IGNORECASE)
_NO_KEY_IN_URL = ("endpoint must not hold credentials; put the key in the environment variable named by "
                  "api_key_env")


def _url_holds(url: str, key: Optional[str]) -> bool:
    """Whether ``url`` holds ``key`` (as is or percent-encoded), anywhere: path, query, fragment."""
    return bool(key) and (key in url or key in unquote(url) or key in unquote(url.replace("+", " ")))


class EndpointTeacherConfig(StrictModel):
    """The ``teacher:`` section when the teacher is a server (the key ``endpoint`` says so)."""

    endpoint: str  # server root, .../v1, or the full .../v1/chat/completions URL
    model: str  # the model name the server knows
    api_key_env: Optional[str] = None  # the environment variable holding the key (never the key itself)
    # how the requests go, not what they ask: exclude=True leaves them out of dumps, hence out of the
    # run's stage fingerprint, so raising the concurrency of an interrupted run resumes it
    concurrency: int = Field(4, ge=1, le=512, exclude=True)  # requests in flight
    use_n: Optional[bool] = Field(None, exclude=True)  # None: ask with n, fall back to parallel requests if ignored
    timeout_s: float = Field(600.0, gt=0, exclude=True)  # one whole attempt: connect, send, the full reply
    max_retries: int = Field(5, ge=0, exclude=True)  # on 429 / 5xx / timeouts / refused connections
    backoff_s: float = Field(1.0, ge=0, exclude=True)  # first wait; doubles per retry (jittered, at most 60 s)
    # the largest reply body read; a larger one is given up (one error line), never held whole
    max_response_bytes: int = Field(DEFAULT_MAX_RESPONSE_BYTES, ge=1024, exclude=True)
    tokenizer: Optional[str] = None  # the student's tokenizer, for token ids (see the module docstring)
    sampling: Optional[SamplingConfig] = None  # None: the rollout section's
    extra_body: dict[str, Any] = Field(default_factory=dict)  # other request fields the server takes

    @model_validator(mode="before")
    @classmethod
    def _no_secrets(cls, data: Any) -> Any:
        """URL and key-variable checks that fail without echoing the value (it may be the key)."""
        if not isinstance(data, dict):
            return data
        env = data.get("api_key_env")
        if env is not None and not (isinstance(env, str) and _ENV_NAME.match(env)):
            raise ValueError("api_key_env must be the NAME of an environment variable (letters, digits, _), "
                             "not the key")
        url = data.get("endpoint")
        if isinstance(url, str):
            parts = urlsplit(url.strip())
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError("endpoint must be an http:// or https:// URL")
            if parts.username or parts.password:
                raise ValueError(_NO_KEY_IN_URL)
            for part in (parts.query, parts.fragment):
                names = [k for k, _ in parse_qsl(part, keep_blank_values=True)]
                bad = [k for k in names if _CREDENTIAL_PARAM.search(k)]
                if bad:
                    raise ValueError(f"{_NO_KEY_IN_URL} (the URL has the parameter '{bad[0][:40]}')")
            if isinstance(env, str) and _url_holds(url, os.environ.get(env, "").strip()):
                raise ValueError(f"{_NO_KEY_IN_URL} (the URL holds the value of {env})")
            data = {**data, "endpoint": url.strip()}
        return data

    @field_validator("model")
    @classmethod
    def _nonempty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must be a non-empty model name")
        return v.strip()

    @field_validator("extra_body")
    @classmethod
    def _not_reserved(cls, v: dict) -> dict:
        bad = sorted(set(v) & RESERVED_BODY)
        if bad:
            raise ValueError(f"sets {', '.join(bad)}, which the rollout sets itself (use sampling: / rollout: instead)")
        try:
            json.dumps(v, allow_nan=False)
        except (TypeError, ValueError, RecursionError):
            raise ValueError("must be plain JSON (strings, finite numbers, booleans, null, lists, mappings): "
                             "it is sent as the request body") from None
        return v

    def label(self) -> str:
        """How summaries and the meta file name this teacher."""
        return f"{self.model} @ {self.endpoint}"


def is_endpoint(spec: Any) -> bool:
    return isinstance(spec, EndpointTeacherConfig)


def teacher_section(data: dict, source: str = ""):
    """The ``teacher:`` section of a run file: None (the model itself), an
    :class:`EndpointTeacherConfig` when it has an ``endpoint`` key, else a local ModelConfig."""
    raw = data.get("teacher")
    if raw is None:
        return None
    if isinstance(raw, dict) and "endpoint" in raw:
        return validate(EndpointTeacherConfig, raw, source=source, prefix="teacher")
    return load_section(data, "teacher", source=source)


def read_api_key(cfg: EndpointTeacherConfig) -> Optional[str]:
    """The key from the environment (None when no variable is named); a named but unset one is a UserError."""
    if cfg.api_key_env is None:
        return None
    key = os.environ.get(cfg.api_key_env, "")
    if not key.strip():
        raise UserError(f"teacher.api_key_env names {cfg.api_key_env}, which is not set (or empty) in the environment")
    if _url_holds(cfg.endpoint, key.strip()):  # it would be written to every record and the meta file
        raise UserError(f"teacher.endpoint: {_NO_KEY_IN_URL} (the URL holds the value of {cfg.api_key_env})")
    return key.strip()


def effective_sampling(cfg: EndpointTeacherConfig, rollout: RolloutConfig) -> SamplingConfig:
    return cfg.sampling if cfg.sampling is not None else rollout.sampling


def endpoint_meta(cfg: EndpointTeacherConfig, rollout: RolloutConfig, sampling: SamplingConfig, seed: int) -> dict:
    """The run settings a resume must match (``.meta.json``): who answers, and how they sample.
    Concurrency, retries and timeouts change no output and are left out."""
    return {
        "model": cfg.label(),
        "seed": seed,
        "sampling": sampling.model_dump(),
        "system": rollout.system,
        "max_context": rollout.max_context,
        "teacher": {"endpoint": cfg.endpoint, "model": cfg.model, "tokenizer": cfg.tokenizer,
                    "extra_body": cfg.extra_body},
    }


def join_reasoning(reasoning: str, content: str) -> str:
    """The whole trace: separately returned reasoning first, in ``<think>`` tags, then the answer."""
    return f"<think>\n{reasoning}\n</think>\n\n{content}" if reasoning else content


def task_messages(task, system: Optional[str]) -> list[dict]:
    """The chat messages of a task as a server gets them: the rollout system prompt when the task
    has none, and tool schemas described in the system message (as :func:`mlx_ssp.tasks.render_prompt`
    does for templates without tools)."""
    messages = [dict(m) for m in task.messages()]
    if system is not None and not any(m.get("role") == "system" for m in messages):
        messages = [{"role": "system", "content": system}] + messages
    tools = task.metadata.get("tools") or None
    if tools:
        text = _tools_text(tools)
        if messages and messages[0].get("role") == "system":
            messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}
        else:
            messages = [{"role": "system", "content": text}] + messages
    return messages


def sampling_body(s: SamplingConfig) -> dict:
    """OpenAI request fields of a sampling config; top_k / min_p (not OpenAI's) only when set."""
    body: dict[str, Any] = {"temperature": s.temperature, "top_p": s.top_p, "max_tokens": s.max_tokens}
    if s.top_k:
        body["top_k"] = s.top_k
    if s.min_p:
        body["min_p"] = s.min_p
    if s.stop:
        body["stop"] = list(s.stop)
    return body


class StudentTokens:
    """The student's token view of endpoint records (or none, without a tokenizer)."""

    def __init__(self, tokenizer, request: RolloutRequest):
        self.tok, self.request = tokenizer, request
        self.prompts: dict[int, list[int]] = {}

    def prompt(self, ti: int) -> Optional[list[int]]:
        if self.tok is None:
            return None
        if ti not in self.prompts:
            self.prompts[ti] = render_prompt(self.tok, self.request.tasks[ti], system=self.request.system)
        return self.prompts[ti]

    def completion(self, text: str, finish: str) -> Optional[list[int]]:
        if self.tok is None:
            return None
        ids = list(self.tok.encode(text, add_special_tokens=False))
        eos = getattr(self.tok, "eos_token_id", None)
        if finish == "stop" and not self.request.sampling.stop and eos is not None:
            ids.append(int(eos))  # the natural end, as local records keep it
        return ids


class EndpointRollout:
    """One pass over a request against a server: the work queue, the requests in flight, scoring."""

    def __init__(self, cfg: EndpointTeacherConfig, request: RolloutRequest, samples, stats: dict, tokenizer=None):
        self.cfg, self.request, self.stats = cfg, request, stats
        self.client = ChatClient(cfg.endpoint, cfg.model, read_api_key(cfg), cfg.timeout_s, cfg.max_retries,
                                 cfg.backoff_s, cfg.max_response_bytes)
        self.tokens = StudentTokens(tokenizer, request)
        self.todo: deque[tuple[int, list[int]]] = deque()
        for ti, task in enumerate(request.tasks):
            wanted = request.wanted(task.id, samples)
            if wanted:
                self.todo.append((ti, wanted))
        expected = Counter({ti: len(ss) for ti, ss in self.todo})
        self.total = sum(expected.values())
        self.scorer = Scorer(request.tasks, TaskGroups(expected), stats, verify=request.verify,
                             workers=request.verify_workers)
        self.use_n = cfg.use_n  # None until the first request with n > 1 tells
        self.base = {**cfg.extra_body, **sampling_body(request.sampling)}
        self.messages: dict[int, list[dict]] = {}
        self.listed: Optional[list[str]] = None

    def _body(self, ti: int, ss: list[int]) -> dict:
        if ti not in self.messages:
            self.messages[ti] = task_messages(self.request.tasks[ti], self.request.system)
        body = {**self.base, "messages": self.messages[ti],
                "seed": sample_stream_seed(self.request.seed, self.request.tasks[ti].id, ss[0]) % (2 ** 31)}
        if len(ss) > 1:
            body["n"] = len(ss)
        return body

    def _next_job(self) -> tuple[int, list[int]]:
        ti, ss = self.todo.popleft()
        if len(ss) > 1 and self.use_n is False:  # one request per sample
            self.todo.extendleft((ti, [s]) for s in reversed(ss[1:]))
            ss = ss[:1]
        return ti, ss

    def _worker(self, jobs: queue.SimpleQueue, results: queue.SimpleQueue) -> None:
        """Ask each ``(job, task index, samples)`` of ``jobs`` (None: stop) and put
        ``(job, reply or the exception, seconds)`` onto ``results``."""
        while (item := jobs.get()) is not None:
            job, ti, ss = item
            t0 = time.perf_counter()
            try:
                reply: Any = self.client.chat(self._body(ti, ss))
            except BaseException as e:  # noqa: BLE001 - handed to the main thread, which raises it
                reply = e
            results.put((job, reply, time.perf_counter() - t0))

    def records(self, ti: int, ss: list[int], reply: dict, latency: float) -> list[dict]:
        """The records of the choices of one reply (as many as it has, at most ``len(ss)``)."""
        task = self.request.tasks[ti]
        choices = [c for c in reply["choices"] if isinstance(c, dict)]  # a malformed choice is no sample
        choices = sorted(choices, key=lambda c: c.get("index") if isinstance(c.get("index"), int) else 0)[: len(ss)]
        usage = reply.get("usage") or {}
        self.stats["prompt_tokens"] += int(usage.get("prompt_tokens") or 0)
        share = (int(usage.get("completion_tokens") or 0) // max(1, len(choices)))
        out = []
        for s, c in zip(ss, choices):
            msg = c.get("message") if isinstance(c.get("message"), dict) else {}
            content = msg.get("content") or ""
            reasoning = msg.get("reasoning_content") or msg.get("reasoning") or ""
            text = join_reasoning(str(reasoning), str(content))
            finish = "length" if c.get("finish_reason") == "length" else "stop"
            ids = self.tokens.completion(text, finish)
            out.append({
                "task_id": task.id, "domain": task.domain, "sample": s, "prompt": task.prompt,
                "prompt_token_ids": self.tokens.prompt(ti), "completion": text, "token_ids": ids,
                "logprobs": None, "logprob_temperature": None, "finish_reason": finish, "stop": None,
                "num_tokens": len(ids) if ids is not None else share,
                "reward": None, "reason": None, "detail": None, "latency_s": round(latency, 4), "verify_s": 0.0,
                "teacher": {"endpoint": self.cfg.endpoint, "model": self.cfg.model},
            })
        return out

    def _learn_n(self, ti: int, ss: list[int], got: int) -> None:
        """After an ``n`` request: did the server honour it? Requeue what it did not answer."""
        if len(ss) < 2:
            return
        if got >= len(ss):
            if self.use_n is None:
                self.use_n = True
            return
        if self.use_n is None:
            log.info("teacher endpoint %s returned %d of n=%d choices: asking one sample per request",
                     self.cfg.endpoint, got, len(ss))
            self.use_n = False
        elif self.use_n:
            log.warning("teacher endpoint %s returned %d of n=%d choices; asking for the rest", self.cfg.endpoint, got,
                        len(ss))
        self.todo.appendleft((ti, ss[got:]))

    def _explain(self, e: UserError) -> UserError:
        if "HTTP 404" in str(e) and self.listed:
            # the server's text: masked and cut like every other
            shown = ", ".join(self.client.scrub(m, limit=80) for m in self.listed[:10])
            shown += " ..." if len(self.listed) > 10 else ""
            return UserError(f"{e} (the server lists: {shown})")
        return e

    def run(self) -> Iterator[list[dict]]:
        bar = progress_bar(self.total, unit="sample", desc=f"{self.request.progress_label} (endpoint)",
                           enabled=self.request.progress)
        t0 = time.perf_counter()
        self.listed = self.client.list_models()  # an unreachable server fails here, after the retries
        results: queue.SimpleQueue = queue.SimpleQueue()
        jobs: queue.SimpleQueue = queue.SimpleQueue()
        # daemon workers: an interrupted run exits at once instead of waiting out the requests in flight
        workers = [threading.Thread(target=self._worker, args=(jobs, results), daemon=True, name=f"teacher-{i}")
                   for i in range(self.cfg.concurrency)]
        for w in workers:
            w.start()
        inflight: dict[int, tuple[int, list[int]]] = {}
        job_ids = itertools.count()
        try:
            while self.todo or inflight or self.scorer.pending:
                # while nobody knows whether n is honoured, nothing else goes out beside the request that asks
                while self.todo and len(inflight) < self.cfg.concurrency and not (
                        self.use_n is None and any(len(ss) > 1 for _, ss in inflight.values())):
                    job = next(job_ids)
                    inflight[job] = self._next_job()
                    jobs.put((job, *inflight[job]))
                done = []
                if inflight:
                    try:
                        done.append(results.get(timeout=0.5))
                        while not results.empty():
                            done.append(results.get_nowait())
                    except queue.Empty:
                        pass
                for job, reply, latency in done:
                    ti, ss = inflight.pop(job)
                    if isinstance(reply, BaseException):
                        raise (self._explain(reply) if isinstance(reply, UserError) else reply)
                    recs = self.records(ti, ss, reply, latency)
                    if not recs:
                        raise UserError(f"teacher endpoint {self.cfg.endpoint} returned no choices for task "
                                        f"{self.request.tasks[ti].id}")
                    self._learn_n(ti, ss, len(recs))
                    for rec in recs:
                        self.stats["gen_tokens"] += rec["num_tokens"]
                        if bar is not None:
                            bar.update(1)
                        grp = self.scorer.score(ti, self.request.tasks[ti], rec, rec["completion"])
                        if grp is not None:
                            yield from self._emit([grp], t0)
                if self.scorer.pending:
                    yield from self._emit(self.scorer.collect(wait=not (self.todo or inflight)), t0)
        finally:
            for _ in workers:
                jobs.put(None)  # each worker ends after its current request
            self.scorer.close()
            if bar is not None:
                bar.close()
            self.stats["gen_s"] = time.perf_counter() - t0

    def _emit(self, groups: list[list[dict]], t0: float) -> Iterator[list[dict]]:
        for g in groups:
            self.stats["n_samples"] += len(g)
            self.stats["gen_s"] = time.perf_counter() - t0
            yield g


def iter_endpoint_rollouts(cfg: EndpointTeacherConfig, request: RolloutRequest, *,
                           samples: Optional[dict[str, list[int]]] = None, stats: Optional[dict] = None,
                           tokenizer=None) -> Iterator[list[dict]]:
    """Each task's scored records, asked of the server, as soon as all its samples are scored
    (completion order). ``samples``: task id -> the sample indices to ask for (default all K);
    ``stats`` is filled like :func:`mlx_ssp.rollout.engine.run_request`'s."""
    request.check()
    episodes = [t.id for t in request.tasks if is_episode(t)]
    if episodes:
        raise UserError(f"{len(episodes)} multi-turn task(s) (first: {episodes[0]}) cannot use an endpoint teacher: an "
                        "episode needs the sampled token ids turn by turn; roll them out with a local model")
    stats = stats if stats is not None else {}
    stats.update(skipped=[], gen_tokens=0, prompt_tokens=0, gen_s=0.0, verify_s=0.0, n_samples=0)
    yield from EndpointRollout(cfg, request, samples, stats, tokenizer).run()
