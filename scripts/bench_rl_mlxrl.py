"""One inductive-mlxrl GRPO run with each step timed by phase; run by scripts/bench_rl.py under the
python of mlxrl's own venv (this file imports mlxrl and mlx-lm only, never mlx_ssp).

mlxrl's ``train`` command has no per-step timing or peak memory and takes its prompts from a
built-in GSM8K list, so this drives the same functions its training loop calls, in its order
(mlxrl/cli.py, ``_phase1_gsm8k``): ``generate_group_rollouts`` (generation), ``batch_from_rollouts``
(the old-policy and, with beta > 0, the reference log-probs: "reference" here), ``optimizer_step``
(the update), with its algorithm built from its own ``TrainConfig`` defaults. Rewards use mlxrl's
accuracy + 0.1 x format reward against each prompt's answer.

    python scripts/bench_rl_mlxrl.py SPEC.json   # prints one JSON line per step

SPEC keys: model, prompts, answers, steps, batch (prompts per step), and optionally any of
group_size, max_tokens, temperature, top_p, top_k, beta, learning_rate, rank, scale, use_chat_template,
micro_batch_size, seed (absent: mlxrl's TrainConfig default).
"""

from __future__ import annotations

import json
import sys
import time

import mlx.core as mx
import mlx.optimizers as optim

from mlxrl.cli import _algorithm_from_config, _completion_reward
from mlxrl.config import TrainConfig
from mlxrl.policy.logprobs import pad_token_id_from_tokenizer
from mlxrl.policy.model import LoRAConfig, load_policy_with_lora
from mlxrl.rollout.naive import SamplingConfig, generate_group_rollouts
from mlxrl.train.grpo import batch_from_rollouts, optimizer_step


def main(spec_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    d = TrainConfig()  # mlxrl's defaults for every key the spec leaves out
    get = lambda k, default: spec[k] if spec.get(k) is not None else default  # noqa: E731
    group, max_tokens = get("group_size", d.group_size), get("max_tokens", d.max_completion_len)
    beta, micro = get("beta", d.kl_beta), get("micro_batch_size", d.micro_batch_size)
    chat = get("use_chat_template", d.use_chat_template)
    sampling = SamplingConfig(max_tokens=max_tokens, temperature=get("temperature", d.sampling.temperature),
                              top_p=get("top_p", d.sampling.top_p), min_p=d.sampling.min_p,
                              top_k=get("top_k", d.sampling.top_k))
    model, tok, _ = load_policy_with_lora(spec["model"], LoRAConfig(rank=get("rank", d.rank), scale=get("scale", d.scale),
                                                                    dropout=d.dropout))
    algorithm = _algorithm_from_config(d)
    opt = optim.Adam(learning_rate=get("learning_rate", d.optimizer.learning_rate))
    pad = pad_token_id_from_tokenizer(tok)
    prompts, answers, batch = spec["prompts"], spec["answers"], spec["batch"]
    seed = get("seed", d.seed)
    for step in range(spec["steps"]):
        idx = [(step * batch + i) % len(prompts) for i in range(batch)]
        mx.reset_peak_memory()
        t0, c0 = time.perf_counter(), time.process_time()
        comps = generate_group_rollouts(model=model, tokenizer=tok, prompts=[prompts[i] for i in idx], group_size=group,
                                        config=sampling, seed=seed + step, use_chat_template=chat)
        t1 = time.perf_counter()
        peak_gen = mx.get_peak_memory()
        rewards = [_completion_reward(c.text, answers[idx[c.prompt_index]])[0] for c in comps]
        b = batch_from_rollouts(model=model, completions=comps, rewards=rewards, group_size=group, pad_token_id=pad,
                                algorithm=algorithm, use_checkpoint=d.gradient_checkpointing,
                                compute_reference=beta != 0.0)
        t2 = time.perf_counter()
        optimizer_step(model=model, optimizer=opt, batch=b, beta=beta, pad_token_id=pad, algorithm=algorithm,
                       use_checkpoint=d.gradient_checkpointing, micro_batch_size=micro)
        mx.synchronize()
        t3, c3 = time.perf_counter(), time.process_time()
        print(json.dumps({"step": step + 1, "gen_s": t1 - t0, "ref_s": t2 - t1, "update_s": t3 - t2, "step_s": t3 - t0,
                          "cpu_s": c3 - c0, "gen_tokens": sum(len(c.completion_tokens) for c in comps),
                          "prompt_tokens": [len(c.prompt_tokens) for c in comps][::group],
                          "peak_gen_mb": peak_gen / 2**20, "peak_mb": mx.get_peak_memory() / 2**20}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
