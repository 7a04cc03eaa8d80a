"""The experiments' configuration profiles: the defaults each ``--profile`` starts from (demo model,
``testbed:multi``, ``testbed:tools``) and the ``--tiny`` stand-ins (a minimal config and a verifier
that needs no trained model). See EXPERIMENTS.md for what each setting measures.
"""

from __future__ import annotations

import copy
from typing import Any

_ARITH = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "allow_parentheses": False,
          "allow_negation": False}
_SAMPLING = {"temperature": 0.9, "top_p": 1.0, "max_tokens": 20}


def _switches() -> dict[str, Any]:
    """The experiments' optional arms and probes, off in every profile (a fresh dict each call)."""
    return {
        "domains": None,  # the tasks' domains to use (null: all); e.g. [addition] for one
        # experiment 3: also a GRPO arm at this x the learning rate (a number > 0, or "mgpo": the MGPO
        # arm's mean weight over its steps); null: not run
        "grpo_lr_scale": None,
        # experiment 3: more MGPO arms at these lambdas (numbers > 0), beside rl.mgpo_lambda's, e.g.
        # [0.5, 2, 4] for a lambda grid that shares one GRPO arm
        "extra_lambdas": [],
        # experiment 5: also probe every checkpoint with n samples per probe prompt and rank by pass@k at
        # each k of ks, e.g. {n: 256, ks: [16, 64, 256]}; null: not run
        "large_k": None,
        # experiments 1 and 2: where the SFT data are selected from: "rollouts" (the base model's K
        # samples) or "generator" (the testbed generator's own traces of every correct strategy,
        # mlx_ssp.testbed.spectrum: a spectrum that exists by construction; testbed tasks only)
        "spectrum_source": "rollouts",
        # experiment 1: pass@k at these k (<= spectrum_eval.n) after SFT, from n samples on every held-out
        # task of each domain (the spectrum itself); null: not run
        "spectrum_eval": None,
        # experiment 2: controls for merge vs blend: the blend at half its LoRA scale, a soup of two
        # blend seeds, the specialists' mean task vector scaled by each alpha (1 = the linear merge),
        # and the task vectors' cosines; null: not run
        "merge_controls": None,
    }


#: demo-scale defaults, sized for a few minutes per experiment on a quiet 2-core CPU
DEFAULTS: dict[str, Any] = {
    "model": "demo",
    "seed": 0,
    "tasks": {
        "seed": 1234,
        "domains": {
            "addition": {"source": "reasoning_gym:basic_arithmetic", "params": {**_ARITH, "operators": ["+"]},
                         "answer_extraction": "lenient", "sizes": {"train": 12, "probe": 4, "eval": 12}},
            "subtraction": {"source": "reasoning_gym:basic_arithmetic", "params": {**_ARITH, "operators": ["-"]},
                            "answer_extraction": "lenient", "sizes": {"train": 12, "probe": 4, "eval": 12}},
        },
    },
    "rollout": {"k": 8, "sampling": _SAMPLING, "batch_size": 128},
    "select": {"per_prompt": 4},
    "sft": {
        "lora": {"rank": 8, "num_layers": 8, "scale": 20.0},
        "learning_rate": 3e-4,
        "iters": 12,
        "batch_size": 4,
        "save_every": 6,
        "report_every": 3,
        "val_batches": 0,
        "max_seq_length": 512,
        "probe": {"k": 4, "max_tasks": 4, "batch_size": 64, "sampling": _SAMPLING, "progress": False},
    },
    "sft_seeds": [0],
    "eval": {"k": 8, "n": 8, "sampling": _SAMPLING, "batch_size": 128},
    "merge": {"method": "linear"},
    "rl": {
        "steps": 4, "batch_size": 4, "group_size": 8, "sampling": {**_SAMPLING, "temperature": 0.9},
        "gen_batch_size": 128, "micro_batch_size": 16, "learning_rate": 1e-4, "mgpo_lambda": 1.0,
        "checkpoint_every": 2, "progress": False, "lora": {"rank": 8, "num_layers": 8},
    },
    "rl_eval_every": 4,  # held-out evaluation every N RL steps (and at the last)
    **_switches(),
}

_TB_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 48}


def _tb_domain(name: str) -> dict[str, Any]:
    # the learning round's splits (mlx_ssp.testbed.learning): the two easiest levels; eval and probe
    # are held out from pretraining
    return {"source": f"testbed:{name}", "params": {"levels": [2, 3]}, "sizes": {"train": 256, "probe": 32, "eval": 128}}


#: the testbed profile: the `multi` testbed model (three domains) with the learning round's
#: measured settings (SFT: lr 1e-4, 160 iterations of 8; RL: 60 steps of 8 x G=8 at 3e-4, LoRA scale 2)
TESTBED: dict[str, Any] = {
    "model": "testbed:multi:0",
    "seed": 0,
    "tasks": {"seed": 11, "domains": {d: _tb_domain(d) for d in ("sum", "diff", "countdown")}},
    "rollout": {"k": 8, "sampling": _TB_SAMPLING, "batch_size": 256},
    "select": {"per_prompt": 4},
    "sft": {
        "lora": {"rank": 8, "num_layers": -1, "scale": 20.0},
        "learning_rate": 1e-4,
        "iters": 160,
        "batch_size": 8,
        "save_every": 40,
        "report_every": 40,
        "val_batches": 0,
        "max_seq_length": 96,
        "probe": {"k": 8, "max_tasks": 32, "batch_size": 256, "sampling": _TB_SAMPLING, "progress": False},
    },
    "sft_seeds": [0],
    "eval": {"k": 8, "n": 8, "sampling": _TB_SAMPLING, "batch_size": 256},
    "merge": {"method": "linear"},
    "rl": {
        "steps": 60, "batch_size": 8, "group_size": 8, "sampling": _TB_SAMPLING, "gen_batch_size": 64,
        "micro_batch_size": 16, "learning_rate": 3e-4, "mgpo_lambda": 1.0, "beta": 0.0, "checkpoint_every": 60,
        "progress": False, "lora": {"rank": 8, "scale": 2.0},
    },
    "rl_eval_every": 60,
    **_switches(),
}

_TOOLS_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 48}


def _tools_domain(backend: str) -> dict[str, Any]:
    # eval and probe: in-distribution episodes no train draw can produce (eval_space: seen), at the two
    # levels where testbed:tools is in the pass band (held-out names and levels 3-4: pass@1 under 0.1)
    return {"source": f"testbed_tools:{backend}", "params": {"levels": [1, 2], "eval_space": "seen"},
            "sizes": {"train": 64, "probe": 8, "eval": 24}}


#: the tool-use testbed profile: the `tools` testbed model and its four toy backends, one domain per
#: backend (the agents experiment: specialists per backend, blend, merge)
TOOLS: dict[str, Any] = {
    **TESTBED,
    "model": "testbed:tools:0",
    "tasks": {"seed": 11, "domains": {b: _tools_domain(b) for b in ("kv", "ctr", "files", "bank")}},
    "rollout": {"k": 8, "sampling": _TOOLS_SAMPLING, "batch_size": 64},
    "select": {"per_prompt": 4, "gold": True, "drop_truncated": False},
    "sft": {
        "lora": {"rank": 8, "num_layers": -1, "scale": 20.0},
        "learning_rate": 1e-4,
        "iters": 80,
        "batch_size": 8,
        "save_every": 40,
        "report_every": 40,
        "val_batches": 0,
        "max_seq_length": 448,
        "probe": {"k": 4, "max_tasks": 8, "batch_size": 64, "sampling": _TOOLS_SAMPLING, "progress": False},
    },
    "eval": {"k": 4, "n": 4, "sampling": _TOOLS_SAMPLING, "batch_size": 64},
    "rl": {**TESTBED["rl"], "sampling": _TOOLS_SAMPLING, "gen_batch_size": 32},
    "extra_merges": ["ties"],  # experiment 4: merge methods evaluated beside the merge section's
}

#: where experiments 1 and 2 select SFT data from (``spectrum_source``)
SPECTRUM_SOURCES = ("rollouts", "generator")

#: --profile NAME -> the defaults it starts from
PROFILES: dict[str, dict[str, Any]] = {"demo": DEFAULTS, "testbed": TESTBED, "tools": TOOLS}

TINY_VERIFIER = "experiments_tiny_even"


def _tiny_defaults() -> dict[str, Any]:
    d = copy.deepcopy(DEFAULTS)
    s = {"temperature": 1.0, "max_tokens": 6}
    for dom in d["tasks"]["domains"].values():
        dom["verifier"] = TINY_VERIFIER
        dom["sizes"] = {"train": 4, "probe": 2, "eval": 3}
    d["rollout"].update(k=4, sampling=s, batch_size=32)
    d["select"].update(drop_truncated=False)  # a random model never stops
    d["sft"].update(iters=2, batch_size=1, save_every=1, report_every=1, lora={"rank": 2, "num_layers": 1},
                    probe={"k": 2, "max_tasks": 2, "batch_size": 16, "sampling": s, "progress": False})
    d["eval"].update(k=2, n=2, sampling=s, batch_size=32)
    d["rl"].update(steps=2, batch_size=2, group_size=2, sampling=s, gen_batch_size=16, micro_batch_size=4,
                   checkpoint_every=1, lora={"rank": 2, "num_layers": 1})
    d["rl_eval_every"] = 1
    return d


def _register_tiny_verifier() -> None:
    from mlx_ssp.verify import VERIFIERS, VerifyResult, register

    if TINY_VERIFIER in VERIFIERS:
        return

    @register(TINY_VERIFIER)
    def _even(completion: str, task) -> VerifyResult:  # a coin flip that is a function of the text
        ok = len(completion) % 2 == 0
        return VerifyResult(1.0 if ok else 0.0, "correct" if ok else "wrong_answer", "")

