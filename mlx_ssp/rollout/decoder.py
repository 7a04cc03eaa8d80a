"""What every generation pass holds, whether its samples are single completions
(:mod:`mlx_ssp.rollout.engine`) or multi-turn episodes (:mod:`mlx_ssp.agents.engine`): the model in
eval mode, one mlx-lm ``BatchGenerator`` over float32 logits driven by the request's
:class:`~mlx_ssp.sampling.SamplingPath`, the progress bar, and the wall clock of the pass.

With at most :data:`ONE_THREAD_ROWS` sequences decoding, OpenBLAS runs one thread for the pass
(:func:`mlx_ssp._blas.threads`; Linux only). A step of a few rows multiplies each weight matrix by a
few vectors: it is bound by reading the weights, so a second thread adds no speed and spins
while it waits (on the demo model at 4 rows, 93-116 against 150-180 ms of CPU per step, for the same
or less wall time, on a 2-core machine under load 3-6; outputs bit-identical). On Linux x86_64 the
products of at most 8 rows do not reach OpenBLAS at all: :mod:`mlx_ssp._small_gemm` takes them.

On the CPU the model's rotary embeddings run decoding steps as one compiled function for the pass
(:func:`mlx_ssp.decode_rope.installed`: the same bits, half the op overhead of MLX's reference graph)."""

from __future__ import annotations

import time
from contextlib import ExitStack

from mlx_ssp import _blas, decode_rope, progress, sampling
from mlx_ssp.rollout.request import RolloutRequest


#: decoding this many sequences or fewer runs OpenBLAS on one thread
ONE_THREAD_ROWS = 16


def _shareable(model) -> bool:
    """Whether samples can start from one prefilled cache: every layer's cache is a plain KV cache
    that batches by copying (not a rotating window or a state-space cache)."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    try:  # mlx-lm's prompt batch (0.32): without it each sample prefills its own prompt
        from mlx_lm.generate import PromptProcessingBatch  # noqa: F401
    except ImportError:
        return False
    return all(type(c) is KVCache for c in make_prompt_cache(model))


class Decoder:
    """``gen`` (the generator), ``path`` (the sampling path), ``lp_temp`` (the temperature behaviour
    log-probs are stored at), ``bar`` (:func:`mlx_ssp.progress.bar`); :meth:`close` restores the model's mode."""

    def __init__(self, model, tokenizer, request: RolloutRequest, *, total: int, unit: str, desc: str,
                 episodes: bool = False):
        from mlx_lm.generate import BatchGenerator


        s = request.sampling
        self.model = model
        self.lp_temp = s.temperature if s.temperature > 0 else 1.0
        self.was_training = getattr(model, "training", False)
        model.eval()
        self.path = sampling.sampling_path(s.temperature, s.top_p, s.top_k, s.min_p,
                                           logprobs=request.logprobs or episodes)
        self.gen = BatchGenerator(
            sampling.Float32Logits(model),  # bf16/fp16 models: normalise and sample in float32 (mlx_ssp.sampling)
            sampler=self.path.generator_sampler,
            max_tokens=s.max_tokens,
            stop_tokens=[[t] for t in sorted(tokenizer.eos_token_ids)],
            completion_batch_size=request.batch_size,
            prefill_batch_size=request.prefill_batch(episodes),
        )
        self.share_prefix = request.share_prefix and _shareable(model)
        self.saved_prefill = 0  # prompt tokens samples did not prefill themselves (shared prefixes)
        self.prefix_s, self.prefix_tokens = 0.0, 0  # the shared prefills (outside the generator's timers)
        self.bar = progress.bar(total, unit=unit, desc=desc, enabled=request.progress)
        with ExitStack() as scopes:  # a failure here undoes what was entered; close() undoes the rest
            if min(request.batch_size, total) <= ONE_THREAD_ROWS:
                scopes.enter_context(_blas.threads(1))
            scopes.enter_context(decode_rope.installed(model))
            self._scopes = scopes.pop_all()
        self.t_start = time.perf_counter()
        self.gen_s_before = 0.0  # time of an earlier pass in the same request (episodes, then single turns)

    def insert(self, prompts: list[list[int]], max_tokens: list[int], streams: list[int], caches=None) -> list[int]:
        """Queue sequences, each with its noise stream (and, to continue one, its KV cache)."""
        kw = {"caches": caches} if caches is not None else {}
        uids = self.gen.insert(prompts, max_tokens=max_tokens, samplers=self.path.insert_samplers(streams), **kw)
        for uid, stream in zip(uids, streams):
            self.path.register(uid, stream)
        return uids

    def insert_shared(self, prompt: list[int], max_tokens: list[int], streams: list[int]) -> list[int]:
        """Queue the samples of one prompt (shared prompt prefixes). With ``share_prefix``
        and two or more samples, ``prompt[:-1]`` is prefilled once, by mlx-lm's own prompt batch (the
        arithmetic a sequence prefilled alone goes through), and every sample starts from that one
        cache (the generator copies it when it batches the samples; it never writes to it) with its
        last token as its prompt. Otherwise each sample prefills the prompt itself."""
        n = len(streams)
        if n < 2 or len(prompt) < 2 or not self.share_prefix:
            return self.insert([list(prompt)] * n, max_tokens, streams)
        tic = time.perf_counter()
        cache = self.prefix_cache(prompt[:-1])
        self.prefix_s += time.perf_counter() - tic
        self.prefix_tokens += len(prompt) - 1
        self.saved_prefill += (n - 1) * (len(prompt) - 1)
        return self.insert([prompt[-1:]] * n, max_tokens, streams, caches=[cache] * n)

    def prefix_cache(self, tokens: list[int]):
        """The KV cache of ``tokens`` prefilled alone (a list of per-layer caches, as mlx-lm's)."""
        import mlx.core as mx
        from mlx_lm.generate import PromptProcessingBatch
        from mlx_lm.models.cache import make_prompt_cache

        pb = PromptProcessingBatch(self.gen.model, uids=[-1], caches=[make_prompt_cache(self.gen.model)],
                                   prefill_step_size=self.gen.prefill_step_size)
        with mx.stream(self.gen.stream):
            pb.prompt([list(tokens)])
            return pb.extract_cache(0)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t_start

    def close(self, stats: dict) -> None:
        try:
            self.gen.close()
        finally:
            self._scopes.close()
            self.bar.close()
            if self.was_training:
                self.model.train()
        stats["gen_s"] = self.gen_s_before + self.elapsed()
        # prompt tokens not prefilled again because samples shared their prompt's prefill
        stats["prefill_saved_tokens"] = stats.get("prefill_saved_tokens", 0) + self.saved_prefill
        stats["prefix_prefill_s"] = stats.get("prefix_prefill_s", 0.0) + self.prefix_s
        stats["prefix_prefill_tokens"] = stats.get("prefix_prefill_tokens", 0) + self.prefix_tokens
