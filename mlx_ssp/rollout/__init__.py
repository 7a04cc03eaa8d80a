"""Batched K-rollouts with behaviour log-probs and verifier rewards (SSP step 1, "Spectrum").

Algorithm (VibeThinker-1.5B, arXiv:2511.06221, section 3.2 "Spectrum phase": sample many candidate
solutions per problem and keep the verified ones). For every task, render the prompt with the
model's chat template, queue K sequences (one per sample index) into one
``mlx_lm.generate.BatchGenerator`` (continuous batching; the decoding loop is mlx-lm's), each with
its own noise stream whose PRNG key is derived from ``(seed, task id, sample index)``; one shared
:class:`mlx_ssp.sampling.BatchSampler` draws the whole batch's tokens per step in one batched op
and records each token's ``log_softmax(logprobs / T)[token]`` (from mlx-lm's T=1 log-prob vector),
the behaviour log-prob GRPO's ratio needs (see :mod:`mlx_ssp.sampling` for truncation and
greedy). When all K samples of a task are done they are verified with
:func:`mlx_ssp.verify.verify` and handed out together, so the CLI appends each finished task to
``rollouts.jsonl`` at once (:class:`mlx_ssp.io.JsonlAppender` on a writer thread: a crash loses at
most the tasks in flight, never leaves half a line).

Record keys: ``task_id, domain, sample, prompt, prompt_token_ids, completion, token_ids, logprobs,
logprob_temperature, finish_reason ("stop" | "length"), stop (the stop string hit, or null),
num_tokens, reward, reason, detail, latency_s (insert to finish), verify_s``; the file stage adds
``task_fingerprint`` and ``run_fingerprint`` (below).

Resume (:func:`run_rollouts`, :mod:`.resume`): the output is locked for the whole run (a second run on it stops at
once, naming the holder). Each record carries ``task_fingerprint``, a hash of what decides its task's
samples and rewards (domain, prompt, answer, verifier, metadata, system prompt), and
``run_fingerprint``, a hash of the run settings kept in ``.meta.json`` (model, seed, sampling,
system, context). On resume, records of a task whose fingerprint changed (the prompt or answer was
edited under the same id) and repeated (task, sample) records are dropped, the file is rewritten
atomically without them, and those samples are generated again: the user edited the task file and
expects the output to follow it, and the untouched tasks keep their samples. Records from other
run settings, or records with no ``.meta.json`` and no ``run_fingerprint`` to vouch for them,
are refused: mixing them would silently blend two runs.

Choices and deviations (the paper gives none of these details):
- ``token_ids``/``logprobs`` hold every sampled token, including the EOS token that ended the
  sequence (RL must learn to emit it) and the tokens that spell a stop string; ``completion`` is
  the decoded text without the EOS and cut before the stop string (as OpenAI-style APIs do).
- Stop strings are matched on the decoded text (a stop string can tokenize differently inside a
  stream); the sequence is then removed from the generator.
- A prompt that does not fit the context (``max_context``, default the model's
  ``max_position_embeddings``) is skipped with one counted warning; ``max_tokens`` is clamped so
  prompt + completion fit.
- The model is put in eval mode during generation (LoRA dropout off) and restored afterwards; it
  is never reloaded, so a LoRA policy samples as itself.
- Shared prompt prefixes: the K samples of a prompt queued together are prefilled once
  (``prompt[:-1]`` through mlx-lm's own prompt batch) and all start from that cache, with their last
  prompt token as their prompt (:meth:`mlx_ssp.rollout.decoder.Decoder.insert_shared`); the same
  tokens as prefilling each alone (tests), behaviour log-probs equal up to float32 rounding (the
  batches they decode in are composed differently). ``RolloutRequest.share_prefix=False`` turns it
  off; models whose caches are not plain KV caches (sliding windows, state-space layers) never share.

Parts (one job each): :mod:`.config` (the ``rollout:`` section), :mod:`.request` (one
:class:`RolloutRequest` passed from the stages to the engine), :mod:`.engine` (the loop around
mlx-lm's BatchGenerator; :mod:`mlx_ssp.sampling` holds the sampler interface), :mod:`.stops`,
:mod:`.records`, :mod:`.scoring` (verification beside generation), :mod:`.summary` (pass@k),
:mod:`.resume` (fingerprints, meta, lock, stale records), :mod:`.stage` (the resumable file stage);
the command ``mlx_ssp rollout`` is :mod:`mlx_ssp.commands.rollout`.
"""

from mlx_ssp.rollout.config import RolloutConfig, SamplingConfig
from mlx_ssp.rollout.engine import generate, generate_rollouts, iter_rollouts, model_context_length
from mlx_ssp.rollout.request import RolloutRequest, stage_settings
from mlx_ssp.rollout.resume import read_meta, run_fingerprint, sidecar, task_fingerprint
from mlx_ssp.rollout.stage import run_rollouts
from mlx_ssp.rollout.summary import format_table, group_by_task, stage_summary, summarize

__all__ = [
    "RolloutConfig", "RolloutRequest", "SamplingConfig", "format_table", "generate",
    "generate_rollouts", "group_by_task", "iter_rollouts", "model_context_length", "read_meta",
    "run_fingerprint", "run_rollouts", "sidecar", "stage_settings",
    "stage_summary", "summarize", "task_fingerprint",
]
