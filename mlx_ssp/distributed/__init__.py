"""Data parallelism over ``mx.distributed``: one process per rank, launched by ``mlx.launch``.

The recipe's expensive stages (K-rollouts, eval, SFT, MGPO-GRPO) are data parallel: every rank
holds the whole model, works on its share of the prompts and the ranks meet only to exchange
small things (records, gradients, counts). This module is the thin layer the stages use; the
transport is MLX's own (ring over TCP, MPI, JACCL over Thunderbolt RDMA, NCCL on CUDA).

Primitives
- :func:`world` initialises the global group once (size 1 when the program was not launched by
  ``mlx.launch``/``mpirun``, so every stage runs unchanged on one process).
- :func:`shard` gives rank ``r`` the ``r``-th of ``size`` contiguous, balanced blocks (sizes differ by
  at most one, the first ``n % size`` ranks take one more). Because blocks are contiguous and
  taken in rank order, concatenating the ranks' results (what :func:`all_gather_records` returns)
  restores the global order exactly.
- :func:`all_gather_records` sends arbitrary JSON records from every rank to every rank: each
  rank serialises its list to UTF-8 JSON, the lengths are all-gathered, the byte buffers are
  padded to the longest and all-gathered as ``uint8`` arrays, then decoded in rank order.
  :func:`broadcast_object` is the same with only the root contributing; :func:`run_on_main` runs a
  function on rank 0 (saving, probing, fusing) while the other ranks wait, and re-raises rank 0's
  error on every rank instead of leaving them waiting.
- :func:`average_gradients` is ``mlx.nn.utils.average_gradients`` (the one mlx-lm's trainer uses:
  concatenate small arrays into ~32 MB buffers, one ``all_sum`` each, divide by the size) on our
  group, evaluated inside the failure guard. :func:`sum_gradients` / :func:`all_sum` /
  :func:`sum_floats` are the plain sums, for losses normalised by a global count (RL: each rank
  trains on its block of the batch with the loss divided by the *global* aggregation units, so the
  summed gradients are the full batch's).
- :func:`iter_sharded_groups` is sharded generation (rollouts, eval, probes, RL sampling): the
  (task, sample) pairs are cut into rounds, each rank generates its contiguous block, the records
  are gathered and handed to every rank in global order. Every sample's PRNG stream depends only
  on (seed, task id, sample index) (:mod:`mlx_ssp.sampling`), so the records equal one process's.
- :func:`check_same` stops ranks that would otherwise diverge (e.g. resuming from different
  checkpoints because the run directory is not shared between hosts).

Failure handling (measured with mlx 0.32.4, ring backend, two local ranks)
- A peer whose process ends (crash, exception, SIGKILL) closes its sockets and a collective on the
  survivors fails at once with ``RuntimeError: [ring] connection to a peer was lost``. We turn that
  into :class:`DistributedError` (a :class:`UserError`: the CLI prints one line and exits 2) and arm
  a short exit deadline so a rank can never hang while unwinding.
- A peer that is alive but frozen (SIGSTOP, a hung machine, a cable pulled with no TCP reset) makes
  the survivors wait forever: every collective runs under a watchdog thread (``mx.eval`` releases
  the GIL while it blocks) which, after ``distributed.timeout_s`` seconds, prints which collective
  on which rank timed out and ends the process with exit status :data:`EXIT_TIMEOUT`.
- Collectives we do not wrap (mlx-lm's trainer) run inside :func:`watch`: a liveness deadline
  re-armed by :func:`heartbeat` (each training report) and by every successful wrapped collective.
- ``mx.distributed.init`` blocks forever while a peer never shows up, and does *not* release the
  GIL, so a thread cannot help: when the process was launched for several ranks, init runs under a
  small watchdog *process* that kills us with a clear message after ``distributed.init_timeout_s``.
- ``mlx.launch`` itself stops the other ranks (SIGTERM) when one exits non-zero, but it exits 0
  whatever its ranks did (mlx 0.32.4): read the ranks' messages, or check the stage's output file.
- ``mlx.launch -n 1`` exports an empty ``MLX_HOSTFILE`` that makes ``mx.distributed.init`` fail
  (mlx 0.32.4); :func:`world` treats it as the one-process run it is.

Deviations / limits: no elastic membership (a lost rank ends the run; restart it and the stages
resume from their last checkpoint); records are JSON (no arrays; use :func:`broadcast_tree`);
a legitimate wait longer than ``timeout_s`` (a straggler rank, rank 0 probing a checkpoint) is
indistinguishable from a frozen peer, so ``timeout_s`` must exceed the longest such wait.

Modules: :mod:`.world` (the group, its config, init), :mod:`.watchdog` (the failure guards),
:mod:`.collectives` (records, objects, trees, sums, rank 0's work and books), :mod:`.shard`
(shards and sharded generation), :mod:`.check` (``python -m mlx_ssp.distributed``).
"""

from mlx_ssp.distributed.collectives import (
    NullAppender,
    all_gather_records,
    all_sum,
    appender,
    average_gradients,
    barrier,
    broadcast_object,
    broadcast_tree,
    check_same,
    gather_per_rank,
    main_first,
    output_lock,
    run_on_main,
    sum_floats,
    sum_gradients,
)
from mlx_ssp.distributed.shard import iter_sharded_groups, shard, shard_bounds
from mlx_ssp.distributed.watchdog import collective, heartbeat, watch
from mlx_ssp.distributed.world import (
    EXIT_GRACE_S,
    EXIT_TIMEOUT,
    DistributedConfig,
    DistributedError,
    World,
    configure,
    is_main,
    launched,
    rank,
    settings,
    size,
    world,
)

__all__ = [
    "NullAppender", "all_gather_records", "all_sum", "appender", "average_gradients", "barrier",
    "broadcast_object", "broadcast_tree", "check_same", "gather_per_rank", "main_first", "output_lock",
    "run_on_main", "sum_floats", "sum_gradients", "iter_sharded_groups", "shard", "shard_bounds",
    "collective", "heartbeat", "watch", "EXIT_GRACE_S", "EXIT_TIMEOUT", "DistributedConfig",
    "DistributedError", "World", "configure", "is_main", "launched", "rank", "settings", "size", "world",
]
