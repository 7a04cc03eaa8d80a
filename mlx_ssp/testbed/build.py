"""Build (pretrain) and cache a testbed model.

A random Llama in mlx-lm's own architecture (so every stage runs on it unchanged) with a byte-level
BPE tokenizer trained on the corpus, pretrained from scratch with mlx-lm's trainer (all weights
trainable, prompt tokens masked) on chat-formatted traces of the three domains of
:mod:`mlx_ssp.testbed.problems`. The mix is designed, not tuned:

- **graded difficulty**: level j of a domain's range appears with weight ``LEVEL_DECAY ** j``, so
  the easy levels are learnt and the hard ones are partly learnt (held-out prompts spread over the
  pass band, some at 0 and some at 1);
- **unequal strategies**: each problem's trace uses one of its correct strategies, drawn with the
  domain's :data:`STRATEGY_WEIGHTS` (``sum``: chain 0.6, pairs 0.3, sorted 0.1; ``diff``: chain 0.75,
  group 0.25; ``countdown``: solution i with weight ``0.5 ** i``), so a spectrum exists and can be
  widened (diverse selection) or narrowed (first-win);
- **interference**: ``sum`` and ``diff`` share their surface form;
- **unreliable traces** (a size's ``guess``, 0 by default): that share of the corpus answers with no
  working and a number within :data:`GUESS_SPREAD` of the truth, as real pretraining data hold wrong
  solutions beside right ones.

Deterministic from the seed (weights, corpus, batch order); cached under
``cache_dir()/testbed/<size>-s<seed>-v<VERSION>`` with ``build.json`` (settings, loss curve, wall
time). Model specs: ``testbed`` (= ``testbed:small:0``), ``testbed:SIZE:SEED``.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import random
import shutil
import sys
import time
import types
from pathlib import Path
from typing import Optional

from mlx_ssp.agents.episode import replay
from mlx_ssp.errors import UserError
from mlx_ssp.io import cache_dir
from mlx_ssp.progress import is_on, mlx_lm_train_ui
from mlx_ssp.testbed.problems import DOMAINS, LEVELS, draw, held_out, strategies, trace
from mlx_ssp.testbed.tools.corpus import corpus as tools_corpus
from mlx_ssp.testing import make_tiny_model, train_tokenizer

VERSION = 2  # 2: the held-out quarter of the problem space is left out of the corpus
LEVEL_DECAY = 0.6
STRATEGY_WEIGHTS = {"sum": {"chain": 0.6, "pairs": 0.3, "sorted": 0.1}, "diff": {"chain": 0.75, "group": 0.25}}

#: size -> model shape and pretraining budget
SIZES: dict[str, dict] = {
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=192,
                 corpus=1500, steps=300, batch_size=32, learning_rate=3e-3),
    "small": dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=384,
                  corpus=6000, steps=1500, batch_size=32, learning_rate=2e-3),
    # the first designs for the CI learning-regression test, measured and kept for reference: no round
    # raises their held-out pass@1 (EXPERIMENTS.md). One domain, easy levels, a short pretraining
    "micro": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=192,
                  corpus=3000, steps=300, batch_size=32, learning_rate=3e-3, domains=("sum",), levels={"sum": (2, 3)}),
    # micro with 4x the traces per step (batch 128): measured, does not learn either (EXPERIMENTS.md)
    "nano": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=192,
                 corpus=12000, steps=300, batch_size=128, learning_rate=3e-3, domains=("sum",), levels={"sum": (2, 3)}),
    # the CI learning-regression test's model (tests/test_learning.py): sum at 2-3 terms, half the corpus
    # unreliable guesses (real pretraining data hold wrong solutions too: a round has something to
    # select away on every prompt), 900 steps (500 at twice the rate, or 300, leave it unable to add)
    "ci": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=192,
               corpus=8000, steps=900, batch_size=32, learning_rate=3e-3, domains=("sum",), levels={"sum": (2, 3)},
               guess=0.5),
    # the merge experiment's model (experiment 3): ci's shape and recipe over all three domains
    # at their two easiest levels (sum and diff share a surface, so specialists interfere), twice ci's
    # steps for 2.5x its traces. Fixed before any experiment ran on it
    "multi": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=192,
                  corpus=8000, steps=1800, batch_size=32, learning_rate=3e-3, domains=DOMAINS,
                  levels={"sum": (2, 3), "diff": (2, 3), "countdown": (2, 3)}, guess=0.5),
    # the tool-use testbed's model (the agents experiment): whole episodes on the four toy backends of
    # mlx_ssp.testbed.tools (corpus: n episodes per backend, gold with skewed call orders and a share of
    # unreliable traces), trained on the model's tokens only; a larger vocabulary, since every record
    # repeats the compact header and the tool names
    "tools": dict(kind="tools", hidden_size=96, num_layers=3, num_heads=4, num_kv_heads=2, intermediate_size=288,
                  corpus=1200, steps=1600, batch_size=16, learning_rate=3e-3, unreliable=0.25, vocab_size=1024,
                  max_seq=448),
}
MAX_SEQ = 96
GUESS_SPREAD = 3


def pick_strategy(domain: str, names: list[str], rng: random.Random) -> str:
    w = STRATEGY_WEIGHTS.get(domain)
    weights = [w.get(n, 0.0) for n in names] if w else [0.5 ** i for i in range(len(names))]
    if sum(weights) == 0:
        weights = [1.0] * len(names)
    return rng.choices(names, weights)[0]


def corpus(n_per_domain: int, seed: int, domains: tuple[str, ...] = DOMAINS,
           level_ranges: Optional[dict[str, tuple[int, int]]] = None, guess: float = 0.0) -> list[dict]:
    """Chat records (``messages``: the prompt, then one strategy's trace) with the designed mix,
    plus each record's domain, level and strategy (for the build report). ``domains`` / ``level_ranges``
    narrow the mix (a size's subset) and ``guess`` replaces that share of the traces by unreliable
    guesses; the defaults draw exactly what they always drew."""
    rng = random.Random(f"testbed-corpus:{seed}")
    noise = random.Random(f"testbed-guess:{seed}")  # its own stream: guess = 0 draws what was always drawn
    out = []
    for d in domains:
        lo, hi = (level_ranges or {}).get(d, LEVELS[d])
        levels = list(range(lo, hi + 1))
        lw = [LEVEL_DECAY ** j for j in range(len(levels))]
        for _ in range(n_per_domain // (2 if d == "countdown" else 1)):  # countdown problems are costly to draw
            p = draw(d, rng, rng.choices(levels, lw)[0])
            while held_out(p):  # never pretrain on a problem eval or probe may draw
                p = draw(d, rng, rng.choices(levels, lw)[0])
            name = pick_strategy(d, list(strategies(p)), rng)
            text = trace(p, name)
            if guess and p.answer is not None and noise.random() < guess:
                # an unreliable trace, as real pretraining data hold: no working, an answer within 3 of the truth
                name, text = "guess", f"answer {p.answer + noise.randint(-GUESS_SPREAD, GUESS_SPREAD)}"
            out.append({"messages": [{"role": "user", "content": p.prompt}, {"role": "assistant", "content": text}],
                        "domain": d, "level": p.level, "strategy": name})
    rng.shuffle(out)
    return out


def _episode_item(tok, rec: dict, max_seq: int) -> tuple[list[int], list[int]]:
    """A corpus episode as ``(token ids, mask)``, as the rollout engine would have produced it (the
    task's rendered prompt, then each message's tokens), cut to ``max_seq``."""
    prompt, ids, mask = replay(tok, rec["task"], rec["messages"])
    return (prompt + ids)[:max_seq], ([0] * len(prompt) + mask)[:max_seq]


def testbed_dir(size: str, seed: int) -> Path:
    return cache_dir() / "testbed" / f"{size}-s{seed}-v{VERSION}"


def parse_spec(spec: str) -> tuple[str, int]:
    """``testbed`` | ``testbed:SIZE`` | ``testbed:SIZE:SEED`` -> (size, seed)."""
    parts = spec.split(":")
    size = parts[1] if len(parts) > 1 and parts[1] else "small"
    try:
        seed = int(parts[2]) if len(parts) > 2 else 0
    except ValueError:
        raise UserError(f"model spec {spec!r}: the seed must be an integer (testbed:SIZE:SEED)") from None
    if size not in SIZES or len(parts) > 3:
        raise UserError(f"model spec {spec!r}: expected testbed[:SIZE[:SEED]] with SIZE one of {', '.join(SIZES)}")
    return size, seed


def cached(size: str, seed: int) -> Optional[Path]:
    """The cache directory of ``testbed:SIZE:SEED`` if it is built (None if not); a build whose
    settings differ from :data:`SIZES` now is refused, never silently reused."""
    out = testbed_dir(size, seed)
    if not (out / "build.json").is_file():
        return None
    built = json.loads((out / "build.json").read_text())
    # the cache is keyed by size, seed and VERSION only: a size whose settings were changed since
    # must not silently reuse the old build
    want = json.loads(json.dumps(SIZES[size]))  # tuples as the lists build.json holds
    skip = set(built.get("overrides", ()))  # a build told to differ (tests' short builds)
    stale = sorted(k for k, v in want.items() if k in built and k not in skip and built[k] != v)
    if stale:
        raise UserError(f"cached testbed {out} was built with other settings ({', '.join(stale)} differ from "
                        f"SIZES[{size!r}]); delete it to rebuild, or bump testbed VERSION")
    return out


def ensure_testbed(spec: str = "testbed", *, progress: bool = True) -> Path:
    """The cached testbed model of ``spec``, built first if missing (minutes on a 2-core CPU)."""
    size, seed = parse_spec(spec)
    return cached(size, seed) or build(size, seed, testbed_dir(size, seed), progress=progress)


def build(size: str, seed: int, out: Path, *, steps: Optional[int] = None, corpus_size: Optional[int] = None,
          progress: bool = True) -> Path:
    """Pretrain a testbed model into ``out`` (built in a temp directory, then renamed: a killed build
    leaves nothing half-written). ``steps`` / ``corpus_size`` override the size's (tests)."""
    s = dict(SIZES[size])
    overrides = [k for k, v in (("steps", steps), ("corpus", corpus_size)) if v]  # recorded: not stale settings
    steps = steps or s["steps"]
    t0 = time.perf_counter()
    tmp = out.with_name(out.name + f".tmp{int(time.time() * 1000)}")
    recs = _corpus_records(s, seed, corpus_size)
    model, tok = _init_model(tmp, s, recs, seed)
    losses = _pretrain(model, tok, recs, s, steps, seed, tmp, progress=progress, label=f"{size}:{seed}")
    final = _save(model, tmp)
    info = {"size": size, "seed": seed, "version": VERSION, "steps": steps,
            **{k: v for k, v in s.items() if k not in ("steps", "levels")},
            **({"levels": {d: list(r) for d, r in s["levels"].items()}} if "levels" in s else {}),
            "corpus_records": len(recs), "mix": _mix(recs, tools=_is_tools(s)), "losses": losses,
            "seconds": round(time.perf_counter() - t0, 1), "params": _n_params(model), "overrides": overrides}
    (final / "build.json").write_text(json.dumps(info, indent=1))
    return _publish(tmp, final, out)


def _is_tools(s: dict) -> bool:
    return s.get("kind") == "tools"


def _corpus_records(s: dict, seed: int, corpus_size: Optional[int]) -> list[dict]:
    """The size's corpus: tool-use episodes for the tools size, else the arithmetic domains' traces."""
    n = corpus_size or s["corpus"]
    if _is_tools(s):
        return tools_corpus(n, seed, unreliable=s.get("unreliable", 0.0))
    return corpus(n, seed, tuple(s.get("domains", DOMAINS)), s.get("levels"), s.get("guess", 0.0))


def _init_model(tmp: Path, s: dict, recs: list[dict], seed: int):
    """A tokenizer trained on the corpus and a random model of the size's shape, loaded by mlx-lm."""
    from mlx_lm.utils import load

    texts = [m["content"] for r in recs[:4000] for m in r["messages"]]
    tok_dir = train_tokenizer(tmp / "tok", vocab_size=s.get("vocab_size", 320), corpus=texts)
    make_tiny_model(tmp / "init", "llama", tokenizer_dir=tok_dir, hidden_size=s["hidden_size"],
                    num_layers=s["num_layers"], num_heads=s["num_heads"], num_kv_heads=s["num_kv_heads"],
                    intermediate_size=s["intermediate_size"], seed=seed)
    return load(str(tmp / "init"))


def _train_data(tok, recs: list[dict], s: dict, seed: int, max_seq: int):
    """The training set and its batching: whole episodes with a target mask for the tools size, else
    chat records with the prompt masked."""
    from mlx_lm.tuner.datasets import CacheDataset, create_dataset

    from mlx_ssp.sft.batches import (  # lazy: sft -> models -> this module
        make_iterate_batches,
        make_masked_iterate_batches,
    )
    from mlx_ssp.sft.episodes import TokenDataset
    from mlx_ssp.sft.loss import masked_loss

    if _is_tools(s):  # whole episodes: every assistant message is a target, tool results and user turns are not
        data = TokenDataset([_episode_item(tok, r, max_seq) for r in recs])
        return data, {"iterate_batches": make_masked_iterate_batches(seed), "loss": masked_loss}
    data = CacheDataset(create_dataset([{"messages": r["messages"]} for r in recs], tok,
                                       types.SimpleNamespace(mask_prompt=True)))
    return data, {"iterate_batches": make_iterate_batches(seed)}


def _optimizer(s: dict, steps: int):
    """AdamW with a 5% linear warmup, then cosine to 5% of the peak."""
    import mlx.optimizers as optim

    lr, warm = s["learning_rate"], max(1, steps // 20)
    sched = optim.join_schedules([optim.linear_schedule(0.0, lr, warm),
                                  optim.cosine_decay(lr, max(1, steps - warm), lr * 0.05)], [warm])
    return optim.AdamW(learning_rate=sched, weight_decay=0.01)


def _pretrain(model, tok, recs: list[dict], s: dict, steps: int, seed: int, tmp: Path, *, progress: bool,
              label: str) -> list[dict]:
    """Train every weight with mlx-lm's trainer; the loss curve (one point per report)."""
    import mlx.core as mx
    from mlx_lm.tuner.trainer import TrainingArgs, train

    max_seq = s.get("max_seq", MAX_SEQ)
    data, batching = _train_data(tok, recs, s, seed, max_seq)
    opt = _optimizer(s, steps)
    losses: list[dict] = []
    show = is_on(progress)

    class Log:
        def on_train_loss_report(self, info):
            losses.append({"step": int(info["iteration"]), "loss": round(float(info["train_loss"]), 4)})
            if show:
                print(f"[testbed {label}] step {info['iteration']}/{steps} loss {info['train_loss']:.3f}",
                      file=sys.stderr, flush=True)

        def on_val_loss_report(self, info):
            pass

    mx.random.seed(seed)
    args = TrainingArgs(batch_size=s["batch_size"], iters=steps, val_batches=0, steps_per_report=max(1, steps // 10),
                        steps_per_eval=steps + 1, steps_per_save=steps + 1, max_seq_length=max_seq,
                        adapter_file=str(tmp / "unused.safetensors"))
    quiet = contextlib.redirect_stdout(io.StringIO()) if not show else contextlib.nullcontext()
    with quiet, mlx_lm_train_ui("testbed", enabled=False):  # Log's lines below say how far it is
        train(model=model, optimizer=opt, train_dataset=data, val_dataset=None, args=args, training_callback=Log(),
              **batching)
    (tmp / "unused.safetensors").unlink(missing_ok=True)
    return losses


def _save(model, tmp: Path) -> Path:
    """The trained weights with the initial model's config and tokenizer files, in ``tmp/model``."""
    from mlx_lm.utils import save_model

    final = tmp / "model"
    save_model(final, model)
    for f in (tmp / "init").iterdir():
        if f.name == "config.json" or f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, final / f.name)
    return final


def _mix(recs: list[dict], *, tools: bool) -> dict[str, dict]:
    """Records per domain (backend) by level and by strategy (record kind), for build.json."""
    mix: dict[str, dict] = {}
    for r in recs:
        m = mix.setdefault(r["backend"] if tools else r["domain"], {"levels": {}, "strategies": {}})
        m["levels"][str(r["level"])] = m["levels"].get(str(r["level"]), 0) + 1
        kind = r["kind"] if tools else r["strategy"]
        m["strategies"][kind] = m["strategies"].get(kind, 0) + 1
    return mix


def _n_params(model) -> int:
    from mlx.utils import tree_flatten

    return int(sum(math.prod(v.shape) for _, v in tree_flatten(model.parameters())))


def _publish(tmp: Path, final: Path, out: Path) -> Path:
    """Rename the finished model to ``out`` (another process built it meanwhile: keep theirs)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():
        shutil.rmtree(tmp, ignore_errors=True)
        return out
    final.rename(out)
    shutil.rmtree(tmp, ignore_errors=True)
    return out
