"""Upload a model directory to the Hugging Face Hub (``--upload-repo ORG/NAME``; ``upload:`` in a run file).

Through huggingface_hub's ``HfApi``: ``create_repo(private=..., exist_ok=True)`` then one
``upload_folder`` commit (as ``mlx_lm fuse --upload-repo`` does, with ``upload_folder`` instead of
``upload_large_folder`` so the upload is one commit). New repos are private unless ``public`` is
set; the Hub keeps an existing repo's visibility, so an existing public repo is refused unless
``public`` is set (:func:`check_visibility`). Hidden files (:data:`IGNORE_PATTERNS`: our atomic
writes' leftovers such as ``.README.md.tmp-*``) are never sent. The token is huggingface_hub's own lookup
(``HF_TOKEN``, else the file ``hf auth login`` writes), sent only as the request's
``Authorization`` header: mlx_ssp never writes it to a config, card or log. The endpoint is read
from ``HF_ENDPOINT`` when the upload starts (huggingface_hub reads it once, at import).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from pydantic import field_validator

from mlx_ssp.config import StrictModel
from mlx_ssp.errors import UserError

#: what upload_folder leaves out: hidden files and directories at any depth (huggingface_hub matches
#: with fnmatch, whose ``*`` crosses ``/``: ``.*`` is a hidden top-level entry and everything under it,
#: ``**/.*`` anything below a hidden name further down), e.g. the ``.NAME.tmp-*`` files an interrupted
#: atomic write leaves beside the model
IGNORE_PATTERNS = (".*", "**/.*")


def check_repo_id(repo: str, what: str = "--upload-repo") -> str:
    """``repo`` if it is a Hub model repo id of the form ORG/NAME; else a one-line UserError."""
    # lazy: huggingface_hub loads its HTTP client (0.1 s); only a command that uploads gets here
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo)
    except HFValidationError as e:
        raise UserError(f"{what} {repo!r} is not a Hub repo id ({str(e).splitlines()[0]}); give ORG/NAME") from None
    if repo.count("/") != 1:
        raise UserError(f"{what} {repo!r}: give the repo as ORG/NAME (your user name or an organization, then the name)")
    return repo


class UploadConfig(StrictModel):
    """The run file's ``upload:`` section: where ``mlx_ssp run`` uploads its final model."""

    repo: Optional[str] = None  # ORG/NAME; None: no upload
    public: bool = False  # a new repo is private unless this is set

    @field_validator("repo")
    @classmethod
    def _repo_id(cls, v: Optional[str]) -> Optional[str]:
        if v is not None:
            try:
                check_repo_id(v, "upload.repo")
            except UserError as e:
                raise ValueError(str(e)) from None
        return v


def require_token() -> str:
    """huggingface_hub's token (``HF_TOKEN``, else the login file); a one-line UserError when there is
    none. Commands call it before their work, so a missing token stops them before a long run."""
    # lazy: huggingface_hub loads its HTTP client (0.1 s); only a command that uploads gets here
    from huggingface_hub import get_token

    token = get_token()
    if not token:
        raise UserError("no Hugging Face token for the upload: set HF_TOKEN (a write token) or run `hf auth login`")
    return token


def check_upload(repo: Optional[str], public: bool = False) -> None:
    """Before a command's work: the repo id and the token, when ``repo`` asks for an upload; ``public``
    without a repo is refused (it would do nothing, silently)."""
    if public and repo is None:
        raise UserError("--public needs --upload-repo ORG/NAME (it sets the visibility of the repo uploaded to)")
    if repo is not None:
        check_repo_id(repo)
        require_token()


def _one_line(text: str, token: str) -> str:
    line = next((s.strip() for s in str(text).splitlines() if s.strip()), "")
    return line.replace(token, "***") if token else line


def check_visibility(repo: str, private: Optional[bool], public: bool) -> None:
    """Refuse to upload into ``repo`` when the Hub does not say it is private and ``public`` was not
    asked for: ``create_repo`` keeps an existing repo as it is, so a private-by-default upload into
    an existing public repo would otherwise publish the model without anyone saying so."""
    if not public and private is not True:
        raise UserError(f"{repo} already exists on the Hub and is public; pass --public (upload.public: true in a "
                        "run file) to upload to it anyway, or choose another repo")


def upload_model(folder: str | Path, repo: str, *, public: bool = False) -> str:
    """Create ``repo`` (private unless ``public``; an existing one is kept, and refused when it is public
    and ``public`` is not set) and upload every file of ``folder`` but hidden ones in one commit.
    Returns the repo's URL. Any failure is a one-line UserError."""
    folder = Path(folder)
    check_repo_id(repo)
    if not (folder / "config.json").is_file():
        raise UserError(f"{folder} is not a model directory (no config.json); nothing to upload")
    token = require_token()
    # lazy: huggingface_hub loads its HTTP client (0.1 s); only a command that uploads gets here
    from huggingface_hub import HfApi

    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None, token=token)
    url = _hub_call(repo, token, lambda: api.create_repo(repo_id=repo, repo_type="model", private=not public,
                                                         exist_ok=True))
    if not public:
        info = _hub_call(repo, token, lambda: api.repo_info(repo_id=repo, repo_type="model"))
        check_visibility(repo, info.private, public)
    # a fresh list each call: upload_folder appends its own defaults to the list it is given
    _hub_call(repo, token, lambda: api.upload_folder(folder_path=str(folder), repo_id=repo, repo_type="model",
                                                     commit_message=f"Upload {folder.name} with mlx_ssp",
                                                     ignore_patterns=list(IGNORE_PATTERNS)))
    return str(url)


def _hub_call(repo: str, token: str, call):
    """``call()``, with any failure as a one-line UserError naming ``repo`` (never the token)."""
    # lazy: huggingface_hub loads its HTTP client (0.1 s); only a command that uploads gets here
    from huggingface_hub.utils import HfHubHTTPError

    try:
        return call()
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        hint = {401: " (the token is invalid)", 403: " (the token cannot write to this repo)"}.get(status, "")
        raise UserError(f"upload to {repo} failed: HTTP {status}{hint}: {_one_line(e, token)}") from None
    except Exception as e:  # the transport's own errors (httpx/requests), not HTTP statuses
        raise UserError(f"upload to {repo} failed: {type(e).__name__}: {_one_line(e, token)}") from None
