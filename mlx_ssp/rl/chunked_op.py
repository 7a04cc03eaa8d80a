"""The chunked log-prob op as ``mx.custom_function`` s, and the chunk-by-chunk evaluation under it.

:func:`make_op` builds the op of (hidden rows, targets, trained head parameters): the forward runs
one engine (:mod:`mlx_ssp.rl.chunk_engines`) per chunk of tokens, and its vjp recomputes each
chunk's logits from h and the head, so [tokens x vocab] never exists beyond one chunk.
:func:`make_saved_op` (frozen heads, callers that will differentiate: the RL loop's training path)
computes each chunk's d logp / d hidden rows in the forward pass instead: two head matmuls and one
exp pass per chunk, as naive, instead of three with the recompute.

Memory: with more than one chunk, each chunk is evaluated eagerly, since MLX's lazy graph would
otherwise hold every chunk's buffers at once, and it is built and evaluated on a helper thread
(:func:`_outside_trace`; the reference and the kernels alike, on every device), because inside
``mx.grad`` MLX keeps every intermediate of an evaluated graph alive (measured 6-7 [chunk x V]
buffers per backward chunk instead of 2) and only a copy through NumPy (:func:`_materialize`) would
cut it there. That copy is kept for the small per-token chunk inputs; a trained head's gradient
([V x D], 593 MiB in float32 at Qwen3-0.6B's size) is accumulated on the helper thread and never
leaves the device (through NumPy once per chunk it made the kernel path 26-37x slower than the
reference on an H200). Under mx.compile / vmap, where evaluation is not allowed, the chunks stay in
the caller's lazy graph, in order (correct, without the memory bound).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np

from mlx_ssp.rl.chunk_engines import chunk_engine


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


def evaluable(*xs: mx.array) -> bool:
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
    threaded = evaluable(h, targets)
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


def make_op(logits_fn, n_params: int, temperature: float, chunk_size: int, impl, want_entropy: bool,
             entropy_grad: bool = False):
    """The chunked op as an mx.custom_function of (h, targets, *trained_head_params).

    Outputs: (log-probs, [entropy], [logsumexp per token, kept for the backward by the reference]).
    The entropy's cotangent is used only with ``entropy_grad`` (else the entropy is a statistic).
    A trained head's gradient is summed over the chunks on the helper thread (its running sum is
    an input and an output of each chunk's step there), so it is never copied off the device."""
    eng = chunk_engine(impl, temperature, entropy_grad)

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
        threaded = evaluable(h, targets, g, *dps, *extra)
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


def make_saved_op(logits_fn, temperature: float, chunk_size: int, impl, want_entropy: bool,
                   entropy_grad: bool = False):
    """The chunked op for a frozen head with the backward done in the forward pass.

    Each lp_i depends only on h_i, so d lp_i / d h_i is one D-vector J_i; it is computed while the
    chunk's logits are alive (J_i = (W[t_i] - softmax_i @ W) / T for a linear head). The backward
    is then ``dh = g[:, None] * J``: two head matmuls per chunk in all (as naive), instead of three
    with the recompute, for [tokens x D] of memory. A forward-only caller pays the second matmul
    for nothing: use it where a gradient follows.

    With ``entropy_grad`` each chunk also yields d H_i / d h_i (a second D-vector per token: one more
    head-gradient matmul per chunk) and the backward is ``g J + gh J_H``."""
    eng = chunk_engine(impl, temperature, entropy_grad)

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
