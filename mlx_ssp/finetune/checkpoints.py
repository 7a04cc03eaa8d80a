"""The checkpoint layout both trainers write and resume from.

``<run>/checkpoints/<name>/`` holds ``adapters.safetensors`` (the trained weights),
``adapter_config.json``, ``optimizer.safetensors`` and ``state.json`` (written last in an atomic
directory, so a directory with ``state.json`` is complete). Both stages name a checkpoint with
:func:`checkpoint_dir` (``step_0000050``, :data:`NAME`) and, after writing one, call
:func:`trim_optimizer_states`: only the newest checkpoint is a resume point, so older ones keep
their weights but not their optimizer state. :func:`step_of` also reads the names earlier runs
wrote (SFT ``0000050``, RL ``step_000050``), so those runs still resume, list and fuse.
Resume checks the optimizer-state keys against the fresh optimizer and the saved config
fingerprint against the current one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from mlx_ssp.errors import UserError
from mlx_ssp.io import atomic_dir, iter_jsonl, repair_jsonl_tail, write_json_atomic, write_jsonl_atomic

ADAPTER_FILE = "adapters.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
NAME = "step_{:07d}"


def checkpoint_dir(root: Path, step: int) -> Path:
    """Where the checkpoint of ``step`` is written under ``root`` (``<run>/checkpoints``)."""
    return root / NAME.format(step)


def step_of(name: str) -> Optional[int]:
    """The step a checkpoint directory name encodes (``step_0000050``; earlier runs' ``0000050``
    and ``step_000050``), else None."""
    digits = name[5:] if name.startswith("step_") else name
    return int(digits) if digits.isdigit() else None


def list_checkpoints(root: Path) -> list[Path]:
    """The complete checkpoints under ``root`` (``<run>/checkpoints``), oldest step first."""
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if p.is_dir() and step_of(p.name) is not None and (p / "state.json").is_file()]
    return sorted(done, key=lambda p: step_of(p.name))


def find_checkpoint(root: Path, step: int) -> Path:
    """The complete checkpoint of ``step`` under ``root``, whichever name wrote it."""
    found = [p for p in list_checkpoints(root) if step_of(p.name) == step]
    if not found:
        raise UserError(f"{root}: no complete checkpoint of step {step}")
    return found[-1]


def write_checkpoint(path: Path, weights: dict, adapter_cfg: dict, opt_state: dict, state: dict) -> None:
    """One checkpoint directory, written atomically (replaces an existing one)."""
    import mlx.core as mx

    with atomic_dir(path, overwrite=True) as tmp:
        mx.save_safetensors(str(tmp / ADAPTER_FILE), weights)
        write_json_atomic(tmp / "adapter_config.json", adapter_cfg)
        mx.save_safetensors(str(tmp / OPTIMIZER_FILE), opt_state)
        write_json_atomic(tmp / "state.json", state)


def trim_optimizer_states(root: Path, step: int) -> None:
    """After writing the checkpoint of ``step``: drop the optimizer states (the bulk of a checkpoint
    with Adam) of the older checkpoints, since a resume starts from the newest one only."""
    for p in list_checkpoints(root):
        if step_of(p.name) < step:
            (p / OPTIMIZER_FILE).unlink(missing_ok=True)


def load_adapter_weights(model, ckpt: Path) -> None:
    import mlx.core as mx

    model.load_weights(list(mx.load(str(ckpt / ADAPTER_FILE)).items()), strict=False)


def load_optimizer_state(optimizer, model, ckpt: Path, *, hint: str) -> None:
    """Put the saved optimizer state into ``optimizer`` (initialised on the model's trainable
    parameters); a missing file or different state keys is a UserError ending in ``hint``."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map_with_path

    opt_file = ckpt / OPTIMIZER_FILE
    if not opt_file.is_file():
        raise UserError(f"{ckpt}: the optimizer state is missing, cannot resume ({hint})")
    saved = mx.load(str(opt_file))
    optimizer.init(model.trainable_parameters())
    if set(dict(tree_flatten(optimizer.state))) != set(saved):
        raise UserError(f"{opt_file}: the optimizer state does not match this model/config ({hint})")
    optimizer.state = tree_map_with_path(lambda path, _: saved[path], optimizer.state)


def check_fingerprint(old: dict, new: dict, *, where: Path, hint: str) -> None:
    """Stop when a saved fingerprint ``old`` differs from ``new`` in any key (a resume would mix two runs)."""
    changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    if changed:
        raise UserError(f"{where} holds a run with different settings ({', '.join(changed)}); {hint}")


def trim_metrics(path: Path, step: int) -> None:
    """On resume, drop metric rows of steps after the checkpoint (they will be redone)."""
    if path.is_file():
        repair_jsonl_tail(path)  # a kill mid-write leaves a torn last row
        rows = [r for r in iter_jsonl(path, what="metrics") if int(r.get("step", 0)) <= step]
        write_jsonl_atomic(path, rows)
