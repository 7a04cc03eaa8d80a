"""What OUT_DIR a merge may write, checked before the first byte is written.

A merge replaces OUT_DIR as a whole (built beside it, swapped in at the end), so a wrong OUT_DIR
deletes whatever it held. The rules:

1. OUT_DIR may never be, contain, or lie inside an input: a model directory, a LoRA adapter
   directory, a directory an input file really lives in (symlinks followed, e.g. a hub cache's
   blobs), and it may never be or contain an input file (the merge config). Paths are compared
   both as given (made absolute) and with symlinks resolved, so a symlink to an input, or a folder
   holding a symlink to one, is refused too.
2. OUT_DIR may never be or contain the working directory (``.`` would rename the cwd away).
3. An existing OUT_DIR is replaced only with ``overwrite``, and only when it is empty or a previous
   merge output (``mergekit_config.yml`` plus a shard whose header says ``merged_by: mlx_ssp``, and
   no subdirectory, whose contents a merge would never have written); anything else needs
   ``overwrite_any``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from mlx_ssp.errors import UserError
from mlx_ssp.merge.safetensors_io import read_header

#: the safetensors ``__metadata__`` entry every shard of a merge output carries
MARK_KEY, MARK_VALUE = "merged_by", "mlx_ssp"
CONFIG_NAME = "mergekit_config.yml"


@dataclass(frozen=True)
class Protected:
    """One input path the output must keep clear of; ``is_dir`` decides whether lying inside it
    counts (a file cannot hold OUT_DIR; the working directory may)."""

    path: Path
    what: str  # e.g. "input model demo", "the merge config"
    is_dir: bool = True


def _forms(p: Path) -> set[Path]:
    """The absolute path as given and the one with symlinks resolved."""
    p = Path(p).expanduser()
    return {Path(os.path.abspath(p)), p.resolve()}


def _relation(out: Path, item: Path, item_is_dir: bool) -> str | None:
    """How ``out`` collides with ``item`` (both absolute), or None."""
    if out == item:
        return "is"
    if out in item.parents:
        return "contains"
    if item_is_dir and item in out.parents:
        return "lies inside"
    return None


def check_clear_of_inputs(out_dir: Path, protected: Iterable[Protected]) -> None:
    """Rules 1 and 2: a UserError naming OUT_DIR and the input (or cwd) it collides with."""
    outs = _forms(out_dir)
    # OUT_DIR may lie inside the working directory, never be or hold it
    items = list(protected) + [Protected(Path.cwd(), "the working directory", is_dir=False)]
    for item in items:
        for form in sorted(_forms(item.path)):
            for out in sorted(outs):
                rel = _relation(out, form, item.is_dir)
                if rel is None:
                    continue
                shown = f" ({form})" if str(form) != str(item.path) else ""
                raise UserError(f"OUT_DIR {out_dir} {rel} {item.what} {item.path}{shown}; a merge replaces "
                                "OUT_DIR as a whole, so choose another output directory")


def is_merge_output(d: Path) -> bool:
    """True if ``d`` looks like what a merge writes (rule 3)."""
    try:
        entries = list(d.iterdir())
    except OSError:
        return False
    if any(e.is_dir() for e in entries) or not (d / CONFIG_NAME).is_file():
        return False
    shards = sorted(e for e in entries if e.name.endswith(".safetensors"))
    if not shards:
        return False
    try:
        header, _ = read_header(shards[0])
    except UserError:
        return False
    meta = header.get("__metadata__")
    return isinstance(meta, dict) and meta.get(MARK_KEY) == MARK_VALUE


def check_replaceable(out_dir: Path, *, overwrite: bool, overwrite_any: bool) -> None:
    """Rule 3, for an OUT_DIR that already exists."""
    out_dir = Path(out_dir)
    if not (out_dir.exists() or out_dir.is_symlink()):
        return
    if not (overwrite or overwrite_any):
        raise UserError(f"{out_dir} already exists; pass --overwrite to replace it")
    if not out_dir.is_dir():
        raise UserError(f"OUT_DIR {out_dir} exists and is not a directory; choose another output directory")
    if overwrite_any or not any(out_dir.iterdir()) or is_merge_output(out_dir):
        return
    raise UserError(f"OUT_DIR {out_dir} is not empty and is not a previous merge output (no {CONFIG_NAME} "
                    f"and mlx_ssp-merged shards, or it holds a subdirectory); --overwrite replaces only a "
                    "previous output: choose another directory, or pass --overwrite-any to delete its contents")


def check_out_dir(out_dir: Path, protected: Iterable[Protected], *, overwrite: bool = False,
                  overwrite_any: bool = False) -> None:
    """Every rule, before anything is written."""
    check_clear_of_inputs(out_dir, protected)
    check_replaceable(out_dir, overwrite=overwrite, overwrite_any=overwrite_any)
