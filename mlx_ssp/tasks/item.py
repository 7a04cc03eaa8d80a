"""What every task source produces before the domain's instruction and system prompt are applied:
:class:`Item` rows, drawn into the three splits in :data:`ORDER`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from mlx_ssp.errors import UserError
from mlx_ssp.io import iter_jsonl_numbered

ORDER = ("eval", "probe", "train")  # eval is drawn first: it stays fixed when train/probe change

#: the task metadata keys :func:`mlx_ssp.tasks._to_task` sets itself (``verifier``: it reads a row's
#: own verifier from there, then drops it); the file sources keep dataset columns off them
BUILDER_KEYS = ("verifier", "split", "source", "answer_extraction", "sandbox")


@dataclass
class Item:
    """One problem before the domain's instruction/system prompt are applied."""

    key: str  # id within the source (row index, task_id, BFCL id)
    prompt: Any  # str or chat messages
    answer: Any
    metadata: dict[str, Any]
    #: the item's own sub-domain: its task's domain is ``<domain>_<this>`` (BFCL multi-turn: the backend)
    domain: Optional[str] = None
    #: what makes two rows the same problem (deduplication); None: the prompt. An episode is its
    #: every turn and its initial state, not its first message.
    identity: Any = None

    def dedup_key(self) -> str:
        return json.dumps(self.prompt if self.identity is None else self.identity, sort_keys=True)


def read_rows(path: str) -> list[dict]:
    rows = [rec for _, rec in iter_jsonl_numbered(path, what="source")]
    if not rows:
        raise UserError(f"{Path(path).expanduser()}: no rows")
    return rows


def no_params(kind: str, params: dict) -> None:
    if params:
        raise UserError(f"source '{kind}' takes no params (got {', '.join(params)})")
