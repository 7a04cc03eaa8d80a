"""Reproducible batched sampling for ``mlx_lm.generate.BatchGenerator``, and behaviour log-probs.

Reproducibility. Every sample owns a 64-bit stream seed derived from ``(seed, task id, sample
index)`` (BLAKE2b). Its token t is drawn by Gumbel-max, ``argmax(filter(logprobs) + T * g_t)``
(= ``argmax(filter(logprobs) / T + g_t)``, exactly a draw from ``softmax(filter(logprobs) / T)``),
with the noise row ``g_t = mx.random.gumbel((V,), key=step_key(stream, t))``. The draw therefore
depends only on the sample's identity and on its own logits, never on the batch it shares, the
task order, or a resume. (The logits come from a batched, padded forward pass whose float32
rounding can differ by ~1e-6 between batch shapes, so a near-exact tie between two tokens could in
principle resolve differently; the tests check identical samples across batch sizes and orders.)

Speed. mlx-lm's ``GenerationBatch._step`` makes one batched sampler call when every sequence has
the same sampler object, and otherwise calls one sampler per sequence in a Python loop (B small
graphs per step: on a small model that costs as much as the forward pass). :class:`BatchSampler`
is that one shared object: it maps rows to sequences, builds the (B, 2) key array of the step in
Python, and draws all B noise rows with one ``vmap``-ed ``gumbel`` (bit-identical to B separate
keyed draws), so a step costs a constant number of ops, like mlx-lm's own ``categorical`` sampler.
On the CPU three exact shortcuts cut the full-vocabulary work of a step: the nucleus threshold
comes from the top of each row (:mod:`mlx_ssp.nucleus`); with top-p alone the noise is drawn at
the kept tokens only (:func:`nucleus_draw`, :mod:`mlx_ssp.keyed_noise`: the elements of the same
keyed rows); and the behaviour log-prob's tempered ``logsumexp`` is summed from the terms that can
change it (:func:`tempered_logsumexp`, :mod:`mlx_ssp.row_logsumexp`; only where the top-p draw
already read the rows, so a step without it never waits for the forward pass). The tokens and log-probs are
those of MLX's whole-row ops, bit for bit (tested; the noise and the logsumexp also check
themselves against MLX once per process and fall back to MLX's ops if they differ).
:class:`SequenceSampler` draws the same tokens one sequence at a time (the fallback).
Both sit behind one interface, :class:`SamplingPath` (:data:`SAMPLING_PATHS`, chosen by
:func:`sampling_path`), so the rollout engine drives either without knowing which.

Behaviour log-probs. mlx-lm hands back with each token the normalised log-probs at T=1. What is
stored is ``log_softmax(logprobs / T)[token]``: the *untruncated* tempered log-prob. Why
untruncated: GRPO's ratio is ``exp(logp_new - logp_old)`` where the trainer computes ``logp_new``
from the full tempered softmax; storing the untruncated value makes the on-policy ratio exactly
1, whereas a truncated (renormalised) value would bias every ratio by the dropped mass. With the
RL defaults (top_p=1, top_k=0, min_p=0) the stored value *is* the log-prob of the distribution
sampled from; with truncation on, it is the log-prob under the full tempered policy
(top-p/top-k/min-p act on the T=1 log-probs before temperature, mlx-lm's order). Greedy decoding
(T=0) has a point-mass behaviour distribution (log-prob 0 everywhere, which carries nothing); for
T=0 the stored value is the T=1 log-prob instead, and records say so in ``logprob_temperature``.
:class:`BatchSampler` computes them in the same graph as the draw (scheduled with it, so reading
them later does not wait on the next forward pass); :func:`behaviour_logprobs` does it for a
step's rows on the per-sequence path. Precision: mlx-lm normalises the logits in the model's
dtype, and a bfloat16 log-prob rounds to 2^-5 near -5 (measured: mean gap 0.0145 to the trainer's
float32 log-softmax). The rollout engine therefore hands mlx-lm a model wrapped in
:class:`Float32Logits`: the head's logits are cast to float32 before mlx-lm normalises them, so
the T=1 log-probs, the draw and the behaviour log-probs are float32 math, as in the trainer. A
float32 model's logits pass through untouched (same tokens, same log-probs).
"""

from __future__ import annotations

import hashlib
import os
from collections import deque
from typing import Optional, Protocol

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from mlx_ssp import keyed_noise, nucleus, row_logsumexp

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def sample_stream_seed(seed: int, task_id: str, sample: int) -> int:
    """The 64-bit stream seed of one sample: a hash of (seed, task id, sample index)."""
    h = hashlib.blake2b(f"{int(seed)}\x1f{task_id}\x1f{int(sample)}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little")


def splitmix64(x: int) -> int:
    """One round of SplitMix64 (Steele et al. 2014): a bijective 64-bit mixer."""
    z = (x + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def step_key(stream: int, t: int) -> mx.array:
    """The PRNG key for token ``t`` of a sample's stream."""
    return mx.random.key(splitmix64((stream + t * _GOLDEN) & _MASK64))


def top_p_filter(logprobs: mx.array, top_p: float) -> mx.array:
    """``mlx_lm.sample_utils.apply_top_p(logprobs, top_p)``, bit for bit, faster on the CPU.

    Nucleus filtering needs each row's threshold (where the probabilities summed from the top
    reach ``top_p``). On the CPU, MLX's sort of a batch of 49k-token rows costs more than the small
    demo model's forward pass; :func:`mlx_ssp.nucleus.thresholds` finds the same thresholds from
    the top of each row (see that module for why that is exact), sorting only there. On a GPU, or
    for dtypes NumPy lacks (bfloat16), mlx-lm's function runs as is."""
    if not _numpy_path(logprobs):
        return apply_top_p(logprobs, top_p)
    thr, _ = nucleus.thresholds(np.array(logprobs).reshape(-1, logprobs.shape[-1]), top_p)
    return _drop_below(logprobs, thr)


def _numpy_path(logprobs: mx.array) -> bool:
    """Whether the NumPy routes apply: on the CPU, for the dtypes NumPy has."""
    return mx.default_device() == mx.cpu and logprobs.dtype in (mx.float32, mx.float16)


def _drop_below(logprobs: mx.array, thr: np.ndarray) -> mx.array:
    """mlx-lm's mask: -inf where a log-prob is below its row's threshold."""
    return mx.where(logprobs < mx.array(thr.reshape(*logprobs.shape[:-1], 1)), -float("inf"), logprobs)


def _filters(top_p: float, top_k: int, min_p: float):
    """mlx-lm's own truncation functions, in mlx-lm's order (reused, not reimplemented; top-p
    through :func:`top_p_filter`, the same result computed faster)."""
    fs = []
    if 0 < top_p < 1.0:
        fs.append(lambda x: top_p_filter(x, top_p))
    if min_p > 0.0:
        fs.append(lambda x: apply_min_p(x, min_p))
    if top_k > 0:
        fs.append(lambda x: apply_top_k(x, top_k))
    return fs


def _key_words(stream: int, t: int) -> tuple[int, int]:
    """The two uint32 words of ``step_key(stream, t)`` (mx.random.key's layout: high word first)."""
    x = splitmix64((stream + t * _GOLDEN) & _MASK64)
    return x >> 32, x & 0xFFFFFFFF


_GUMBEL_ROWS: dict[int, object] = {}


def _gumbel_rows(vocab_size: int):
    """keys (B, 2) -> (B, V) Gumbel noise, row b keyed by keys[b]: vmap of the single-key draw,
    so row b is bit-identical to ``mx.random.gumbel((V,), key=keys[b])``."""
    f = _GUMBEL_ROWS.get(vocab_size)
    if f is None:
        f = _GUMBEL_ROWS[vocab_size] = mx.vmap(lambda k: mx.random.gumbel((vocab_size,), key=k))
    return f


def _gumbel_max(x: mx.array, keys: mx.array, T: float) -> mx.array:
    """``argmax(x + T * g)`` per row, row b's noise keyed by ``keys[b]`` (the whole row drawn)."""
    g = _gumbel_rows(x.shape[-1])(keys)
    return mx.argmax(x + (g if T == 1.0 else T * g), axis=-1)  # x * 1.0 is exact: same tokens


def nucleus_draw(logprobs: mx.array, top_p: float, keys: np.ndarray, T: float) -> Optional[mx.array]:
    """The tokens of ``argmax(apply_top_p(logprobs, top_p) + T * g)`` (row b's noise keyed by
    ``keys[b]``), drawing the noise at the kept tokens only: a dropped token's value is -inf
    whatever its noise, so the same argmax. ``x + T * g`` and the argmax (first maximum; column 0
    when a whole row is -inf, as MLX's) are the same float32 operations on fewer elements.
    None when a row needed the full sort (rows with NaN, unnormalised rows): the caller draws the
    whole row then."""
    x = np.array(logprobs)
    thr, cand = nucleus.thresholds(x, top_p)
    if any(c is None for c in cand):
        return None
    kept = nucleus.kept_columns(x, thr, cand)
    counts = np.array([len(k) for k in kept])
    rows = np.repeat(np.arange(len(kept)), counts)
    cols = np.concatenate(kept)
    g = keyed_noise.gumbel_at(keys[rows], cols, x.shape[-1])
    vals = np.array(mx.array(x[rows, cols]) + (g if T == 1.0 else T * g))
    padded = np.full((len(kept), counts.max()), -np.inf, dtype=vals.dtype)
    padded[rows, np.arange(len(cols)) - np.repeat(np.cumsum(counts) - counts, counts)] = vals
    pos = padded.argmax(axis=-1)
    tokens = np.where(padded.max(axis=-1) == -np.inf, 0, cols[np.cumsum(counts) - counts + pos])
    return mx.array(tokens.astype(np.uint32))


def tempered_logsumexp(logprobs: mx.array, T: float, *, evaluated: bool = True) -> mx.array:
    """``mx.logsumexp(logprobs * (1.0 / T), axis=-1, keepdims=True)``; on the CPU for float32
    rows already evaluated, the same values from the terms that can change the sum
    (:mod:`mlx_ssp.row_logsumexp`). ``evaluated=False`` (rows still lazy): MLX's own op, since
    reading the rows would wait for the forward pass and lose mlx-lm's overlap of steps."""
    if (not evaluated or logprobs.dtype != mx.float32 or not _numpy_path(logprobs)
            or not row_logsumexp.exact_here()):
        return mx.logsumexp(logprobs * (1.0 / T), axis=-1, keepdims=True)
    # NumPy's float32 product is MLX's (one IEEE rounding of the same two float32 operands)
    x = np.array(logprobs) * np.float32(1.0 / T)
    if np.isnan(x).any():
        return mx.logsumexp(logprobs * (1.0 / T), axis=-1, keepdims=True)
    return mx.array(row_logsumexp.logsumexp_rows(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], 1))


class Float32Logits:
    """A model whose forward returns float32 logits (see the module docstring), everything else
    delegated: mlx-lm's generators call it and read ``layers`` / ``make_cache`` from it. Only the
    last position of each decode step is ever evaluated, so the cast costs one [B x V] buffer."""

    def __init__(self, model):
        self.model = model

    def __call__(self, *args, **kwargs):
        logits = self.model(*args, **kwargs)
        return logits if logits.dtype == mx.float32 else logits.astype(mx.float32)

    def __getattr__(self, name):  # only reached for names this wrapper does not define
        return getattr(self.model, name)


class SequenceSampler:
    """The sampler of one sequence (the per-sequence fallback of :class:`BatchSampler`, same tokens).
    Called once per generated token with that sequence's (1, V) T=1 log-probs; the t-th call returns
    ``argmax(filter(logprobs) + T * g_t)`` with ``g_t`` keyed by ``step_key(stream, t)``."""

    __slots__ = ("stream", "temperature", "filters", "t")

    def __init__(self, stream: int, temperature: float, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0):
        self.stream = stream
        self.temperature = float(temperature)
        self.filters = _filters(top_p, top_k, min_p) if temperature > 0 else []
        self.t = 0

    def __call__(self, logprobs: mx.array) -> mx.array:
        t = self.t
        self.t += 1
        if self.temperature <= 0:
            return mx.argmax(logprobs, axis=-1)
        for f in self.filters:
            logprobs = f(logprobs)
        g = mx.random.gumbel((logprobs.shape[-1],), key=step_key(self.stream, t))
        # argmax(x / T + g) == argmax(x + T * g) for T > 0
        return mx.argmax(logprobs + self.temperature * g, axis=-1)


class _StepLogprobs:
    """The behaviour log-probs of one batched draw, converted to Python floats once, on first use."""

    __slots__ = ("array", "_values")

    def __init__(self, array: mx.array):
        self.array = array
        self._values = None

    def __getitem__(self, row: int) -> float:
        if self._values is None:
            self._values = self.array.tolist()  # (B, 1): one nested list per row
        return self._values[row][0]


class BatchSampler:
    """One sampler shared by every sequence of a ``BatchGenerator``, drawing a whole step at once
    (see the module docstring for why), and recording each token's behaviour log-prob.

    Rows are mapped to sequences through the ``uids`` of the batch that calls it (the calling
    frame's ``self``: mlx-lm's ``GenerationBatch._step``). If a future mlx-lm calls the sampler from
    somewhere without that ``uids`` list, the call fails with a message naming the fallback:
    ``MLX_SSP_PER_SEQUENCE_SAMPLER=1`` (one sampler per sequence, slower on small models, same
    samples)."""

    def __init__(self, temperature: float, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
                 logprobs: bool = True):
        self.temperature = float(temperature)
        self.filters = _filters(top_p, top_k, min_p) if temperature > 0 else []
        # top-p alone: the draw can look at the kept tokens only (:func:`nucleus_draw`)
        self.nucleus_only = top_p if len(self.filters) == 1 and 0 < top_p < 1.0 else None
        self.logprobs = logprobs  # False: draw only (a tempered softmax over the vocabulary per step saved)
        self._t: dict[int, int] = {}  # uid -> tokens drawn so far
        self._stream: dict[int, int] = {}
        # uid -> behaviour log-probs of its drawn tokens not yet handed out, oldest first
        self._pending: dict[int, deque] = {}

    def add(self, uid: int, stream: int) -> None:
        """Register the sequence ``uid`` (as returned by ``BatchGenerator.insert``) and its stream seed."""
        self._t[uid] = 0
        self._stream[uid] = stream
        self._pending[uid] = deque()

    def drop(self, uid: int) -> None:
        """Forget a finished sequence (and the log-prob of a look-ahead token mlx-lm drew for it)."""
        self._t.pop(uid, None)
        self._stream.pop(uid, None)
        self._pending.pop(uid, None)

    @property
    def n_live(self) -> int:
        """Sequences registered and not yet dropped. (Not ``__len__``: mlx-lm tests the sampler with
        ``sampler or greedy_sampler``, and an empty one would be falsy.)"""
        return len(self._t)

    def behaviour_logprob(self, uid: int) -> float:
        """The behaviour log-prob of the oldest token of ``uid`` not yet asked for: call it once per
        token mlx-lm returns for that sequence, in order."""
        step, row = self._pending[uid].popleft()
        return step[row]

    @staticmethod
    def _caller_uids(n: int) -> list:
        import sys

        owner = sys._getframe(2).f_locals.get("self")
        uids = getattr(owner, "uids", None)
        if not isinstance(uids, list) or len(uids) != n:
            import mlx_lm

            raise RuntimeError(
                f"mlx-lm {getattr(mlx_lm, '__version__', '?')} called the batch sampler from "
                f"{type(owner).__name__} without a matching `uids` list, so rows cannot be mapped to "
                "sequences; set MLX_SSP_PER_SEQUENCE_SAMPLER=1 (same samples, slower) or use mlx-lm 0.32.x"
            )
        return uids

    def __call__(self, logprobs: mx.array) -> mx.array:
        uids = self._caller_uids(logprobs.shape[0])
        T = self.temperature
        try:
            ts = [self._t[u] for u in uids]
        except KeyError as e:
            raise RuntimeError(f"batch sampler: sequence uid {e.args[0]} was never registered with add()") from None
        for u, t in zip(uids, ts):
            self._t[u] = t + 1
        evaluated = False  # whether the rows were read here (then a NumPy step costs no wait)
        if T <= 0:
            tokens = mx.argmax(logprobs, axis=-1)
        else:
            keys = np.array([_key_words(self._stream[u], t) for u, t in zip(uids, ts)], dtype=np.uint32)
            tokens = None
            if self.nucleus_only is not None and _numpy_path(logprobs) and keyed_noise.exact_here():
                evaluated = True  # nucleus_draw reads the rows (waits for the forward pass)
                tokens = nucleus_draw(logprobs, self.nucleus_only, keys, T)
            if tokens is None:
                x = logprobs
                for f in self.filters:  # mlx-lm's filters work row-wise on (B, V)
                    x = f(x)
                tokens = _gumbel_max(x, mx.array(keys), T)
        if not self.logprobs:
            return tokens
        # behaviour log-probs in the same graph, scheduled now; unless the top-p draw already read
        # the rows, everything here stays lazy so mlx-lm's next forward pass overlaps this step
        lp = mx.take_along_axis(logprobs, tokens[:, None], axis=-1)
        if T > 0 and T != 1.0:  # the rows are normalised at T=1 already
            lp = lp / T - tempered_logsumexp(logprobs, T, evaluated=evaluated)
        mx.async_eval(lp)
        step = _StepLogprobs(lp)
        for row, u in enumerate(uids):
            self._pending[u].append((step, row))
        return tokens


def behaviour_logprobs(rows: list[mx.array], tokens: list[int], temperature: float) -> list[float]:
    """``log_softmax(row / T)[token]`` for each (T=1 log-prob row, sampled token) pair of one step,
    in one batched computation. T <= 0 (greedy) gives the T=1 log-probs (see the module docstring)."""
    if not rows:
        return []
    x = mx.stack([r.reshape(-1) if r.ndim != 1 else r for r in rows]).astype(mx.float32)
    idx = mx.array(tokens)[:, None]
    if temperature <= 0 or temperature == 1.0:
        # rows are already normalised at T=1
        return mx.take_along_axis(x, idx, axis=-1)[:, 0].tolist()
    x = x * (1.0 / temperature)
    lp = mx.take_along_axis(x, idx, axis=-1)[:, 0] - mx.logsumexp(x, axis=-1)
    return lp.tolist()


# -- one interface over both paths, for the rollout engine ---------------------------------------


class SamplingPath(Protocol):
    """How the rollout engine samples through mlx-lm's ``BatchGenerator``: the sampler handed to the
    generator (None: per-sequence samplers at insert), the samplers of newly inserted sequences,
    and the behaviour log-probs of each step's tokens."""

    generator_sampler: Optional[object]

    def insert_samplers(self, streams: list[int]) -> Optional[list]: ...

    def register(self, uid: int, stream: int) -> None: ...

    def release(self, uid: int) -> None: ...

    def step_logprobs(self, responses: list) -> Optional[list[float]]:
        """The behaviour log-prob of each response's token; None when the path was made without them."""
        ...


class SharedSampling:
    """One :class:`BatchSampler` for every sequence: mlx-lm samples the batch in one call, and the
    log-probs come out of the same graph as the draw."""

    def __init__(self, temperature: float, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
                 logprobs: bool = True):
        self.generator_sampler = BatchSampler(temperature, top_p, top_k, min_p, logprobs=logprobs)

    def insert_samplers(self, streams: list[int]) -> None:
        return None

    def register(self, uid: int, stream: int) -> None:
        self.generator_sampler.add(uid, stream)

    def release(self, uid: int) -> None:
        self.generator_sampler.drop(uid)

    def step_logprobs(self, responses: list) -> Optional[list[float]]:
        if not self.generator_sampler.logprobs:
            return None
        return [self.generator_sampler.behaviour_logprob(r.uid) for r in responses]


class PerSequenceSampling:
    """One :class:`SequenceSampler` per sequence (the fallback; same samples, slower on small
    models); log-probs from each step's returned T=1 rows."""

    generator_sampler = None

    def __init__(self, temperature: float, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
                 logprobs: bool = True):
        self.params = (float(temperature), top_p, top_k, min_p)
        self.logprobs = logprobs

    def insert_samplers(self, streams: list[int]) -> list[SequenceSampler]:
        return [SequenceSampler(st, *self.params) for st in streams]

    def register(self, uid: int, stream: int) -> None:
        pass  # the stream travels with the sequence's own sampler

    def release(self, uid: int) -> None:
        pass

    def step_logprobs(self, responses: list) -> Optional[list[float]]:
        if not self.logprobs:
            return None
        return behaviour_logprobs([r.logprobs for r in responses], [r.token for r in responses], self.params[0])


#: name -> sampling path; ``MLX_SSP_PER_SEQUENCE_SAMPLER=1`` picks the fallback, in case mlx-lm's
#: internals change under the shared sampler
SAMPLING_PATHS: dict[str, type] = {"shared": SharedSampling, "per_sequence": PerSequenceSampling}


def sampling_path(temperature: float, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, *,
                  logprobs: bool = True) -> SamplingPath:
    """The sampling path this process uses (see :data:`SAMPLING_PATHS`); ``logprobs=False``: the
    same tokens without their behaviour log-probs."""
    name = "per_sequence" if os.environ.get("MLX_SSP_PER_SEQUENCE_SAMPLER") == "1" else "shared"
    return SAMPLING_PATHS[name](temperature, top_p, top_k, min_p, logprobs=logprobs)
