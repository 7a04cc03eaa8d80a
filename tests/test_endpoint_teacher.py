"""The endpoint teacher (mlx_ssp.rollout.endpoint): records like local ones that select and SFT take,
retries on 429/5xx, the error paths, resume without asking a task twice, the key kept out of every
file, and a real ``mlx_lm.server`` on loopback killed mid-run and resumed."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from mlx_ssp.errors import UserError
from mlx_ssp.rollout import RolloutConfig
from mlx_ssp.rollout.endpoint import EndpointTeacherConfig, join_reasoning, teacher_section
from mlx_ssp.rollout.stage import run_rollouts
from mlx_ssp.tasks import Task, write_tasks

KEY = "sk-test-Zq81xv0-do-not-write-me"


class Stub:
    """An OpenAI-style chat server in a thread: answers "Answer: <a+1>" to even choices and a wrong
    answer to odd ones (with a separate reasoning part), fails the statuses in ``fail`` first, and
    keeps every request body it got."""

    def __init__(self, *, honour_n=True, fail=(), models=("stub",), key=None, reasoning_key="reasoning_content"):
        self.honour_n, self.fail, self.models, self.key = honour_n, list(fail), list(models), key
        self.reasoning_key = reasoning_key
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self.lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def _send(self, code, obj, headers=()):
                raw = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                for k, v in headers:
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self):
                if self.path == "/v1/models":
                    self._send(200, {"data": [{"id": m} for m in stub.models]})
                else:
                    self._send(404, {"error": "no such route"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with stub.lock:
                    stub.bodies.append(body)
                    stub.headers.append(dict(self.headers))
                    status = stub.fail.pop(0) if stub.fail else None
                if stub.key is not None and self.headers.get("Authorization") != f"Bearer {stub.key}":
                    return self._send(401, {"error": {"message": "bad key"}})
                if status is not None:
                    return self._send(status, {"error": f"status {status}"}, [("Retry-After", "0")] if status == 429 else [])
                if body.get("model") not in stub.models:
                    return self._send(404, {"error": f"model {body.get('model')} not found"})
                n = body.get("n", 1) if stub.honour_n else 1
                q = body["messages"][-1]["content"]
                a = int(q.split("What is ")[1].split(" ")[0]) + 1
                choices = [{"index": i, "finish_reason": "stop",
                            "message": {"role": "assistant", "content": f"Answer: {a if i % 2 == 0 else -1}",
                                        stub.reasoning_key: f"{a - 1} plus one, way {i}"}} for i in range(n)]
                self._send(200, {"choices": choices, "model": body["model"],
                                 "usage": {"prompt_tokens": 7, "completion_tokens": 3 * n}})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub_factory():
    made = []

    def make(**kw):
        s = Stub(**kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def tasks_file(path, n=4):
    write_tasks(path, [Task(id=f"q{i}", domain="a" if i < 2 else "b", prompt=f"What is {i} + 1?", answer=str(i + 1),
                            verifier="exact") for i in range(n)])
    return path


def teacher(url, **kw):
    return EndpointTeacherConfig(endpoint=url, model=kw.pop("model", "stub"), backoff_s=0.001, **kw)


def lines(path):
    return [json.loads(x) for x in Path(path).read_text().splitlines()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_records_like_local_ones_pass_select_and_sft(tmp_path, stub_factory, tiny_qwen3):
    from mlx_ssp.models import load_model, load_tokenizer
    from mlx_ssp.rollout import generate_rollouts
    from mlx_ssp.select import SelectConfig, run_select
    from mlx_ssp.sft.data import load_sft_file
    from mlx_ssp.tasks import load_tasks, render_prompt

    stub = stub_factory()
    tf = tasks_file(tmp_path / "t.jsonl")
    out = tmp_path / "r.jsonl"
    summ = run_rollouts(teacher(stub.url, tokenizer=str(tiny_qwen3)), tf, RolloutConfig(k=3), out, progress=False)
    recs = lines(out)
    assert sorted((r["task_id"], r["sample"]) for r in recs) == [(f"q{i}", s) for i in range(4) for s in range(3)]
    assert len(stub.bodies) == 4 and all(b["n"] == 3 for b in stub.bodies)  # the server honours n: one request a task

    model, tok, _ = load_model(str(tiny_qwen3))
    local = generate_rollouts(model, tok, load_tasks(tf)[:1], k=1, sampling=RolloutConfig().sampling.model_copy(
        update={"max_tokens": 3}), progress=False)[0]
    assert set(recs[0]) == set(local) | {"task_fingerprint", "run_fingerprint", "teacher"}
    tok = load_tokenizer(str(tiny_qwen3))
    for r in recs:
        s = r["sample"]
        a = int(r["task_id"][1:]) + 1
        assert r["completion"] == join_reasoning(f"{a - 1} plus one, way {s}", f"Answer: {a if s % 2 == 0 else -1}")
        assert r["reward"] == (1.0 if s % 2 == 0 else 0.0)
        assert r["teacher"] == {"endpoint": stub.url, "model": "stub"}
        assert r["token_ids"][:-1] == list(tok.encode(r["completion"], add_special_tokens=False))
        assert r["token_ids"][-1] == tok.eos_token_id and r["num_tokens"] == len(r["token_ids"])
    by_id = {t.id: t for t in load_tasks(tf)}
    assert all(r["prompt_token_ids"] == render_prompt(tok, by_id[r["task_id"]]) for r in recs)
    assert summ["overall"]["pass@1"] == pytest.approx(2 / 3) and summ["model"] == "stub @ " + stub.url

    report = run_select(out, SelectConfig(valid_fraction=0.0), tmp_path / "sel")
    train = lines(tmp_path / "sel" / "a" / "train.jsonl")
    assert train and all(x["messages"][-1]["content"].startswith("<think>\n") for x in train)
    a = report["domains"]["a"]
    assert a["n_prompts"] == 2 and a["mean_correct_per_prompt"] == 2 and a["n_train"] == len(train) == 4
    ds, _ = load_sft_file(tmp_path / "sel" / "a" / "train.jsonl", tok, mask_prompt=True, max_seq_length=256)
    assert len(ds) == len(train)


def test_retries_429_and_500_then_gives_up(tmp_path, stub_factory):
    tf = tasks_file(tmp_path / "t.jsonl", n=2)
    stub = stub_factory(fail=[429, 500, 503])
    run_rollouts(teacher(stub.url, max_retries=3), tf, RolloutConfig(k=2), tmp_path / "r.jsonl", progress=False)
    assert len(lines(tmp_path / "r.jsonl")) == 4
    assert len(stub.bodies) == 3 + 2  # three failures asked again, then one request per task

    stub2 = stub_factory(fail=[500, 500, 500])
    with pytest.raises(UserError, match=r"gave up after 2 attempt\(s\): HTTP 500"):
        run_rollouts(teacher(stub2.url, max_retries=1), tf, RolloutConfig(k=2), tmp_path / "r2.jsonl", progress=False)


def test_n_ignored_falls_back_to_one_request_per_sample(tmp_path, stub_factory):
    tf = tasks_file(tmp_path / "t.jsonl", n=3)
    stub = stub_factory(honour_n=False, reasoning_key="reasoning")  # mlx_lm.server's key for the reasoning part
    run_rollouts(teacher(stub.url, concurrency=3), tf, RolloutConfig(k=4), tmp_path / "r.jsonl", progress=False)
    recs = lines(tmp_path / "r.jsonl")
    assert sorted((r["task_id"], r["sample"]) for r in recs) == [(f"q{i}", s) for i in range(3) for s in range(4)]
    assert len(stub.bodies) == 12  # the probe with n=4 answered one sample; every other request asked one
    assert sum("n" in b for b in stub.bodies) == 1
    assert all(r["completion"].startswith("<think>\n") for r in recs)
    seeds = [b["seed"] for b in stub.bodies]
    assert len(set(seeds)) == 12  # each sample its own seed
    # no tokenizer: no token ids, the server's usage as the length; select takes such records too
    from mlx_ssp.select import SelectConfig, run_select

    assert all(r["token_ids"] is None and r["prompt_token_ids"] is None and r["num_tokens"] == 3 for r in recs)
    rep = run_select(tmp_path / "r.jsonl", SelectConfig(valid_fraction=0.0), tmp_path / "sel")
    # the stub's one choice per request is always its choice 0: four equal correct samples, one kept
    assert all(r["reward"] == 1.0 for r in recs) and rep["domains"]["b"]["n_train"] == 1


def test_unreachable_and_unknown_model_are_clear_errors(tmp_path, stub_factory):
    tf = tasks_file(tmp_path / "t.jsonl", n=1)
    t0 = time.time()
    with pytest.raises(UserError, match="is the server running"):
        run_rollouts(teacher(f"http://127.0.0.1:{free_port()}", max_retries=1), tf, RolloutConfig(k=1),
                     tmp_path / "r.jsonl", progress=False)
    assert time.time() - t0 < 20  # refused at once, no wait on the probe's 30 s timeout; margin for a busy machine
    stub = stub_factory()
    with pytest.raises(UserError, match=r"does not know the model 'nope'.*the server lists: stub"):
        run_rollouts(teacher(stub.url, model="nope"), tf, RolloutConfig(k=1), tmp_path / "r2.jsonl", progress=False)
    assert len(stub.bodies) == 1  # a 4xx is not retried


def test_resume_asks_only_the_tasks_not_in_the_file(tmp_path, stub_factory):
    tf = tasks_file(tmp_path / "t.jsonl", n=5)
    out = tmp_path / "r.jsonl"
    stub = stub_factory(fail=[None, None, 400])  # the third request fails for good (a crash): the run stops there
    with pytest.raises(UserError, match="HTTP 400"):
        run_rollouts(teacher(stub.url, concurrency=1), tf, RolloutConfig(k=2), out, progress=False)
    first = lines(out)
    done = {r["task_id"] for r in first}
    assert done == {"q0", "q1"} and len(first) == 4
    asked_before = len(stub.bodies)
    run_rollouts(teacher(stub.url, concurrency=1), tf, RolloutConfig(k=2), out, progress=False)
    again = [b["messages"][-1]["content"] for b in stub.bodies[asked_before:]]
    assert sorted(again) == [f"What is {i} + 1?" for i in (2, 3, 4)]  # no task asked twice
    recs = lines(out)
    assert recs[:4] == first and len(recs) == 10
    # other settings are refused, not blended
    with pytest.raises(UserError, match="different settings"):
        run_rollouts(teacher(stub.url, model="stub", tokenizer=None, extra_body={"x": 1}), tf, RolloutConfig(k=2),
                     out, progress=False)


def test_api_key_sent_but_never_written(tmp_path, stub_factory, tiny_qwen3, monkeypatch, caplog):
    from mlx_ssp import pipeline

    monkeypatch.setenv("TEACHER_KEY", KEY)
    stub = stub_factory(key=KEY)
    run_dir = tmp_path / "run"
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"""
run_dir: {run_dir}
model: {tiny_qwen3}
teacher: {{endpoint: "{stub.url}/v1", model: stub, api_key_env: TEACHER_KEY, backoff_s: 0.001}}
tasks:
  domains:
    a:
      source: jsonl:{tasks_file(tmp_path / 't.jsonl', n=4)}
      sizes: {{train: 2, probe: 1, eval: 1}}
rollout: {{k: 2}}
""")
    caplog.set_level("DEBUG")
    pipeline.run_pipeline(cfg, only="tasks", progress=False, echo=lambda s: None)
    res = pipeline.run_pipeline(cfg, only="rollout", progress=False, echo=lambda s: None)
    assert res["rollout"]["teacher"] == f"stub @ {stub.url}/v1"
    assert all(h.get("Authorization") == f"Bearer {KEY}" for h in stub.headers)
    recs = lines(run_dir / "rollout" / "rollouts.jsonl")
    assert len(recs) == 4 and recs[0]["prompt_token_ids"]  # the student's (model:) tokens by default
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert len(files) >= 5
    for p in files:
        assert KEY.encode() not in p.read_bytes(), p
    assert KEY not in caplog.text

    monkeypatch.setenv("TEACHER_KEY", "wrong-" + KEY)  # a rejected key: the message names the variable, not the key
    with pytest.raises(UserError, match="TEACHER_KEY|api_key_env") as e:
        run_rollouts(teacher(stub.url, api_key_env="TEACHER_KEY"), tmp_path / "t.jsonl", RolloutConfig(k=1),
                     tmp_path / "r.jsonl", progress=False)
    assert KEY not in str(e.value)
    monkeypatch.delenv("TEACHER_KEY")
    with pytest.raises(UserError, match="TEACHER_KEY, which is not set"):
        run_rollouts(teacher(stub.url, api_key_env="TEACHER_KEY"), tmp_path / "t.jsonl", RolloutConfig(k=1),
                     tmp_path / "r.jsonl", progress=False)


def test_teacher_section_validation():
    assert teacher_section({}) is None
    assert teacher_section({"teacher": "demo"}).path == "demo"
    t = teacher_section({"teacher": {"endpoint": "http://127.0.0.1:1", "model": "m", "concurrency": 2}})
    assert isinstance(t, EndpointTeacherConfig) and t.concurrency == 2
    # how requests go is not what they ask: left out of the dump (and so of the stage fingerprint)
    assert t.model_dump() == t.model_copy(update={"concurrency": 9, "max_retries": 0, "use_n": False}).model_dump()
    assert t.model_dump() != t.model_copy(update={"model": "other"}).model_dump()
    for bad, msg in [({"api_key": KEY}, "unknown key 'teacher.api_key'"),
                     ({"api_key_env": KEY}, "NAME of an environment variable"),
                     ({"endpoint": "ftp://x"}, "http"),
                     ({"endpoint": "http://u:pw@h:1"}, "credentials"),
                     ({"endpoint": f"http://h:1/v1?api_key={KEY}"}, "credentials.*parameter 'api_key'"),
                     ({"endpoint": f"http://h:1/v1?x=1&key={KEY}"}, "credentials.*parameter 'key'"),
                     ({"endpoint": f"https://h/v1/chat/completions?access_token={KEY}"}, "credentials"),
                     ({"endpoint": f"http://h:1?Token={KEY}"}, "credentials"),
                     ({"endpoint": f"http://h:1/v1#client_secret={KEY}"}, "credentials"),
                     ({"extra_body": {"n": 3}}, "sets n"),
                     ({"concurrency": 0}, "concurrency")]:
        raw = {"endpoint": "http://127.0.0.1:1", "model": "m", **bad}
        with pytest.raises(UserError, match=msg) as e:
            teacher_section({"teacher": raw}, "run.yaml")
        assert KEY not in str(e.value)
    # a query that is not a credential passes (Azure's api-version)
    assert teacher_section({"teacher": {"endpoint": "https://h/v1?api-version=2024-06-01", "model": "m"}})


def test_the_key_anywhere_in_the_endpoint_url_is_refused(tmp_path, stub_factory, monkeypatch):
    """Whatever the parameter is called: the URL lands in .meta.json and every record."""
    monkeypatch.setenv("TEACHER_KEY", KEY)
    stub = stub_factory(key=KEY)
    for url in (f"{stub.url}/v1?q={KEY}", f"{stub.url}/{KEY}/v1", f"{stub.url}/v1?q={KEY.replace('-', '%2D')}"):
        with pytest.raises(UserError, match="must not hold credentials.*the value of TEACHER_KEY") as e:
            teacher_section({"teacher": {"endpoint": url, "model": "stub", "api_key_env": "TEACHER_KEY"}}, "run.yaml")
        assert KEY not in str(e.value)
    # the variable set only after the config was read: refused when the run reads the key, before any file
    monkeypatch.delenv("TEACHER_KEY")
    cfg = teacher(f"{stub.url}/v1?q={KEY}", api_key_env="TEACHER_KEY")
    monkeypatch.setenv("TEACHER_KEY", KEY)
    with pytest.raises(UserError, match="must not hold credentials") as e:
        run_rollouts(cfg, tasks_file(tmp_path / "t.jsonl", n=1), RolloutConfig(k=1), tmp_path / "r.jsonl",
                     progress=False)
    assert KEY not in str(e.value) and not list(tmp_path.glob("r.jsonl*")) and stub.bodies == []


def test_the_model_list_the_server_sends_is_masked(tmp_path, stub_factory, monkeypatch):
    monkeypatch.setenv("TEACHER_KEY", KEY)
    stub = stub_factory(models=("stub", f"echo-{KEY}", "z" * 5000))
    with pytest.raises(UserError, match=r"the server lists: stub, echo-\*\*\*, z+\.\.\.") as e:
        run_rollouts(teacher(stub.url, model="nope", api_key_env="TEACHER_KEY"), tasks_file(tmp_path / "t.jsonl", n=1),
                     RolloutConfig(k=1), tmp_path / "r.jsonl", progress=False)
    assert KEY not in str(e.value) and len(str(e.value)) < 1000


def test_cli_endpoint_flags(tmp_path, stub_factory):
    from click.testing import CliRunner

    from mlx_ssp.cli import main

    stub = stub_factory()
    tf = tasks_file(tmp_path / "t.jsonl", n=2)
    res = CliRunner().invoke(main, ["rollout", "--no-progress", "--endpoint", stub.url, "--model", "stub", "--tasks",
                                    str(tf), "--k", "2", "--concurrency", "2", "-o", str(tmp_path / "r.jsonl")])
    assert res.exit_code == 0, res.output
    assert len(lines(tmp_path / "r.jsonl")) == 4 and "pass@2" in res.output
    res = CliRunner().invoke(main, ["rollout", "--endpoint", stub.url, "--tasks", str(tf), "-o", str(tmp_path / "x")])
    assert res.exit_code == 2 and "--model NAME" in res.output
    res = CliRunner().invoke(main, ["rollout", "--concurrency", "3", "--tasks", str(tf), "-o", str(tmp_path / "x")])
    assert res.exit_code == 2 and "go with --endpoint" in res.output


def test_cli_set_teacher_keys_go_with_the_endpoint_flag(tmp_path, stub_factory):
    """``--set teacher.KEY=...`` with ``--endpoint`` and no teacher.endpoint: honoured, and an unknown
    key refused naming the valid ones (they were dropped silently)."""
    from click.testing import CliRunner

    from mlx_ssp.cli import main

    tf = tasks_file(tmp_path / "t.jsonl", n=1)

    def rollout(url, *sets, model=("--model", "stub")):
        args = ["rollout", "--no-progress", "--endpoint", url, *model, "--tasks", str(tf), "--k", "1",
                "-o", str(tmp_path / "r.jsonl"), "--overwrite"]
        return CliRunner().invoke(main, args + [x for kv in sets for x in ("--set", kv)])

    stub = stub_factory(fail=[500])
    res = rollout(stub.url, "teacher.max_retries=0")
    assert res.exit_code == 2 and "gave up after 1 attempt(s): HTTP 500" in res.output, res.output
    stub = stub_factory(fail=[500, 500])
    res = rollout(stub.url, "teacher.max_retries=2", "teacher.backoff_s=0.001", "teacher.model=stub", model=())
    assert res.exit_code == 0, res.output
    assert len(stub.bodies) == 3
    res = rollout(stub.url, "teacher.max_retries=0", "teacher.bogus=1")
    assert res.exit_code == 2 and "unknown key 'teacher.bogus'; valid keys:" in res.output
    assert "max_retries" in res.output and "timeout_s" in res.output
    res = rollout(stub.url, "teacher.timeout_s=.inf")
    assert res.exit_code == 2 and "teacher.timeout_s: Input should be a finite number" in res.output
    # a config file's endpoint section, --set over it, the flags over both
    cfg = tmp_path / "run.yaml"
    cfg.write_text("teacher: {endpoint: http://127.0.0.1:1, model: other, max_retries: 7}\n")
    stub = stub_factory(fail=[500])
    res = CliRunner().invoke(main, ["rollout", "--no-progress", "--config", str(cfg), "--endpoint", stub.url,
                                    "--model", "stub", "--tasks", str(tf), "--k", "1", "-o", str(tmp_path / "r2.jsonl"),
                                    "--set", "teacher.max_retries=0"])
    assert res.exit_code == 2 and "gave up after 1 attempt(s)" in res.output, res.output


@pytest.mark.slow
def test_real_mlx_lm_server_killed_mid_run_and_resumed(tmp_path, tiny_qwen3):
    """mlx_lm.server on loopback with the tiny model; the client (a subprocess) is killed once some
    tasks are in the file, and the resume asks only for the rest."""
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    server = subprocess.Popen([sys.executable, "-m", "mlx_lm.server", "--model", str(tiny_qwen3), "--host", "127.0.0.1",
                               "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
            except OSError:
                if time.time() > deadline or server.poll() is not None:
                    pytest.fail("mlx_lm.server did not start")
                time.sleep(0.2)
        tf = tasks_file(tmp_path / "t.jsonl", n=8)
        out = tmp_path / "r.jsonl"
        args = [sys.executable, "-m", "mlx_ssp.cli", "rollout", "--no-progress", "--endpoint", url, "--model",
                "default_model", "--tasks", str(tf), "--k", "2", "--max-tokens", "24", "--concurrency", "1",
                "--seed", "3", "-o", str(out)]
        client = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + 90
        while not (out.exists() and len(out.read_text().splitlines()) >= 4):
            if client.poll() is not None or time.time() > deadline:
                pytest.fail(f"client ended early: {client.stdout.read().decode()[-2000:]}")
            time.sleep(0.05)
        client.kill()
        client.wait()
        before = lines(out)
        done = {r["task_id"] for r in before}
        assert 2 <= len(done) < 8 and len(before) == 2 * len(done)  # whole tasks only
        cfg = RolloutConfig(k=2, seed=3, sampling={"max_tokens": 24})
        summ = run_rollouts(EndpointTeacherConfig(endpoint=url, model="default_model", concurrency=4), tf, cfg, out,
                            progress=False)
        recs = lines(out)
        assert sorted((r["task_id"], r["sample"]) for r in recs) == [(f"q{i}", s) for i in range(8) for s in range(2)]
        assert recs[: len(before)] == before
        assert summ["this_run"]["samples"] == 16 - len(before)  # the kept tasks were not asked again
        assert {r["task_id"] for r in recs[len(before):]}.isdisjoint(done)
        assert all(r["teacher"]["model"] == "default_model" and r["num_tokens"] > 0 for r in recs)
    finally:
        server.kill()
        server.wait()


def test_a_redirect_is_refused_and_the_key_goes_nowhere_else():
    """urllib would re-send the Authorization header to the redirect's host: we do not follow."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from mlx_ssp.rollout.endpoint_client import ChatClient

    seen = []

    class Other(BaseHTTPRequestHandler):
        def do_POST(self):
            seen.append(self.headers.get("Authorization"))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *a):
            pass

    other = HTTPServer(("127.0.0.1", 0), Other)

    class Redirect(BaseHTTPRequestHandler):
        def do_POST(self):
            self.send_response(307)
            self.send_header("Location", f"http://127.0.0.1:{other.server_port}/v1/chat/completions")
            self.end_headers()

        def log_message(self, *a):
            pass

    red = HTTPServer(("127.0.0.1", 0), Redirect)
    for srv in (other, red):
        threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        client = ChatClient(f"http://127.0.0.1:{red.server_port}", "m", api_key="sk-secret", max_retries=0)
        with pytest.raises(UserError, match="redirect") as e:
            client.request(f"http://127.0.0.1:{red.server_port}/v1/chat/completions", {"x": 1})
        assert "sk-secret" not in str(e.value) and seen == []
    finally:
        red.shutdown()
        other.shutdown()
