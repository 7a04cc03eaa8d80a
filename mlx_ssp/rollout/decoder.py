"""What every generation pass holds, whether its samples are single completions
(:mod:`mlx_ssp.rollout.engine`) or multi-turn episodes (:mod:`mlx_ssp.agents.engine`): the model in
eval mode, one mlx-lm ``BatchGenerator`` over float32 logits driven by the request's
:class:`~mlx_ssp.sampling.SamplingPath`, the progress bar, and the wall clock of the pass."""

from __future__ import annotations

import time

from mlx_ssp.rollout.request import RolloutRequest


class Decoder:
    """``gen`` (the generator), ``path`` (the sampling path), ``lp_temp`` (the temperature behaviour
    log-probs are stored at), ``bar`` (tqdm or None); :meth:`close` restores the model's mode."""

    def __init__(self, model, tokenizer, request: RolloutRequest, *, total: int, unit: str, desc: str):
        from mlx_lm.generate import BatchGenerator

        from mlx_ssp import sampling

        s = request.sampling
        self.model = model
        self.lp_temp = s.temperature if s.temperature > 0 else 1.0
        self.was_training = getattr(model, "training", False)
        model.eval()
        self.path = sampling.sampling_path(s.temperature, s.top_p, s.top_k, s.min_p)
        self.gen = BatchGenerator(
            sampling.Float32Logits(model),  # bf16/fp16 models: normalise and sample in float32 (mlx_ssp.sampling)
            sampler=self.path.generator_sampler,
            max_tokens=s.max_tokens,
            stop_tokens=[[t] for t in sorted(tokenizer.eos_token_ids)],
            completion_batch_size=request.batch_size,
            prefill_batch_size=request.prefill_batch(),
        )
        self.bar = None
        if request.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit=unit, desc=desc, dynamic_ncols=True)
        self.t_start = time.perf_counter()
        self.gen_s_before = 0.0  # time of an earlier pass in the same request (episodes, then single turns)

    def insert(self, prompts: list[list[int]], max_tokens: list[int], streams: list[int], caches=None) -> list[int]:
        """Queue sequences, each with its noise stream (and, to continue one, its KV cache)."""
        kw = {"caches": caches} if caches is not None else {}
        uids = self.gen.insert(prompts, max_tokens=max_tokens, samplers=self.path.insert_samplers(streams), **kw)
        for uid, stream in zip(uids, streams):
            self.path.register(uid, stream)
        return uids

    def elapsed(self) -> float:
        return time.perf_counter() - self.t_start

    def close(self, stats: dict) -> None:
        self.gen.close()
        if self.bar is not None:
            self.bar.close()
        if self.was_training:
            self.model.train()
        stats["gen_s"] = self.gen_s_before + self.elapsed()
