"""A small client for an OpenAI-compatible chat-completions server (stdlib ``urllib`` only), used by
the endpoint teacher (:mod:`mlx_ssp.rollout.endpoint`).

Retries: HTTP 429 and 5xx, timeouts, refused or dropped connections and unparsable 200 bodies are
retried up to ``max_retries`` times, waiting ``backoff_s * 2**attempt`` (jittered, at most 60 s, or
the server's ``Retry-After`` when it sends one). Any other 4xx is the caller's mistake and is raised
at once as a :class:`~mlx_ssp.errors.UserError` (401/403: the key; 404: the model or the URL).

The API key is sent only in the ``Authorization`` header. It is never part of a message: every
error text is scrubbed of it (a server may echo what it was sent), and the request objects that
hold it are never logged.
"""

from __future__ import annotations

import http.client
import json
import logging
import random
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Optional

from mlx_ssp.errors import UserError

log = logging.getLogger("mlx_ssp.rollout")

#: statuses worth asking again: rate limits and server-side failures
RETRY_STATUS = frozenset({408, 409, 425, 429}) | frozenset(range(500, 600))
MAX_WAIT_S = 60.0


def chat_url(endpoint: str) -> str:
    """The chat-completions URL of an endpoint given as a server root, a ``.../v1`` base or the full URL."""
    url = endpoint.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    if url.endswith("/v1"):
        return url + "/chat/completions"
    return url + "/v1/chat/completions"


def models_url(endpoint: str) -> str:
    """``.../v1/models`` beside the chat-completions URL."""
    return chat_url(endpoint)[: -len("/chat/completions")] + "/models"


class RetryableError(Exception):
    """One failed attempt that may succeed when repeated: ``(message (already scrubbed), seconds the
    server asked to wait or None, whether no HTTP reply came at all)``."""


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Refuse redirects: urllib's handler would re-send the Authorization header (the API key) to
    wherever the server points, another host included. A teacher endpoint has no reason to redirect."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        raise urllib.error.HTTPError(req.full_url, code, f"the server redirected to {newurl}; refusing to follow "
                                     "(the request carries the API key): give the final URL", headers, fp)


_OPENER = urllib.request.build_opener(_NoRedirect())


@dataclass
class ChatClient:
    """POSTs JSON to one endpoint with the retry policy above; thread-safe (one connection per call)."""

    endpoint: str
    model: str
    api_key: Optional[str] = None
    timeout_s: float = 600.0
    max_retries: int = 5
    backoff_s: float = 1.0

    def scrub(self, text: str) -> str:
        """``text`` with the API key (if any) masked."""
        return text.replace(self.api_key, "***") if self.api_key else text

    def _headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def _once(self, url: str, body: Optional[dict], timeout: float) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, headers=self._headers(), method="GET" if body is None else "POST")
        try:
            with _OPENER.open(req, timeout=timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            detail = self.scrub(_error_text(e))
            if e.code in RETRY_STATUS:
                raise RetryableError(f"HTTP {e.code}: {detail}", _retry_after(e), False) from None
            raise _client_error(self, e.code, detail) from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException) as e:
            reason = getattr(e, "reason", e)
            raise RetryableError(self.scrub(f"{type(reason).__name__}: {reason}"), None, True) from None
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise RetryableError(f"the reply is not JSON ({self.scrub(raw[:200].decode(errors='replace'))!r})", None,
                                 False) from None

    def request(self, url: str, body: Optional[dict] = None, *, retries: Optional[int] = None,
                timeout: Optional[float] = None, only_unreachable: bool = False) -> Any:
        """The parsed JSON reply to a POST of ``body`` (GET when None), retried as the module says;
        ``only_unreachable``: retry only when no reply came, and return None for a failed reply."""
        retries = self.max_retries if retries is None else retries
        timeout = self.timeout_s if timeout is None else timeout
        for attempt in range(retries + 1):
            try:
                return self._once(url, body, timeout)
            except RetryableError as e:
                msg, after, no_reply = e.args
                if only_unreachable and not no_reply:
                    return None  # the server answered: it is up, whatever it said
                if attempt == retries:
                    raise UserError(f"teacher endpoint {url}: gave up after {retries + 1} attempt(s): {msg}"
                                    + _hint(msg)) from None
                wait = after if after is not None else self.backoff_s * (2 ** attempt) * (0.5 + random.random())
                wait = min(MAX_WAIT_S, max(0.0, wait))
                log.warning("teacher endpoint %s: %s; retrying in %.1fs (%d/%d)", url, msg, wait, attempt + 1, retries)
                time.sleep(wait)
        raise AssertionError("unreachable")  # the loop returns or raises

    def list_models(self) -> Optional[list[str]]:
        """Model ids the server lists at ``/v1/models`` (None when it lists none, has no such route or
        answers it with anything but a list). Only an unreachable server is an error here (after the retries)."""
        url = models_url(self.endpoint)
        try:
            reply = self.request(url, None, timeout=min(self.timeout_s, 30.0), only_unreachable=True)
        except UserError as e:
            if ": HTTP 4" in str(e):
                return None  # no models route (or it wants other rights): the first completion says more
            raise
        data = reply.get("data") if isinstance(reply, dict) else None
        if not isinstance(data, list):
            return None
        return [str(m.get("id")) for m in data if isinstance(m, dict) and m.get("id") is not None]

    def chat(self, body: dict) -> dict:
        """One chat completion (``body`` without ``model``: it is added here)."""
        reply = self.request(chat_url(self.endpoint), {"model": self.model, **body})
        if not isinstance(reply, dict) or not isinstance(reply.get("choices"), list):
            raise UserError(f"teacher endpoint {chat_url(self.endpoint)}: the reply has no 'choices' list; "
                            "is this an OpenAI-compatible chat-completions server?")
        return reply


def _error_text(e: urllib.error.HTTPError) -> str:
    try:
        raw = e.read()[:500].decode(errors="replace")
    except Exception:  # noqa: BLE001 - the body is only for the message
        raw = ""
    try:
        err = json.loads(raw).get("error", raw)
        if isinstance(err, dict):
            err = err.get("message", err)
        return str(err)[:300]
    except (ValueError, AttributeError):
        return raw[:300] or str(e.reason)


def _retry_after(e: urllib.error.HTTPError) -> Optional[float]:
    v = e.headers.get("Retry-After") if e.headers is not None else None
    try:
        return float(v) if v is not None else None
    except ValueError:
        return None  # an HTTP date: use our own backoff


def _client_error(client: ChatClient, code: int, detail: str) -> UserError:
    where = f"teacher endpoint {chat_url(client.endpoint)}"
    if code in (401, 403):
        return UserError(f"{where}: HTTP {code} (not authorised): {detail}; check the API key in the environment "
                         "variable named by teacher.api_key_env (--api-key-env)")
    if code == 404:
        return UserError(f"{where}: HTTP 404: {detail}; the server does not know the model '{client.model}' "
                         "(teacher.model / --model) or the URL is not a chat-completions endpoint")
    return UserError(f"{where}: HTTP {code}: {detail}")


def _hint(msg: str) -> str:
    if "Refused" in msg or "refused" in msg or "gaierror" in msg or "Name or service" in msg:
        return "; is the server running and the URL right?"
    return ""
