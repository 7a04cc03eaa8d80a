"""The update of an RL step: ``mu`` inner updates of the policy on one batch, all or nothing.

Steps 4-5 of a step (VibeThinker-1.5B section 3.4; GRPO, DeepSeekMath arXiv:2402.03300 section 4):

4. ``mu`` inner updates on the whole batch (pieces of at most ``micro_batch_size`` rows,
   gradients accumulated so the loss is exactly the full batch's: :mod:`mlx_ssp.rl.pieces`); the
   ratio is against the log-probs of the policy that sampled (``old_logprobs: recompute``: the
   first inner update's own forward, so the ratio is exactly 1 there and the clip acts from the
   second; ``behaviour``: the sampler's recorded log-probs, for rollouts from another engine);
   optional k3 KL to the reference (LoRA: adapters off; full fine-tuning: a frozen copy);
5. optimizer step (mlx.optimizers, grad-norm clipping); a step whose loss or gradients are not
   finite at any inner update changes nothing (with ``mu > 1`` the inner updates already applied
   are undone from a snapshot).

:class:`Updater` holds the optimizer and lays the batch's rows out (:meth:`Updater.layout`: the
G samples of a prompt share its prefill in every training forward with ``share_prefix``,
:mod:`mlx_ssp.rl.prefix`; ``auto_micro_batch`` sizes the pieces by :mod:`mlx_ssp.rl.memory`). With
several ranks each trains on its block of the batch and the gradients and statistics are summed
over ranks. Token statistics are exact whole-batch values: sums and counts over pieces, inner
updates and ranks, divided once.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from mlx_ssp import distributed as dist
from mlx_ssp.finetune.lora import adapters_disabled
from mlx_ssp.finetune.optim import OPTIMIZERS, build_optimizer, warmup_constant
from mlx_ssp.rl import memory, objectives
from mlx_ssp.rl.batch import slice_rows, trim_padding
from mlx_ssp.rl.config import RLConfig
from mlx_ssp.rl.lm_heads import head_of, head_trainable
from mlx_ssp.rl.logprobs import chunk_tokens
from mlx_ssp.rl.loss import finalize_totals, merge_totals
from mlx_ssp.rl.objectives import aggregation_units
from mlx_ssp.rl.pieces import (
    behaviour_totals,
    flat_kv,
    make_loss,
    piece_value_and_grad,
    prefix_grads,
    sequence_logprobs,
    set_params,
)
from mlx_ssp.rl.policy import memory_config
from mlx_ssp.rl.prefix import blocks, hidden_after, prefix_kv, shareable


def reduce_totals(parts: list[dict]) -> dict:
    """Totals of every micro-batch, inner update or rank together (one dict of floats)."""
    return functools.reduce(merge_totals, parts, {})


def _stacked(totals: dict[str, mx.array]) -> tuple[list[str], mx.array]:
    """(names, one float32 vector of the values): evaluated with the micro-batch, then read back with
    a single ``tolist()`` instead of a second evaluation."""
    keys = list(totals)
    return keys, mx.stack([totals[k].astype(mx.float32) for k in keys])


def _snapshot(model: nn.Module, opt) -> tuple:
    """The trainable parameters and the optimizer state as they are now. MLX arrays are immutable and
    an update only rebinds them, so fresh containers holding the same arrays are a snapshot (no data
    copied; the optimizer mutates its dicts in place, hence the fresh containers)."""
    return tree_map(lambda x: x, model.trainable_parameters()), tree_map(lambda x: x, opt.state)


def _restore(model: nn.Module, opt, snap: tuple) -> None:
    params, state = snap
    model.update(params)
    opt.state = state


def _finite(x: mx.array) -> bool:
    return bool(mx.isfinite(x).all().item())


def _grad_norm(grads) -> mx.array:
    leaves = [g for _, g in tree_flatten(grads)]
    return mx.sqrt(sum(((g.astype(mx.float32) ** 2).sum() for g in leaves), mx.array(0.0)))



class Updater:
    """The update of one policy: its optimizer, the layout of a batch's rows in pieces, and
    :meth:`update` (``mu`` inner updates on a batch, all or nothing)."""

    def __init__(self, model: nn.Module, cfg: RLConfig, ref_model: Optional[nn.Module] = None):
        self.model, self.cfg, self.ref_model = model, cfg, ref_model
        self._shareable = shareable(model) and (ref_model is None or shareable(ref_model))
        self._chunk_tokens = chunk_tokens(head_of(model), cfg.chunk_size)
        # a forward computed twice (prefix kv, two-phase) must be the same function both times
        self._recompute_safe = cfg.fine_tune_type != "lora" or not cfg.lora.dropout
        self._frozen_head = not head_trainable(head_of(model))
        # the memory model's view of the policy, for auto_micro_batch (None: a model it does not cover)
        self._memory_config = memory_config(model) if cfg.auto_micro_batch else None
        self._piece_rows: dict[tuple[int, int], int] = {}
        sched = warmup_constant(cfg.learning_rate, cfg.warmup_steps)
        wd = {"weight_decay": cfg.weight_decay} if OPTIMIZERS[cfg.optimizer].weight_decay else {}
        self.opt = build_optimizer(cfg.optimizer, sched, wd, what="rl.optimizer")
        self.opt.init(model.trainable_parameters())

    def update(self, batch: dict) -> tuple[bool, dict]:
        """``mu`` inner updates on the batch; returns (all finite, statistics).

        All or nothing: when the loss or gradient of any inner update is not finite, the updates
        already applied are undone (parameters and optimizer state, step count included, restored
        from a snapshot), so a skipped step changes nothing. Statistics are whole-batch values
        (totals over micro-batches, inner updates and ranks, divided once: see
        :func:`mlx_ssp.rl.loss.finalize_totals`), whatever ``micro_batch_size`` and the world size."""
        cfg = self.cfg
        batch, layout, units, ref_s = self.plan(batch)
        kept_frac = batch.pop("entropy_kept_frac", None)
        loss_fn = make_loss(cfg, units)
        # with one inner update nothing is applied before the finiteness check: no snapshot needed
        snap = _snapshot(self.model, self.opt) if cfg.mu > 1 else None
        glob: dict[str, float] = {}  # loss, grad norm: already global (all-reduced), mean over mu
        parts: list[dict] = []  # this rank's totals, one per micro-batch and inner update
        old_parts: list[mx.array] = []
        ok = True
        for inner in range(cfg.mu):
            grads_sum, loss_sum = self._accumulate(loss_fn, batch, layout, inner, old_parts, parts)
            grads_sum, loss_sum = self._all_reduce(grads_sum, loss_sum)
            gnorm = _grad_norm(grads_sum)
            if not (math.isfinite(loss_sum) and _finite(gnorm)):
                ok = False
                break
            self._apply(grads_sum, gnorm)
            glob["loss"] = glob.get("loss", 0.0) + loss_sum / cfg.mu
            glob["grad_norm"] = glob.get("grad_norm", 0.0) + float(gnorm.item()) / cfg.mu
        if not ok and snap is not None:
            _restore(self.model, self.opt, snap)
            mx.eval(self.model.trainable_parameters(), self.opt.state)
        stats = self._statistics(parts, glob, ok)
        stats["ref_s"] = ref_s
        if kept_frac is not None:
            stats["entropy_kept_frac"] = kept_frac
        return ok, stats

    def plan(self, batch: dict) -> tuple[dict, list, float, float]:
        """(this rank's share of the batch, its layout (:meth:`layout`), the batch's aggregation
        units, the seconds of the reference forward), with the reference log-probs (KL) and the
        behaviour log-probs as old log-probs attached."""
        cfg = self.cfg
        if cfg.top_entropy_quantile is not None:
            # the cut is over the whole batch's tokens (before ranks and micro-batches split it), from
            # the policy at the start of the step, so micro-batch size and world size change nothing
            ent = self.entropies(batch)
            thr = objectives.entropy_threshold(ent, batch["mask"], cfg.top_entropy_quantile)
            n_before = float(batch["mask"].sum().item())
            batch["mask"] = objectives.top_entropy_mask(ent, batch["mask"], thr)
            batch["entropy_kept_frac"] = float(batch["mask"].sum().item()) / max(n_before, 1.0)
        units = float(aggregation_units(cfg.aggregation, batch["mask"]).item()) or 1.0
        # data parallel: each rank trains on its block of the (identical, gathered)
        # batch; loss shares are of the global units, so the summed gradients are the batch's
        lo, hi = dist.shard_bounds(batch["inputs"].shape[0], dist.rank(), dist.size())
        batch = slice_rows(batch, lo, hi)
        layout = self.layout(batch)
        ref_s = 0.0  # the reference forward's share of train_s (reported as ref_s)
        if cfg.beta > 0:
            t0 = time.perf_counter()
            batch["ref"] = self._ref_logprobs(batch, layout)
            ref_s = time.perf_counter() - t0
        if cfg.old_logprobs == "behaviour" and cfg.tis_cap is None:
            batch["old"] = batch["behaviour"]
        # with tis_cap the old policy is the trainer's own (recomputed in the first inner update) and
        # the sampler's mismatch enters as a truncated weight (make_loss)
        return batch, layout, units, ref_s

    def layout(self, batch: dict) -> list[tuple[int, list[tuple[int, int]]]]:
        """(shared prefix length, pieces of rows) for each block of rows (:func:`mlx_ssp.rl.prefix.blocks`:
        a group's rows share its prompt; one block of the whole batch, prefix 0, without sharing).

        A block's prefix runs once per pass; its rows go in pieces of at most ``micro_batch_size``
        rows whose log-prob tokens also fit one chunk of the op, where a row does (over more chunks
        the op evaluates its input inside the gradient trace: see :func:`piece_value_and_grad`,
        which a row longer than a chunk takes alone; with a trained head, full fine-tuning, it
        stays in one trace and pays that memory). Gradients accumulate, so the update is the
        same whatever the layout (tests/test_rl_prefix.py). With LoRA dropout the layout is the
        unshared one and there is no two-phase path: both recompute a forward, which would draw
        other dropout masks than the loss saw."""
        inputs, mask = np.asarray(batch["inputs"]), np.asarray(batch["mask"])
        n, L = inputs.shape
        if self.cfg.share_prefix and self._shareable and self._recompute_safe:
            spans = blocks(inputs, mask)
        else:
            spans = [(0, n, 0)] if n else []  # a rank with no rows has nothing to lay out
        cap = self._rows_cap(mask)
        out = []
        for i, j, p in spans:
            per = max(1, min(cap, self._chunk_tokens // max(1, L - p)))
            out.append((p, [(a, min(a + per, j)) for a in range(i, j, per)]))
        return out

    def _rows_cap(self, mask: np.ndarray) -> int:
        """Rows per piece at most: ``micro_batch_size``, or with ``auto_micro_batch`` the memory
        model's choice for this batch's longest prompt and completion (:func:`memory.auto_micro_batch`)."""
        if self._memory_config is None or not mask.size:
            return self.cfg.micro_batch_size
        # mask[r, t] marks the targets t + 1 that are completion tokens: the first is the prompt's end
        prompt = int(mask.argmax(axis=1).max()) + 1
        completion = max(1, mask.shape[1] + 1 - prompt)
        key = (prompt, completion)
        if key not in self._piece_rows:
            rl = self.cfg.model_copy(update={"sampling": self.cfg.sampling.model_copy(update={"max_tokens": completion})})
            device = "cpu" if mx.default_device() == mx.cpu else "gpu"
            dtype = memory.train_dtype(self.cfg, memory.shape_from_config(self._memory_config), device)
            self._piece_rows[key] = memory.auto_micro_batch(self._memory_config, rl, prompt_tokens=prompt, dtype=dtype)
        return self._piece_rows[key]

    def _accumulate(self, loss_fn, batch: dict, layout, inner: int, old_parts: list, parts: list):
        """(summed gradients, summed loss) of one inner update over this rank's pieces of rows;
        each piece's totals go to ``parts``. A block's prefix keys and values are computed once
        (no graph), each piece's gradient reaches them, and the prefix's backward runs once with
        their sum (:func:`prefix_grads`). ``recompute``: the first inner update's log-probs are
        the old log-probs of the later ones (kept in ``old_parts``)."""
        recompute = self.cfg.old_logprobs == "recompute" or self.cfg.tis_cap is not None
        names, arrays = (list(x) for x in zip(*tree_flatten(self.model.trainable_parameters())))
        grads_sum, loss_sum, k = None, 0.0, 0

        def add(acc, g):
            return g if acc is None else [a + b for a, b in zip(acc, g)]

        try:
            for p, pieces in layout:
                first = batch["inputs"][pieces[0][0]:pieces[0][0] + 1, :p]
                kv = prefix_kv(self.model, first) if p else None
                if kv:
                    mx.eval(kv)
                dkv = None
                for i, j in pieces:
                    mb = slice_rows(batch, i, j)
                    if self.cfg.trim_padding:
                        mb = trim_padding(mb, keep=p + 1)
                    mb["prefix"] = p
                    if recompute:
                        mb["old"] = old_parts[k] if inner > 0 else None
                    cols = mb["inputs"].shape[1]
                    two = (j - i) * (cols - p) > self._chunk_tokens and self._frozen_head and self._recompute_safe
                    (loss, (totals, logp)), grads, gkv = piece_value_and_grad(self.model, loss_fn, mb, kv, names,
                                                                               arrays, two)
                    if inner == 0:  # sampler vs trainer log-probs of the same tokens: should be ~1e-5
                        totals = {**totals, **behaviour_totals(logp, mb["behaviour"], mb["mask"])}
                    keys, vec = _stacked(totals)
                    mx.eval(loss, grads, gkv, vec, logp)
                    if inner == 0 and recompute:
                        old_parts.append(logp)
                    loss_sum += float(loss.item())
                    # the cache's gradient summed in float32 (bf16 training), cast once for the prefix's backward
                    grads_sum, dkv, k = add(grads_sum, grads), add(dkv, [g.astype(mx.float32) for g in gkv]), k + 1
                    parts.append(dict(zip(keys, vec.tolist())))
                if p:
                    dkv = [g.astype(x.dtype) for g, x in zip(dkv, flat_kv(kv))]
                    grads_sum = add(grads_sum, prefix_grads(self.model, first, dkv, names, arrays))
                    mx.eval(grads_sum)
        finally:
            set_params(self.model, names, arrays)  # the parameters, not the transforms' tracers
        if grads_sum is None:
            return None, loss_sum
        return tree_unflatten(list(zip(names, grads_sum))), loss_sum

    def _all_reduce(self, grads_sum, loss_sum: float):
        """Gradients and loss summed over ranks (unchanged on one)."""
        if dist.size() > 1:
            if grads_sum is None:  # no sequence on this rank (batch smaller than the world)
                grads_sum = tree_map(mx.zeros_like, self.model.trainable_parameters())
            grads_sum = dist.sum_gradients(grads_sum, what="rl: sum gradients")
            loss_sum = dist.sum_floats({"loss": loss_sum}, what="rl: sum loss")["loss"]
        return grads_sum, loss_sum

    def _apply(self, grads_sum, gnorm: mx.array) -> None:
        """Clip the gradients to ``max_grad_norm`` and take one optimizer step."""
        if self.cfg.max_grad_norm is not None:
            scale = mx.minimum(1.0, self.cfg.max_grad_norm / (gnorm + 1e-6))
            grads_sum = tree_map(lambda g: g * scale, grads_sum)
        self.opt.update(self.model, grads_sum)
        mx.eval(self.model.trainable_parameters(), self.opt.state)

    def _statistics(self, parts: list[dict], glob: dict, ok: bool) -> dict:
        """Whole-batch statistics: this rank's totals, summed over ranks, divided once."""
        totals = reduce_totals(parts)
        if dist.size() > 1:  # sums and counts over every rank's tokens, maxima as maxima
            totals = reduce_totals(dist.gather_per_rank(totals, what="rl: gather statistics"))
        stats = {**finalize_totals(totals), **glob}
        stats["lr"] = float(self.opt.learning_rate.item())
        if not ok:
            stats["loss"] = float("nan")
        return stats

    def _forward(self, model: nn.Module, batch: dict, layout, entropy: bool = False) -> mx.array:
        """Per-token log-probs (or entropies) of ``model`` on the batch, no gradient, in ``layout``
        (:meth:`layout`): each block's prefix runs once, its pieces attend to it. With
        ``trim_padding`` a piece runs to its last loss token and its values after it are 0."""
        T = self.cfg.sampling.temperature
        L = batch["inputs"].shape[1]
        parts = []
        for p, pieces in layout:
            kv = prefix_kv(model, batch["inputs"][pieces[0][0]:pieces[0][0] + 1, :p]) if p else None
            for i, j in pieces:
                mb = slice_rows(batch, i, j)
                if self.cfg.trim_padding:
                    mb = trim_padding(mb, keep=p + 1)
                h = hidden_after(model, mb["inputs"][:, p:], kv) if p else model.model(mb["inputs"])
                out = sequence_logprobs(model, mb["inputs"], mb["targets"], T, self.cfg.chunk_size,
                                        entropy=entropy, prefix=p, hidden=h)
                x = out[1] if entropy else out
                if x.shape[1] < L:
                    x = mx.pad(x, [(0, 0), (0, L - x.shape[1])])
                mx.eval(x)
                parts.append(x)
        return mx.stop_gradient(mx.concatenate(parts))

    def entropies(self, batch: dict) -> mx.array:
        """Per-token entropy of the current policy at the sampling temperature (no gradient)."""
        return self._forward(self.model, batch, self.layout(batch), entropy=True)

    def _ref_logprobs(self, batch: dict, layout) -> mx.array:
        if self.ref_model is not None:
            return self._forward(self.ref_model, batch, layout)
        with adapters_disabled(self.model):
            return self._forward(self.model, batch, layout)

