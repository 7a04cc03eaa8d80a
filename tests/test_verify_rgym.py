"""reasoning_gym verifier: the dataset's own scorer, re-scoring from a task file alone."""

from __future__ import annotations

import pytest

from mlx_ssp.tasks import load_tasks, write_tasks
from mlx_ssp.tasks.build import export_source
from mlx_ssp.verify import verify

PARAMS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "operators": ["+", "-"]}


def test_rescoring_from_a_task_file_without_the_dataset(tmp_path):
    import mlx_ssp.verify.rgym as rgym

    tasks = export_source("reasoning_gym:basic_arithmetic", size=20, params=PARAMS, answer_extraction="lenient")
    path = tmp_path / "t.jsonl"
    write_tasks(path, tasks)
    rgym._CACHE.clear()
    loaded = load_tasks(path)
    for t in loaded:
        assert verify(f"Let me think.\nAnswer: {t.answer}", t).reward == 1.0
        assert verify(f"Answer: {int(t.answer) + 1}", t).reward == 0.0
        assert verify(f"{t.metadata['reasoning_gym']['question']} = {t.answer}", t).reward == 1.0  # lenient: last "= X"
    assert rgym._CACHE  # the scorer object was rebuilt from metadata and cached


def test_strict_extraction_is_stored_per_task():
    t = export_source("reasoning_gym:basic_arithmetic", size=1, params=PARAMS, answer_extraction="strict")[0]
    assert t.metadata["answer_extraction"] == "strict"
    assert verify(f"It is {t.answer}", t).reason == "no_answer"
    t2 = t.model_copy(update={"metadata": {**t.metadata, "answer_extraction": "lenient"}})
    assert verify(f"It is\n{t.answer}", t2).reward == 1.0  # lenient: the last non-empty line


def test_word_task_uses_dataset_scorer():
    t = export_source("reasoning_gym:spell_backward", size=3, params={"min_word_len": 3, "max_word_len": 5})[0]
    assert verify(f"Answer: {t.answer}", t).reward == 1.0
    assert verify("Answer: zzzzqq", t).reward < 1.0


def test_bad_rgym_task_fails_up_front():
    from mlx_ssp.errors import UserError
    from mlx_ssp.tasks import Task, check_tasks

    t = Task(id="x", domain="d", prompt="p", answer="1", verifier="reasoning_gym", metadata={})
    with pytest.raises(UserError, match="metadata.reasoning_gym"):
        check_tasks([t])


@pytest.mark.parametrize("name", ["rotate_matrix", "arc_1d", "emoji_mystery", "sentence_reordering"])
def test_multiline_and_sentence_answers_rescore_from_file(tmp_path, name):
    import mlx_ssp.verify.rgym as rgym

    tasks = export_source(f"reasoning_gym:{name}", size=2)
    write_tasks(tmp_path / "t.jsonl", tasks)
    rgym._CACHE.clear()
    rgym._ENTRIES.clear()
    for t in load_tasks(tmp_path / "t.jsonl"):
        assert verify(f"Let me work it out.\nAnswer:\n{t.answer}\n", t).reward == 1.0
        assert verify("Answer:\nno idea", t).reward < 1.0
