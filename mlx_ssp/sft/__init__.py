"""Specialist SFT: one LoRA specialist per domain, checkpoint chosen by Pass@K on a probe set, fused.

Algorithm (VibeThinker-1.5B, arXiv:2511.06221, section 3.2 "Spectrum phase"; the loop's third stage).
For each domain d listed in the ``sft:`` section:

1. Fresh LoRA (or DoRA) layers are put on the base model (loaded once for all domains) with
   ``mlx_lm.tuner.utils.linear_to_lora_layers``, and trained on d's SFT data (the output of
   ``mlx_ssp select``, or any mlx-lm chat / completions / text JSONL) through
   ``mlx_lm.tuner.trainer.train``: its compiled step, loss, padding and batching. Token records
   (whole episodes: ``token_ids`` + a 0/1 ``mask`` on the model's tokens, :mod:`mlx_ssp.sft.episodes`)
   go through the same ``train`` with length-bucketed masked batches
   (:func:`~mlx_ssp.sft.batches.make_masked_iterate_batches`) and the masked loss
   (:func:`~mlx_ssp.sft.loss.masked_loss`): every assistant turn is a target, nothing else is.
   The cross-entropy is the RL stage's chunked log-prob op by default (``sft.loss``,
   :mod:`mlx_ssp.sft.loss`: the logits never exist whole; ``sft.gather_targets``: only at the
   weighted targets), and ``sft.pack`` packs a batch's
   records into fewer rows (:mod:`mlx_ssp.sft.packing`); both give the same loss to float32 rounding.
2. Every ``save_every`` steps (and at the last step) the adapter is saved as a checkpoint
   (``adapters.safetensors`` + ``adapter_config.json``, so ``mlx_lm fuse`` / ``load_adapters`` work on
   it) and *probed*: K samples per probe prompt through the rollout engine
   (:func:`mlx_ssp.eval.evaluate`), scored by each task's verifier, giving Pass@K with the unbiased
   estimator (Chen et al. 2021) and Pass@1. The validation loss is recorded too when there is
   validation data.
3. The specialist is the checkpoint that maximises the selection rule: ``pass@k`` (the paper's
   "most valid solutions"), ``pass@1`` or ``val_loss`` (lowest), for comparison. Ties (equal to
   1e-9) are broken by the other probe metric (pass@1 for pass@k, pass@k for pass@1), then by the
   lower validation loss, then by the *earlier* step (less drift from the base model, which keeps
   more of its diversity).
4. The chosen adapter is fused with the LoRA layers' own ``fuse()`` (what ``mlx_lm fuse`` does) and
   saved with ``mlx_lm.utils.save`` into ``OUT/specialists/<d>/`` (HF layout, same dtype as the base).
   The base model is then restored in memory (the LoRA wrappers hold the untouched base layers) and
   the next domain starts without reloading anything.

Outputs per domain under ``OUT/<d>/``: ``checkpoints/step_NNNNNNN/`` (adapter, adapter_config.json,
state.json, probe.json; the latest also holds the optimizer state), ``metrics.jsonl`` (training loss
reports), ``probe_curve.jsonl`` (step, loss, val_loss, pass@1, pass@k, chosen) and ``probe_curve.png``,
``adapters.safetensors`` + ``adapter_config.json`` (the chosen checkpoint, ready for ``mlx_lm fuse``)
and ``result.json``; ``OUT/summary.json`` lists every domain's specialist.

Resume. A killed run continues from its last complete checkpoint and ends with the same adapter as
an uninterrupted run with the same seed: the checkpoint holds the adapter and the optimizer state
(Adam moments, step count, hence the learning-rate schedule position); the data order is
reproduced by replaying mlx-lm's batch iterator from the seed and skipping the batches already
trained on (its shuffling draws from NumPy's global RNG, which we confine to a private
``RandomState`` so that nothing else can shift it); and MLX's global RNG (LoRA dropout) is
re-seeded at every checkpoint from (seed, step), so it is a function of the step, not of history.
A checkpoint saved but not yet probed when the run died is probed on resume. Probing uses its own
per-sample PRNG keys and the same seed at every checkpoint (common random numbers: differences
between checkpoints are the model's, not the sampler's).

Deviations from mlx-lm's ``lora`` command, all deliberate:
- MLX's RNG is re-seeded at every checkpoint (above); mlx-lm seeds once. Without dropout this
  changes nothing.
- Validation loss is computed at checkpoints (not at ``steps_per_eval``), on the same fixed subset
  of ``val_batches`` batches each time, so checkpoints are compared on equal terms.
- ``mask_prompt`` defaults to true (train on the solutions, not on the problems).
- Data is tokenized and checked before training (every record, errors name file:line) instead of
  lazily, so a bad record cannot stop a run hours in.
Deviations from the paper: the paper does not give probe sizes, K, or the checkpoint interval;
they are configuration here (``probe.k``, ``probe.max_tasks``, ``save_every``).
"""

from mlx_ssp.finetune.fuse import fuse_and_save, restore_base
from mlx_ssp.finetune.lora import LoRAConfig, check_lora_targets
from mlx_ssp.finetune.seed import step_seed
from mlx_ssp.sft.batches import make_iterate_batches, make_masked_iterate_batches, masked_batch
from mlx_ssp.sft.config import OPTIMIZERS, SELECT_RULES, DomainSpec, ProbeConfig, ScheduleConfig, SFTConfig
from mlx_ssp.sft.data import DomainPlan, load_sft_file, plan_domains
from mlx_ssp.sft.episodes import TokenDataset, load_token_records
from mlx_ssp.sft.loss import CE_KINDS, make_loss, masked_loss
from mlx_ssp.sft.packing import PACKABLE_MODEL_TYPES, packed_batch
from mlx_ssp.sft.probe import ProbeFn, default_probe, probe_seed, read_curve, select_checkpoint, write_curve
from mlx_ssp.sft.stage import adapter_config, build_optimizer, fingerprint, run_sft, train_specialist

__all__ = [
    "CE_KINDS", "OPTIMIZERS", "PACKABLE_MODEL_TYPES", "SELECT_RULES", "DomainPlan", "DomainSpec", "LoRAConfig", "ProbeConfig", "ProbeFn", "SFTConfig",
    "ScheduleConfig", "TokenDataset", "adapter_config", "build_optimizer", "check_lora_targets", "default_probe",
    "fingerprint", "fuse_and_save", "load_sft_file", "load_token_records", "make_iterate_batches", "make_masked_iterate_batches",
    "make_loss", "masked_batch", "masked_loss", "packed_batch", "plan_domains", "probe_seed",
    "read_curve", "restore_base", "run_sft", "select_checkpoint", "step_seed", "train_specialist", "write_curve",
]
