"""The per-chunk math of the chunked log-prob op (:mod:`mlx_ssp.rl.logprobs`): one engine per path.

Given one chunk's logits, an engine does the forward (log-probs, the optional entropy, and what the
backward keeps), the gradient into the chunk's hidden rows and trained head parameters, and the
``save_grad`` forward (log-probs plus d logp / d hidden rows for cotangent 1).

- :class:`FusedEngine`: the reference math written out per chunk (the path wherever no custom
  kernel runs); it keeps the forward's logsumexp for the backward, ``d logits = (g / T) *
  (onehot(t) - exp(x - lse))``, formed in one exp pass with the one-hot part scatter-added at the
  targets only.
- :class:`KernelEngine`: a custom kernel called per chunk as ``impl(logits, targets, T)`` with its
  own vjp (:mod:`mlx_ssp.rl.kernels`).

Entropy: the per-token entropy H of softmax(logits / T) from the same logits, a statistic without
gradient unless ``entropy_grad`` (the RL loss's entropy bonus). Then the backward also uses
dH/dlogits = -p (log p + H) / T: in the recompute vjp one more element-wise term on the
recomputed chunk; in the save_grad forward a second per-token D-vector d H / d h (one more
head-gradient matmul per chunk). Deviation: the custom kernels have no entropy backward, so with
``entropy_grad`` the reference math runs on every device (:func:`chunk_engine`).
"""

from __future__ import annotations

import mlx.core as mx

from mlx_ssp.rl.kernels.log_softmax import flat_index, scaled, selective_log_softmax_reference

# An engine does one chunk's math given its logits: the forward (log-probs, optional entropy, and
# what the backward keeps), the gradient into the chunk's hidden rows and head params, and the
# save_grad forward (log-probs plus d logp / d hidden rows for cotangent 1).


def _onehot_add(d: mx.array, targets: mx.array, values: mx.array) -> mx.array:
    """``d + values[:, None] * onehot(targets)``: a scatter-add at the targets only (in place where
    MLX can donate ``d``; no [chunk x V] one-hot, no put_along_axis)."""
    return d.reshape(-1).at[flat_index(targets, d.shape[1])].add(values).reshape(d.shape)


class FusedEngine:
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


class KernelEngine:
    """A per-chunk ``impl(logits, targets, T)`` with its own vjp (the custom kernels)."""

    saves_lse = False

    def __init__(self, impl, temperature: float):
        self.impl, self.t = impl, temperature

    def forward(self, logits, tc, want_entropy):
        lp = self.impl(logits, tc, self.t)
        return lp, (softmax_entropy(logits, self.t) if want_entropy else None), None

    def grads(self, logits_fn, hc, params, tc, g, lse, gh=None, ent=None):
        # gh is always None here: with an entropy gradient chunk_engine picks FusedEngine
        _, grads = mx.vjp(lambda x, *p: self.impl(logits_fn(x, *p), tc, self.t), [hc, *params], [g])
        return grads

    def saved(self, logits_fn, hc, tc, want_entropy, entropy_grad=False):
        # entropy_grad is always False here: with an entropy gradient chunk_engine picks FusedEngine
        def f(x):
            logits = logits_fn(x)
            lp = self.impl(logits, tc, self.t)
            return (lp, softmax_entropy(logits, self.t)) if want_entropy else (lp,)

        n = hc.shape[0]
        cot = [mx.ones((n,), mx.float32)] + ([mx.zeros((n,), mx.float32)] if want_entropy else [])
        outs, (j,) = mx.vjp(f, [hc], cot)
        return outs[0], j, (outs[1] if want_entropy else None), None


def chunk_engine(impl, temperature: float, entropy_grad: bool = False):
    """The chunk engine: the reference math (:class:`FusedEngine`) unless a kernel runs. The kernels
    have no entropy backward, and one could not be verified on this CPU: when the entropy's
    gradient is wanted the reference runs instead (on Metal/CUDA too)."""
    if impl is selective_log_softmax_reference or entropy_grad:
        return FusedEngine(temperature)
    return KernelEngine(impl, temperature)


def softmax_entropy(logits: mx.array, temperature: float, grad: bool = False) -> mx.array:
    """Entropy of softmax(logits / T) per row, float32; no gradient (a statistic) unless ``grad``."""
    x = scaled(logits, temperature) if grad else mx.stop_gradient(scaled(logits, temperature))
    lse = mx.logsumexp(x, axis=-1, keepdims=True)
    p = mx.exp(x - lse)
    return lse[:, 0] - (p * x).sum(axis=-1)
