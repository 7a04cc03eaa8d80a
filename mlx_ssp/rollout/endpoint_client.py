"""A small client for an OpenAI-compatible chat-completions server (stdlib ``urllib`` only), used by
the endpoint teacher (:mod:`mlx_ssp.rollout.endpoint`).

Retries: HTTP 429 and 5xx, timeouts, refused or dropped connections and unparsable 200 bodies are
retried up to ``max_retries`` times, waiting ``backoff_s * 2**attempt`` (jittered, at most 60 s, or
the server's ``Retry-After`` when it sends one). Any other 4xx is the caller's mistake and is raised
at once as a :class:`~mlx_ssp.errors.UserError` (401/403: the key; 404: the model or the URL), as
is a reply of the wrong shape (no ``choices`` list, ``usage`` counts that are not whole numbers)
or one larger than ``max_response_bytes``.

Bounds on what a server can make the client do: ``timeout_s`` is the limit of one whole attempt
(connect, send, and the reply's headers and full body), not of each socket read, so a server that
trickles bytes cannot hold a request open; the body is read in chunks and given up once it passes
``max_response_bytes`` (a ``Content-Length`` above it is refused unread); the JSON parser accepts no
``NaN``/``Infinity`` and a reply nested too deeply to parse is an unparsable reply, not a crash.

The API key is sent only in the ``Authorization`` header. It is never part of a message: every
text that comes from the server goes through :func:`mask_secret` (the key, its percent-encoded and
base64 forms) before it is cut to length and shown, and the request objects that hold the key are
never logged.
"""

from __future__ import annotations

import base64
import functools
import http.client
import json
import logging
import math
import random
import re
import socket
import threading
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
#: the largest reply body read by default: far above a real completion (a 32k-token reply with
#: n: 16 is a few MiB of JSON), far below what hurts a laptop
DEFAULT_MAX_RESPONSE_BYTES = 16 * 1024 * 1024
_CHUNK = 64 * 1024  # body bytes asked of the socket at a time
_ERROR_BYTES = 4096  # an error reply's body bytes read for its message
_SHOW = 300  # characters of server text shown in a message


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
    """One failed attempt that may succeed when repeated: ``(message (already masked), seconds the
    server asked to wait or None, whether no HTTP reply came at all)``."""


class _TooLarge(Exception):
    """The reply body passed ``max_response_bytes`` (args: the declared length, or None)."""


# -- masking ---------------------------------------------------------------------------------------

_UNRESERVED = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")


@functools.lru_cache(maxsize=8)
def _secret_pattern(secret: str) -> tuple[re.Pattern, int]:
    """(a regex matching the forms of ``secret`` a server may echo, the longest such form's length).

    Forms: the secret as is or percent-encoded character by character, in either hex case, with
    ``+`` for a space (what ``quote``/``quote_plus``/form encoding give); JSON- and repr-escaped;
    and the part of its standard and URL-safe base64 that does not depend on what precedes it
    (at each of the three byte alignments; only when that part is at least 8 characters, so a
    short key does not mask unrelated text)."""
    chars = []
    for ch in secret:
        if ch in _UNRESERVED:
            chars.append(re.escape(ch))
            continue
        enc = "".join("%" + "".join(f"[{c}{c.lower()}]" for c in f"{b:02X}") for b in ch.encode())
        alts = [re.escape(ch), enc] + ([r"\+"] if ch == " " else [])
        chars.append("(?:" + "|".join(alts) + ")")
    literal = {json.dumps(secret)[1:-1], repr(secret)[1:-1]} - {secret}
    raw = secret.encode()
    for off in range(3):
        enc = base64.b64encode(b"\0" * off + raw).decode()
        core = enc[-(-8 * off // 6):(8 * (off + len(raw))) // 6]
        if len(core) >= 8:
            literal |= {core, core.translate(str.maketrans("+/", "-_"))}
    forms = ["".join(chars)] + [re.escape(f) for f in sorted(literal, key=len, reverse=True)]
    longest = max([3 * len(raw)] + [len(f) for f in literal])
    return re.compile("|".join(forms)), longest


def mask_secret(text: str, secret: Optional[str], *, limit: Optional[int] = None, cut: bool = False) -> str:
    """``text`` (from a server, which may echo what it was sent) with every form of ``secret`` that
    :func:`_secret_pattern` knows replaced by ``***``, then cut to ``limit`` characters: masked
    first, so no cut can leave part of the secret standing. ``cut``: ``text`` is the start of a
    longer text, so its end may hold the start of the secret; the last characters that could be
    that are dropped as well."""
    if secret:
        pattern, longest = _secret_pattern(secret)
        text = pattern.sub("***", text)
        if cut:
            text = text[: max(0, len(text) - longest + 1)]  # a form's start is at most longest - 1 long
    if cut or (limit is not None and len(text) > limit):
        text = (text if limit is None else text[:limit]) + "..."
    return text


# -- the whole-request deadline ---------------------------------------------------------------------

class _Deadline:
    """The end of one attempt. Every socket the attempt opens is registered; when the time is up
    a timer shuts them down, which wakes whatever read or write is blocked on them (a server that
    trickles its headers or body byte by byte never lets a per-read timeout fire)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.end = time.monotonic() + seconds
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._expired = False
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def left(self) -> float:
        return self.end - time.monotonic()

    @property
    def expired(self) -> bool:
        return self._expired or self.left() <= 0

    def watch(self, sock: Optional[socket.socket]) -> None:
        if sock is None:
            return
        with self._lock:
            self._socks.append(sock)
            if self._expired:
                _shutdown(sock)

    def _expire(self) -> None:
        with self._lock:
            self._expired = True
            for s in self._socks:
                _shutdown(s)

    def cancel(self) -> None:
        self._timer.cancel()


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed


class _DeadlineConnection:
    """Mixin of the connection classes: registers each socket with the request's deadline (the plain
    one when it is made, the TLS one that replaces it for https; the TLS handshake itself is bounded
    per read by the socket timeout, which is the time left)."""

    def __init__(self, *args, deadline: _Deadline, **kw):
        super().__init__(*args, **kw)
        self._deadline = deadline
        make = self._create_connection

        def create(*a, **k):
            sock = make(*a, **k)
            deadline.watch(sock)
            return sock

        self._create_connection = create

    def connect(self):
        super().connect()
        self._deadline.watch(self.sock)


class _DeadlineHTTPConnection(_DeadlineConnection, http.client.HTTPConnection):
    pass


class _DeadlineHTTPSConnection(_DeadlineConnection, http.client.HTTPSConnection):
    pass


class _DeadlineHandlerMixin:
    """Open the request's connection with the class above when the request carries a deadline."""

    def do_open(self, http_class, req, **kw):
        deadline = getattr(req, "deadline", None)
        if deadline is not None:
            cls = _DeadlineHTTPSConnection if issubclass(http_class, http.client.HTTPSConnection) \
                else _DeadlineHTTPConnection
            http_class = functools.partial(cls, deadline=deadline)
        return super().do_open(http_class, req, **kw)


class _HTTPHandler(_DeadlineHandlerMixin, urllib.request.HTTPHandler):
    pass


class _HTTPSHandler(_DeadlineHandlerMixin, urllib.request.HTTPSHandler):
    pass


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Refuse redirects: urllib's handler would re-send the Authorization header (the API key) to
    wherever the server points, another host included. A teacher endpoint has no reason to redirect."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        raise urllib.error.HTTPError(req.full_url, code, f"the server redirected to {newurl}; refusing to follow "
                                     "(the request carries the API key): give the final URL", headers, fp)


_OPENER = urllib.request.build_opener(_NoRedirect(), _HTTPHandler(), _HTTPSHandler())


def _set_read_timeout(resp, seconds: float) -> None:
    """The time left as the socket timeout of the next body read (best effort: the deadline's
    timer bounds the read regardless)."""
    sock = getattr(getattr(getattr(resp, "fp", None), "raw", None), "_sock", None)
    if sock is not None:
        try:
            sock.settimeout(max(seconds, 0.001))
        except OSError:
            pass


def _read_capped(resp, deadline: _Deadline, cap: int, *, strict: bool = True) -> tuple[bytearray, bool]:
    """(the body, in chunks, of at most ``cap`` bytes; whether more followed). ``strict``: more than
    ``cap`` bytes is :class:`_TooLarge` (a reply), else the first ``cap`` bytes are kept (an error's text)."""
    if strict:
        try:
            declared = int(resp.headers.get("Content-Length"))
        except (TypeError, ValueError):
            declared = None
        if declared is not None and declared > cap:
            raise _TooLarge(declared)
    buf = bytearray()
    while True:
        left = deadline.left()
        if left <= 0:
            raise TimeoutError("the deadline passed")
        _set_read_timeout(resp, left)
        chunk = resp.read1(min(_CHUNK, cap + 1 - len(buf)))
        if not chunk:
            break
        buf += chunk
        if len(buf) > cap:
            if strict:
                raise _TooLarge(None)
            del buf[cap:]
            return buf, True
    if deadline.expired:  # the timer shut the socket: what came is not the whole body
        raise TimeoutError("the deadline passed")
    if strict and getattr(resp, "length", None):  # Content-Length said more: the connection dropped
        raise http.client.IncompleteRead(bytes(buf[-20:]), resp.length)
    return buf, False


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


@dataclass
class ChatClient:
    """POSTs JSON to one endpoint with the retry policy above; thread-safe (one connection per call)."""

    endpoint: str
    model: str
    api_key: Optional[str] = None
    timeout_s: float = 600.0  # one whole attempt: connect, send, headers and full body
    max_retries: int = 5
    backoff_s: float = 1.0
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES

    def scrub(self, text: str, *, limit: Optional[int] = _SHOW, cut: bool = False) -> str:
        """Server text as a message may show it: the API key masked (:func:`mask_secret`), then cut."""
        return mask_secret(text, self.api_key, limit=limit, cut=cut)

    def _headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def _once(self, url: str, body: Optional[dict], timeout: float) -> Any:
        deadline = _Deadline(timeout)
        try:
            raw = self._fetch(url, body, deadline)
        finally:
            deadline.cancel()
        return self._parse(raw)

    def _fetch(self, url: str, body: Optional[dict], deadline: _Deadline) -> bytearray:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, headers=self._headers(), method="GET" if body is None else "POST")
        req.deadline = deadline  # type: ignore[attr-defined]  # read by _DeadlineHandlerMixin
        try:
            with _OPENER.open(req, timeout=max(deadline.left(), 0.001)) as resp:
                return _read_capped(resp, deadline, self.max_response_bytes)[0]
        except urllib.error.HTTPError as e:
            detail = self._error_text(e, deadline)
            if e.code in RETRY_STATUS:
                raise RetryableError(f"HTTP {e.code}: {detail}", _retry_after(e), False) from None
            raise _client_error(self, e.code, detail) from None
        except _TooLarge as e:
            size = f" (Content-Length {e.args[0]})" if e.args[0] is not None else ""
            raise UserError(f"teacher endpoint {url}: the reply is larger than teacher.max_response_bytes "
                            f"({self.max_response_bytes} bytes){size}; giving up (raise it if the server's replies "
                            "really are that long)") from None
        except (OSError, http.client.HTTPException) as e:
            if deadline.expired:
                raise RetryableError(f"no complete reply within teacher.timeout_s ({deadline.seconds:g} s)", None,
                                     True) from None
            reason = getattr(e, "reason", e)
            raise RetryableError(self.scrub(f"{type(reason).__name__}: {reason}"), None, True) from None

    def _error_text(self, e: urllib.error.HTTPError, deadline: _Deadline) -> str:
        """The message of an error reply (its JSON ``error.message``, else its text, else the reason),
        masked, then cut: the body's first bytes only, read under the same deadline."""
        try:
            raw, more = _read_capped(e.fp, deadline, _ERROR_BYTES, strict=False)
        except Exception:  # noqa: BLE001 - the body is only for the message (no fp, a timeout, a reset)
            raw, more = bytearray(), False
        finally:
            e.close()
        text = bytes(raw).decode(errors="replace")
        try:
            err = json.loads(text, parse_constant=_no_constant).get("error", text)
            if isinstance(err, dict):
                err = err.get("message", err)
            text, more = str(err), False
        except (ValueError, AttributeError, RecursionError):
            pass
        return self.scrub(text or str(e.reason), cut=more)

    def _parse(self, raw: bytearray) -> Any:
        try:
            return json.loads(raw, parse_constant=_no_constant)
        except RecursionError:
            raise RetryableError("the reply is JSON nested too deeply to parse", None, False) from None
        except ValueError:  # UnicodeDecodeError included
            head = raw[:_ERROR_BYTES].decode(errors="replace")
            shown = self.scrub(head, limit=200, cut=len(raw) > _ERROR_BYTES)
            raise RetryableError(f"the reply is not JSON ({shown!r})", None, False) from None

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
        return [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]

    def chat(self, body: dict) -> dict:
        """One chat completion (``body`` without ``model``: it is added here), its shape checked."""
        url = chat_url(self.endpoint)
        reply = self.request(url, {"model": self.model, **body})
        if not isinstance(reply, dict) or not isinstance(reply.get("choices"), list):
            raise UserError(f"teacher endpoint {url}: the reply has no 'choices' list; "
                            "is this an OpenAI-compatible chat-completions server?")
        usage = reply.get("usage")
        if usage is not None and not isinstance(usage, dict):
            raise UserError(f"teacher endpoint {url}: the reply's 'usage' is not a mapping")
        for k in ("prompt_tokens", "completion_tokens"):
            v = (usage or {}).get(k)
            if v is not None and not _whole(v):
                raise UserError(f"teacher endpoint {url}: the reply's usage.{k} is {self.scrub(repr(v), limit=40)}, "
                                "not a whole number of tokens")
        return reply


def _whole(v: Any) -> bool:
    """A count: a non-negative whole number (``7.0`` too), not a bool, NaN or infinity."""
    return (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
            and v == int(v))


def _retry_after(e: urllib.error.HTTPError) -> Optional[float]:
    v = e.headers.get("Retry-After") if e.headers is not None else None
    try:
        wait = float(v) if v is not None else None
    except ValueError:
        return None  # an HTTP date: use our own backoff
    return wait if wait is None or math.isfinite(wait) else None


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
