"""The MGPO-GRPO training loop (``mlx_ssp rl``): Signal phase of SSP.

Each step (VibeThinker-1.5B section 3.4; GRPO, DeepSeekMath arXiv:2402.03300 section 4):

1. take ``batch_size`` prompts from a seeded, per-epoch shuffled stream of the training tasks;
2. sample ``group_size`` completions per prompt from the *current* policy with the rollout engine
   (:func:`mlx_ssp.rollout.generate_rollouts`: mlx-lm's BatchGenerator, behaviour log-probs kept,
   verifier rewards); with ``dynamic_sampling`` (DAPO) groups whose rewards are all equal (p in
   {0, 1} for binary rewards: no learning signal) are dropped and more prompts are sampled, at
   most ``max_refill_rounds`` extra rounds;
3. with ``long2short`` set, the kept groups' rewards are shaped first (:mod:`mlx_ssp.rl.shaping`:
   zero-sum among each group's correct samples, so p(q) is unchanged; VibeThinker-3B section 2.2.2);
   MGPO advantages A' = w(p) * A (:func:`mlx_ssp.rl.mgpo.mgpo_advantages`, or its kernel twin);
4. ``mu`` inner updates on the whole batch (micro-batches of ``micro_batch_size`` sequences,
   gradients accumulated so the loss is exactly the full batch's): the forward runs on
   prompt + completion, the completion mask selects the tokens (an episode's: the model's own
   messages only, not the tool results between them; :func:`build_batch`), log-probs come from the chunked
   op at the sampling temperature; the ratio is against the log-probs of the policy that sampled
   (``old_logprobs: recompute``: the first inner update's own forward, so the ratio is exactly 1
   there and the clip acts from the second; ``behaviour``: the sampler's recorded log-probs,
   for rollouts from another engine); optional k3 KL to the reference (LoRA: adapters off);
5. optimizer step (mlx.optimizers, grad-norm clipping); a step whose loss or gradients are not
   finite at any inner update is skipped and counted, and changes nothing (with ``mu > 1`` the
   inner updates already applied are undone from a snapshot); ``max_bad_steps`` in a row stop
   the run with a checkpoint of the last good state.

Metrics (one JSON line per step in ``metrics.jsonl``, ``pass@1`` and ``correct_len_mean`` among them; token statistics are exact whole-batch
values: sums and counts over micro-batches, inner updates and ranks, divided once), checkpoints
every ``checkpoint_every`` steps in ``checkpoints/step_NNNNNNN`` (adapters or weights, optimizer
state, RNG and stream state) and a resumable run directory. The G samples of a prompt share its prefill
in the rollout engine and in every training forward (``share_prefix``: the prefix a block of rows,
a group, shares runs once per pass, :mod:`mlx_ssp.rl.prefix`). Deviation: the reference for KL with full
fine-tuning is a second copy of the model (only LoRA can switch the adapters off).
"""

from __future__ import annotations

import functools
import json
import math
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from mlx_ssp import distributed as dist
from mlx_ssp import progress, trackers
from mlx_ssp.errors import UserError
from mlx_ssp.finetune import checkpoints as ckpts
from mlx_ssp.finetune.lora import adapter_config as lora_adapter_config
from mlx_ssp.finetune.lora import adapters_disabled, attach_lora
from mlx_ssp.finetune.optim import OPTIMIZERS, build_optimizer, warmup_constant
from mlx_ssp.finetune.seed import step_seed
from mlx_ssp.io import write_json_atomic
from mlx_ssp.models import load_model
from mlx_ssp.rl import kernels, memory, objectives
from mlx_ssp.rl.config import RLConfig
from mlx_ssp.rl.kernels import grouped_advantages
from mlx_ssp.rl.logprobs import chunk_tokens, head_of, head_trainable, token_logprobs
from mlx_ssp.rl.loss import finalize_totals, merge_totals, policy_loss, token_totals
from mlx_ssp.rl.objectives import aggregation_units
from mlx_ssp.rl.prefix import blocks, hidden_after, prefix_kv, shareable, suffix_hidden
from mlx_ssp.rl.shaping import apply_shapings, correct_length_metrics, shaping_on
from mlx_ssp.rollout import generate_rollouts
from mlx_ssp.tasks import Task, render_prompt

ADAPTER_FILE = ckpts.ADAPTER_FILE


# -- model setup ---------------------------------------------------------------------------------


def resolve_train_dtype(cfg: RLConfig):
    """float32 on CPU (half-precision matmul is slow there), else the model's own dtype (None);
    log-softmax always accumulates in float32."""
    if cfg.train_dtype == "auto":
        return mx.float32 if mx.default_device() == mx.cpu else None
    return getattr(mx, cfg.train_dtype)


def memory_config(model: nn.Module) -> Optional[dict]:
    """The model's mlx-lm arguments as a config.json dict for :mod:`mlx_ssp.rl.memory`, or None where
    the memory model does not cover it (no ``args``, experts, a missing size)."""
    try:
        cfg = dict(vars(model.args))
        memory.shape_from_config(cfg)
    except (AttributeError, TypeError, ValueError, KeyError):
        return None
    return cfg


def setup_model(model: nn.Module, cfg: RLConfig, seed: int = 0) -> nn.Module:
    """Freeze the base and add LoRA adapters (``lora``; their init is seeded by ``seed``), or
    train every weight (``full``); cast to the training dtype (float32 on CPU by default)."""
    dtype = resolve_train_dtype(cfg)
    if dtype is not None:
        model.set_dtype(dtype)
    if cfg.fine_tune_type == "lora":
        attach_lora(model, cfg.lora, seed)
    else:
        model.unfreeze()
    model.train()
    return model


def adapter_config(cfg: RLConfig, model: nn.Module) -> dict:
    """``adapter_config.json`` (:func:`mlx_ssp.finetune.lora.adapter_config`) with the block count resolved."""
    n = len(model.layers) if cfg.lora.num_layers < 0 else cfg.lora.num_layers
    return lora_adapter_config(cfg.lora, fine_tune_type=cfg.fine_tune_type, num_layers=n)


# -- batches -------------------------------------------------------------------------------------


class TaskStream:
    """Prompts in a per-epoch permutation seeded by (seed, epoch); the position is the state."""

    def __init__(self, n: int, seed: int, epoch: int = 0, cursor: int = 0):
        self.n, self.seed, self.epoch, self.cursor = n, seed, epoch, cursor
        self._order = self._perm()

    def _perm(self) -> np.ndarray:
        return np.random.default_rng([self.seed, self.epoch]).permutation(self.n)

    def take(self, k: int) -> list[int]:
        out = []
        for _ in range(k):
            if self.cursor >= self.n:
                self.epoch, self.cursor = self.epoch + 1, 0
                self._order = self._perm()
            out.append(int(self._order[self.cursor]))
            self.cursor += 1
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}


def build_batch(records: list[dict], advantages: np.ndarray) -> dict:
    """Right-padded [B, L] inputs/targets of prompt + completion, the loss mask, the behaviour
    log-probs on the mask, and the per-sample advantages.

    Episodes: ``token_ids`` is the whole conversation after the prompt (the model's
    messages and the tool results / user turns rendered between them) and ``model_mask`` marks the
    tokens the model sampled. The forward still runs over the whole conversation (the model's later
    messages are conditioned on the tool results), but the mask is the completion span times
    ``model_mask``, so tool-result and user tokens get no loss, no gradient and no weight in any
    aggregation or statistic. Records without ``model_mask`` (single-turn) are all the model's.
    ``tokens`` counts the forward's tokens (prompt + conversation), ``model_tokens`` the loss's."""
    seqs = [list(r["prompt_token_ids"]) + list(r["token_ids"]) for r in records]
    L = max(len(s) for s in seqs) - 1
    B = len(seqs)
    inputs = np.zeros((B, L), np.int32)
    targets = np.zeros((B, L), np.int32)
    mask = np.zeros((B, L), np.float32)
    old = np.zeros((B, L), np.float32)
    for i, (r, s) in enumerate(zip(records, seqs)):
        n = len(s) - 1
        inputs[i, :n] = s[:-1]
        targets[i, :n] = s[1:]
        p, c = len(r["prompt_token_ids"]), len(r["token_ids"])
        # target position j predicts token j+1: completion tokens are targets p-1 .. p+c-2
        mask[i, p - 1 : p - 1 + c] = model_mask(r)
        # episodes record 0.0 off the model's tokens; masked there anyway, zeroed so no stray value counts
        old[i, p - 1 : p - 1 + c] = np.asarray(r["logprobs"], np.float32)[:c] * mask[i, p - 1 : p - 1 + c]
    return {
        "inputs": mx.array(inputs),
        "targets": mx.array(targets),
        "mask": mx.array(mask),
        "behaviour": mx.array(old),
        "adv": mx.array(advantages.astype(np.float32)),
        "tokens": int(sum(len(s) for s in seqs)),
        "model_tokens": int(mask.sum()),
    }


def mask_truncated(batch: dict, records: list[dict]) -> tuple[dict, int]:
    """The batch with the rows of samples cut at the token limit masked out (DAPO's overlong
    filtering), and how many there were."""
    keep = mx.array(objectives.truncation_mask([r.get("finish_reason") for r in records]))[:, None]
    batch = {**batch, "mask": batch["mask"] * keep}
    batch["model_tokens"] = int(batch["mask"].sum().item())
    return batch, int(len(records) - float(keep.sum().item()))


def model_mask(record: dict) -> np.ndarray:
    """1.0 on the completion tokens the model sampled: ``model_mask`` of an episode record, else
    every token (a single-turn completion is all the model's)."""
    c = len(record["token_ids"])
    m = record.get("model_mask")
    if m is None:
        return np.ones(c, np.float32)
    if len(m) != c:
        raise ValueError(f"record {record.get('task_id')!r}: model_mask has {len(m)} entries for {c} token ids")
    return np.asarray(m, np.float32)


def _slice(batch: dict, i: int, j: int) -> dict:
    return {k: (v[i:j] if isinstance(v, mx.array) else v) for k, v in batch.items()}


# -- loss ----------------------------------------------------------------------------------------


def sequence_hidden_states(model: nn.Module, inputs, prefix: int = 0) -> mx.array:
    """Final hidden states of ``inputs`` [B, L]: of every position, or with ``prefix`` > 0 of the
    positions after the shared prefix (run once: :mod:`mlx_ssp.rl.prefix`), [B, L - prefix, D]."""
    return model.model(inputs) if prefix <= 0 else suffix_hidden(model, inputs, prefix)


def sequence_logprobs(model: nn.Module, inputs, targets, temperature: float, chunk_size, *, entropy: bool = False,
                      save_grad: bool = False, entropy_grad: bool = False, prefix: int = 0,
                      hidden: mx.array | None = None):
    """Per-token log-probs of ``targets`` after ``inputs`` (prompt + completion) at temperature T
    (and the entropy with ``entropy``). ``prefix`` > 0: the rows' first ``prefix`` tokens are
    identical and carry no loss; they run once and their positions get log-prob and entropy 0.
    ``hidden``: the body's output (:func:`sequence_hidden_states`) when the caller has it."""
    h = sequence_hidden_states(model, inputs, prefix) if hidden is None else hidden
    out = token_logprobs(h, head_of(model), targets[:, prefix:], temperature, chunk_size, return_entropy=entropy,
                         save_grad=save_grad, entropy_grad=entropy_grad)
    if prefix <= 0:
        return out
    pad = mx.zeros((inputs.shape[0], prefix), mx.float32)
    if entropy:
        return tuple(mx.concatenate([pad, x], axis=1) for x in out)
    return mx.concatenate([pad, out], axis=1)


def _set_params(model: nn.Module, names, arrays) -> None:
    model.update(tree_unflatten(list(zip(names, arrays))))


def _flat(kv) -> list:
    """[(k, v), ...] -> [k, v, ...] (the cache as a flat list of arrays for the transforms)."""
    return [x for pair in kv for x in pair] if kv else []


def piece_value_and_grad(model: nn.Module, loss_fn: Callable, mb: dict, kv, names, arrays, two_phase: bool):
    """((loss, aux), d loss / d trainable arrays, d loss / d prefix kv) of one piece of rows.

    ``kv``: the block's shared-prefix keys and values (:func:`mlx_ssp.rl.prefix.prefix_kv`,
    evaluated, no graph) that the rows' suffixes attend to, or None (no prefix: the rows run
    whole). Their gradient is returned so that the prefix's own backward runs once per block
    (:func:`prefix_grads`), however many pieces the block has.

    ``two_phase`` (a piece whose log-prob tokens span more than one chunk of the op: a row longer
    than a chunk): the chunked op evaluates its input chunk by chunk, and inside a gradient trace
    that evaluation keeps every intermediate of the body's forward for the tape (2.5x the body's
    memory at 4 rows of 384 tokens on the demo model, BENCHMARKS "RL step memory"). So the body's
    output h is evaluated outside any trace, dL/dh comes from the loss as a function of h, and the
    body's gradient is its vjp with that cotangent: one more body forward, the body's own memory.
    The head must be frozen there (LoRA). The model holds ``arrays`` again afterwards."""
    n, p = len(arrays), mb.get("prefix", 0)
    kv_flat = _flat(kv)

    def body(*xs):
        _set_params(model, names, xs[:n])
        if not kv_flat:
            return model.model(mb["inputs"])
        return hidden_after(model, mb["inputs"][:, p:], list(zip(xs[n::2], xs[n + 1::2])))

    primals = [*arrays, *kv_flat]
    try:
        if not two_phase:
            grad_fn = mx.value_and_grad(lambda *xs: loss_fn(model, mb, body(*xs)), argnums=list(range(len(primals))))
            (loss, aux), g = grad_fn(*primals)
        else:
            h = body(*primals)
            mx.eval(h)
            (loss, aux), dh = mx.value_and_grad(lambda x: loss_fn(model, mb, x))(h)
            mx.eval(loss, aux, dh)
            del h
            _, g = mx.vjp(body, primals, [dh])
    finally:
        _set_params(model, names, arrays)  # the parameters again, not the transform's tracers
    return (loss, aux), list(g[:n]), list(g[n:])


def prefix_grads(model: nn.Module, tokens: mx.array, dkv: list, names, arrays) -> list:
    """d loss / d trainable arrays through a block's shared prefix ``tokens`` [1, P], given the
    summed gradient ``dkv`` of its keys and values over the block's pieces (chain rule: the
    prefix's forward, then its backward, once per block)."""
    def f(*xs):
        _set_params(model, names, xs)
        return _flat(prefix_kv(model, tokens))

    try:
        _, g = mx.vjp(f, list(arrays), dkv)
    finally:
        _set_params(model, names, arrays)
    return list(g)


def make_loss(cfg: RLConfig, units_total: float) -> Callable:
    """loss(model, mb, hidden=None) for one micro-batch, scaled by its share of the batch's
    aggregation units so that summed micro-batch gradients equal the full batch's; ``hidden``: the
    body's output when the caller computed it (:func:`piece_value_and_grad`)."""
    T = cfg.sampling.temperature
    eps_low, eps_high = objectives.clip_range(cfg)
    bonus = bool(cfg.entropy_coef)  # off (None or 0): the op's entropy stays a statistic, the loss as before

    def loss_fn(model, mb, hidden=None):
        logp, ent = sequence_logprobs(model, mb["inputs"], mb["targets"], T, cfg.chunk_size, entropy=True,
                                      save_grad=True, entropy_grad=bonus, prefix=mb.get("prefix", 0), hidden=hidden)
        old = mb["old"] if mb.get("old") is not None else mx.stop_gradient(logp)
        weights = None
        if cfg.tis_cap is not None:  # rollouts from another engine: truncated importance weights
            weights = objectives.tis_weight(old, mb["behaviour"], cfg.tis_cap, cfg.tis_mode)
        out = policy_loss(
            logp, old, mb["adv"], mb["mask"], eps_low=eps_low, eps_high=eps_high, dual_clip=cfg.dual_clip,
            aggregation=cfg.aggregation, max_tokens=cfg.sampling.max_tokens, beta=cfg.beta,
            ref_logp=mb.get("ref"), entropy=ent, ratio_level=cfg.importance_sampling_level, surrogate=cfg.loss,
            weights=weights,
        )
        loss = out.loss
        if bonus:  # verl's entropy_coeff: the entropy aggregated as the policy loss is, subtracted
            loss = loss - objectives.entropy_bonus(ent, mb["mask"], cfg.entropy_coef, cfg.aggregation,
                                                   cfg.sampling.max_tokens)
        share = aggregation_units(cfg.aggregation, mb["mask"]) / units_total
        return loss * share, (out.totals, mx.stop_gradient(logp))

    return loss_fn


def behaviour_totals(logp: mx.array, behaviour: mx.array, mask: mx.array) -> dict[str, mx.array]:
    """Totals (:func:`mlx_ssp.rl.loss.token_totals`) of |trainer - sampler| log-prob per token."""
    return token_totals("behaviour_logp_absdiff", mx.abs(logp - behaviour), mask)


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


def reward_metrics(sampled: list[list[dict]]) -> dict:
    """Reward statistics over every sampled group (kept or dropped by dynamic sampling)."""
    rewards_all = np.array([float(r["reward"]) for g in sampled for r in g], np.float32)
    rec = {"reward_mean": float(rewards_all.mean()) if rewards_all.size else 0.0}
    rec["pass_rate"] = float((rewards_all >= 0.999).mean()) if rewards_all.size else 0.0
    p_all = [float(np.mean([r["reward"] for r in g])) for g in sampled]
    rec["frac_groups_mixed"] = float(np.mean([0.0 < p < 1.0 for p in p_all])) if p_all else 0.0
    return rec


# -- the trainer ---------------------------------------------------------------------------------


class Trainer:
    """State of one RL run: model, optimizer, task stream, counters; ``step()`` does one step."""

    def __init__(self, model, tokenizer, tasks: list[Task], cfg: RLConfig, out_dir: Path, *, seed: int = 0,
                 ref_model: Optional[nn.Module] = None, model_path: str = ""):
        self.model, self.tokenizer, self.tasks, self.cfg = model, tokenizer, tasks, cfg
        self.out_dir, self.seed, self.ref_model, self.model_path = Path(out_dir), seed, ref_model, model_path
        self.stream = TaskStream(len(tasks), seed)
        self.step_no = 0
        self.bad_in_row = 0
        self.skipped_total = 0
        self.last_good_ckpt: Optional[str] = None
        self._prompt_cache: dict[str, list[int]] = {}
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

    # -- generation --------------------------------------------------------------------------
    def _rollouts(self, idx: list[int], round_no: int) -> tuple[list[list[dict]], dict]:
        tasks = [self.tasks[i] for i in idx]
        stats: dict = {}
        recs = generate_rollouts(
            self.model, self.tokenizer, tasks, k=self.cfg.group_size, sampling=self.cfg.sampling,
            seed=(self.seed * 1_000_003 + self.step_no * 101 + round_no) % (2**31), batch_size=self.cfg.gen_batch_size,
            progress=False, system=self.cfg.system, stats=stats,
        )
        by: dict[str, list[dict]] = {}
        for r in recs:
            by.setdefault(r["task_id"], []).append(r)
        return [by[t.id] for t in tasks if t.id in by], stats

    def collect(self) -> tuple[list[list[dict]], dict, list[list[dict]]]:
        """(kept groups, generation info, every sampled group): ``batch_size`` groups from the
        current policy; with dynamic sampling only groups whose rewards differ are kept."""
        cfg = self.cfg
        kept: list[list[dict]] = []
        info = {"gen_s": 0.0, "gen_tokens": 0, "groups_sampled": 0, "groups_dropped": 0, "refill_rounds": 0}
        all_groups: list[list[dict]] = []
        for rnd in range(1 + (cfg.max_refill_rounds if cfg.dynamic_sampling else 0)):
            need = cfg.batch_size - len(kept)
            if need <= 0:
                break
            t0 = time.perf_counter()
            groups, _ = self._rollouts(self.stream.take(need), rnd)
            info["gen_s"] += time.perf_counter() - t0
            # model-sampled tokens only: an episode's tool results and user turns were not generated
            info["gen_tokens"] += sum(r["num_tokens"] for g in groups for r in g)
            info["groups_sampled"] += len(groups)
            info["refill_rounds"] = rnd
            all_groups.extend(groups)
            for g in groups:
                rs = [float(r["reward"]) for r in g]
                if cfg.dynamic_sampling and max(rs) == min(rs):
                    info["groups_dropped"] += 1
                    continue
                kept.append(g)
        info["groups_kept"] = min(len(kept), cfg.batch_size)
        return kept[: cfg.batch_size], info, all_groups

    # -- one step ----------------------------------------------------------------------------
    def step(self) -> dict:
        """One GRPO step: rollouts (dynamic sampling in :meth:`collect`) -> rewards -> MGPO
        advantages -> ``mu`` inner updates -> metrics."""
        t_step, cpu_step = time.perf_counter(), time.process_time()
        groups, info, sampled = self._sample()
        rec: dict = {"step": self.step_no + 1, **reward_metrics(sampled), **correct_length_metrics(sampled)}
        rec.update(info)
        if not groups:
            rec.update(skipped=True, reason="no informative groups", step_s=time.perf_counter() - t_step)
            self.step_no += 1
            return rec
        batch = self._advantage_batch(groups, rec)
        t_train = time.perf_counter()
        ok, train_stats = self._update(batch)
        train_s = time.perf_counter() - t_train
        rec.update(train_stats)
        rec.update(self._throughput(info, batch, train_s, t_step, cpu_step))
        rec["skipped"] = not ok
        self._count_outcome(ok)
        rec["skipped_total"] = self.skipped_total
        return rec

    def _sample(self) -> tuple[list[list[dict]], dict, list[list[dict]]]:
        """Rollouts of the current policy (:meth:`collect`) with the generation's peak memory."""
        mx.reset_peak_memory()
        # the global MLX RNG (LoRA dropout) is reseeded from (seed, step): resuming at step k
        # draws what an uninterrupted run draws, with no RNG state to save
        mx.random.seed(step_seed(self.seed, self.step_no))
        groups, info, sampled = self.collect()
        info["peak_memory_gen_mb"] = mx.get_peak_memory() / 2**20
        mx.reset_peak_memory()
        return groups, info, sampled

    def _advantage_batch(self, groups: list[list[dict]], rec: dict) -> dict:
        """MGPO advantages A' = w(p) * A of the kept groups (their statistics into ``rec``) and the
        training batch built from them."""
        cfg = self.cfg
        recs = [r for g in groups for r in g]
        gids = np.repeat(np.arange(len(groups)), [len(g) for g in groups])
        rewards = np.array([float(r["reward"]) for r in recs], np.float32)
        if shaping_on(cfg):  # reward shaping: Long2Short, DAPO's overlong penalty
            lengths = np.array([float(r["num_tokens"]) for r in recs], np.float64)
            shaped = apply_shapings(cfg, rewards, lengths, gids)
            rec["shaping_abs_mean"] = float(np.abs(shaped - rewards).mean())
            rewards = shaped.astype(np.float32)
        # the one-pass kernel on Metal/CUDA, the plain-MLX reference (mgpo_advantages) elsewhere
        adv = grouped_advantages(rewards, gids, lam=cfg.mgpo_lambda, scale_rewards=cfg.scale_rewards, eps=cfg.adv_eps,
                                 num_groups=len(groups))
        rec["mgpo_weight_mean"] = float(adv.w.mean().item())
        rec["adv_abs_mean"] = float(mx.abs(adv.advantages).mean().item())
        batch = build_batch(recs, np.array(adv.advantages))
        if cfg.mask_truncated_completions:  # DAPO: a sample cut at max_tokens carries no gradient
            batch, rec["truncated_masked"] = mask_truncated(batch, recs)
        return batch

    def _throughput(self, info: dict, batch: dict, train_s: float, t_step: float, cpu_step: float) -> dict:
        """Timing, throughput and peak-memory metrics of the step."""
        rec = {"train_s": train_s}
        rec["gen_tokens_per_s"] = info["gen_tokens"] / info["gen_s"] if info["gen_s"] > 0 else 0.0
        rec["train_tokens_per_s"] = batch["tokens"] * self.cfg.mu / train_s if train_s > 0 else 0.0
        rec["train_model_tokens"] = batch["model_tokens"]  # tokens in the loss (episodes: the model's only)
        rec["step_s"] = time.perf_counter() - t_step
        rec["step_cpu_s"] = time.process_time() - cpu_step  # all threads; less sensitive to a busy machine
        rec["peak_memory_train_mb"] = mx.get_peak_memory() / 2**20
        rec["peak_memory_mb"] = max(rec["peak_memory_train_mb"], info["peak_memory_gen_mb"])
        return rec

    def _count_outcome(self, ok: bool) -> None:
        """Advance the step; a skipped step extends the run of bad steps that ``max_bad_steps`` stops."""
        self.step_no += 1
        if ok:
            self.bad_in_row = 0
        else:
            self.bad_in_row += 1
            self.skipped_total += 1

    def _update(self, batch: dict) -> tuple[bool, dict]:
        """``mu`` inner updates on the batch; returns (all finite, statistics).

        All or nothing: when the loss or gradient of any inner update is not finite, the updates
        already applied are undone (parameters and optimizer state, step count included, restored
        from a snapshot), so a skipped step changes nothing. Statistics are whole-batch values
        (totals over micro-batches, inner updates and ranks, divided once: see
        :func:`mlx_ssp.rl.loss.finalize_totals`), whatever ``micro_batch_size`` and the world size."""
        cfg = self.cfg
        batch, layout, units, ref_s = self._plan(batch)
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

    def _plan(self, batch: dict) -> tuple[dict, list, float, float]:
        """(this rank's share of the batch, its layout (:meth:`_layout`), the batch's aggregation
        units, the seconds of the reference forward), with the reference log-probs (KL) and the
        behaviour log-probs as old log-probs attached."""
        cfg = self.cfg
        if cfg.top_entropy_quantile is not None:
            # the cut is over the whole batch's tokens (before ranks and micro-batches split it), from
            # the policy at the start of the step, so micro-batch size and world size change nothing
            ent = self._entropies(batch)
            thr = objectives.entropy_threshold(ent, batch["mask"], cfg.top_entropy_quantile)
            n_before = float(batch["mask"].sum().item())
            batch["mask"] = objectives.top_entropy_mask(ent, batch["mask"], thr)
            batch["entropy_kept_frac"] = float(batch["mask"].sum().item()) / max(n_before, 1.0)
        units = float(aggregation_units(cfg.aggregation, batch["mask"]).item()) or 1.0
        # data parallel: each rank trains on its block of the (identical, gathered)
        # batch; loss shares are of the global units, so the summed gradients are the batch's
        lo, hi = dist.shard_bounds(batch["inputs"].shape[0], dist.rank(), dist.size())
        batch = _slice(batch, lo, hi)
        layout = self._layout(batch)
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

    def _layout(self, batch: dict) -> list[tuple[int, list[tuple[int, int]]]]:
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
        L = batch["inputs"].shape[1]
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
                    mb = _slice(batch, i, j)
                    mb["prefix"] = p
                    if recompute:
                        mb["old"] = old_parts[k] if inner > 0 else None
                    two = (j - i) * (L - p) > self._chunk_tokens and self._frozen_head and self._recompute_safe
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
                    dkv = [g.astype(x.dtype) for g, x in zip(dkv, _flat(kv))]
                    grads_sum = add(grads_sum, prefix_grads(self.model, first, dkv, names, arrays))
                    mx.eval(grads_sum)
        finally:
            _set_params(self.model, names, arrays)  # the parameters, not the transforms' tracers
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
        (:meth:`_layout`): each block's prefix runs once, its pieces attend to it."""
        T = self.cfg.sampling.temperature
        parts = []
        for p, pieces in layout:
            kv = prefix_kv(model, batch["inputs"][pieces[0][0]:pieces[0][0] + 1, :p]) if p else None
            for i, j in pieces:
                h = hidden_after(model, batch["inputs"][i:j, p:], kv) if p else model.model(batch["inputs"][i:j])
                out = sequence_logprobs(model, batch["inputs"][i:j], batch["targets"][i:j], T, self.cfg.chunk_size,
                                        entropy=entropy, prefix=p, hidden=h)
                x = out[1] if entropy else out
                mx.eval(x)
                parts.append(x)
        return mx.stop_gradient(mx.concatenate(parts))

    def _entropies(self, batch: dict) -> mx.array:
        """Per-token entropy of the current policy at the sampling temperature (no gradient)."""
        return self._forward(self.model, batch, self._layout(batch), entropy=True)

    def _ref_logprobs(self, batch: dict, layout) -> mx.array:
        if self.ref_model is not None:
            return self._forward(self.ref_model, batch, layout)
        with adapters_disabled(self.model):
            return self._forward(self.model, batch, layout)

    # -- checkpoints -------------------------------------------------------------------------
    def trained_weights(self) -> dict[str, mx.array]:
        return dict(tree_flatten(self.model.trainable_parameters()))

    def save_checkpoint(self) -> Path:
        ckpt = ckpts.checkpoint_dir(self.out_dir / "checkpoints", self.step_no)
        self.last_good_ckpt = str(ckpt)
        if not dist.is_main():  # rank 0 writes; every rank holds the same weights
            return ckpt
        ckpts.write_checkpoint(ckpt, self.trained_weights(), adapter_config(self.cfg, self.model),
                               dict(tree_flatten(self.opt.state)), {
            "step": self.step_no, "stream": self.stream.state(), "bad_in_row": self.bad_in_row,
            "skipped_total": self.skipped_total, "seed": self.seed, "model": self.model_path,
        })
        ckpts.trim_optimizer_states(ckpt.parent, self.step_no)
        # the latest adapters beside the run, where `mlx_lm fuse --adapter-path` looks
        for name in (ADAPTER_FILE, "adapter_config.json"):
            shutil.copyfile(ckpt / name, self.out_dir / f".{name}.tmp")
            (self.out_dir / f".{name}.tmp").replace(self.out_dir / name)
        return ckpt

    def load_checkpoint(self, ckpt: Path) -> None:
        state = json.loads((ckpt / "state.json").read_text())
        ckpts.load_adapter_weights(self.model, ckpt)
        ckpts.load_optimizer_state(self.opt, self.model, ckpt, hint="pass --restart")
        self.step_no = int(state["step"])
        self.stream = TaskStream(len(self.tasks), self.seed, state["stream"]["epoch"], state["stream"]["cursor"])
        self.bad_in_row = int(state["bad_in_row"])
        self.skipped_total = int(state["skipped_total"])
        self.last_good_ckpt = str(ckpt)
        mx.eval(self.model.parameters(), self.opt.state)


def latest_checkpoint(out_dir: Path) -> Optional[Path]:
    done = ckpts.list_checkpoints(Path(out_dir) / "checkpoints")
    return done[-1] if done else None


#: rl: keys a resumed run may change (how long, how often, how verbose); any other change stops it
RESUMABLE_KEYS = ("steps", "checkpoint_every", "max_bad_steps", "progress", "kernels", "output",
                  # the update's layout (gradients accumulate, so the update is the same); a key that
                  # every earlier record holds stays out of here: finished phases hash these fingerprints
                  "auto_micro_batch")


def config_record(cfg: RLConfig, seed: int, model_path: str) -> dict:
    """``rl_config.json``: the resolved settings of the run (``lora.fine_tune_type`` is excluded from
    dumps: RL admits only ``lora``, recorded as ``fine_tune_type``)."""
    return {"seed": seed, "model": model_path, "rl": cfg.model_dump(mode="json")}


def fingerprint(record: dict) -> dict:
    """The keys of a :func:`config_record` that a resume compares: the seed and the rl: settings
    (not the model path: a run directory copied or moved with its merged model is the same run)."""
    rl = {f"rl.{k}": v for k, v in (record.get("rl") or {}).items() if k not in RESUMABLE_KEYS}
    return {"seed": record.get("seed"), **rl}


def train(model, tokenizer, tasks: list[Task], cfg: RLConfig, out_dir: str | Path, *, seed: int = 0,
          resume: bool = True, ref_model=None, model_path: str = "", on_step: Optional[Callable] = None) -> dict:
    """Run (or resume) MGPO-GRPO. ``model`` must already be set up (:func:`setup_model`).
    Returns a summary; writes metrics.jsonl, checkpoints/ and the latest adapters to ``out_dir``.

    Load or resume (config fingerprint, optimizer keys) -> one :meth:`Trainer.step` per line of
    metrics -> a checkpoint every ``checkpoint_every`` steps (and a stop after ``max_bad_steps``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _check_inputs(tokenizer, tasks, cfg)
    tr = Trainer(model, tokenizer, tasks, cfg, out, seed=seed, ref_model=ref_model, model_path=model_path)
    metrics_path = out / "metrics.jsonl"
    _start_or_resume(tr, metrics_path, resume)
    bar = progress.bar(cfg.steps, initial=tr.step_no, desc="rl", unit="step", enabled=cfg.progress and dist.is_main())
    last = {}
    with dist.appender(metrics_path) as log:  # rank 0 writes the metrics
        while tr.step_no < cfg.steps:
            rec = tr.step()
            log.write(rec)
            trackers.log("", rec, rec["step"])  # rl/reward_mean, ... (rl/<phase>/... in a phase)
            last = rec
            if on_step is not None:
                on_step(tr, rec)
            bar.set_postfix(reward=f"{rec['reward_mean']:.3f}", loss=f"{rec.get('loss', float('nan')):.4f}")
            bar.update(1)
            _checkpoint_or_stop(tr)
    bar.close()
    return {"steps": tr.step_no, "skipped_total": tr.skipped_total, "last": last, "checkpoint": tr.last_good_ckpt,
            "out_dir": str(out)}


def _check_inputs(tokenizer, tasks: list[Task], cfg: RLConfig) -> None:
    """Select the kernel mode and fail early on prompts the tokenizer cannot render."""
    if cfg.kernels is not None:
        kernels.set_mode(cfg.kernels)
    for t in tasks:
        render_prompt(tokenizer, t, cfg.system)


def _start_or_resume(tr: Trainer, metrics_path: Path, resume: bool) -> None:
    """Resume from the latest checkpoint (its config fingerprint and optimizer keys checked; the
    metrics trimmed to its step) or start afresh; record the run's config either way."""
    out = tr.out_dir
    ckpt = latest_checkpoint(out) if resume else None
    record = config_record(tr.cfg, tr.seed, tr.model_path)
    dist.check_same(str(ckpt), what=f"the checkpoint to resume from in {out} (it must be on a disk all hosts share)")
    if ckpt is not None:
        saved = out / "rl_config.json"
        if saved.is_file():
            ckpts.check_fingerprint(fingerprint(json.loads(saved.read_text())), fingerprint(record), where=out,
                                    hint="pass --restart to start afresh")
        tr.load_checkpoint(ckpt)
        if dist.is_main():
            ckpts.trim_metrics(metrics_path, tr.step_no)
    elif metrics_path.exists() and dist.is_main():
        metrics_path.unlink()
    if dist.is_main():
        write_json_atomic(out / "rl_config.json", record)


def _checkpoint_or_stop(tr: Trainer) -> None:
    """After a step: stop with the last good state after ``max_bad_steps`` skipped steps in a row,
    else checkpoint every ``checkpoint_every`` steps and at the end."""
    cfg = tr.cfg
    if tr.bad_in_row >= cfg.max_bad_steps:
        path = tr.save_checkpoint()  # skipped steps changed nothing: this is the last good state
        raise UserError(
            f"rl: {tr.bad_in_row} steps in a row had a non-finite loss or gradient (step {tr.step_no}); "
            f"stopped. Last good state saved to {path}; lower rl.learning_rate or check the rewards."
        )
    if tr.step_no % cfg.checkpoint_every == 0 or tr.step_no == cfg.steps:
        tr.save_checkpoint()


def load_policy(model_cfg, cfg: RLConfig, seed: int = 0):
    """Load the policy (plus a frozen reference copy only for full fine-tuning with a KL term: with
    LoRA the reference is the same model with adapters off) and set it up.
    Returns ``(model, tokenizer, model_path, ref_model)``."""
    model, tokenizer, path = load_model(model_cfg)
    ref = None
    if cfg.beta > 0 and cfg.fine_tune_type == "full":
        ref, _, _ = load_model(model_cfg)
        ref.freeze()
        if (dt := resolve_train_dtype(cfg)) is not None:
            ref.set_dtype(dt)
    setup_model(model, cfg, seed)
    return model, tokenizer, path, ref


def load_and_train(model_cfg, tasks: list[Task], cfg: RLConfig, out_dir: str | Path, *, seed: int = 0,
                   resume: bool = True):
    """:func:`load_policy`, then :func:`train`.
    Returns ``(summary, model, tokenizer, model_path)`` so callers can fuse or save the result."""
    model, tokenizer, path, ref = load_policy(model_cfg, cfg, seed)
    summary = train(model, tokenizer, tasks, cfg, out_dir, seed=seed, resume=resume, ref_model=ref,
                    model_path=str(path))
    return summary, model, tokenizer, path
