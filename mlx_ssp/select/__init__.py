"""Diversity-exploring selection: from K verified rollouts per prompt to SFT data (SSP step 2).

Algorithm (VibeThinker-1.5B, arXiv:2511.06221, section 3.2: the Spectrum phase keeps *many distinct*
correct solutions per problem, not the first win). Per prompt, with the ``diverse`` policy:

1. keep the correct completions (reward >= ``min_reward``; by default also drop ones cut off by
   ``max_tokens``, which would teach the model not to stop);
2. drop exact duplicates (after whitespace normalisation), then near duplicates: walking the
   samples in index order, a completion within ``near_duplicate`` distance of one already kept is
   dropped;
3. greedy farthest-point selection up to M (``per_prompt``): start from the earliest kept sample
   (sample order is random, so this is a seeded random start), then repeatedly add the candidate
   whose distance to its nearest selected solution is largest (ties: lowest sample index).

Distances (a registry, :data:`DISTANCES`): ``ngram`` = Jaccard distance between the sets of word
n-grams (default n=3), ``edit`` = word-level Levenshtein distance / the longer length, and the
strategy distances of :mod:`mlx_ssp.select.strategy` (``steps``, ``ast``, ``calls``; ``auto`` picks one per
prompt, :func:`strategy_kind`). All are in [0, 1]; the report counts each prompt's distinct
strategies whatever distance selects. For an episode the compared text is its call sequence (:func:`strategy_text`), so distinct
strategies are distinct call sequences, not distinct wording. ``first`` keeps the first correct sample per prompt (the single-path baseline SSP argues
against) and ``all`` keeps every correct one.

Output: ``OUT_DIR/<domain>/train.jsonl`` and ``valid.jsonl`` in mlx-lm's chat format
(``{"messages": [...prompt..., {"role": "assistant", "content": completion}]}``), so
``mlx_lm.tuner`` reads the directory as is, and ``OUT_DIR/spectrum.json``: per prompt and per domain,
correct / distinct correct / selected counts, mean pairwise distance of the selected and of the
distinct correct solutions, and the prompts with no correct solution. The valid split holds out
whole prompts (``valid_fraction``, at least one); a domain with a single prompt gets valid = train
(mlx-lm needs a non-empty valid set), flagged ``valid_is_train`` in the report. Deviation: the paper
does not say how diversity is measured; n-gram Jaccard is our documented default.

Data quality (VibeThinker-3B technical report, section 2.1.1), each off by default and
counted per reason in the report when on (:mod:`mlx_ssp.select.quality` holds the pure functions):
``repetition`` drops degenerate (looping) samples before the diversity walk; ``decontaminate`` leaves
out whole training prompts that share an n-gram with a held-out, probe or benchmark prompt;
``pseudo_label`` writes ``OUT_DIR/pseudo_labels.jsonl``, the tasks labelled by the majority answer of
their samples. The report's LLM judge of query quality is not implemented. Deviations (thresholds,
template handling, vote equality) are listed in :mod:`mlx_ssp.select.quality`.

Input integrity: a (task, sample) that appears more than once (two runs wrote one file, or files
were concatenated) is kept once when the copies agree and refused when they differ; records
stamped with different ``run_fingerprint`` values (other model, seed or sampling) are refused, so
one selection never mixes two runs.

Modules: :mod:`.text` (word features), :mod:`.strategy` (strategy features), :mod:`.distance`
(the registry), :mod:`.quality` (data-quality filters, pseudo-label votes), :mod:`.config` (the
``select:`` section), :mod:`.policy` (selection, pure) and :mod:`.stage` (files in, files out).
"""

from mlx_ssp.select.config import DecontaminateConfig, PseudoLabelConfig, RepetitionConfig, SelectConfig
from mlx_ssp.select.distance import DISTANCE_CHOICES, DISTANCES, edit_distance_fn, ngram_distance_fn
from mlx_ssp.select.policy import (
    DROP_REASONS,
    POLICIES,
    dedupe,
    drop_reason,
    farthest_point,
    mean_pairwise,
    select,
    select_prompt,
    strategy_kind,
    strategy_text,
    to_chat,
)
from mlx_ssp.select.stage import (
    PSEUDO_LABELS,
    contamination,
    dedupe_records,
    format_report,
    gold_records,
    pseudo_labels,
    reference_prompts,
    run_select,
    safe_dirname,
)
from mlx_ssp.select.text import edit_distance, jaccard_distance, levenshtein, ngrams, normalize, words

__all__ = [
    "DecontaminateConfig",
    "PseudoLabelConfig",
    "RepetitionConfig",
    "SelectConfig",
    "DISTANCE_CHOICES",
    "DISTANCES",
    "edit_distance_fn",
    "ngram_distance_fn",
    "DROP_REASONS",
    "POLICIES",
    "dedupe",
    "drop_reason",
    "farthest_point",
    "mean_pairwise",
    "select",
    "select_prompt",
    "strategy_kind",
    "strategy_text",
    "to_chat",
    "PSEUDO_LABELS",
    "contamination",
    "dedupe_records",
    "format_report",
    "gold_records",
    "pseudo_labels",
    "reference_prompts",
    "run_select",
    "safe_dirname",
    "edit_distance",
    "jaccard_distance",
    "levenshtein",
    "ngrams",
    "normalize",
    "words",
]
