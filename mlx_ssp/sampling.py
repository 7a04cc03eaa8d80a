"""Per-sequence samplers for ``mlx_lm.generate.BatchGenerator`` with reproducible keys, and
behaviour log-probs.

Reproducibility. Every sample owns a 64-bit stream seed derived from ``(seed, task id, sample
index)`` (BLAKE2b). Its token t is drawn by Gumbel-max, ``argmax(filter(logprobs) + T * g_t)``
(= ``argmax(filter(logprobs) / T + g_t)``), with noise rows from
``mx.random.gumbel(key=mx.random.key(splitmix64(stream + c * golden)))`` for chunk ``c = t // C``
(C depends only on the vocabulary size). The draw therefore depends only on
the sample's identity and on its own logits, never on the batch it shares, the task order, or a
resume. (The logits come from a batched, padded forward pass whose float32 rounding can differ
by ~1e-6 between batch shapes, so a near-exact tie between two tokens could in principle resolve
differently; the tests check identical samples across batch sizes and task orders.)

Why Gumbel-max with chunked noise rather than ``mx.random.categorical(key=...)`` per token (the
same distribution): ``BatchGenerator`` calls a per-sequence sampler in a Python loop over the
batch, so every op in it is paid B times per step; drawing C steps of noise at once cuts the
per-token cost of the sampler to an add and an argmax (the noise is pre-scaled by T).

Behaviour log-probs. ``BatchGenerator`` returns with each token the normalised log-probs at T=1.
:func:`behaviour_logprobs` turns a step's rows into ``log_softmax(logprobs / T)[token]`` in one
batched op: the *untruncated* tempered log-prob. Why untruncated: GRPO's ratio is
``exp(logp_new - logp_old)`` where the trainer computes ``logp_new`` from the full tempered
softmax; storing the untruncated value makes the on-policy ratio exactly 1, whereas a truncated
(renormalised) value would bias every ratio by the dropped mass. With the RL defaults (top_p=1,
top_k=0, min_p=0) the stored value *is* the log-prob of the distribution sampled from; with
truncation on, it is the log-prob under the full tempered policy (top-p/top-k/min-p act on the
T=1 log-probs before temperature, mlx-lm's order). Greedy decoding (T=0) has a point-mass
behaviour distribution (log-prob 0 everywhere, which carries nothing); for T=0 the stored value
is the T=1 log-prob instead, and records say so in ``logprob_temperature``.
"""

from __future__ import annotations

import hashlib

import mlx.core as mx

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


def _filters(top_p: float, top_k: int, min_p: float):
    """mlx-lm's own truncation functions, in mlx-lm's order (reused, not reimplemented)."""
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    fs = []
    if 0 < top_p < 1.0:
        fs.append(lambda x: apply_top_p(x, top_p))
    if min_p > 0.0:
        fs.append(lambda x: apply_min_p(x, min_p))
    if top_k > 0:
        fs.append(lambda x: apply_top_k(x, top_k))
    return fs


def noise_chunk(vocab_size: int) -> int:
    """Steps of Gumbel noise drawn at once per sequence: a function of the vocabulary size only (so
    samples do not depend on the batch), about 4 MB per sequence, at most 32 steps."""
    return max(1, min(32, (1 << 20) // max(1, vocab_size)))


class SequenceSampler:
    """The sampler of one sequence. ``BatchGenerator`` calls it once per generated token with
    that sequence's (1, V) T=1 log-probs; the t-th call draws token t by Gumbel-max,
    ``argmax(filter(logprobs) + T * g_t)`` (the same argmax as ``filter(logprobs) / T + g_t``), which is
    exactly a draw from ``softmax(filter(logprobs) / T)``.
    The noise rows ``g_t`` come from ``mx.random.gumbel`` keyed by ``step_key(stream, t // C)`` in
    chunks of C = :func:`noise_chunk` steps: one random op per C tokens instead of one per token,
    because the per-sequence sampler runs in a Python loop over the batch and its op count is the
    overhead over mlx-lm's single batched sampler."""

    __slots__ = ("stream", "temperature", "filters", "t", "_chunk", "_buf", "_c")

    def __init__(self, stream: int, temperature: float, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0):
        self.stream = stream
        self.temperature = float(temperature)
        self.filters = _filters(top_p, top_k, min_p) if temperature > 0 else []
        self.t = 0
        self._chunk = -1
        self._buf = None
        self._c = 0

    def noise(self, t: int, vocab_size: int) -> mx.array:
        """The (1, V) row ``T * g_t`` of Gumbel noise for token ``t``."""
        if not self._c:
            self._c = noise_chunk(vocab_size)
        chunk, row = divmod(t, self._c)
        if chunk != self._chunk:
            g = mx.random.gumbel((self._c, vocab_size), key=step_key(self.stream, chunk))
            if self.temperature != 1.0:
                g = g * self.temperature
            # one split op per chunk, so that a step costs no slicing op
            self._buf = mx.split(g, self._c, axis=0)
            self._chunk = chunk
        return self._buf[row]

    def __call__(self, logprobs: mx.array) -> mx.array:
        t = self.t
        self.t += 1
        if self.temperature <= 0:
            return mx.argmax(logprobs, axis=-1)
        for f in self.filters:
            logprobs = f(logprobs)
        # argmax(x / T + g) == argmax(x + T * g) for T > 0: two ops per token
        return mx.argmax(logprobs + self.noise(t, logprobs.shape[-1]), axis=-1)

    def drop(self) -> None:
        self._buf = None


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
