"""Token records: whole conversations as token ids with a per-token training mask (multi-turn SFT).

A record is one JSON line ``{"token_ids": [...], "mask": [...], ...}``: ``token_ids`` is the whole
conversation exactly as the model saw it (prompt, every assistant turn, tool results, user turns),
``mask`` is 1 on the tokens the model produced (the training targets: each assistant turn's text,
its tool calls and its end-of-message token) and 0 elsewhere. Other keys (``messages``, ``source``,
``task_id``) are for humans and for the counts, not for training.

Algorithm of :func:`load_token_records`: every line is checked (ids are non-negative ints below the
vocabulary size, the mask is 0/1 of the same length, at least one target after the first token);
then each record is cut to ``max_seq_length`` tokens (the tokens beyond are dropped with their
mask), and a record left with no target is dropped. The counts (records truncated, records dropped,
target tokens lost) are returned and warned about once.
"""

from __future__ import annotations

import warnings
from collections import Counter
from pathlib import Path
from typing import Optional

from mlx_ssp.errors import UserError


def is_token_record(rec: dict) -> bool:
    return "token_ids" in rec and "mask" in rec


class TokenDataset:
    """``(token_ids, mask)`` items; ``itemlen`` lets a length sort avoid building items."""

    def __init__(self, items: list[tuple[list[int], list[int]]]):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[list[int], list[int]]:
        return self.items[i]

    def itemlen(self, i: int) -> int:
        return len(self.items[i][0])


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # JSON true is not a token id


def check_token_record(where: str, rec: dict, vocab_size: Optional[int]) -> tuple[list[int], list[int]]:
    """The record's ``(token_ids, mask)``, or a UserError naming ``where`` (file:line)."""
    ids, mask = rec["token_ids"], rec["mask"]
    if not isinstance(ids, list) or not ids:
        raise UserError(f"{where}: 'token_ids' must be a non-empty list of ints")
    if not isinstance(mask, list):
        raise UserError(f"{where}: 'mask' must be a list of 0/1")
    if len(ids) != len(mask):
        raise UserError(f"{where}: 'token_ids' has {len(ids)} entries but 'mask' has {len(mask)}; they must be equal")
    for i, t in enumerate(ids):
        # an id past the embedding table is not caught by MLX's gather: it would train on garbage
        if not _is_int(t) or t < 0 or (vocab_size is not None and t >= vocab_size):
            lim = f" below the vocabulary size {vocab_size}" if vocab_size is not None else ""
            raise UserError(f"{where}: token_ids[{i}] = {t!r} is not a non-negative int{lim} "
                            "(made with another tokenizer?)")
    for i, m in enumerate(mask):
        if not _is_int(m) or m not in (0, 1):
            raise UserError(f"{where}: mask[{i}] = {m!r}; the mask holds only 0 and 1")
    # the first token is never predicted (nothing precedes it), so a target must come after it
    if not any(mask[1:]):
        raise UserError(f"{where}: the mask has no 1 after the first token (nothing to train on)")
    return ids, mask


def _vocab_size(tokenizer) -> Optional[int]:
    for obj in (tokenizer, getattr(tokenizer, "_tokenizer", None)):
        try:
            return len(obj)
        except TypeError:
            continue
    return None


def load_token_records(path: Path, recs: list[tuple[int, dict]], tokenizer, *, max_seq_length: int):
    """``(TokenDataset, stats)`` of the checked, truncated records (see the module docstring)."""
    vocab = _vocab_size(tokenizer)
    items: list[tuple[list[int], list[int]]] = []
    n_tokens = n_targets = lost = 0
    truncated: list[int] = []
    dropped: list[int] = []
    sources: Counter = Counter()
    for lineno, rec in recs:
        ids, mask = check_token_record(f"{path}:{lineno}", rec, vocab)
        if len(ids) > max_seq_length:
            truncated.append(lineno)
            lost += sum(mask[max_seq_length:])
            ids, mask = ids[:max_seq_length], mask[:max_seq_length]
            if not any(mask[1:]):  # every target was past the cut
                dropped.append(lineno)
                continue
        items.append((list(ids), list(mask)))
        n_tokens += len(ids)
        n_targets += sum(mask[1:])
        sources[str(rec.get("source", "unknown"))] += 1
    if not items:
        raise UserError(f"{path}: every record's targets lie past max_seq_length={max_seq_length}; raise it")
    if truncated:
        warnings.warn(
            f"{path}: {len(truncated)} record(s) longer than max_seq_length={max_seq_length} truncated "
            f"(first at line {truncated[0]}), {lost} target token(s) lost, {len(dropped)} record(s) dropped "
            "with no target left; raise sft.max_seq_length to keep them",
            stacklevel=3,
        )
    stats = {"records": len(items), "dropped": len(dropped), "tokens": n_tokens, "truncated": len(truncated),
             "format": "tokens", "target_tokens": n_targets, "target_tokens_lost": lost, "sources": dict(sources)}
    return TokenDataset(items), stats
