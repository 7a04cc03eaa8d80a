"""Tokenizer surgery: ``tokenizer_source: base | union | <model>`` and mergekit's ``tokenizer:``.

mergekit 0.1.5 (``mergekit/tokenizer/build.py``, ``embed.py``): an output vocabulary is chosen
(the base's, one model's, or the union of all of them), each model's embedding / LM-head rows are
permuted onto it, tokens a model lacks get rows by a rule, and the merge method then runs on the
aligned rows. Here, as there:

- A vocabulary is ``tokenizer.json``'s token -> id map with its added tokens. Tokens whose id is
  not below the model's ``vocab_size`` (config.json; else the vocabulary's size) count as absent.
  A model without any tokenizer file is assumed to share the base's vocabulary.
- ``union``: the base's tokenizer, then every other token of the models in order (base first),
  plain tokens before added ones (first settings win), appended with the next ids. As in mergekit
  (which adds them with transformers' ``add_tokens``), a new *plain* token becomes an added token
  of the output: it is matched literally in text, so a byte-level BPE piece (``Ġword``) is in
  practice reached only by its id, while an added token (``<tool_call>``) encodes to its new id.
- A token a model lacks (mergekit's ``assign_embedding_sources``): the row of the one model that
  has it; else, if several have it, the base's row when the base has it, else their mean (summed
  in model order in the compute dtype, then divided); else zeros. ``tokenizer.tokens`` chooses per
  token (``source``: a model, ``{kind: model_token, model, token_id | token}`` or ``{kind: zero}``;
  ``force``: every model takes those rows), and adds the token to the output when it is new.
- ``pad_to_multiple_of`` pads the rows; each model's pad rows are the mean of its aligned rows.
  ``config.json``'s ``vocab_size`` becomes the output's row count.

Deviations: mergekit iterates a hash map, so its order among new tokens is arbitrary; here it is
(model, id). mergekit strips a tokenizer's tokens with ids past ``vocab_size`` from the output;
here they stay, with rows by the rules above. A ``tokens`` entry without ``source`` follows the
automatic rule (mergekit raises). A tokenizer without ``tokenizer.json`` (only slow files) is an
error, not converted. Pad rows are a float32 mean rounded to the compute dtype (torch may round
one ulp differently). Only the ``models:`` form (``slices:`` copies a tokenizer, vocabularies
equal). When the output vocabulary is a model's unchanged, its files are copied byte for byte;
otherwise ``tokenizer.json`` is rewritten and ``tokenizer_config.json``'s ``added_tokens_decoder``
(if it has one) extended, and stale slow-tokenizer files (``vocab.json``, ``merges.txt``,
``tokenizer.model``, ``added_tokens.json``) are not copied.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
import numpy as np

import mlx_ssp  # noqa: F401
from mlx_ssp.errors import UserError
from mlx_ssp.io import decode_utf8, parse_json, read_json
from mlx_ssp.merge.config import ModelTokenEmbedding, ZeroEmbedding

#: files a model's tokenizer may consist of (copied when the output vocabulary is that model's)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")
#: what a rewritten tokenizer keeps of the source's files besides tokenizer.json / tokenizer_config.json
_SIDE_FILES = ("special_tokens_map.json", "chat_template.jinja", "chat_template.json", "generation_config.json")
_SLOW_FILES = ("tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")
_ADDED_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")


# ------------------------------------------------------------ vocabularies (data)


@dataclass(frozen=True)
class Vocab:
    """One model's vocabulary: token -> id (added tokens included), its added tokens' settings
    (id -> {content, single_word, lstrip, rstrip, normalized, special}) and ``limit``: ids at or
    above it have no embedding row (count as absent)."""

    ids: dict[str, int]
    added: dict[int, dict]
    limit: int


def read_tokenizer_json(model_dir: Path, ref: str) -> Optional[str]:
    """The text of ``tokenizer.json``; None when the model has no tokenizer file at all (mergekit
    then assumes the base's); an error when it has only slow-tokenizer files."""
    f = Path(model_dir) / "tokenizer.json"
    if f.is_file():
        return decode_utf8(f.read_bytes(), f"model {ref}: {f}")
    slow = [n for n in _SLOW_FILES if (Path(model_dir) / n).is_file()]
    if slow:
        raise UserError(f"model {ref}: tokenizer surgery needs tokenizer.json (found only {', '.join(slow)}); "
                        "load and save the tokenizer with transformers once to write it")
    return None


def vocab_of(tokenizer_json: str, vocab_size: Optional[int], ref: str) -> Vocab:
    """The :class:`Vocab` of a ``tokenizer.json`` text: the model's token -> id map (a list of
    pieces for Unigram) and the added tokens, as the library's ``get_vocab(with_added_tokens)``
    gives them (read from the JSON: building the tokenizer costs far more on 150k vocabularies)."""
    data = parse_json(tokenizer_json, f"model {ref}: tokenizer.json")
    try:
        vocab = data["model"]["vocab"]
        ids = dict(vocab) if isinstance(vocab, dict) else {piece[0]: i for i, piece in enumerate(vocab)}
        added = {a["id"]: {"content": a["content"], **{k: bool(a.get(k, False)) for k in _ADDED_FLAGS}}
                 for a in data.get("added_tokens") or []}
    except (KeyError, TypeError, IndexError, AttributeError) as e:
        raise UserError(f"model {ref}: unreadable tokenizer.json ({type(e).__name__}: {e})") from None
    # ids index rows and sort against ints: a string, float, bool or negative id is refused here
    bad = next(((t, i) for t, i in ids.items() if not (isinstance(t, str) and _is_id(i))), None)
    if bad is None:
        bad = next(((a["content"], i) for i, a in added.items() if not (isinstance(a["content"], str) and _is_id(i))), None)
    if bad is not None:
        raise UserError(f"model {ref}: tokenizer.json maps {bad[0]!r} to {bad[1]!r}: token ids must be non-negative "
                        "integers and tokens strings")
    ids.update({a["content"]: i for i, a in added.items()})
    return Vocab(ids, added, int(vocab_size) if vocab_size else len(ids))


def _is_id(i) -> bool:
    return isinstance(i, int) and not isinstance(i, bool) and i >= 0


def plain_token(content: str) -> dict:
    """The settings transformers' ``add_tokens(str)`` gives a new token (what mergekit calls)."""
    return {"content": content, "single_word": False, "lstrip": False, "rstrip": False, "normalized": True,
            "special": False}


def union_additions(vocabs: list[Vocab]) -> list[dict]:
    """mergekit's union order: the tokens to append to ``vocabs[0]``'s tokenizer: plain tokens of
    every model (in model order, by id) that the first lacks, then the added tokens it lacks (first
    settings win). Tokens without an embedding row (id >= limit) are left out."""
    added_by_content: dict[str, dict] = {}
    for v in vocabs:
        for i in sorted(v.added):
            if i < v.limit:
                added_by_content.setdefault(v.added[i]["content"], v.added[i])
    seen = set(vocabs[0].ids)
    plain = []
    for v in vocabs[1:]:  # the first model's tokens are all seen
        new = [(i, tok) for tok, i in v.ids.items() if tok not in seen and i < v.limit and tok not in added_by_content]
        for _, tok in sorted(new):
            if tok not in seen:
                plain.append(plain_token(tok))
                seen.add(tok)
    return plain + [a for c, a in added_by_content.items() if c not in seen]


def extend_tokenizer(tokenizer_json: str, ids: dict[str, int], additions: list[dict]) -> tuple[str, dict[str, int]]:
    """``tokenizer.json`` (whose vocabulary is ``ids``) with ``additions`` appended in order (the
    library assigns the next ids, as transformers' ``add_tokens`` does); returns (its text, its
    vocabulary)."""
    from tokenizers import AddedToken, Tokenizer

    try:
        tok = Tokenizer.from_str(tokenizer_json)
    except Exception as e:  # noqa: BLE001 - the library raises a bare Exception for a file it cannot build
        raise UserError(f"the tokenizers library cannot load the tokenizer.json to extend ({e})") from None
    out = dict(ids)
    for a in additions:  # one at a time: the ids follow this order exactly
        at = AddedToken(a["content"], **{k: a[k] for k in _ADDED_FLAGS})
        (tok.add_special_tokens if a["special"] else tok.add_tokens)([at])
        out[a["content"]] = tok.token_to_id(a["content"])
    return tok.to_str(pretty=True), out


# ------------------------------------------------------------ permutations and row rules (pure)


def permutation(out_ids: dict[str, int], model: Vocab, n_out: int) -> np.ndarray:
    """Output id -> the model's row of that token, -1 where it lacks it (or it has no row)."""
    p = np.full(n_out, -1, dtype=np.int64)
    toks = list(out_ids)
    p[np.fromiter(out_ids.values(), np.int64, len(toks))] = np.fromiter(
        (model.ids.get(t, -1) for t in toks), np.int64, len(toks))
    p[p >= model.limit] = -1
    return p


@dataclass(frozen=True)
class RowRule:
    """How one output token's default rows are built: ``copy`` (``rows[0]`` = (source, row)),
    ``mean`` of ``rows`` (summed in their order), or ``zero``."""

    kind: str
    rows: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class TokenChoice:
    """A ``tokenizer.tokens`` entry resolved against the sources: ``kind`` is ``auto`` (no source),
    ``model`` (``source`` index: its row of the token), ``model_token`` (``source``'s ``row``) or
    ``zero``."""

    kind: str
    source: Optional[int] = None
    row: Optional[int] = None
    force: bool = False


def default_rules(perms: dict[int, np.ndarray], out_ids: dict[str, int], choices: dict[str, TokenChoice],
                  base: Optional[int], names: Optional[dict[int, str]] = None) -> tuple[dict[int, RowRule], set[int]]:
    """mergekit's rules (see the module docstring) for every output token that some model lacks,
    or that ``choices`` forces: (output id -> rule, the forced output ids). ``perms`` maps each
    source index (in merge order) to its :func:`permutation`."""
    order = list(perms)
    stacked = np.stack([perms[s] for s in order]) if order else np.zeros((0, 0), np.int64)
    everywhere = (stacked >= 0).all(axis=0)
    rules: dict[int, RowRule] = {}
    forced: set[int] = set()
    for tok, t in out_ids.items():
        ch = choices.get(tok)
        if ch is not None and ch.force:
            forced.add(t)
        elif everywhere[t]:
            continue
        have = [s for s in order if perms[s][t] >= 0]
        if ch is None or ch.kind == "auto":
            if len(have) == 1:
                rules[t] = RowRule("copy", ((have[0], int(perms[have[0]][t])),))
            elif not have:
                rules[t] = RowRule("zero")
            elif base is not None and base in have:
                rules[t] = RowRule("copy", ((base, int(perms[base][t])),))
            else:
                rules[t] = RowRule("mean", tuple((s, int(perms[s][t])) for s in have))
        elif ch.kind == "zero":
            rules[t] = RowRule("zero")
        elif ch.kind == "model_token":
            rules[t] = RowRule("copy", ((ch.source, ch.row),))
        else:  # "model": that model's own row of the token
            if perms[ch.source][t] < 0:
                who = (names or {}).get(ch.source, f"number {ch.source}")
                raise UserError(f"tokenizer.tokens.{tok}: its source, model {who}, lacks the token "
                                "(use {kind: model_token, model, token} for another token's row)")
            rules[t] = RowRule("copy", ((ch.source, int(perms[ch.source][t])),))
    return rules, forced


def gather_index(perm: np.ndarray, n_rows: int, default_pos: dict[int, int], forced: set[int]) -> np.ndarray:
    """Row indices into ``concat(the model's rows, the default rows)`` for every output token: its
    own row where it has the token (and it is not forced), else ``n_rows + `` its default row."""
    idx = perm.copy()
    for t, j in default_pos.items():
        if idx[t] < 0 or t in forced:
            idx[t] = n_rows + j
    if (idx < 0).any():  # default_rules gives every lacking token a rule; a bug otherwise
        raise RuntimeError("an output token has neither a row nor a default")
    return idx


def padded_rows(n: int, multiple: Optional[int]) -> int:
    """``n`` rounded up to ``multiple`` (mergekit's ``pad_to_multiple_of``)."""
    return n if not multiple or n % multiple == 0 else (n // multiple + 1) * multiple


# ------------------------------------------------------------ the plan and the per-tensor step


@dataclass
class VocabPlan:
    """Everything a vocabulary-sized tensor needs to be aligned, fixed at plan time."""

    n_vocab: int  # the output vocabulary's size
    rows: int  # the output's rows (padded)
    perms: dict[int, np.ndarray]  # source index -> permutation
    rules: dict[int, RowRule]
    forced: set[int]
    limits: dict[int, int]  # source index -> rows it must have
    tokenizer_json: Optional[str]  # None: copy ``tokenizer_from``'s files as they are
    tokenizer_from: Path
    new_added: list[dict] = field(default_factory=list)  # for tokenizer_config.json's added_tokens_decoder
    out_ids: dict[str, int] = field(default_factory=dict)

    def default_order(self) -> list[int]:
        return sorted(self.rules)

    def is_identity(self, src: int, n_rows: int) -> bool:
        """The source's rows are already the output's (same tokens at the same ids, no pad)."""
        p = self.perms[src]
        return (self.rows == n_rows == len(p) and not self.forced
                and bool((p == np.arange(len(p))).all()))


def default_matrix(vp: VocabPlan, load: Callable[[int], mx.array], cd) -> Optional[mx.array]:
    """The default rows of one tensor (rows in :meth:`VocabPlan.default_order`), in the compute
    dtype ``cd``: each source's tensor is read once (only its needed rows are kept)."""
    order = vp.default_order()
    if not order:
        return None
    pos = {t: j for j, t in enumerate(order)}
    needed = sorted({s for r in vp.rules.values() for s, _ in r.rows})
    out = None
    means = [t for t in order if vp.rules[t].kind == "mean"]
    acc = None
    for s in needed:
        x = load(s).astype(cd)
        if out is None:
            out = mx.zeros((len(order), *x.shape[1:]), dtype=cd)
            if means:
                acc = mx.zeros((len(means), *x.shape[1:]), dtype=cd)
        copies = [(pos[t], r.rows[0][1]) for t in order if (r := vp.rules[t]).kind == "copy" and r.rows[0][0] == s]
        if copies:
            dst, src = zip(*copies)
            out[mx.array(dst)] = x[mx.array(src)]
        if means:
            # mergekit adds the present models' rows one model at a time in the tensor dtype
            row_of = [dict(vp.rules[t].rows).get(s, -1) for t in means]
            has = mx.array([r >= 0 for r in row_of]).reshape(-1, *([1] * (x.ndim - 1)))
            acc = mx.where(has, acc + x[mx.array([max(r, 0) for r in row_of])], acc)
        mx.eval(out, *([acc] if acc is not None else []))
        del x
    if out is None:  # only zero rules: the shape comes from any source
        x = load(next(iter(vp.perms)))
        out = mx.zeros((len(order), *x.shape[1:]), dtype=cd)
    if means:
        counts = mx.array([len(vp.rules[t].rows) for t in means]).astype(cd)
        out[mx.array([pos[t] for t in means])] = acc / counts.reshape(-1, *([1] * (acc.ndim - 1)))
    return out


def align(vp: VocabPlan, src: int, x: mx.array, defaults: Optional[mx.array], cd) -> mx.array:
    """Source ``src``'s tensor ``x`` (vocabulary first) on the output's rows, in ``cd``."""
    if vp.is_identity(src, x.shape[0]):
        return x
    n_rows = x.shape[0]
    pos = {t: j for j, t in enumerate(vp.default_order())}
    idx = gather_index(vp.perms[src], n_rows, pos, vp.forced)
    table = x.astype(cd) if defaults is None else mx.concatenate([x.astype(cd), defaults], axis=0)
    y = table[mx.array(idx)]
    if vp.rows > vp.n_vocab:
        mean = mx.mean(y.astype(mx.float32), axis=0, keepdims=True).astype(cd)
        y = mx.concatenate([y, mx.broadcast_to(mean, (vp.rows - vp.n_vocab, *y.shape[1:]))], axis=0)
    return y


def aligned_fetch(vp: VocabPlan, fetch: Callable[[int], mx.array], cd) -> Callable[[int], mx.array]:
    """``fetch`` (source index -> its tensor) with every result aligned; the default rows are
    built once per tensor, at the first call."""
    memo: dict[str, Optional[mx.array]] = {}

    def get(i: int) -> mx.array:
        if "d" not in memo:
            memo["d"] = default_matrix(vp, fetch, cd)
        return align(vp, i, fetch(i), memo["d"], cd)
    return get


# ------------------------------------------------------------ planning


def _choices(tcfg, sources, vocab_of_src: Callable[[int], Vocab]) -> dict[str, TokenChoice]:
    refs = {s.ref: i for i, s in enumerate(sources)}

    def index(ref: str, tok: str) -> int:
        if ref not in refs:
            raise UserError(f"tokenizer.tokens.{tok}: source model {ref} is not one of the models "
                            f"({', '.join(refs)})")
        return refs[ref]

    out = {}
    for tok, e in (tcfg.tokens or {}).items():
        src = e.source
        if src is None:
            out[tok] = TokenChoice("auto", force=e.force)
        elif isinstance(src, ZeroEmbedding):
            out[tok] = TokenChoice("zero", force=e.force)
        elif isinstance(src, ModelTokenEmbedding):
            i = index(src.model, tok)
            v = vocab_of_src(i)
            row = src.token_id if src.token_id is not None else v.ids.get(src.token)
            if row is None:
                raise UserError(f"tokenizer.tokens.{tok}: token {src.token!r} is not in model {src.model}'s tokenizer")
            if row >= v.limit:
                raise UserError(f"tokenizer.tokens.{tok}: token id {row} is out of range for model {src.model} "
                                f"({v.limit} rows)")
            out[tok] = TokenChoice("model_token", i, int(row), e.force)
        else:
            out[tok] = TokenChoice("model", index(src, tok), force=e.force)
    return out


def plan_vocab(tcfg, sources, configs: list[dict], base: Optional[int], reference: int) -> VocabPlan:
    """The :class:`VocabPlan` of ``tcfg`` (:class:`.config.TokenizerConfig`) over the opened
    ``sources`` (their ``config.json`` in ``configs``; ``base`` the base model's index, the
    ``reference`` the first model's when there is none)."""
    texts = [read_tokenizer_json(s.path, s.ref) for s in sources]
    first = base if base is not None else reference
    if texts[first] is None:
        raise UserError(f"model {sources[first].ref} has no tokenizer.json, which tokenizer surgery starts from")
    parsed: dict[str, Vocab] = {}  # fine-tunes of one base share one tokenizer.json: parse it once

    def vocab(i: int) -> Vocab:
        text = texts[i] if texts[i] is not None else texts[first]
        if text not in parsed:
            parsed[text] = vocab_of(text, None, sources[i].ref)
        v = parsed[text]
        return Vocab(v.ids, v.added, int(configs[i].get("vocab_size") or len(v.ids)))
    vocabs = [vocab(i) for i in range(len(sources))]
    src = tcfg.source
    additions: list[dict] = []
    if src == "union":
        order = [first] + [i for i in range(len(sources)) if i != first]
        additions = union_additions([vocabs[i] for i in order])
        out_from = first
    elif src == "base":
        out_from = first
    else:
        match = [i for i, s in enumerate(sources) if s.ref == src]
        if not match:
            raise UserError(f"tokenizer source {src} is not one of the models ({', '.join(s.ref for s in sources)}); "
                            "valid: base, union or one of them")
        out_from = match[0]
        if texts[out_from] is None:
            raise UserError(f"tokenizer source {src} has no tokenizer.json")
    have = set(vocabs[out_from].ids) | {a["content"] for a in additions}
    # mergekit: tokenizer.tokens' new tokens are added after the union's, as plain tokens
    additions += [plain_token(t) for t in (tcfg.tokens or {}) if t not in have]
    if additions:
        out_text, out_ids = extend_tokenizer(texts[out_from], vocabs[out_from].ids, additions)
    else:
        out_text, out_ids = None, dict(vocabs[out_from].ids)
    n = len(out_ids)
    if set(out_ids.values()) != set(range(n)):
        raise UserError(f"the output tokenizer's ids are not 0..{n - 1} (holes in {sources[out_from].ref}'s "
                        "vocabulary); tokenizer surgery needs consecutive ids")
    perms = {i: permutation(out_ids, vocabs[i], n) for i in range(len(sources))}
    choices = _choices(tcfg, sources, lambda i: vocabs[i])
    rules, forced = default_rules(perms, out_ids, choices, base, {i: s.ref for i, s in enumerate(sources)})
    return VocabPlan(n_vocab=n, rows=padded_rows(n, tcfg.pad_to_multiple_of), perms=perms, rules=rules,
                     forced=forced, limits={i: v.limit for i, v in enumerate(vocabs)},
                     tokenizer_json=out_text, tokenizer_from=sources[out_from].path, new_added=additions,
                     out_ids=out_ids)


# ------------------------------------------------------------ writing


def copy_tokenizer_files(src: Path, out_dir: Path, files=None) -> None:
    """Copy the tokenizer files ``src`` has (``files``: default :data:`TOKENIZER_FILES`) byte for byte."""
    for f in (TOKENIZER_FILES if files is None else files):
        if (src / f).is_file():
            shutil.copy2(src / f, out_dir / f)


def write_tokenizer(vp: VocabPlan, out_dir: Path) -> None:
    """The output's tokenizer files: the source's, copied byte for byte when its vocabulary is the
    output's; else the rewritten ``tokenizer.json`` with a consistent ``tokenizer_config.json``."""
    src = vp.tokenizer_from
    if vp.tokenizer_json is None:
        copy_tokenizer_files(src, out_dir)
        return
    copy_tokenizer_files(src, out_dir, _SIDE_FILES)
    (out_dir / "tokenizer.json").write_text(vp.tokenizer_json, encoding="utf-8")
    conf_file = src / "tokenizer_config.json"
    if conf_file.is_file():
        conf = read_json(conf_file)
        if not isinstance(conf, dict):
            raise UserError(f"{conf_file}: expected a JSON object")
        dec = conf.get("added_tokens_decoder")
        if isinstance(dec, dict):
            for a in vp.new_added:
                dec[str(vp.out_ids[a["content"]])] = dict(a)
        (out_dir / "tokenizer_config.json").write_text(json.dumps(conf, indent=2, ensure_ascii=False) + "\n",
                                                       encoding="utf-8")
