"""Model cards: the ``README.md`` of every model directory mlx_ssp writes (a fused SFT specialist, a
merge, an RL model, a distilled student).

A card is YAML front matter in the Hugging Face Hub's model-card schema (built with huggingface_hub's
``ModelCardData``: ``base_model``, ``library_name: mlx``, ``tags``, ``datasets``, ``pipeline_tag``)
and a Markdown body saying how the model was made: the recipe (:data:`KINDS`) and its key settings,
the input models, the merge config as YAML (the fields mergekit's own card gives a merge), and the
held-out table once one exists (:func:`with_eval_table`).

``base_model`` must hold Hub repo ids, so a local input counts only when its id can be recovered
(:func:`hub_ids`): a Hub cache snapshot, or a directory whose own card (one we wrote) names it. Cards
are written only into our output directories, atomically; an input's README.md is only read.

A card is meant to be shared, so its body never holds an absolute local path (:func:`shown`): a local
model or data file is named by its last component, a Hub cache snapshot by its repo id, and the merge
config's paths likewise (the ``mergekit_config.yml`` beside it keeps the real ones, to rerun the merge).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import yaml
from huggingface_hub import ModelCardData

from mlx_ssp.io import write_text_atomic

if TYPE_CHECKING:
    from huggingface_hub import ModelCard

CARD_FILE = "README.md"
#: the tag every card of ours carries (how :func:`is_our_card` tells ours from a user's README)
OUR_TAG = "mlx_ssp"
EVAL_HEADING = "## Held-out evaluation"


@dataclass(frozen=True)
class Kind:
    """One way a model is made: its Hub tags and the sentence that opens the card."""

    tags: tuple[str, ...]
    made: str
    relation: Optional[str] = None  # the Hub's base_model_relation


#: how each kind of output model is made; the card's tags and first sentence come from here
KINDS: dict[str, Kind] = {
    "merge": Kind(("merge", "mergekit"), "a parameter merge of the input models (`mlx_ssp merge`, streaming, "
                  "mergekit-compatible config)", "merge"),
    "lora": Kind(("lora", "sft"), "LoRA supervised fine-tuning of the base model on its domain's selected "
                 "verified solutions, with the checkpoint chosen by probe Pass@K, fused into the weights "
                 "(`mlx_ssp sft`)", "finetune"),
    "grpo": Kind(("grpo", "mgpo", "reinforcement-learning"), "MGPO-weighted GRPO with verifiable rewards on the "
                 "base model (`mlx_ssp rl`)", "finetune"),
    "distill": Kind(("distillation", "lora", "sft"), "offline self-distillation: the RL checkpoints' verified "
                    "traces, selected by learning potential, trained into the student with LoRA and fused "
                    "(`mlx_ssp run`, distill stage)", "finetune"),
}


@dataclass(frozen=True)
class Card:
    """What a card says; callers fill in what they know."""

    kind: str  # a key of KINDS
    inputs: tuple[str, ...]  # the base / input models, as given (paths or Hub ids)
    settings: dict[str, Any] = field(default_factory=dict)  # the recipe's key settings
    datasets: tuple[str, ...] = ()  # training data on the Hub: dataset ids (front matter and body)
    data_files: tuple[str, ...] = ()  # training data on disk (body only)
    config_yaml: Optional[str] = None  # the merge config (mergekit YAML)
    eval_table: Optional[str] = None  # a Markdown table of held-out results
    title: str = ""
    how: str = ""  # a clause ending the opening sentence (e.g. whether adapters were fused or all weights trained)


def _is_repo_id(ref: str) -> bool:
    # lazy: huggingface_hub's errors load its HTTP client (25 ms); only a ref that is no local path gets here
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(ref)
    except HFValidationError:
        return False
    return "/" in ref


#: a Hub cache snapshot: .../models--ORG--NAME/snapshots/<sha>
_CACHE = re.compile(r"models--([^/]+?)--([^/]+)/snapshots/[^/]+/?$")
#: a path that names the maker's own file system: absolute (POSIX, Windows) or home-relative
_LOCAL = re.compile(r"^(/|~|[A-Za-z]:[\\/]|\\\\)")


def is_local_path(ref: str) -> bool:
    """Whether ``ref`` names a place on this machine that a reader of a shared card must not see:
    an absolute or home-relative path, or a relative one that climbs out (``..``)."""
    return bool(_LOCAL.match(ref)) or ".." in Path(ref).parts


def shown(ref: str) -> str:
    """How a card's body names a model or file: a Hub id (or a plain relative path) as it is, a Hub
    cache snapshot by its repo id, any other local path by its last component only (an absolute path
    tells a reader nothing and gives away the maker's user name and directory layout)."""
    ref = str(ref)
    if not is_local_path(ref):
        return ref
    m = _CACHE.search(ref.rstrip("/\\"))
    if m:
        return f"{m.group(1)}/{m.group(2)}"
    name = re.split(r"[/\\]", ref.rstrip("/\\"))[-1]
    return name if name not in ("", "~", "..") else "(a local path)"


def _shown_yaml(config_yaml: str) -> str:
    """The merge config with every local path :func:`shown`; as written when it holds none (so its
    comments and layout stay), else re-dumped (mergekit's own card dumps its config too)."""
    try:
        data = yaml.safe_load(config_yaml)
    except yaml.YAMLError:  # validated before a merge, so only a caller's odd text: hide it all
        return "# (the config could not be read back; see mergekit_config.yml)\n"

    def walk(x):
        if isinstance(x, str):
            return shown(x)
        if isinstance(x, dict):
            return {walk(k): walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x

    hidden = walk(data)
    if hidden == data and not any(is_local_path(tok) for tok in config_yaml.split()):
        return config_yaml
    return yaml.safe_dump(hidden, sort_keys=False)


def hub_ids(ref: str) -> list[str]:
    """The Hub repo ids ``ref`` stands for (empty when unknown): the id itself, a Hub cache snapshot's
    id, or the ``base_model`` of the directory's own card when we wrote it (so a merge of fused
    specialists names the model they were trained from)."""
    p = Path(ref).expanduser()
    if not p.exists():
        return [ref] if _is_repo_id(ref) else []
    m = _CACHE.search(str(p.resolve()))
    if m:
        return [f"{m.group(1)}/{m.group(2)}"]
    card = read_card(p)
    if card is None or not is_our_card(card):
        return []
    base = card.data.base_model
    return [base] if isinstance(base, str) else list(base or [])


def read_card(model_dir: Path) -> Optional[ModelCard]:
    """The card of a model directory, or None (no README.md, or unreadable front matter)."""
    path = Path(model_dir) / CARD_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    # lazy: ModelCard's module loads the Hub client (0.1 s); only a directory with a README.md gets here
    from huggingface_hub import ModelCard

    try:
        return ModelCard(text, ignore_metadata_errors=True)
    except (ValueError, yaml.YAMLError):
        return None


def is_our_card(card: ModelCard) -> bool:
    return OUR_TAG in (card.data.tags or [])


def _unique(xs) -> list:
    return list(dict.fromkeys(x for x in xs if x))


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, (list, tuple)):
        return ", ".join(_value(x) for x in v)
    if isinstance(v, (str, Path)):
        v = shown(str(v))  # e.g. a merge's base model or tokenizer source given as a path
    return str(v).replace("|", "\\|")


def front_matter(card: Card) -> ModelCardData:
    kind = KINDS[card.kind]
    bases = _unique(i for ref in card.inputs for i in hub_ids(ref))
    datasets = _unique(card.datasets)
    return ModelCardData(
        base_model=(bases[0] if len(bases) == 1 else bases) or None,
        base_model_relation=kind.relation if bases else None,
        library_name="mlx",
        pipeline_tag="text-generation",
        tags=_unique(("mlx", OUR_TAG, *kind.tags)),
        datasets=datasets or None,
    )


def render(card: Card) -> str:
    """The README.md text of ``card`` (pure)."""
    if card.kind not in KINDS:
        raise ValueError(f"unknown card kind {card.kind!r}; valid: {', '.join(KINDS)}")
    kind = KINDS[card.kind]
    how = f", {card.how}" if card.how else ""
    lines = [f"# {card.title or 'mlx_ssp ' + card.kind + ' model'}", "",
             f"This model is {kind.made}{how}, made with mlx_ssp on [MLX](https://github.com/ml-explore/mlx).", ""]
    if card.inputs:
        lines += ["## Input models", ""] + [f"- `{shown(ref)}`" + (" (a local directory)" if _local_dir(ref) else "")
                                            for ref in card.inputs] + [""]
    if card.settings:
        lines += ["## Settings", "", "| setting | value |", "|---|---|"]
        lines += [f"| {k} | {_value(v)} |" for k, v in card.settings.items() if v is not None] + [""]
    if card.datasets or card.data_files:
        lines += ["## Training data", ""] + [f"- `{d}`" for d in card.datasets]
        lines += [f"- `{shown(f)}` (a local file)" for f in card.data_files] + [""]
    if card.config_yaml:
        lines += ["## Configuration", "", "The following YAML configuration was used to produce this model:", "",
                  "```yaml", _shown_yaml(card.config_yaml).rstrip("\n"), "```", ""]
    lines += ["## Use with mlx", "", "```python", "from mlx_lm import load, generate", "",
              'model, tokenizer = load("PATH_OR_REPO")',
              'print(generate(model, tokenizer, prompt="What is 7 + 5?", max_tokens=64))', "```", ""]
    text = f"---\n{front_matter(card).to_yaml()}\n---\n\n" + "\n".join(lines)
    return with_eval_table(text, card.eval_table) if card.eval_table else text


def _local_dir(ref: str) -> bool:
    """A local input that is not a Hub cache snapshot (which :func:`shown` names by its repo id)."""
    return is_local_path(str(ref)) and not _CACHE.search(str(ref).rstrip("/\\"))


def with_eval_table(text: str, table_md: str, note: str = "") -> str:
    """``text`` with its held-out section (always the last one) replaced by, or ended with, ``table_md``."""
    start = text.rfind(f"\n{EVAL_HEADING}\n")
    if start >= 0:
        text = text[:start]
    section = [EVAL_HEADING, ""] + ([note, ""] if note else []) + [table_md.strip("\n"), ""]
    return text.rstrip("\n") + "\n\n" + "\n".join(section)


def write_card(model_dir: str | Path, card: Card) -> Path:
    """Write ``card`` as ``model_dir/README.md`` (atomically); returns its path. Only for output
    directories we made: an input's README.md is never touched."""
    path = Path(model_dir) / CARD_FILE
    write_text_atomic(path, render(card))
    return path


def add_eval_table(model_dir: str | Path, table_md: str, note: str = "") -> bool:
    """Put ``table_md`` into the held-out section of ``model_dir``'s card when that card is ours;
    False (nothing written) for a directory without one of our cards (a user's model)."""
    card = read_card(Path(model_dir))
    if card is None or not is_our_card(card):
        return False
    path = Path(model_dir) / CARD_FILE
    write_text_atomic(path, with_eval_table(path.read_text(encoding="utf-8"), table_md, note))
    return True
