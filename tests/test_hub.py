"""Hub upload against a loopback stand-in of the Hub's HTTP API.

The stand-in (http.server on 127.0.0.1, reached through ``HF_ENDPOINT``) answers the calls a
real huggingface_hub client makes for ``create_repo`` + ``repo_info`` + ``upload_folder`` of small files:
``POST /api/repos/create`` (409 for an existing repo, as the Hub does), ``GET /api/models/{repo}``
(the repo's ``private``), ``POST /api/validate-yaml`` (the README.md's front matter, checked
before the commit), ``POST /api/models/{repo}/preupload/{rev}`` (every file "regular", so no LFS) and
``POST /api/models/{repo}/commit/{rev}`` (NDJSON: a header line, then one line per file
with its bytes in base64). It records every request, so the tests check what reached the wire.
"""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from huggingface_hub import constants as hf_constants

from mlx_ssp.errors import UserError
from mlx_ssp.hub import UploadConfig, check_repo_id, upload_model

TOKEN = "hf_loopbackSecretToken123"


class FakeHub:
    """Requests seen (method, path, headers, body) and the repos with their committed files."""

    def __init__(self, fail_status: int | None = None):
        self.requests: list[tuple[str, str, dict, bytes]] = []
        self.repos: dict[str, dict] = {}
        self.validated: list[str] = []  # README.md texts sent to /api/validate-yaml
        self.fail_status = fail_status


def _handler(hub: FakeHub):
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):  # quiet
            pass

        def _reply(self, status: int, obj) -> None:
            body = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _body(self) -> bytes:
            n = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(n) if n else b""

        def do_GET(self):
            hub.requests.append(("GET", self.path, dict(self.headers), b""))
            path = self.path.split("?")[0]
            parts = path.split("/")  # /api/models/ORG/NAME: repo_info
            if len(parts) == 5 and parts[:3] == ["", "api", "models"]:
                repo = f"{parts[3]}/{parts[4]}"
                if repo in hub.repos:
                    return self._reply(200, {"id": repo, "private": hub.repos[repo]["visibility"] == "private",
                                             "sha": "a" * 40})
                return self._reply(404, {"error": "Repository not found"})
            self._reply(404, {"error": f"not in the stand-in: {self.path}"})

        def do_POST(self):
            body = self._body()
            hub.requests.append(("POST", self.path, dict(self.headers), body))
            path = self.path.split("?")[0]
            if hub.fail_status:
                return self._reply(hub.fail_status, {"error": "Invalid credentials in Authorization header"})
            if path == "/api/validate-yaml":  # upload_folder has the Hub check README.md's front matter
                hub.validated.append(json.loads(body)["content"])
                return self._reply(200, {"errors": [], "warnings": []})
            if path == "/api/repos/create":
                req = json.loads(body)
                repo = f"{req['organization']}/{req['name']}" if req.get("organization") else req["name"]
                url = f"http://{self.headers['Host']}/{repo}"
                if repo in hub.repos:  # the Hub keeps an existing repo as it is
                    return self._reply(409, {"error": "You already created this model repo", "url": url})
                hub.repos[repo] = {"visibility": req.get("visibility"), "files": {}}
                return self._reply(200, {"url": url})
            parts = path.split("/")  # /api/models/ORG/NAME/{preupload,commit}/REV
            if len(parts) == 7 and parts[:3] == ["", "api", "models"] and parts[5] == "preupload":
                files = json.loads(body)["files"]
                return self._reply(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                                   for f in files]})
            if len(parts) == 7 and parts[:3] == ["", "api", "models"] and parts[5] == "commit":
                repo = f"{parts[3]}/{parts[4]}"
                for line in body.splitlines():
                    item = json.loads(line)
                    if item["key"] == "file":
                        v = item["value"]
                        assert v["encoding"] == "base64"
                        hub.repos[repo]["files"][v["path"]] = base64.b64decode(v["content"])
                return self._reply(200, {"commitUrl": f"http://{self.headers['Host']}/{repo}/commit/abc",
                                         "commitOid": "a" * 40, "pullRequestUrl": None})
            return self._reply(404, {"error": f"not in the stand-in: {path}"})

    return H


@pytest.fixture
def fake_hub(monkeypatch):
    """Start the stand-in; point HF_ENDPOINT at it and HF_TOKEN at the test token."""

    def start(fail_status: int | None = None) -> FakeHub:
        hub = FakeHub(fail_status)
        server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)  # a test environment may set it
        return hub

    servers: list = []
    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


def _model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama"}\n')
    (d / "model.safetensors").write_bytes(bytes(range(256)) * 4)
    (d / "README.md").write_text("---\nlibrary_name: mlx\n---\n\n# card\n")
    return d


def test_upload_creates_a_private_repo_with_the_files_and_sends_the_token_only_as_a_header(tmp_path, fake_hub):
    hub = fake_hub()
    d = _model_dir(tmp_path)
    url = upload_model(d, "org/tiny")
    assert url.endswith("/org/tiny")
    assert hub.repos["org/tiny"]["visibility"] == "private"
    files = hub.repos["org/tiny"]["files"]
    assert set(files) == {"config.json", "model.safetensors", "README.md"}
    for name, data in files.items():
        assert data == (d / name).read_bytes()
    assert hub.validated == [(d / "README.md").read_text()]
    assert hub.requests
    for method, path, headers, body in hub.requests:
        auth = {k.lower(): v for k, v in headers.items()}.get("authorization")
        assert auth == f"Bearer {TOKEN}"
        assert TOKEN not in path and TOKEN.encode() not in body
        assert TOKEN not in "".join(v for k, v in headers.items() if k.lower() != "authorization")
    assert not any(TOKEN.encode() in p.read_bytes() for p in tmp_path.rglob("*") if p.is_file())


def test_public_flag_makes_a_public_repo(tmp_path, fake_hub):
    hub = fake_hub()
    upload_model(_model_dir(tmp_path), "org/open", public=True)
    assert hub.repos["org/open"]["visibility"] == "public"


def test_an_existing_public_repo_is_refused_without_public(tmp_path, fake_hub):
    """create_repo keeps an existing repo's visibility, so a private-by-default upload into a public
    repo would publish the model: it is refused before any file is sent, and --public allows it."""
    hub = fake_hub()
    hub.repos["org/open"] = {"visibility": "public", "files": {}}
    d = _model_dir(tmp_path)
    with pytest.raises(UserError) as e:
        upload_model(d, "org/open")
    msg = str(e.value)
    assert "\n" not in msg and "org/open" in msg and "public" in msg and "--public" in msg
    assert hub.repos["org/open"]["files"] == {}
    assert not any("/commit/" in path or "/preupload/" in path for _, path, _, _ in hub.requests)
    upload_model(d, "org/open", public=True)
    assert set(hub.repos["org/open"]["files"]) == {"config.json", "model.safetensors", "README.md"}


def test_an_existing_private_repo_gets_the_upload(tmp_path, fake_hub):
    hub = fake_hub()
    hub.repos["org/mine"] = {"visibility": "private", "files": {}}
    upload_model(_model_dir(tmp_path), "org/mine")
    assert hub.repos["org/mine"]["visibility"] == "private"
    assert set(hub.repos["org/mine"]["files"]) == {"config.json", "model.safetensors", "README.md"}


def test_hidden_leftovers_are_not_uploaded(tmp_path, fake_hub):
    """An interrupted atomic write leaves hidden temporaries beside the model; they stay local."""
    hub = fake_hub()
    d = _model_dir(tmp_path)
    (d / ".ggml-model-f16.gguf.tmp-123.tmp.gguf").write_bytes(b"half a gguf")
    (d / ".README.md.tmp-456").write_text("stale")
    (d / "sub").mkdir()
    (d / "sub" / ".hidden").write_text("x")
    (d / "sub" / "kept.json").write_text("{}")
    upload_model(d, "org/tiny")
    assert set(hub.repos["org/tiny"]["files"]) == {"config.json", "model.safetensors", "README.md", "sub/kept.json"}
    upload_model(d, "org/tiny")  # the patterns hold on a second call too (huggingface_hub extends the list)
    assert set(hub.repos["org/tiny"]["files"]) == {"config.json", "model.safetensors", "README.md", "sub/kept.json"}


def test_public_without_a_repo_is_refused():
    from mlx_ssp.hub import check_upload

    with pytest.raises(UserError, match="--upload-repo"):
        check_upload(None, public=True)
    check_upload(None)  # nothing asked, nothing checked


def test_http_error_is_one_line_without_the_token(tmp_path, fake_hub):
    fake_hub(fail_status=401)
    with pytest.raises(UserError) as e:
        upload_model(_model_dir(tmp_path), "org/tiny")
    msg = str(e.value)
    assert "\n" not in msg and "HTTP 401" in msg and "org/tiny" in msg and TOKEN not in msg


def test_no_token_is_one_line(tmp_path, fake_hub, monkeypatch):
    hub = fake_hub()
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # no token file either
    monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(tmp_path / "hf_home" / "token"))
    monkeypatch.setattr(hf_constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "hf_home" / "stored_tokens"))
    with pytest.raises(UserError, match="HF_TOKEN"):
        upload_model(_model_dir(tmp_path), "org/tiny")
    assert hub.requests == []


@pytest.mark.parametrize("repo", ["noslash", "a/b/c", "bad name/x", "org/-x-"])
def test_bad_repo_ids_are_refused(repo):
    with pytest.raises(UserError):
        check_repo_id(repo)


def test_upload_section_validates_the_repo():
    from mlx_ssp.config import validate

    assert validate(UploadConfig, {"repo": "org/x"}).public is False
    with pytest.raises(UserError, match="upload"):
        validate(UploadConfig, {"repo": "not a repo"}, source="run.yaml", prefix="upload")
    with pytest.raises(UserError, match="publik"):
        validate(UploadConfig, {"repo": "org/x", "publik": True}, source="run.yaml", prefix="upload")


# ------------------------------------------------------------------ mlx_ssp merge --export-gguf --upload-repo


def test_merge_cli_writes_card_and_gguf_and_uploads_them(tmp_path, fake_hub):
    """A real merge of two tiny llama models: OUT_DIR gets our card (base_model taken from the inputs'
    own cards, the merge config as YAML), a GGUF file, and every file reaches the stand-in Hub."""
    import shutil

    import yaml
    from click.testing import CliRunner
    from gguf import GGUFReader
    from huggingface_hub import ModelCard

    from mlx_ssp.card import Card, write_card
    from mlx_ssp.cli import main
    from mlx_ssp.testing import make_tiny_model

    a = make_tiny_model(tmp_path / "a", arch="llama", num_layers=1)
    b = shutil.copytree(a, tmp_path / "b")
    for m in (a, b):  # inputs that are our own specialists of a Hub model
        write_card(m, Card("lora", ("SomeOrg/base-model",)))
    user_readme = (a / "README.md").read_bytes()
    cfg = tmp_path / "merge.yml"
    cfg.write_text(yaml.safe_dump({"merge_method": "linear", "models": [
        {"model": str(a), "parameters": {"weight": 0.5}}, {"model": str(b), "parameters": {"weight": 0.5}}]}))
    hub = fake_hub()
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["merge", str(cfg), str(out), "--quiet", "--export-gguf", "--upload-repo", "org/merged"])
    assert r.exit_code == 0, (r.output, r.exception)
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["uploaded"].endswith("/org/merged") and Path(res["gguf"]).parent == out
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model == "SomeOrg/base-model" and card.data.library_name == "mlx"
    assert {"mlx", "mlx_ssp", "merge"} <= set(card.data.tags) and card.data.pipeline_tag == "text-generation"
    assert "merge_method: linear" in card.text and "- `a` (a local directory)" in card.text
    readme = (out / "README.md").read_text()
    assert str(tmp_path) not in readme and str(tmp_path) not in hub.validated[0]  # nor what the Hub got
    assert str(a) in (out / "mergekit_config.yml").read_text()  # the local copy reruns the merge as it was
    assert (a / "README.md").read_bytes() == user_readme  # an input's card is never rewritten
    assert GGUFReader(out / "ggml-model-f16.gguf").tensors
    files = hub.repos["org/merged"]["files"]
    assert hub.repos["org/merged"]["visibility"] == "private"
    assert set(files) == {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "README.md",
                                                             "mergekit_config.yml", "ggml-model-f16.gguf"}
    assert all(files[n] == (out / n).read_bytes() for n in files)
    assert not any(TOKEN.encode() in p.read_bytes() for p in tmp_path.rglob("*") if p.is_file())


def test_merge_cli_refuses_gguf_of_an_unsupported_architecture_before_merging(tmp_path):
    import shutil

    import yaml
    from click.testing import CliRunner

    from mlx_ssp.cli import main
    from mlx_ssp.testing import make_tiny_model

    a = make_tiny_model(tmp_path / "a", arch="qwen3", num_layers=1)
    b = shutil.copytree(a, tmp_path / "b")
    cfg = tmp_path / "merge.yml"
    cfg.write_text(yaml.safe_dump({"merge_method": "linear", "models": [
        {"model": str(a), "parameters": {"weight": 1.0}}, {"model": str(b), "parameters": {"weight": 1.0}}]}))
    r = CliRunner().invoke(main, ["merge", str(cfg), str(tmp_path / "out"), "--quiet", "--export-gguf"])
    assert r.exit_code == 2
    assert "qwen3" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_sft_upload_needs_one_domain_and_stops_before_training(tmp_path, monkeypatch):
    import yaml
    from click.testing import CliRunner

    from mlx_ssp.cli import main

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({"run_dir": str(tmp_path / "run"), "model": str(tmp_path / "no-model"),
                                   "sft": {"domains": {"math": {"data": "x"}, "code": {"data": "y"}}}}))
    r = CliRunner().invoke(main, ["sft", str(run), "--upload-repo", "org/spec"])
    assert r.exit_code == 2 and "--domain" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_run_upload_repo_is_checked_at_load(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from mlx_ssp.cli import main

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    cfg = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
    r = CliRunner().invoke(main, ["run", str(cfg), "--set", f"run_dir={tmp_path / 'run'}", "--upload-repo", "not a repo"])
    assert r.exit_code == 2 and "upload.repo" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------ mlx_ssp rl --upload-repo


def _rl_run_file(tmp_path: Path, policy: Path, **rl) -> Path:
    import yaml

    from mlx_ssp.tasks import Task, write_tasks

    tasks = tmp_path / "tasks.jsonl"
    write_tasks(tasks, [Task(id=f"t{i}", domain="toy", prompt=f"What is {i} + 1?", answer=str(i + 1), verifier="exact")
                        for i in range(4)])
    run = {"model": str(policy), "seed": 0, "run_dir": str(tmp_path / "run"),
           "rl": {"tasks": str(tasks), "steps": 1, "batch_size": 2, "group_size": 2, "progress": False,
                  "sampling": {"max_tokens": 3}, **rl}}
    cfg = tmp_path / "rl.yaml"
    cfg.write_text(yaml.safe_dump(run))
    return cfg


@pytest.mark.slow
def test_rl_upload_fuses_beside_the_policy_not_over_it(tmp_path, fake_hub):
    """The policy is a pipeline's RL model, <run>/rl/model, and `mlx_ssp rl` writes to <run>/rl: the
    upload fuses into <run>/rl/fused and sends that, leaving the policy's files as they were."""
    import shutil

    from click.testing import CliRunner
    from huggingface_hub import ModelCard

    from mlx_ssp.cli import main
    from mlx_ssp.testing import make_tiny_model

    policy = tmp_path / "run" / "rl" / "model"
    shutil.copytree(make_tiny_model(tmp_path / "tiny", arch="llama", num_layers=1), policy)
    before = {p.name: p.read_bytes() for p in policy.iterdir() if p.is_file()}
    hub = fake_hub()
    r = CliRunner().invoke(main, ["rl", str(_rl_run_file(tmp_path, policy)), "--upload-repo", "org/rl"])
    assert r.exit_code == 0, (r.output, r.exception)
    assert {p.name: p.read_bytes() for p in policy.iterdir() if p.is_file()} == before
    fused = tmp_path / "run" / "rl" / "fused"
    assert json.loads(r.stdout.strip().splitlines()[-1])["uploaded"].endswith("/org/rl")
    files = hub.repos["org/rl"]["files"]
    assert set(files) == {p.name for p in fused.iterdir()} and all(files[n] == (fused / n).read_bytes() for n in files)
    card = ModelCard.load(fused / "README.md")
    assert "grpo" in card.data.tags and str(tmp_path) not in card.text


def test_rl_upload_refuses_to_fuse_over_the_policy_before_training(tmp_path, fake_hub):
    import shutil

    from click.testing import CliRunner

    from mlx_ssp.cli import main
    from mlx_ssp.testing import make_tiny_model

    policy = tmp_path / "elsewhere" / "fused"
    shutil.copytree(make_tiny_model(tmp_path / "tiny", arch="llama", num_layers=1), policy)
    hub = fake_hub()
    cfg = _rl_run_file(tmp_path, policy, output=str(tmp_path / "elsewhere"))
    r = CliRunner().invoke(main, ["rl", str(cfg), "--upload-repo", "org/rl"])
    assert r.exit_code == 2 and "rl.output" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "elsewhere" / "metrics.jsonl").exists() and hub.requests == []
