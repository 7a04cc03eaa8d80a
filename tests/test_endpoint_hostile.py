"""The endpoint teacher's client against hostile or broken servers (each on loopback, in a thread):
an endless or oversized body, bytes trickled to outlast a per-read timeout, the API key echoed in
its encoded forms or across a cut, replies nested too deeply or with non-finite / negative /
fractional usage counts. Each ends within a few seconds with one UserError line, no traceback and
no key. Also: non-finite floats refused in every config model (``temperature: .inf``)."""

from __future__ import annotations

import base64
import json
import math
import re
import threading
import time
import tracemalloc
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mlx_ssp.errors import UserError
from mlx_ssp.rollout.endpoint_client import ChatClient

KEY = "sk-live/Zq81+xv0=do~not write-me"  # reserved characters: its URL-quoted forms differ from it


class Raw:
    """A server whose every POST is answered by ``respond(handler)`` writing to ``handler.wfile``
    (GET /v1/models: 404, so a rollout goes straight to the chat requests)."""

    def __init__(self, respond):
        self.requests = 0

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                self.send_error(404)

            def do_POST(h):
                h.rfile.read(int(h.headers.get("Content-Length") or 0))
                self.requests += 1
                try:
                    respond(h)
                except OSError:  # the client gave up and closed
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def serve():
    made = []

    def make(respond):
        made.append(Raw(respond))
        return made[-1]

    yield make
    for s in made:
        s.close()


def send(h, code, body: bytes, *, reason=None, length=True, ctype="application/json"):
    h.send_response(code, reason)
    h.send_header("Content-Type", ctype)
    if length:
        h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    h.wfile.write(body)


def client(url, **kw):
    kw.setdefault("max_retries", 0)
    return ChatClient(url, "m", backoff_s=0.001, **kw)


def ask(c):
    return c.chat({"messages": [{"role": "user", "content": "hi"}]})


def one_line(e) -> str:
    msg = str(e.value)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


# -- 1. the body is capped --------------------------------------------------------------------------

def test_an_endless_body_is_given_up_at_the_cap_without_holding_it(serve):
    chunk = b" " * 65536
    sent = []

    def endless(h):  # no Content-Length: read until the server closes, which it does after 64 MiB
        h.send_response(200)
        h.end_headers()
        for _ in range(1024):
            h.wfile.write(chunk)
            sent.append(len(chunk))

    srv = serve(endless)
    cap = 1 << 20
    tracemalloc.start()
    try:
        with pytest.raises(UserError, match=r"larger than teacher\.max_response_bytes \(1048576 bytes\)") as e:
            ask(client(srv.url, max_response_bytes=cap))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # what the server got to send when the client gave up: the cap and the socket buffers (a few
    # MiB), not the 64 MiB it offers
    assert sum(sent) < 32 << 20 and peak < 4 * cap, (sum(sent), peak)
    one_line(e)
    assert srv.requests == 1  # too large is not retried

    release, released = threading.Event(), threading.Event()

    def declared(h):  # a Content-Length above the cap is refused before a byte of the body is read
        h.send_response(200)
        h.send_header("Content-Length", str(10 ** 12))
        h.end_headers()
        release.wait(60)
        released.set()

    with pytest.raises(UserError, match=r"max_response_bytes .*Content-Length 1000000000000"):
        ask(client(serve(declared).url, max_response_bytes=cap, max_retries=2))
    assert not released.is_set()  # refused while the server still held the body back
    release.set()


def test_max_response_bytes_is_a_validated_teacher_setting(tmp_path, serve):
    from mlx_ssp.rollout import RolloutConfig
    from mlx_ssp.rollout.endpoint import EndpointTeacherConfig
    from mlx_ssp.rollout.endpoint_client import DEFAULT_MAX_RESPONSE_BYTES
    from mlx_ssp.rollout.stage import run_rollouts
    from mlx_ssp.tasks import Task, write_tasks

    t = EndpointTeacherConfig(endpoint="http://127.0.0.1:1", model="m")
    assert t.max_response_bytes == DEFAULT_MAX_RESPONSE_BYTES == 16 << 20
    assert "max_response_bytes" not in t.model_dump()  # how requests go: not in the stage fingerprint
    for bad in (0, 100, "lots"):
        with pytest.raises(Exception, match="max_response_bytes"):
            EndpointTeacherConfig(endpoint="http://127.0.0.1:1", model="m", max_response_bytes=bad)

    big = json.dumps({"choices": [{"index": 0, "message": {"content": "x" * 5000}}]}).encode()
    srv = serve(lambda h: send(h, 200, big))
    tf = tmp_path / "t.jsonl"
    write_tasks(tf, [Task(id="q", domain="a", prompt="What is 1 + 1?", answer="2", verifier="exact")])
    cfg = EndpointTeacherConfig(endpoint=srv.url, model="m", max_response_bytes=4096, max_retries=0)
    with pytest.raises(UserError, match=r"max_response_bytes \(4096 bytes\)"):
        run_rollouts(cfg, tf, RolloutConfig(k=1), tmp_path / "r.jsonl", progress=False)


# -- 2. timeout_s bounds the whole request --------------------------------------------------------

def test_timeout_bounds_the_whole_request_not_each_read(serve):
    # 30 s of trickle, cut short when the client closes: the client gives up at its 1 s limit, long
    # before the trickle ends, however busy the machine
    trickled = []

    def trickle_body(h):  # a byte every 0.5 s: no read ever waits a second
        h.send_response(200)
        h.send_header("Content-Length", "100")
        h.end_headers()
        for _ in range(60):
            h.wfile.write(b" ")
            time.sleep(0.5)
        trickled.append(h)

    def trickle_headers(h):
        h.wfile.write(b"HTTP/1.0 200 OK\r\nX-Slow: ")
        for _ in range(60):
            h.wfile.write(b"z")
            time.sleep(0.5)
        trickled.append(h)

    for respond in (trickle_body, trickle_headers):
        srv = serve(respond)
        with pytest.raises(UserError, match=r"no complete reply within teacher\.timeout_s \(1 s\)") as e:
            ask(client(srv.url, timeout_s=1.0))
        assert not trickled, respond.__name__
        one_line(e)

    # a slow but steady reply inside the limit still comes through whole
    ok = json.dumps({"choices": []}).encode()

    def slow_ok(h):
        h.send_response(200)
        h.send_header("Content-Length", str(len(ok)))
        h.end_headers()
        for b in (ok[:5], ok[5:]):
            h.wfile.write(b)
            time.sleep(0.2)

    assert ask(client(serve(slow_ok).url, timeout_s=5.0)) == {"choices": []}


# -- 3. the key is masked before any cut, in its encoded forms too --------------------------------

def test_mask_secret_forms_and_cuts():
    from mlx_ssp.rollout.endpoint_client import mask_secret

    forms = [KEY, urllib.parse.quote(KEY, safe=""), urllib.parse.quote_plus(KEY), urllib.parse.quote(KEY),
             re.sub("%[0-9A-F]{2}", lambda m: m.group().lower(), urllib.parse.quote(KEY, safe="")),  # %2f
             json.dumps(KEY)[1:-1]]
    for prefix in ("", "a", "ab", "Bearer ", "user:"):  # base64 at every alignment (basic auth too)
        for enc in (base64.b64encode, base64.urlsafe_b64encode):
            forms.append(enc((prefix + KEY).encode()).decode())
    for f in forms:
        out = mask_secret(f"<{f}>", KEY)
        assert "***" in out and "Zq81" not in out and "do~not" not in out, (f, out)
    # masked first, then cut: a key across the cut leaves none of itself
    text = "x" * 290 + KEY + "y" * 100
    assert mask_secret(text, KEY, limit=300) == "x" * 290 + "***" + "y" * 7 + "..."
    # a text that is the start of a longer one: a key begun at its end is dropped
    assert KEY[:6] not in mask_secret("x" * 50 + KEY[:12], KEY, cut=True)
    assert mask_secret("no key here", None, limit=5) == "no ke..."


def test_error_text_echoing_the_key_shows_none_of_it(serve):
    b64 = base64.b64encode(f"Bearer {KEY}".encode()).decode()
    bodies = [
        ("x" * 290 + KEY + " tail").encode(),  # across the old 300-character cut
        json.dumps({"error": {"message": f"bad key {urllib.parse.quote(KEY, safe='')} ({b64})"}}).encode(),
        json.dumps({"error": "y" * 280 + urllib.parse.quote_plus(KEY)}).encode(),
        (KEY * 200).encode(),  # more than is read: the read's end cuts a key
    ]
    for body in bodies:
        srv = serve(lambda h, body=body: send(h, 400, body, ctype="text/plain"))
        with pytest.raises(UserError, match="HTTP 400") as e:
            ask(client(srv.url, api_key=KEY))
        msg = one_line(e)
        assert "***" in msg and "Zq81" not in msg and "do~not" not in msg and "sk-live" not in msg, msg
        assert len(msg) < 600

    # the reason phrase, a retried 5xx and an unparsable 200 go through the same masking
    srv = serve(lambda h: send(h, 503, b"", reason=f"overloaded {KEY}"))
    with pytest.raises(UserError, match="HTTP 503") as e:
        ask(client(srv.url, api_key=KEY))
    assert "Zq81" not in one_line(e)
    srv = serve(lambda h: send(h, 200, ("z" * 190 + KEY).encode()))
    with pytest.raises(UserError, match="not JSON") as e:
        ask(client(srv.url, api_key=KEY))
    assert "sk-live" not in one_line(e)


# -- 6. malformed replies are one error line --------------------------------------------------------

@pytest.mark.parametrize("body, msg", [
    (b"[" * 200_000 + b"]" * 200_000, "nested too deeply"),
    (b'{"choices": [], "usage": {"prompt_tokens": NaN}}', "not JSON"),
    (b'{"choices": [], "usage": {"prompt_tokens": Infinity}}', "not JSON"),
    (b'{"choices": [], "usage": {"prompt_tokens": 1e999}}', r"usage\.prompt_tokens is inf"),
    (b'{"choices": [], "usage": {"completion_tokens": -3}}', r"usage\.completion_tokens is -3"),
    (b'{"choices": [], "usage": {"completion_tokens": 2.5}}', r"usage\.completion_tokens is 2\.5"),
    (b'{"choices": [], "usage": {"completion_tokens": "12"}}', r"usage\.completion_tokens is '12'"),
    (b'{"choices": [], "usage": [1, 2]}', "'usage' is not a mapping"),
])
def test_malformed_replies_are_one_line_errors(serve, body, msg):
    srv = serve(lambda h: send(h, 200, body))
    with pytest.raises(UserError, match=msg) as e:
        ask(client(srv.url, max_retries=1))
    one_line(e)


def test_a_well_formed_usage_passes(serve):
    body = b'{"choices": [], "usage": {"prompt_tokens": 7.0, "completion_tokens": 3}}'
    assert ask(client(serve(lambda h: send(h, 200, body)).url))["usage"]["prompt_tokens"] == 7


def test_a_rollout_against_a_bad_usage_fails_with_one_line(tmp_path, serve):
    from mlx_ssp.rollout import RolloutConfig
    from mlx_ssp.rollout.endpoint import EndpointTeacherConfig
    from mlx_ssp.rollout.stage import run_rollouts
    from mlx_ssp.tasks import Task, write_tasks

    body = json.dumps({"choices": [{"index": 0, "message": {"content": "2"}}],
                       "usage": {"prompt_tokens": math.inf}}).encode()  # json writes Infinity
    srv = serve(lambda h: send(h, 200, body.replace(b"Infinity", b"1e999")))
    tf = tmp_path / "t.jsonl"
    write_tasks(tf, [Task(id="q", domain="a", prompt="What is 1 + 1?", answer="2", verifier="exact")])
    with pytest.raises(UserError, match=r"usage\.prompt_tokens is inf"):
        run_rollouts(EndpointTeacherConfig(endpoint=srv.url, model="m", max_retries=0), tf, RolloutConfig(k=1),
                     tmp_path / "r.jsonl", progress=False)


# -- non-finite floats in config ----------------------------------------------------------------------

def test_non_finite_floats_are_refused_in_every_config_model(tmp_path):
    from mlx_ssp.config import SECTIONS, StrictModel, load_file, load_section, section_model, validate
    from mlx_ssp.rollout.endpoint import EndpointTeacherConfig, teacher_section

    for inf in (".inf", "-.inf", ".nan"):
        with pytest.raises(UserError, match=r"rollout\.sampling\.temperature: Input should be a finite number"):
            load_section(load_file(None, [f"rollout.sampling.temperature={inf}"]), "rollout", source="--set")
    run = tmp_path / "run.yaml"
    run.write_text("rollout: {sampling: {temperature: .inf}}\n")
    with pytest.raises(UserError, match=r"run.yaml: rollout\.sampling\.temperature: .*finite"):
        load_section(load_file(run), "rollout", source=str(run))
    for bad, key in [({"sampling": {"temperature": float("nan")}}, r"teacher\.sampling\.temperature"),
                     ({"timeout_s": float("inf")}, r"teacher\.timeout_s"),
                     ({"extra_body": {"repetition_penalty": float("inf")}}, r"teacher\.extra_body: .*plain JSON")]:
        with pytest.raises(UserError, match=key):
            teacher_section({"teacher": {"endpoint": "http://127.0.0.1:1", "model": "m", **bad}}, "run.yaml")
    with pytest.raises(UserError, match=r"rl\.long2short\.lambda: .*finite"):
        validate(section_model("rl"), {"long2short": {"lambda": float("nan")}}, prefix="rl")

    # every config model, of every section, refuses them (the shared StrictModel setting)
    for name in SECTIONS:
        section_model(name)
    todo, seen = [StrictModel], []
    while todo:
        cls = todo.pop()
        seen.append(cls)
        todo += cls.__subclasses__()
    assert EndpointTeacherConfig in seen and len(seen) > 20
    assert [c.__name__ for c in seen if c.model_config.get("allow_inf_nan") is not False] == []
