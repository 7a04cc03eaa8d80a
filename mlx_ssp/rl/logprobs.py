"""Per-token log-probs from hidden states and the LM head, chunk by chunk (selective log-softmax).

RL needs ``log pi(y_t | y_<t)`` of the sampled tokens only, at the sampling temperature T:
``log_softmax(h_t W^T / T)[y_t]``. Computing it naively materialises the [tokens x vocab] logits
and their log-softmax (4096 tokens x 151,936 Qwen3 vocab = 2.5 GB each in float32), plus the same
again in the backward pass. This module computes it in chunks of ``chunk_size`` tokens:

- forward: for each chunk, logits = head(h_chunk) (one [chunk x V] buffer), the target logit by a
  gather on the flat index, and ``logsumexp(x)`` with ``x = logits / T`` in float32 (one exp
  pass); the per-token logsumexp is kept (a [tokens] vector) for the backward;
- backward (``mx.custom_function`` vjp): each chunk's logits are *recomputed* from h and the head,
  ``d logits = (g / T) * (onehot(t) - exp(x - lse))`` is formed in one exp pass with the one-hot
  part scatter-added at the targets only, and the gradient flows on into the hidden states (and
  into the head's weight when it is trained), chunk by chunk.

Kernel dispatch: :func:`_chunk_impl` asks the one dispatcher (:mod:`mlx_ssp.rl.kernels`) and returns
its ``selective_log_softmax`` when a kernel runs, else ``selective_log_softmax_reference`` (both live in
:mod:`mlx_ssp.rl.kernels.log_softmax`; this module builds on them and is never imported by them).
``MLX_SSP_KERNELS=reference`` or the ``rl.kernels`` config key forces the reference. With the
reference, the chunked op runs the same math written out per chunk (:class:`_Fused`, which keeps the
forward's logsumexp for the backward); a kernel is called per chunk as ``impl(logits, targets, T)``
with its own vjp (:class:`_Impl`).

Entropy (``return_entropy``): the per-token entropy H of softmax(logits / T) from the same logits,
a statistic without gradient unless ``entropy_grad`` (the RL loss's entropy bonus). Then the backward
also uses dH/dlogits = -p (log p + H) / T: in the recompute vjp one more element-wise term on the
recomputed chunk; in the save_grad forward a second per-token D-vector d H / d h (one more
head-gradient matmul per chunk). Deviation: the custom kernels have no entropy backward, so with
``entropy_grad`` the reference math runs on every device (:func:`_engine`).

Heads: ``nn.Linear`` (with or without bias), a tied ``nn.Embedding`` (its ``as_linear``),
``nn.QuantizedLinear`` and ``nn.QuantizedEmbedding`` (``mx.quantized_matmul``; no gradient into the
quantized weights, which cannot be trained anyway). Any other head module falls back to the naive,
unchunked computation (correct, not memory-efficient).

Deviations from a fused kernel: the whole chunk's logits exist at once (a kernel tiles the vocab
too); the backward pays one extra head matmul per chunk (the recompute), which is the price of not
keeping [tokens x vocab] alive between forward and backward. ``save_grad=True`` (frozen heads,
callers that will differentiate: the RL loop's training path) avoids that extra matmul by
computing each chunk's d logp / d hidden rows in the forward pass (:func:`_make_saved_op`): two
head matmuls and one exp pass per chunk, as naive.

Memory: the default chunk is the largest whose live [chunk x V] float32 buffers fit a 768 MiB
budget (:func:`auto_chunk_size`; 432 tokens at Qwen3's vocab). With more than one chunk, each
chunk is evaluated eagerly, since MLX's lazy graph would otherwise hold every chunk's buffers at
once, and it is built and evaluated on a helper thread (:func:`_outside_trace`; the reference and
the kernels alike, on every device), because inside ``mx.grad`` MLX keeps every intermediate of an
evaluated graph alive (measured 6-7 [chunk x V] buffers per backward chunk instead of 2) and only a
copy through NumPy (:func:`_materialize`) would cut it there. That copy is kept for the small
per-token chunk inputs; a trained head's gradient ([V x D], 593 MiB in float32 at Qwen3-0.6B's
size) is accumulated on the helper thread and never leaves the device (through NumPy once per
chunk it made the kernel path 26-37x slower than the reference on an H200).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from mlx_ssp.rl import kernels
from mlx_ssp.rl.kernels.log_softmax import flat_index, scaled, selective_log_softmax_reference

# -- the per-chunk op ---------------------------------------------------------------------------


def _chunk_impl() -> Callable[[mx.array, mx.array, float], mx.array]:
    """The per-chunk selective log-softmax: a custom kernel where one can run, else the reference."""
    return kernels.selective_log_softmax if kernels.kernel_available() else selective_log_softmax_reference


def chunk_impl_name() -> str:
    """Which per-chunk implementation :func:`token_logprobs` uses right now (for logs)."""
    impl = _chunk_impl()
    return "reference" if impl is selective_log_softmax_reference else f"{impl.__module__}.{impl.__name__}"


# -- LM heads -----------------------------------------------------------------------------------
# type -> fn(module) -> (params tuple, logits_fn(h, *params)). Params are explicit inputs of the
# chunked op so that a trained head (full fine-tuning, untied or tied) gets its gradient.


def _dense(weight_key: str = "weight"):
    def build(m: nn.Module):
        if "bias" in m:
            return (m[weight_key], m["bias"]), lambda h, w, b: h @ w.T + b
        return (m[weight_key],), lambda h, w: h @ w.T

    return build


def _quantized(m: nn.Module):
    gs, bits, mode = m.group_size, m.bits, getattr(m, "mode", "affine")
    biases = m.get("biases")
    bias = m["bias"] if "bias" in m else None

    def fn(h, w, scales, *rest):
        qb = rest[0] if biases is not None else None
        out = mx.quantized_matmul(h, w, scales=scales, biases=qb, transpose=True, group_size=gs, bits=bits, mode=mode)
        return out + rest[-1] if bias is not None else out

    params = (m["weight"], m["scales"]) + ((biases,) if biases is not None else ()) + ((bias,) if bias is not None else ())
    return params, fn


HEADS: dict[type, Callable] = {
    nn.QuantizedLinear: _quantized,
    nn.QuantizedEmbedding: _quantized,
    nn.Linear: _dense(),
    nn.Embedding: _dense(),  # tied embeddings: logits = h @ E^T (Embedding.as_linear)
}


def head_of(model: nn.Module) -> nn.Module:
    """The LM head of an mlx-lm model: ``lm_head``, or the tied input embedding."""
    if "lm_head" in model:  # mlx-lm creates lm_head only for untied embeddings
        return model["lm_head"]
    inner = getattr(model, "model", None)
    emb = getattr(inner, "embed_tokens", None) if inner is not None else None
    if emb is None:
        raise ValueError(f"cannot find the LM head of {type(model).__name__} (no lm_head, no model.embed_tokens)")
    return emb


def _head_builder(head: nn.Module):
    for cls, build in HEADS.items():  # exact types first so QuantizedLinear is not taken as Linear
        if type(head) is cls:
            return build
    for cls, build in HEADS.items():
        if isinstance(head, cls):
            return build
    return None


def head_trainable(head: nn.Module) -> bool:
    """Whether the head has float parameters that train (full fine-tuning), so it gets a gradient."""
    return any(mx.issubdtype(v.dtype, mx.floating) for _, v in tree_flatten(head.trainable_parameters()))


def head_vocab(head: nn.Module) -> int:
    """Output size of an LM head (rows of its weight)."""
    return int(head["weight"].shape[0]) if "weight" in head else 0


#: Default memory budget for one chunk's [chunk x vocab] float32 buffers (see auto_chunk_size).
CHUNK_BYTES = 3 << 28  # 768 MiB
#: [chunk x vocab] float32 buffers alive at once at the peak of a chunk (measured on the CPU path
#: with mx.get_peak_memory: 2 in the recompute backward, 3 in the save_grad forward).
LIVE_CHUNK_BUFFERS = 3


def auto_chunk_size(vocab: int, budget_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk: the largest multiple of 16 whose live [chunk x vocab] float32 buffers
    (:data:`LIVE_CHUNK_BUFFERS` of them) fit in ``budget_bytes`` (at least 16).

    Qwen3's 151,936 vocab gives 432 tokens (3 x 263 MB). Larger chunks cost no time on the CPU
    (every phase scales linearly in the chunk) but memory; smaller ones only add per-chunk
    overhead, so the budget, not speed, sets the default."""
    per_token = LIVE_CHUNK_BUFFERS * 4 * max(1, vocab)
    return max(16, (budget_bytes // per_token) // 16 * 16)


def chunk_tokens(head: nn.Module, chunk_size: int | None = None) -> int:
    """Tokens per chunk of :func:`token_logprobs` for ``head``: ``chunk_size``, or the automatic one."""
    return auto_chunk_size(head_vocab(head)) if chunk_size is None else int(chunk_size)


# -- per-chunk engines ----------------------------------------------------------------------------
# An engine does one chunk's math given its logits: the forward (log-probs, optional entropy, and
# what the backward keeps), the gradient into the chunk's hidden rows and head params, and the
# save_grad forward (log-probs plus d logp / d hidden rows for cotangent 1).


def _onehot_add(d: mx.array, targets: mx.array, values: mx.array) -> mx.array:
    """``d + values[:, None] * onehot(targets)``: a scatter-add at the targets only (in place where
    MLX can donate ``d``; no [chunk x V] one-hot, no put_along_axis)."""
    return d.reshape(-1).at[flat_index(targets, d.shape[1])].add(values).reshape(d.shape)


class _Fused:
    """The reference math written out per chunk (the path wherever no custom kernel runs).

    Per chunk: forward = 1 head matmul + one exp pass (logsumexp); the log-prob is a gather of
    the target logit on the flat index. Backward = the recompute matmul + one element-wise
    pass using the forward's saved logsumexp, ``d logits = (g / T) * (onehot - exp(x - lse))``
    (the one-hot by :func:`_onehot_add`), then the gradient matmul(s). save_grad: one matmul, a
    max, one exp pass, a scale and one-hot add, and the gradient matmul (2 matmuls in all, as
    naive)."""

    saves_lse = True

    def __init__(self, temperature: float):
        self.inv_t = 1.0 / temperature

    def _picked(self, logits, tc):
        flat = flat_index(tc, logits.shape[1])
        return mx.take(logits.reshape(-1), flat).astype(mx.float32) * self.inv_t

    def forward(self, logits, tc, want_entropy):
        picked = self._picked(logits, tc)
        if not want_entropy:
            lse = mx.logsumexp(logits.astype(mx.float32) * self.inv_t, axis=-1)
            return picked - lse, None, lse
        ex, s, lse = self._stats(logits)
        return picked - lse, self._entropy(ex, s, lse, logits), lse

    def _entropy(self, ex, s, lse, logits):
        """lse - E_p[x] with p = ex / s; the row sums of ex * logits as a batched dot product, so
        no [chunk x V] product buffer exists."""
        dot = (ex[:, None, :] @ logits.astype(mx.float32)[:, :, None])[:, 0, 0]
        return lse - dot * (self.inv_t / s[:, 0])

    def _stats(self, logits):
        """exp((logits - max) / T), its row sums and logsumexp(logits / T): one exp pass."""
        m = mx.max(logits, axis=-1, keepdims=True).astype(mx.float32)  # the max is exact in any dtype
        # subtract in float32: in bfloat16 the difference itself rounds (7e-4 off on a bf16 head)
        ex = mx.exp((logits.astype(mx.float32) - m) * self.inv_t)
        s = ex.sum(axis=-1, keepdims=True)
        return ex, s, (m * self.inv_t + mx.log(s))[:, 0]

    def grads(self, logits_fn, hc, params, tc, g, lse, gh=None, ent=None):
        logits = logits_fn(hc, *params)  # the recompute
        gt = g.astype(mx.float32) * self.inv_t
        if gh is None:
            # d logits = (g / T) * (onehot - exp(x - lse)), with the forward's lse: one exp pass
            d = mx.exp(logits.astype(mx.float32) * self.inv_t - lse[:, None]) * (-gt)[:, None]
        else:
            d = self._entropy_dlogits(logits, lse, ent, gt, gh.astype(mx.float32) * self.inv_t)
        d = _onehot_add(d, tc, gt)
        _, grads = mx.vjp(logits_fn, [hc, *params], [d.astype(logits.dtype)])
        return grads

    def _entropy_dlogits(self, logits, lse, ent, gt, ght):
        """The non-one-hot part of d logits for cotangents g (log-prob) and gh (entropy), both
        already divided by T: ``-p * (g + gh * (log p + H)) / T``, using
        dH/dlogits = -p * (log p - sum p log p) / T with the forward's lse and H."""
        logp = logits.astype(mx.float32) * self.inv_t - lse[:, None]
        # -p * (a + b * log p) with per-row a = (g + gh H) / T, b = gh / T
        a = (gt + ght * ent.astype(mx.float32))[:, None]
        return mx.exp(logp) * (-(a + ght[:, None] * logp))

    def saved(self, logits_fn, hc, tc, want_entropy, entropy_grad=False):
        logits = logits_fn(hc)
        picked = self._picked(logits, tc)
        ex, s, lse = self._stats(logits)
        ent = self._entropy(ex, s, lse, logits) if want_entropy else None
        jh = None
        if entropy_grad:  # d H / d hidden rows for cotangent 1 (only when the entropy is trained)
            dh = self._entropy_dlogits(logits, lse, ent, mx.zeros(tc.shape, mx.float32),
                                       mx.full(tc.shape, self.inv_t, mx.float32))
            _, (jh,) = mx.vjp(logits_fn, [hc], [dh.astype(logits.dtype)])
        # d lp / d logits for cotangent 1: (onehot - ex / s) / T, in place over ex
        d = _onehot_add(ex * (-self.inv_t / s), tc, mx.full(tc.shape, self.inv_t, mx.float32))
        _, (j,) = mx.vjp(logits_fn, [hc], [d.astype(logits.dtype)])
        return picked - lse, j, ent, jh


class _Impl:
    """A per-chunk ``impl(logits, targets, T)`` with its own vjp (the custom kernels)."""

    saves_lse = False

    def __init__(self, impl, temperature: float):
        self.impl, self.t = impl, temperature

    def forward(self, logits, tc, want_entropy):
        lp = self.impl(logits, tc, self.t)
        return lp, (_entropy(logits, self.t) if want_entropy else None), None

    def grads(self, logits_fn, hc, params, tc, g, lse, gh=None, ent=None):
        # gh is always None here: with an entropy gradient _engine picks _Fused
        _, grads = mx.vjp(lambda x, *p: self.impl(logits_fn(x, *p), tc, self.t), [hc, *params], [g])
        return grads

    def saved(self, logits_fn, hc, tc, want_entropy, entropy_grad=False):
        # entropy_grad is always False here: with an entropy gradient _engine picks _Fused
        def f(x):
            logits = logits_fn(x)
            lp = self.impl(logits, tc, self.t)
            return (lp, _entropy(logits, self.t)) if want_entropy else (lp,)

        n = hc.shape[0]
        cot = [mx.ones((n,), mx.float32)] + ([mx.zeros((n,), mx.float32)] if want_entropy else [])
        outs, (j,) = mx.vjp(f, [hc], cot)
        return outs[0], j, (outs[1] if want_entropy else None), None


def _engine(impl, temperature: float, entropy_grad: bool = False):
    """The chunk engine: the reference math (:class:`_Fused`) unless a kernel runs. The kernels
    have no entropy backward, and one could not be verified on this CPU: when the entropy's
    gradient is wanted the reference runs instead (on Metal/CUDA too)."""
    if impl is selective_log_softmax_reference or entropy_grad:
        return _Fused(temperature)
    return _Impl(impl, temperature)


# -- the chunked op -----------------------------------------------------------------------------


def _detach(x: mx.array) -> mx.array:
    """``x`` evaluated, as a new array with no graph (a copy through NumPy)."""
    if x.dtype == mx.bfloat16:
        # NumPy has no bfloat16: through float32 (exact both ways), converted by the constructor.
        # A .view(bfloat16) here would be an op bound to this thread's stream, which the helper
        # thread (_outside_trace) cannot run: "There is no Stream(cpu, 0) in current thread"
        return mx.array(np.asarray(x.astype(mx.float32)), dtype=mx.bfloat16)
    return mx.array(np.asarray(x))


def _materialize(*xs: mx.array | None) -> tuple:
    """``xs`` evaluated now (together) and cut from their graph: a chunk's inputs (slices of h,
    targets, cotangents; [chunk] or [chunk x D]) as the graph-free arrays :func:`_outside_trace`
    needs.

    Inside a gradient transformation evaluated arrays keep their inputs alive for the tape (our
    custom vjp never needs them), and on the calling thread only a copy through NumPy drops that
    graph. So only small per-token arrays come here: a [V x D] head gradient through NumPy once per
    chunk costs more than the chunk's math on a GPU (the helper thread accumulates it instead).
    Under mx.compile / vmap evaluation is not allowed: there ``xs`` are returned as they are (the
    result stays correct; the memory bound is lost). Detaching also means no higher-order
    gradients."""
    live = [x for x in xs if x is not None]
    try:
        mx.eval(*live)
    except _NOT_EVALUABLE:
        return xs
    return tuple(None if x is None else _detach(x) for x in xs)


#: what mx.eval raises inside mx.compile / vmap: ValueError on a traced intermediate, RuntimeError
#: ("an array without a primitive") on a traced input of the compiled function
_NOT_EVALUABLE = (ValueError, RuntimeError)

_WORKER: ThreadPoolExecutor | None = None


def _worker() -> ThreadPoolExecutor:
    global _WORKER
    if _WORKER is None:
        _WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlx_ssp-logprobs")
    return _WORKER


def _outside_trace(fn: Callable, *args) -> tuple:
    """``fn(*args)`` (a tuple of arrays or None) built and evaluated on a helper thread.

    MLX keeps its transformation state per thread. Inside ``mx.grad`` (where our vjp runs) an
    evaluation retains every intermediate of the graph, so one chunk's backward held 6-7
    [chunk x V] buffers at once. On a thread of its own the same chunk is evaluated as plain MLX:
    buffers are donated and freed as soon as they are consumed (2 live in the backward, 3 in the
    save_grad forward), and the evaluated results come back already detached. The inputs must be
    evaluated, graph-free arrays (chunks of h go through :func:`_materialize`; head params are
    evaluated first). One worker, so chunks still run one at a time."""
    def run():
        out = fn(*args)
        mx.eval(*[x for x in out if x is not None])
        return out

    return _worker().submit(run).result()


def _evaluable(*xs: mx.array) -> bool:
    """Evaluate ``xs`` now; False where evaluation is not allowed (inside mx.compile / vmap), where
    the chunks must stay in the caller's lazy graph (correct, without the memory bound)."""
    try:
        mx.eval(*xs)
    except _NOT_EVALUABLE:
        return False
    return True


def _chunks(n: int, chunk_size: int):
    return [(s, min(s + chunk_size, n)) for s in range(0, n, chunk_size)]


def _cat(xs):
    return mx.concatenate(xs) if len(xs) > 1 else xs[0]


def _forward_chunks(fn: Callable, h: mx.array, targets: mx.array, chunk_size: int) -> list:
    """``fn(h_chunk, targets_chunk)`` (a tuple of arrays or None) for each chunk -> its outputs column-wise.

    One chunk stays lazy (forcing evaluation inside the gradient trace would materialise the whole
    model's forward at once: measured 2x the activation memory on a tiny model); with several,
    each is evaluated on its own on the helper thread, or, where evaluation is not allowed
    (mx.compile / vmap), left in the caller's lazy graph."""
    n = h.shape[0]
    if n <= chunk_size:
        return [[x] for x in fn(h, targets)]
    threaded = _evaluable(h, targets)
    rows = []
    for s, e in _chunks(n, chunk_size):
        if threaded:
            rows.append(_outside_trace(fn, *_materialize(h[s:e], targets[s:e])))
        else:
            rows.append(fn(*_after(rows, h[s:e], targets[s:e])))
    return [list(col) for col in zip(*rows)]


def _after(rows: list, *xs: mx.array) -> tuple:
    """``xs`` made to depend on the previous chunk's outputs (``rows[-1]``), in a lazy graph (under
    mx.compile / vmap): the evaluation then finishes one chunk, freeing its [chunk x V] buffers,
    before it starts the next, instead of interleaving every chunk's buffers (measured inside
    mlx-lm's compiled train step: 14 chunk buffers alive without it)."""
    prev = [x for x in rows[-1] if x is not None] if rows else []
    return tuple(mx.depends(list(xs), prev)) if prev else xs


def _make_op(logits_fn, n_params: int, temperature: float, chunk_size: int, impl, want_entropy: bool,
             entropy_grad: bool = False):
    """The chunked op as an mx.custom_function of (h, targets, *trained_head_params).

    Outputs: (log-probs, [entropy], [logsumexp per token, kept for the backward by the reference]).
    The entropy's cotangent is used only with ``entropy_grad`` (else the entropy is a statistic).
    A trained head's gradient is summed over the chunks on the helper thread (its running sum is
    an input and an output of each chunk's step there), so it is never copied off the device."""
    eng = _engine(impl, temperature, entropy_grad)

    @mx.custom_function
    def op(h, targets, *params):
        def chunk(x, t):
            return eng.forward(logits_fn(x, *params), t, want_entropy)

        lps, ents, lses = _forward_chunks(chunk, h, targets, chunk_size)
        out = (_cat(lps),)
        if want_entropy:
            out += (_cat(ents),)
        if eng.saves_lse:
            out += (_cat(lses),)
        return out

    @op.vjp
    def op_vjp(primals, cotangents, outputs):
        h, targets, *params = primals
        g = cotangents[0] if isinstance(cotangents, (list, tuple)) else cotangents
        lse = outputs[-1] if eng.saves_lse else None
        # the entropy's cotangent and value (its backward needs H), or None: no entropy gradient
        gh, ent = (cotangents[1], outputs[1]) if entropy_grad else (None, None)
        dhs, dps = [], [mx.zeros_like(p) for p in params]
        n = h.shape[0]
        if n <= chunk_size:  # one chunk: lazy, as the forward
            dh, *dps = eng.grads(logits_fn, h, params, targets, g, lse, gh, ent)
            return (dh, mx.zeros_like(targets), *dps)
        # the accumulators and cotangents travel to the helper thread: evaluated here
        extra = [x for x in (lse, gh, ent) if x is not None]
        threaded = _evaluable(h, targets, g, *dps, *extra)
        part = lambda x, s, e: None if x is None else x[s:e]  # noqa: E731

        def step(hc, tc, gc, lc, ghc, ec, *acc):
            grads = eng.grads(logits_fn, hc, params, tc, gc, lc, ghc, ec)
            return (grads[0], *[a + b for a, b in zip(acc, grads[1:])])

        for s, e in _chunks(n, chunk_size):
            ins = (h[s:e], targets[s:e], g[s:e], part(lse, s, e), part(gh, s, e), part(ent, s, e))
            if threaded:  # only the per-token inputs are copied; dps stay on the device, graph-free
                dh, *dps = _outside_trace(step, *_materialize(*ins), *dps)
            else:  # mx.compile / vmap: one lazy graph, the chunks in order (_after)
                hc, tc = _after([[dhs[-1], *dps]] if dhs else [], ins[0], ins[1])
                dh, *dps = step(hc, tc, *ins[2:], *dps)
            dhs.append(dh)
        return (_cat(dhs), mx.zeros_like(targets), *dps)

    return op


def _make_saved_op(logits_fn, temperature: float, chunk_size: int, impl, want_entropy: bool,
                   entropy_grad: bool = False):
    """The chunked op for a frozen head with the backward done in the forward pass.

    Each lp_i depends only on h_i, so d lp_i / d h_i is one D-vector J_i; it is computed while the
    chunk's logits are alive (J_i = (W[t_i] - softmax_i @ W) / T for a linear head). The backward
    is then ``dh = g[:, None] * J``: two head matmuls per chunk in all (as naive), instead of three
    with the recompute, for [tokens x D] of memory. A forward-only caller pays the second matmul
    for nothing: use it where a gradient follows.

    With ``entropy_grad`` each chunk also yields d H_i / d h_i (a second D-vector per token: one more
    head-gradient matmul per chunk) and the backward is ``g J + gh J_H``."""
    eng = _engine(impl, temperature, entropy_grad)

    @mx.custom_function
    def op(h, targets):
        def chunk(x, t):
            return eng.saved(logits_fn, x, t, want_entropy, entropy_grad)

        lps, js, ents, jhs = _forward_chunks(chunk, h, targets, chunk_size)
        out = (_cat(lps), _cat(js)) + ((_cat(ents),) if want_entropy else ())
        return out + ((_cat(jhs),) if entropy_grad else ())

    @op.vjp
    def op_vjp(primals, cotangents, outputs):
        h, targets = primals
        dh = cotangents[0].astype(mx.float32)[:, None] * outputs[1]
        if entropy_grad:
            dh = dh + cotangents[2].astype(mx.float32)[:, None] * outputs[3]
        return dh.astype(h.dtype), mx.zeros_like(targets)

    return op


def _entropy(logits: mx.array, temperature: float, grad: bool = False) -> mx.array:
    """Entropy of softmax(logits / T) per row, float32; no gradient (a statistic) unless ``grad``."""
    x = scaled(logits, temperature) if grad else mx.stop_gradient(scaled(logits, temperature))
    lse = mx.logsumexp(x, axis=-1, keepdims=True)
    p = mx.exp(x - lse)
    return lse[:, 0] - (p * x).sum(axis=-1)


def token_logprobs(
    hidden: mx.array,
    head: nn.Module,
    targets: mx.array,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    *,
    return_entropy: bool = False,
    entropy_grad: bool = False,
    save_grad: bool = False,
):
    """Per-token log-probs ``log_softmax(head(hidden) / T)[targets]`` as float32, shape ``targets.shape``.

    hidden [..., D], targets [...] int; ``head`` is an mlx-lm LM head (``nn.Linear``,
    ``nn.QuantizedLinear``, or the tied ``nn.Embedding`` / ``nn.QuantizedEmbedding``). Computed
    chunk by chunk over tokens; the custom vjp recomputes each chunk, so [tokens x vocab] never
    exists beyond one chunk in either direction. ``chunk_size=None`` picks the largest chunk whose
    live float32 [chunk x vocab] buffers fit 768 MiB (:func:`auto_chunk_size`: 432 tokens for
    Qwen3's 151,936 vocab, about 0.8 GB at the peak).
    ``save_grad=True`` (for callers that will take the gradient, with a frozen head) computes
    each chunk's d logp / d hidden rows in the forward instead of recomputing the chunk in the
    backward: two head matmuls in all instead of three (see :func:`_make_saved_op`). Gradients flow
    into ``hidden`` and into a float head's weights. With ``return_entropy`` also returns the per-token entropy of
    softmax(logits / T) (from the same forward logits); it has no gradient unless ``entropy_grad``,
    which gives it its exact one (dH/dlogits = -p (log p + H) / T) on every path, at the price of
    one more exp pass per chunk in the backward, or one more head-gradient matmul per chunk with
    ``save_grad``, and the reference math instead of a custom kernel."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if entropy_grad and not return_entropy:
        raise ValueError("entropy_grad=True needs return_entropy=True (the gradient is of the returned entropy)")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    shape = targets.shape
    if hidden.shape[:-1] != shape:
        raise ValueError(f"hidden {hidden.shape} and targets {shape} disagree on the token dimensions")
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1).astype(mx.int32)
    if h.shape[0] == 0:
        z = mx.zeros(shape, dtype=mx.float32)
        return (z, z) if return_entropy else z
    build = _head_builder(head)
    if build is None:  # unknown head type: correct but unchunked
        lp, ent = _unchunked(head, h, t, temperature, return_entropy, entropy_grad)
    else:
        lp, ent = _chunked(build(head), head, h, t, temperature, chunk_size, return_entropy, save_grad, entropy_grad)
    return (lp.reshape(shape), ent.reshape(shape)) if return_entropy else lp.reshape(shape)


def _unchunked(head: nn.Module, h, t, temperature: float, want_entropy: bool, entropy_grad: bool = False):
    """(log-probs, entropy or None) through the full logits of a head type HEADS does not know."""
    logits = head.as_linear(h) if hasattr(head, "as_linear") else head(h)
    lp = selective_log_softmax_reference(logits, t, temperature)
    return lp, (_entropy(logits, temperature, grad=entropy_grad) if want_entropy else None)


def _chunked(built, head: nn.Module, h, t, temperature: float, chunk_size, want_entropy: bool, save_grad: bool,
             entropy_grad: bool = False):
    """(log-probs, entropy or None) by the chunked op, for a head with a HEADS builder (``built``)."""
    params, logits_fn = built
    cs = chunk_tokens(head, chunk_size)
    if h.shape[0] > cs:
        # chunks are built on a helper thread: its inputs must be evaluated (not allowed inside
        # mx.compile, where the chunks stay in the caller's graph: see _forward_chunks)
        _evaluable(*params)
    if not head_trainable(head):
        # frozen head (LoRA, quantized): weights are constants of the op, so its backward
        # never computes (or keeps buffers for) a head gradient nobody asked for
        frozen, fn = params, logits_fn
        params, logits_fn = (), (lambda hc: fn(hc, *frozen))
    if save_grad and not params:
        outs = _make_saved_op(logits_fn, float(temperature), cs, _chunk_impl(), want_entropy, entropy_grad)(h, t)
        return outs[0], (outs[2] if want_entropy else None)
    outs = _make_op(logits_fn, len(params), float(temperature), cs, _chunk_impl(), want_entropy,
                    entropy_grad)(h, t, *params)
    return outs[0], (outs[1] if want_entropy else None)


def naive_token_logprobs(hidden: mx.array, head: nn.Module, targets: mx.array, temperature: float = 1.0) -> mx.array:
    """The unchunked definition (full logits and log-softmax): for tests and benchmarks."""
    logits = head.as_linear(hidden) if isinstance(head, (nn.Embedding, nn.QuantizedEmbedding)) else head(hidden)
    lsm = nn.log_softmax(logits.astype(mx.float32) / temperature, axis=-1)
    return mx.take_along_axis(lsm, targets[..., None].astype(mx.int32), axis=-1)[..., 0]


def sequence_hidden(model: nn.Module, inputs: mx.array) -> mx.array:
    """Final hidden states (after the last norm, before the LM head) of an mlx-lm model."""
    inner = getattr(model, "model", None)
    if inner is None:
        raise ValueError(f"{type(model).__name__} has no .model backbone; not an mlx-lm causal LM")
    return inner(inputs)


def model_token_logprobs(
    model: nn.Module, inputs: mx.array, targets: mx.array, *args, compute_dtype: mx.Dtype | None = None, **options
) -> mx.array | tuple[mx.array, mx.array]:
    """``token_logprobs`` of ``targets`` given ``inputs`` ([B, L] each, targets = inputs shifted
    by one) through an mlx-lm model's backbone and head. ``args`` / ``options`` are
    :func:`token_logprobs`' (temperature, chunk_size, return_entropy, ...); the hidden states are
    cast to ``compute_dtype`` first when one is given."""
    h = sequence_hidden(model, inputs)
    if compute_dtype is not None:
        h = h.astype(compute_dtype)
    return token_logprobs(h, head_of(model), targets, *args, **options)


__all__: Sequence[str] = (
    "chunk_impl_name",
    "head_of",
    "model_token_logprobs",
    "naive_token_logprobs",
    "selective_log_softmax_reference",
    "token_logprobs",
)
