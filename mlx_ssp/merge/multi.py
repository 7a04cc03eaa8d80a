"""Several merges in one config (mergekit's ``mergekit-multimerge``): named intermediate merges
feeding a final one, run in dependency order, each cached by a fingerprint.

The format is mergekit 0.1.5's: a YAML stream of merge configs separated by ``---``. A merge with
``name: X`` is an intermediate, written to ``INTERMEDIATE_DIR/X``; a model reference equal to a
merge's name (in ``models``, ``base_model``, a slice's ``sources``, ``tokenizer_source`` or the
``tokenizer:`` section; ``X+adapter`` too) is that merge's output. The final merge, written to
OUT_DIR, is the unnamed one, or (every merge named) the one no other merge uses. Refused at load,
each with one line: two merges with one name, two unnamed merges, a reference that is neither a
merge nor a model, a cycle, and a merge that nothing uses besides the final one (one config makes
one model).

Each merge is the ordinary streaming merge (:func:`.engine.write_merge`, atomic). Its fingerprint
hashes the merge as written, the fingerprints of the merges it reads, the identity (path, size,
mtime) of every other input file, the shared options (seed, vocab_mismatch, shard size, tokenizer
copy) and the merger's version (mlx_ssp's, :data:`.engine.MERGER_VERSION`, mlx's); it is stored in
the output (:data:`STAMP`, written with it, so only a finished merge has one), with the config
file's path: OUT_DIR is replaced without ``--overwrite`` only when this config file wrote it. A
rerun keeps a merge whose stored fingerprint matches and redoes one whose fingerprint changed; a
changed merge changes the fingerprint of every merge downstream, so they are redone too. A killed
run leaves no finished-looking output (the atomic directory), so a rerun resumes after the last
finished merge.

Deviations from mergekit: the intermediate directory defaults to ``OUT_DIR.intermediates`` beside
OUT_DIR (mergekit requires ``--intermediate-dir``); a cached merge is recognised by its fingerprint,
not by a model file existing (mergekit's ``--lazy``), so an edited config is never served stale;
names must be usable as directory names.
"""

from __future__ import annotations

import copy
import json
import re
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import yaml

import mlx_ssp
import mlx.core as mx

from mlx_ssp.config import digest, load_yaml_documents, read_config_text, validate
from mlx_ssp.errors import UserError
from mlx_ssp.merge import torch_math
from mlx_ssp.merge.config import MergeConfig, check_parameter_names
from mlx_ssp.merge.engine import MERGER_VERSION, plan_merge, source_files, source_paths, write_merge, write_skeleton
from mlx_ssp.merge.outdir import Protected, check_clear_of_inputs, check_replaceable
from mlx_ssp.merge.plan import MergeJob
from mlx_ssp.merge.sources import Source
from mlx_ssp.models import names_a_model

#: the file in each merge's output holding its fingerprint
STAMP = "multimerge.json"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
#: ``tokenizer_source`` / ``tokenizer.source`` words that are not model references
_TOKENIZER_WORDS = ("base", "union")


@dataclass(frozen=True)
class Step:
    """One merge of the config: its name (None: the unnamed final merge), the document as written
    (without ``name``) and the names of the merges it reads."""

    name: Optional[str]
    data: dict
    deps: tuple[str, ...]
    label: str  # "FILE: merge 'X'", for messages


@dataclass(frozen=True)
class MultiMerge:
    """The merges in an order where each comes after every merge it reads; the final one last."""

    source: str
    steps: tuple[Step, ...]

    @property
    def final(self) -> Step:
        return self.steps[-1]


# ------------------------------------------------------------ loading


def read_merge_documents(path: str | Path) -> list[Any]:
    """The YAML documents of a merge config (one for a plain merge)."""
    return load_yaml_documents(read_config_text(path), str(path))


def is_multimerge(docs: list[Any]) -> bool:
    """Several documents, or one with a ``name``: a multimerge config."""
    return len(docs) > 1 or (len(docs) == 1 and isinstance(docs[0], dict) and "name" in docs[0])


def map_refs(data: dict, fn: Callable[[str], str]) -> dict:
    """A copy of a (validated) merge document with every model reference ``r`` replaced by ``fn(r)``."""
    out = copy.deepcopy(data)

    def sub(node: dict, key: str, skip: tuple[str, ...] = ()) -> None:
        if isinstance(node.get(key), str) and node[key] not in skip:
            node[key] = fn(node[key])

    for m in out.get("models") or []:
        sub(m, "model")
    sub(out, "base_model")
    for sl in out.get("slices") or []:
        for src in sl.get("sources") or []:
            sub(src, "model")
    sub(out, "tokenizer_source", _TOKENIZER_WORDS)
    tok = out.get("tokenizer") or {}
    sub(tok, "source", _TOKENIZER_WORDS)
    for entry in (tok.get("tokens") or {}).values():
        if isinstance(entry, dict):
            sub(entry, "source")
            if isinstance(entry.get("source"), dict):
                sub(entry["source"], "model")
    return out


def _split(ref: str) -> tuple[str, str]:
    """``X+adapter`` -> (``X``, ``+adapter``); a reference without an adapter -> (ref, "")."""
    head, plus, tail = ref.partition("+")
    return (head, plus + tail) if plus else (ref, "")


def load_multimerge(path: str | Path, docs: Optional[list[Any]] = None, *, check_models: bool = True) -> MultiMerge:
    """Validate every merge, find what each reads and order them; any problem is one line.
    ``check_models=False`` leaves out the check that every other reference names a model (an
    existing directory or a hub id): the config alone is checked, without its models."""
    source = str(path)
    docs = read_merge_documents(path) if docs is None else docs
    if not docs:
        raise UserError(f"{source}: no merge config in the file")
    steps: list[tuple[Optional[str], dict, str]] = []
    where_named: dict[Optional[str], int] = {}
    for i, doc in enumerate(docs, 1):
        if not isinstance(doc, dict):
            raise UserError(f"{source}: document {i} must be a mapping (a merge config), got {type(doc).__name__}")
        data = dict(doc)
        name = data.pop("name", None)
        if name is not None and (not isinstance(name, str) or not _NAME.match(name)):
            raise UserError(f"{source}: document {i}: name {name!r} must be letters, digits, '.', '_' or '-' "
                            "(it names the merge's directory)")
        if name in where_named:
            if name is None:
                raise UserError(f"{source}: documents {where_named[None]} and {i} both have no name; only the "
                                "final merge may be unnamed")
            raise UserError(f"{source}: two merges are named '{name}' (documents {where_named[name]} and {i})")
        where_named[name] = i
        label = f"{source}: merge '{name}'" if name else f"{source}: the final merge (document {i})"
        cfg = validate(MergeConfig, data, source=label)
        check_parameter_names(cfg, label)
        steps.append((name, data, label))
    names = [n for n, _, _ in steps if n is not None]
    built = []
    for name, data, label in steps:
        deps: list[str] = []

        def note(ref: str, label=label, deps=deps) -> str:
            head, _ = _split(ref)
            if ref in names or head in names:
                dep = ref if ref in names else head
                if dep not in deps:
                    deps.append(dep)
            elif check_models and not names_a_model(ref) and not names_a_model(head):
                raise UserError(f"{label}: model '{ref}' is neither a merge of this config "
                                f"({', '.join(names) or 'none named'}) nor an existing directory nor a hub repo id")
            return ref

        map_refs(data, note)
        built.append(Step(name, data, tuple(deps), label))
    return MultiMerge(source, _order(built, source))


def _order(steps: list[Step], source: str) -> tuple[Step, ...]:
    """Topological order (file order among independent merges), the final merge last; a cycle or a
    second merge that nothing uses is an error."""
    by_name = {s.name: s for s in steps}
    for s in steps:
        if s.name in s.deps:
            raise UserError(f"{source}: merge '{s.name}' reads its own output")
    done: list[Step] = []
    left = list(steps)
    while left:
        ready = [s for s in left if all(d in {x.name for x in done} for d in s.deps)]
        if not ready:
            raise UserError(f"{source}: merges {' -> '.join(_cycle(left, by_name))} form a cycle")
        done.append(ready[0])
        left.remove(ready[0])
    used = {d for s in steps for d in s.deps}
    sinks = [s for s in done if s.name not in used]
    unnamed = [s for s in done if s.name is None]
    final = unnamed[0] if unnamed else sinks[0]
    extra = [s.name for s in sinks if s is not final]
    if extra:
        why = ("the final merge is the unnamed one" if unnamed else
               "which is the final one? Leave its name out")
        raise UserError(f"{source}: merge(s) {', '.join(repr(n) for n in extra)} are used by no other merge, and "
                        f"{why}; a config makes one model")
    done.remove(final)
    return tuple(done + [final])


def _cycle(left: list[Step], by_name: dict) -> list[str]:
    """One cycle among ``left`` (each of them waits on another of them), as names, closed."""
    waiting = {s.name for s in left}
    s, path = left[0], []
    while s.name not in path:
        path.append(s.name)
        s = by_name[next(d for d in s.deps if d in waiting)]
    cyc = path[path.index(s.name):]
    return [repr(n) for n in cyc + [cyc[0]]]


# ------------------------------------------------------------ fingerprints


def default_intermediate_dir(out_dir: Path) -> Path:
    """``OUT_DIR.intermediates`` beside OUT_DIR (never inside it: a merge replaces OUT_DIR whole)."""
    out = Path(out_dir).expanduser().absolute()
    return out.with_name(out.name + ".intermediates")


def resolved(step: Step, outputs: dict[str, Path]) -> tuple[MergeConfig, str]:
    """The step's config with each merge name replaced by that merge's output directory, and its
    YAML (saved beside the output)."""
    def path_of(ref: str) -> str:
        head, tail = _split(ref)
        name = ref if ref in outputs else head if head in outputs else None
        # absolute: the saved config (mergekit_config.yml) must not depend on the working directory
        return ref if name is None else str(Path(outputs[name]).expanduser().absolute()) + ("" if name == ref else tail)

    data = map_refs(step.data, path_of)
    return validate(MergeConfig, data, source=step.label), yaml.safe_dump(data, sort_keys=False)


def file_identity(src: Source, model: bool = True) -> list[list]:
    """The files a source is read from (:func:`.engine.source_files`; with ``model`` False only its
    LoRA adapter's) with size and mtime."""
    out = []
    for f in sorted(source_files(src, model=model)):
        if f.is_file():
            st = f.stat()
            out.append([str(f), st.st_size, st.st_mtime_ns])
    return out


def fingerprint(step: Step, job: MergeJob, upstream: dict[str, str], merged_dirs: set[Path],
                options: dict) -> str:
    """Hash of the merge as written, its upstream merges' fingerprints, its other inputs' files and
    the options; ``merged_dirs``: the directories of this config's merges (identified by their
    fingerprints, not their files; an adapter read on one of them by its files)."""
    inputs = {}
    for s in job.sources:
        if s.path.resolve() not in merged_dirs:
            inputs[s.ref] = file_identity(s)
        elif s.adapter_path is not None:  # keyed without the merge's directory (a dry run's is temporary)
            inputs[f"+{s.adapter_path}"] = file_identity(s, model=False)
    # the merger's identity: MERGER_VERSION moves with every output change of the engine, mlx's
    # version with its kernels' rounding, the float32 math's backend (oneMKL or NumPy) with its last bits
    merger = {"mlx_ssp": mlx_ssp.__version__, "engine": MERGER_VERSION, "mlx": mx.__version__,
              "torch_math": torch_math.backend()}
    return digest({"merger": merger, "config": step.data, "upstream": {d: upstream[d] for d in step.deps},
                   "inputs": inputs, "options": options})


def _stamp(out_dir: Path) -> dict:
    """The :data:`STAMP` of a merge output ({}: none, or unreadable)."""
    try:
        data = json.loads((Path(out_dir) / STAMP).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def read_stamp(out_dir: Path) -> Optional[str]:
    """The fingerprint stored in a merge output (None: none, or unreadable)."""
    return _stamp(out_dir).get("fingerprint")


def _config_id(mm: MultiMerge) -> str:
    return str(Path(mm.source).expanduser().resolve())


def written_by(out_dir: Path, mm: MultiMerge) -> bool:
    """Whether ``out_dir`` is a finished merge of this config file (a rerun after an edit replaces
    it without ``--overwrite``; another config's output, as any other directory, needs it)."""
    return _stamp(out_dir).get("config") == _config_id(mm)


# ------------------------------------------------------------ running


@dataclass(frozen=True)
class Layout:
    """Where each merge is written: OUT_DIR for the final one, ``INTERMEDIATE_DIR/NAME`` for the rest."""

    out_dir: Path
    intermediate_dir: Path

    def target(self, mm: MultiMerge, step: Step) -> Path:
        return self.out_dir if step is mm.final else self.intermediate_dir / step.name

    def check(self, mm: MultiMerge) -> None:
        """Before any merge: OUT_DIR may not be, hold or lie inside the intermediate directory
        (replacing OUT_DIR would delete the intermediates, or an intermediate would replace it), and
        no merge's output may be, hold or lie inside a model directory any merge of the config reads
        (each merge checks its own inputs again when it is written)."""
        check_clear_of_inputs(self.out_dir, [Protected(self.intermediate_dir, "the intermediate directory")])
        names = {s.name for s in mm.steps}
        models: list[Protected] = []

        def note(ref: str) -> str:
            for spec in (ref, _split(ref)[0]):
                if spec not in names and Path(spec).expanduser().exists():
                    models.append(Protected(Path(spec).expanduser(), f"input model {spec}"))
            return ref

        for s in mm.steps:
            map_refs(s.data, note)
        for s in mm.steps:
            check_clear_of_inputs(self.target(mm, s), models)


def run_multimerge(mm: MultiMerge, layout: Layout, *, lazy: bool = True, overwrite: bool = False,
                   overwrite_any: bool = False, out_shard_size: int | str = "5GB", copy_tokenizer: bool = True,
                   seed: int = 0, vocab_mismatch: str = "error", progress: bool = True,
                   workers: Optional[int] = None, before_final: Optional[Callable[[MergeJob], None]] = None,
                   echo: Callable[[str], None] = lambda line: None) -> dict:
    """Run every merge in order, keeping each whose stored fingerprint matches (unless not
    ``lazy``). ``overwrite`` / ``overwrite_any`` apply to OUT_DIR (an OUT_DIR this command wrote
    before is replaced without them); an intermediate directory is only ever replaced when it is a
    previous merge output. ``before_final`` sees the final merge's plan before it is written."""
    layout.check(mm)
    # a foreign OUT_DIR is refused now, not after the intermediates were built
    check_replaceable(layout.out_dir, overwrite=overwrite or written_by(layout.out_dir, mm),
                      overwrite_any=overwrite_any)
    options = {"seed": seed, "vocab_mismatch": vocab_mismatch, "out_shard_size": out_shard_size,
               "copy_tokenizer": copy_tokenizer}  # what every merge shares, in each one's fingerprint
    merged_dirs = {layout.target(mm, s).resolve() for s in mm.steps}
    fps: dict[str, str] = {}
    merges = []
    for step in mm.steps:
        with naming(step):
            merges.append(_run_step(mm, step, layout, fps, merged_dirs, options, lazy=lazy, overwrite=overwrite,
                                    overwrite_any=overwrite_any, progress=progress, workers=workers,
                                    before_final=before_final, echo=echo))
    return {"out_dir": str(layout.out_dir), "intermediate_dir": str(layout.intermediate_dir), "merges": merges}


def _run_step(mm: MultiMerge, step: Step, layout: Layout, fps: dict, merged_dirs: set[Path], options: dict, *,
              lazy: bool, overwrite: bool, overwrite_any: bool, progress: bool, workers: Optional[int],
              before_final: Optional[Callable[[MergeJob], None]], echo: Callable[[str], None]) -> dict:
    """One merge of :func:`run_multimerge`: kept (its stored fingerprint matches) or merged."""
    target = layout.target(mm, step)
    cfg, text = resolved(step, {d: layout.target(mm, _step(mm, d)) for d in step.deps})
    job = plan_merge(cfg, vocab_mismatch=options["vocab_mismatch"], source_label=step.label)
    fp = fingerprint(step, job, fps, merged_dirs, options)
    fps[step.name] = fp
    name = step.name or "(final)"
    stamp = read_stamp(target)
    if lazy and stamp == fp:
        echo(f"merge {name}: unchanged (fingerprint {fp}), kept {target}")
        return {"name": name, "out_dir": str(target), "fingerprint": fp, "action": "kept"}
    final = step is mm.final
    if final and before_final is not None:
        before_final(job)
    why = "not built yet" if stamp is None else "changed" if stamp != fp else "--no-lazy"
    echo(f"merge {name}: {why}, merging into {target}")
    side = {STAMP: json.dumps({"name": step.name, "fingerprint": fp, "config": _config_id(mm)}, indent=2) + "\n"}
    res = write_merge(job, target, overwrite=(overwrite or written_by(target, mm)) if final else True,
                      overwrite_any=overwrite_any if final else False, out_shard_size=options["out_shard_size"],
                      copy_tokenizer=options["copy_tokenizer"], seed=options["seed"], config_text=text,
                      progress=progress, workers=workers, protect=(Path(mm.source),), side_files=side)
    return {"name": name, "fingerprint": fp, "action": "merged", **res}


@contextmanager
def naming(step: Step) -> Iterator[None]:
    """A UserError while planning or writing ``step`` names the merge (the engine's messages name
    tensors and models, not which merge of the config they came from)."""
    try:
        yield
    except UserError as e:
        if str(e).startswith(step.label):
            raise
        raise UserError(f"{step.label}: {e}") from None


def _step(mm: MultiMerge, name: str) -> Step:
    return next(s for s in mm.steps if s.name == name)


def dry_run(mm: MultiMerge, layout: Layout, *, lazy: bool = True, out_shard_size: int | str = "5GB",
            copy_tokenizer: bool = True, seed: int = 0, vocab_mismatch: str = "error") -> dict:
    """Plan every merge (all checks, as the run would) and write nothing but temporary skeletons:
    each intermediate is planned, then laid out as zero-filled sparse shards (headers only,
    :func:`.engine.write_skeleton`) that the merges reading it are planned on."""
    layout.check(mm)
    options = {"seed": seed, "vocab_mismatch": vocab_mismatch, "out_shard_size": out_shard_size,
               "copy_tokenizer": copy_tokenizer}  # what every merge shares, in each one's fingerprint
    fps: dict[str, str] = {}
    plans = []
    with tempfile.TemporaryDirectory(prefix="mlx_ssp-multimerge-") as tmp:
        skeletons = {s.name: Path(tmp) / s.name for s in mm.steps if s is not mm.final}
        shown = {str(p): n for n, p in skeletons.items()}
        skeleton_dirs = {p.resolve() for p in skeletons.values()}
        for step in mm.steps:
            target = layout.target(mm, step)
            cfg, _ = resolved(step, {d: skeletons[d] for d in step.deps})
            with naming(step):
                job = plan_merge(cfg, vocab_mismatch=vocab_mismatch, source_label=step.label)
                leaves = [s for s in job.sources if s.path.resolve() not in skeleton_dirs]
                check_clear_of_inputs(target, source_paths(leaves, (Path(mm.source),)))
            fps[step.name] = fp = fingerprint(step, job, fps, skeleton_dirs, options)
            keep = lazy and read_stamp(target) == fp
            plans.append({"name": step.name or "(final)", "out_dir": str(target), "method": cfg.merge_method,
                          "models": [_shown_ref(s.ref, shown) for s in job.sources], "tensors": len(job.plans),
                          "compute_dtypes": sorted({p.cd for p in job.plans}), "fingerprint": fp,
                          "action": "keep" if keep else "merge"})
            if step is not mm.final:
                write_skeleton(job, skeletons[step.name], out_shard_size=out_shard_size, copy_tokenizer=copy_tokenizer)
    return {"out_dir": str(layout.out_dir), "intermediate_dir": str(layout.intermediate_dir), "merges": plans}


def _shown_ref(ref: str, shown: dict[str, str]) -> str:
    head, tail = _split(ref)
    return shown.get(ref) or (shown[head] + tail if head in shown else ref)
