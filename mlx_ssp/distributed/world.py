"""The process group: the ``distributed:`` config, :func:`world` (initialised once, size 1 when not
launched), rank helpers, and the guarded ``mx.distributed.init`` (a watchdog process: init holds the GIL)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import mlx.core as mx
from pydantic import Field

import mlx_ssp  # noqa: F401  (OpenBLAS before mlx.core)
from mlx_ssp.config import StrictModel, validate
from mlx_ssp.errors import UserError

T = TypeVar("T")

#: exit status of a rank stopped by the watchdog (BSD EX_TEMPFAIL: retrying may work)
EXIT_TIMEOUT = 75
#: seconds a rank may take to exit after it lost a peer before the watchdog ends it
EXIT_GRACE_S = 30.0
#: environment variables set by mlx.launch / mpirun for a multi-process run
_LAUNCH_ENV = (
    "MLX_HOSTFILE", "MLX_RANK", "MLX_WORLD_SIZE", "MLX_JACCL_COORDINATOR", "MLX_IBV_DEVICES",
    "OMPI_COMM_WORLD_SIZE", "PMI_SIZE",
)
_ENV_TIMEOUT = "MLX_SSP_DIST_TIMEOUT"
_ENV_INIT_TIMEOUT = "MLX_SSP_DIST_INIT_TIMEOUT"


class DistributedConfig(StrictModel):
    """The ``distributed:`` section of a run file (read by every data-parallel stage)."""

    backend: Literal["any", "ring", "mpi", "nccl", "jaccl"] = Field(
        "any", description="mx.distributed backend; 'any' takes the one mlx.launch set up"
    )
    timeout_s: float = Field(
        1800.0, gt=0, description="longest wait in one collective before a rank gives up (peer frozen)"
    )
    init_timeout_s: float = Field(
        300.0, gt=0, description="longest wait for all ranks to connect at start-up"
    )


class DistributedError(UserError):
    """A collective failed: a peer rank died, froze or failed. The run cannot continue on this
    group; restart it (stages resume from their last checkpoint)."""


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    group: Any  # mx.distributed.Group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


_lock = threading.Lock()
_config: DistributedConfig | None = None
_world: World | None = None


def _env_float(name: str) -> float | None:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    try:
        v = float(raw)
    except ValueError:
        raise UserError(f"environment variable {name} must be a number of seconds, got {raw!r}") from None
    if v <= 0:
        raise UserError(f"environment variable {name} must be > 0, got {raw!r}")
    return v


def configure(cfg: DistributedConfig | dict | None = None) -> DistributedConfig:
    """Set the timeouts/backend (environment variables ``MLX_SSP_DIST_TIMEOUT`` and
    ``MLX_SSP_DIST_INIT_TIMEOUT`` beat the config). Call before the first :func:`world`; every
    stage loads its config through :func:`mlx_ssp.stage_config.load_stage`, which calls this once."""
    global _config
    if cfg is None:
        cfg = DistributedConfig()
    elif isinstance(cfg, dict):
        cfg = validate(DistributedConfig, cfg, prefix="distributed")
    updates = {}
    if (t := _env_float(_ENV_TIMEOUT)) is not None:
        updates["timeout_s"] = t
    if (t := _env_float(_ENV_INIT_TIMEOUT)) is not None:
        updates["init_timeout_s"] = t
    _config = cfg.model_copy(update=updates) if updates else cfg
    return _config


def settings() -> DistributedConfig:
    return _config if _config is not None else configure(None)


def launched() -> bool:
    """True when this process was started by a multi-process launcher (mlx.launch, mpirun)."""
    return any(os.environ.get(k) for k in _LAUNCH_ENV)


def world() -> World:
    """The global group, initialised on first call (size 1 when not launched)."""
    global _world
    if _world is not None:
        return _world
    with _lock:
        if _world is None:
            cfg = settings()
            _drop_empty_hostfile()
            if launched():
                group = _init_guarded(cfg.backend, cfg.init_timeout_s)
            else:
                group = mx.distributed.init(backend=cfg.backend)
            _world = World(rank=group.rank(), size=group.size(), group=group)
    return _world


def rank() -> int:
    return world().rank


def size() -> int:
    return world().size


def is_main() -> bool:
    return world().rank == 0


def _drop_empty_hostfile() -> None:
    # `mlx.launch -n 1` (ring) exports MLX_HOSTFILE pointing at an empty file, on which
    # mx.distributed.init fails with a JSON parse error (mlx 0.32.4): that is a one-process run.
    path = os.environ.get("MLX_HOSTFILE")
    if path:
        try:
            empty = not open(path).read().strip()
        except OSError:
            return  # let init report the missing file
        if empty:
            os.environ.pop("MLX_HOSTFILE")
            os.environ.pop("MLX_RANK", None)


_INIT_WATCHDOG = r"""
import os, select, signal, sys, time
pid, timeout, msg = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
ready, _, _ = select.select([sys.stdin], [], [], timeout)
if ready:
    sys.exit(0)
sys.stderr.write(msg + "\n"); sys.stderr.flush()
for sig in (signal.SIGTERM, signal.SIGKILL):
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        sys.exit(0)
    time.sleep(3)
"""


def _init_guarded(backend: str, timeout: float):
    # mx.distributed.init holds the GIL while it waits for peers: a thread could not fire, so a
    # tiny separate process (no mlx import) kills us if init has not returned in time.
    who = os.environ.get("MLX_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or "?"
    msg = (
        f"mlx_ssp distributed: rank {who}: the ranks did not all connect within {timeout:.0f}s "
        f"(distributed.init_timeout_s); a peer failed to start or is unreachable (check the hostfile, "
        f"the IPs and that the port range is free). Stopping this rank."
    )
    child = subprocess.Popen(
        [sys.executable, "-c", _INIT_WATCHDOG, str(os.getpid()), str(timeout), msg],
        stdin=subprocess.PIPE,
    )
    try:
        return mx.distributed.init(strict=backend != "any", backend=backend)
    except RuntimeError as e:
        raise DistributedError(f"rank {who}: could not initialise the '{backend}' backend: {e}") from None
    finally:
        try:
            child.stdin.write(b"ok\n")
            child.stdin.close()
        except OSError:
            pass
        child.wait()

