"""Experiment trackers: every metric the stages write to JSONL, sent also to TensorBoard, Weights &
Biases or Trackio (the run file's top-level ``report_to``, or ``--report-to`` on a stage command).

One sink for the process (:func:`session`, opened by ``mlx_ssp run`` and by each stage command) and
one call beside each metrics writer (:func:`log`). A namespace is a step axis: ``sft/<domain>`` (the
SFT step), ``rl`` (the RL step; ``rl/<phase>`` with phases), ``rollout``, ``eval``, ``merge``... A
stage never names its own stage: whoever runs it opens a :func:`scope` (``mlx_ssp run`` one per
stage, a stage command its own), so the same code logs ``sft/math/train_loss`` under ``mlx_ssp run``
and under ``mlx_ssp sft``, and ``distill/sft/...`` when self-distillation trains a student.

What is sent: the numbers of each record, nested mappings flattened with ``/``
(``overall/pass@1``); strings, lists, ``None``, NaN and infinities are left out; booleans count as
0/1. The run's config is the tracker run's parameters. Under ``mlx.launch`` rank 0 alone logs; a
missing package fails on every rank before any work, as one line naming the extra.

Each tracker is an adapter in :data:`TRACKERS` (the config's choices derive from it); its package is
imported only when chosen. Where files go (``dir``: the run directory for ``mlx_ssp run``, the
stage's output directory for a stage command):

- ``tensorboard``: event files in ``dir/tensorboard/<run name>/``;
- ``wandb``: ``dir/wandb/`` unless ``WANDB_DIR`` is set; ``WANDB_MODE``, ``WANDB_PROJECT`` and the
  other ``WANDB_*`` variables work as usual (project: the run directory's name);
- ``trackio``: trackio's local store (``TRACKIO_DIR``, default ``$HF_HOME/trackio``), project: the
  run directory's name.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import numbers
import os
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import yaml

from mlx_ssp.config import plain
from mlx_ssp.errors import UserError

#: the pip extra that installs every tracker package
EXTRA = "trackers"


class Sink(Protocol):
    """Where metrics go. ``namespace`` is a step axis (``sft/math``, ``rl``); ``metrics`` are
    already flat (``{"overall/pass@1": 0.5}``) and finite."""

    def log(self, namespace: str, metrics: dict[str, float], step: int) -> None: ...

    def log_params(self, params: dict) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class RunInfo:
    """What a tracker run is called and where its files go."""

    dir: Path  # tensorboard/ and wandb/ go in here
    project: str  # the run directory's name
    name: str  # the tracker run's name: the run file's ``name``, else "<command>-<date>-<time>"
    params: dict | None = None  # the run's config, for a tracker that takes it when the run starts


def tag(namespace: str, key: str) -> str:
    return f"{namespace}/{key}" if namespace else key


class _Adapter:
    """Base of the adapters: ``module`` is imported only when the tracker is chosen."""

    name = ""
    module = ""  # what to import
    package = ""  # what pip installs

    @classmethod
    def load(cls):
        """The tracker's module; its absence, or an install whose import breaks (a dependency
        missing or at a clashing version, e.g. protobuf), is a one-line UserError naming the extra."""
        try:
            return importlib.import_module(cls.module)
        except ImportError as e:
            name = getattr(e, "name", None)
            if isinstance(e, ModuleNotFoundError) and name is not None and (
                    cls.module == name or cls.module.startswith(name + ".")):
                raise UserError(f"report_to: {cls.name} needs the {cls.package} package: "
                                f'pip install -e ".[{EXTRA}]"') from None
            raise UserError(f"report_to: {cls.name}: importing {cls.module} failed ({type(e).__name__}: {e}); "
                            f'reinstall it: pip install -e ".[{EXTRA}]"') from None


class TensorBoardSink(_Adapter):
    """Event files (scalars as ``simple_value``, read by TensorBoard's scalar dashboard and every
    event-file reader) written with tensorboard's own writer, no TensorFlow or torch needed; the
    params go to the HParams dashboard and, as YAML, to the Text dashboard (``config``)."""

    name, module, package = "tensorboard", "tensorboard", "tensorboard"

    def __init__(self, info: RunInfo):
        self.load()  # lazy: an optional extra, and TensorBoard's import pulls in grpc and protobuf
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = event_pb2.Event, summary_pb2.Summary
        self.logdir = info.dir / "tensorboard" / info.name
        self.logdir.mkdir(parents=True, exist_ok=True)
        self._writer = EventFileWriter(str(self.logdir), flush_secs=10)

    def _write(self, summary, step: int) -> None:
        self._writer.add_event(self._event(wall_time=time.time(), step=step, summary=summary))

    def log(self, namespace: str, metrics: dict[str, float], step: int) -> None:
        values = [self._summary.Value(tag=tag(namespace, k), simple_value=v) for k, v in metrics.items()]
        self._write(self._summary(value=values), step)

    def log_params(self, params: dict) -> None:
        from tensorboard.plugins.hparams.summary_v2 import hparams_pb  # lazy: the optional extra
        from tensorboard.plugins.text.summary_v2 import text_pb

        flat = {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in flatten_params(params).items()}
        self._write(hparams_pb(flat), 0)
        try:
            text = yaml.safe_dump(params, sort_keys=False)
        except yaml.YAMLError:  # a value YAML cannot write: JSON with its str()
            text = json.dumps(params, indent=2, default=str) + "\n"
        self._write(text_pb("config", "```\n" + text + "```"), 0)

    def close(self) -> None:
        self._writer.close()


class WandbSink(_Adapter):
    """A Weights & Biases run. Every namespace gets its own x axis (``<namespace>/step``, through
    ``define_metric``): W&B's own step must only grow, and the stages' steps start again at each
    domain, phase and stage."""

    name, module, package = "wandb", "wandb", "wandb"

    def __init__(self, info: RunInfo):
        wandb = self.load()  # lazy: an optional extra that starts a service process
        where = Path(os.environ.get("WANDB_DIR") or info.dir)  # passed, not left to wandb: its settings
        where.mkdir(parents=True, exist_ok=True)  # are read once per process
        kw = {"project": os.environ.get("WANDB_PROJECT") or info.project, "name": info.name, "dir": str(where)}
        try:
            self.run = wandb.init(**kw)
        except Exception as e:  # noqa: BLE001 - not logged in, no network...: one line, with the way out
            raise UserError(f"report_to: wandb could not start a run ({type(e).__name__}: {e}); log in "
                            "(wandb login, WANDB_API_KEY) or set WANDB_MODE=offline") from None
        self._defined: set[str] = set()

    def log(self, namespace: str, metrics: dict[str, float], step: int) -> None:
        axis = tag(namespace, "step")
        row = {tag(namespace, k): v for k, v in metrics.items()}
        for key in row:
            if key not in self._defined:
                self.run.define_metric(key, step_metric=axis)
                self._defined.add(key)
        self.run.log({**row, axis: step})

    def log_params(self, params: dict) -> None:
        self.run.config.update(params, allow_val_change=True)

    def close(self) -> None:
        self.run.finish()


class TrackioSink(_Adapter):
    """A Trackio run in its local store. Trackio prints its banners on stdout, where some commands
    print their JSON result: they go to stderr. The params go to ``trackio.init`` (``config``); no
    GPU sampling thread (``auto_log_gpu=False``, where the installed trackio has it): the stages'
    metrics only."""

    name, module, package = "trackio", "trackio", "trackio"

    def __init__(self, info: RunInfo):
        self.trackio = self.load()  # lazy: an optional extra with a web stack behind it
        self._params = info.params
        kw: dict[str, Any] = {"config": info.params}
        if "auto_log_gpu" in inspect.signature(self.trackio.init).parameters:  # newer than trackio 0.5
            kw["auto_log_gpu"] = False
        try:
            with redirect_stdout(sys.stderr):
                self.run = self.trackio.init(project=info.project, name=info.name, embed=False, **kw)
        except ValueError as e:  # e.g. a project name trackio reserves
            raise UserError(f"report_to: trackio: {e}") from None

    def log(self, namespace: str, metrics: dict[str, float], step: int) -> None:
        self.run.log({tag(namespace, k): v for k, v in metrics.items()}, step=step)

    def log_params(self, params: dict) -> None:
        if params is not self._params:  # those are already the run's config (given to init)
            self.run.config.update(params)

    def close(self) -> None:
        with redirect_stdout(sys.stderr):
            self.trackio.finish()


#: name -> adapter; ``report_to``'s choices are ``none`` and these
TRACKERS: dict[str, type] = {a.name: a for a in (TensorBoardSink, WandbSink, TrackioSink)}


def choices() -> list[str]:
    return ["none", *TRACKERS]


def parse_report_to(value: Any, source: str = "report_to") -> tuple[str, ...]:
    """``report_to`` as the tracker names, in order, once each: None, ``none``, a name, names
    separated by commas, or a list of those; ``none`` alone means no tracker."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(x, str) for x in items):
        raise UserError(f"{source}: report_to: a tracker name or a list of them; valid: {', '.join(choices())} "
                        f"(got {value!r})")
    names = [n.strip() for x in items for n in x.split(",") if n.strip()]
    for n in names:
        if n not in TRACKERS and n != "none":
            raise UserError(f"{source}: report_to: unknown tracker '{n}'; valid: {', '.join(choices())}")
    if "none" in names and len(set(names)) > 1:
        raise UserError(f"{source}: report_to: 'none' cannot go with trackers ({', '.join(names)})")
    return tuple(dict.fromkeys(n for n in names if n != "none"))


def from_cli(values: Sequence[str]) -> tuple[str, ...] | None:
    """``--report-to`` (repeatable, comma-separated): the trackers, or None when not given."""
    return parse_report_to(list(values), "--report-to") if values else None


# -- what is sent ------------------------------------------------------------------------------------


def flatten(metrics: Mapping, prefix: str = "") -> dict[str, float]:
    """The finite numbers of ``metrics`` (nested mappings joined with ``/``; booleans as 0/1)."""
    out: dict[str, float] = {}
    for k, v in metrics.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "/"))
        elif isinstance(v, numbers.Real):  # bool, int, float, numpy scalars
            f = float(v)
            if math.isfinite(f):
                out[key] = f
    return out


def flatten_params(params: Mapping, prefix: str = "") -> dict[str, Any]:
    """Nested config -> ``{"sft.lora.rank": 8, ...}`` (lists and None kept as values)."""
    out: dict[str, Any] = {}
    for k, v in params.items():
        if isinstance(v, Mapping) and v:
            out.update(flatten_params(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def without(record: Mapping, *keys: str) -> dict:
    """``record`` less ``keys`` (a summary's settings: its sampling, its seed)."""
    return {k: v for k, v in record.items() if k not in keys}


# -- the process's sink --------------------------------------------------------------------------------


class _Fanout:
    def __init__(self, sinks: list):
        self.sinks = sinks

    def log(self, namespace: str, metrics: dict[str, float], step: int) -> None:
        for s in self.sinks:
            s.log(namespace, metrics, step)

    def log_params(self, params: dict) -> None:
        for s in self.sinks:
            s.log_params(params)

    def close(self) -> None:
        error = None
        for s in self.sinks:
            try:
                s.close()
            except Exception as e:  # noqa: BLE001 - close the others, then raise the first
                error = error or e
        if error is not None:
            raise error


_active: _Fanout | None = None
_scope: list[str] = []


def active() -> bool:
    return _active is not None


def log(namespace: str, metrics: Mapping, step: int) -> None:
    """Send ``metrics`` (flattened, finite numbers only; a ``step`` key is the axis, not a metric)
    at ``step`` under the current scope's ``namespace`` to every open tracker; nothing when none is
    open (or on ranks other than 0)."""
    if _active is None:
        return
    flat = flatten(without(metrics, "step"))
    if flat:
        _active.log("/".join(p for p in (*_scope, namespace) if p), flat, int(step))


@contextmanager
def scope(name: str) -> Iterator[None]:
    """Namespaces logged inside the block start with ``name`` (scopes nest)."""
    _scope.append(name)
    try:
        yield
    finally:
        _scope.pop()


@contextmanager
def session(report_to: Iterable[str], *, dir: str | Path, project: str, command: str,
            name: Any = None, params: dict | None = None, scope_name: str | None = None) -> Iterator[None]:
    """Open the chosen trackers for the block (rank 0; every rank first checks that their packages
    import), log ``params``, close them at the end. ``name``: the tracker run's name (default
    ``<command>-<date>-<time>``); ``scope_name``: the block's namespace (a stage command's stage)."""
    global _active
    adapters = [TRACKERS[n] for n in report_to]
    if not adapters:
        yield
        return
    # lazy: every command imports this module (--report-to); only trackers need distributed (mlx.nn, collectives)
    from mlx_ssp import distributed as dist

    if _active is not None:
        raise RuntimeError("a tracker session is already open in this process")
    for a in adapters:  # on every rank: a missing package stops them all, before any work
        a.load()
    info = RunInfo(dir=Path(dir), project=project,
                   name=str(name) if name else f"{command}-{time.strftime('%Y%m%d-%H%M%S')}", params=params)

    def start() -> _Fanout | None:
        if not dist.is_main():
            return None
        sinks: list = []
        try:
            for a in adapters:
                sinks.append(a(info))
            fan = _Fanout(sinks)
            if params:
                fan.log_params(params)
        except BaseException:
            _Fanout(sinks).close()
            raise
        return fan

    sink = dist.run_on_main(start, what="report_to: start the trackers")  # an error there stops every rank
    _active = sink if dist.is_main() else None
    ok = False
    try:
        with scope(scope_name) if scope_name else nullcontext():
            yield
        ok = True
    finally:
        _active = None
        if sink is not None:
            try:
                sink.close()
            except Exception as e:  # the block's own error matters more
                if ok:
                    raise
                print(f"warning: report_to: closing the trackers failed: {e}", file=sys.stderr)


def for_stage(st, cli: tuple[str, ...] | None, *, command: str, dir: str | Path, section: str | None = None):
    """:func:`session` for a stage command: ``--report-to`` (``cli``) beats the run file's
    ``report_to``; the run's config (``section`` and ``model`` with their defaults filled in) as
    the params; the files in ``dir`` (the stage's output directory); namespace ``command``."""
    names = cli if cli is not None else st.report_to
    params = None
    if names:
        params = {**st.data, "run_dir": str(st.run_dir), "seed": st.seed}
        if section is not None and st.cfg is not None:
            params[section] = plain(st.cfg)
        if st.model is not None:
            params["model"] = plain(st.model)
    return session(names, dir=dir, project=project_of(st.run_dir), command=command, name=st.data.get("name"),
                   params=params, scope_name=command)


def project_of(run_dir: str | Path) -> str:
    """The tracker project: the run directory's name."""
    return Path(run_dir).expanduser().resolve().name or "mlx_ssp"


__all__ = [
    "TRACKERS",
    "RunInfo",
    "Sink",
    "choices",
    "flatten",
    "for_stage",
    "from_cli",
    "log",
    "parse_report_to",
    "project_of",
    "scope",
    "session",
    "without",
]
