"""Probe: peak MLX memory of one forward + backward of the RL update's log-prob loss on the demo
model (LoRA r8 on every block), by rows of 384 random tokens, against the body alone and against
naive full logits (BENCHMARKS.md, "RL step memory": the chunked op's excess at 4+ rows).

    python scripts/probe_update_memory.py ROWS[,ROWS...] [LENGTH] [logp|naive|body|bodyeval|twophase] [SAVE_GRAD 0|1] [CHUNK]
    python scripts/probe_update_memory.py 2,4 384 logp

``twophase``: the trainer's path for a piece over more than one log-prob chunk
(:func:`mlx_ssp.rl.pieces.piece_value_and_grad` with ``two_phase``: the body's output evaluated
outside the trace, then the body's vjp), on the same summed log-probs.
"""
import sys, time, mlx_ssp, mlx.core as mx, mlx.nn as nn
from mlx_ssp.models import load_model
from mlx_ssp.finetune.lora import LoRAConfig, attach_lora
from mlx_ssp.rl.pieces import sequence_logprobs
model, tok = load_model("demo")[:2]
attach_lora(model, LoRAConfig(rank=8, num_layers=-1), seed=0)
L = int(sys.argv[2]) if len(sys.argv) > 2 else 384
mode = sys.argv[3] if len(sys.argv) > 3 else "logp"
for B in [int(x) for x in sys.argv[1].split(",")]:
    x = mx.random.randint(0, 49152, (B, L)); mx.eval(x)
    def loss(m):
        if mode == "logp":
            lp = sequence_logprobs(m, x[:, :-1], x[:, 1:], 0.8, (int(sys.argv[5]) if len(sys.argv) > 5 else None), save_grad=(sys.argv[4] == "1") if len(sys.argv) > 4 else True)
            return lp.sum()
        if mode == "naive":
            lg = m(x[:, :-1]).astype(mx.float32) / 0.8
            lp = mx.take_along_axis(lg, x[:, 1:, None], axis=-1)[..., 0] - mx.logsumexp(lg, axis=-1)
            return lp.sum()
        h = m.model(x[:, :-1])
        if mode == "bodyeval":  # the body with its output evaluated inside the gradient trace
            mx.eval(h)
        return (h * h).sum()   # body only: no head
    mx.reset_peak_memory(); t = time.perf_counter()
    if mode == "twophase":
        from mlx.utils import tree_flatten
        from mlx_ssp.rl.pieces import piece_value_and_grad
        names, arrays = zip(*tree_flatten(model.trainable_parameters()))
        lfn = lambda m, mb, h: (sequence_logprobs(m, mb["inputs"], x[:, 1:], 0.8, None, save_grad=True, hidden=h).sum(), ())  # noqa: E731
        (l, _), g, _ = piece_value_and_grad(model, lfn, {"inputs": x[:, :-1]}, None, list(names), list(arrays), True)
        mx.eval(l, g)
    else:
        l, g = nn.value_and_grad(model, loss)(model); mx.eval(l, g)
    print(mode, B, L, f"peak {mx.get_peak_memory()/2**30:.2f} GiB  {time.perf_counter()-t:.1f} s", flush=True)
