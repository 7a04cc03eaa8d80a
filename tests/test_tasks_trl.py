"""TRL-format datasets as task sources (``params: {format: trl}`` on ``jsonl:`` and ``hf:``): prompt as
text or chat messages, the answer from the first answer column, every other column in the task's
metadata where the verifier reads it."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from mlx_ssp.cli import main
from mlx_ssp.config import load_section
from mlx_ssp.errors import UserError
from mlx_ssp.tasks import file_sources, load_tasks
from mlx_ssp.tasks.build import build_split, export_source
from mlx_ssp.tasks.file_sources import MAX_EXTRA_COLUMN_BYTES, load_jsonl
from mlx_ssp.tasks.item import BUILDER_KEYS
from mlx_ssp.verify import verify


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _text_rows():  # TRL prompt-only, standard (text) prompts
    return [{"prompt": f"What is {i} * 3?", "solution": str(3 * i), "level": i % 3, "topic": "times"} for i in range(8)]


def _chat_rows():  # TRL prompt-only, conversational prompts
    return [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"What is {i} + 4?"}],
             "ground_truth": str(i + 4), "difficulty": "easy" if i < 3 else "hard"} for i in range(6)]


def test_trl_text_prompts_export_through_the_cli(tmp_path):
    src = _write(tmp_path / "times.jsonl", _text_rows())
    out = tmp_path / "t.jsonl"
    res = CliRunner().invoke(main, ["tasks", "export", f"jsonl:{src}", "--param", "format=trl", "--verifier", "math",
                                    "--instruction", "End with 'Answer: N'.", "-o", str(out)])
    assert res.exit_code == 0, res.output
    tasks = load_tasks(out)
    assert len(tasks) == 8 and {t.domain for t in tasks} == {"times"}
    by_row = {int(t.id.split("-")[-1]): t for t in tasks}
    for i, row in enumerate(_text_rows()):
        t = by_row[i]
        assert t.prompt == f"{row['prompt']}\n\nEnd with 'Answer: N'."
        assert t.answer == row["solution"]
        # every other column reaches the metadata; the answer column itself does not
        assert t.metadata["level"] == row["level"] and t.metadata["topic"] == "times"
        assert "solution" not in t.metadata and "prompt" not in t.metadata
        assert verify(f"Answer: {row['solution']}", t).reward == 1.0


def test_trl_conversational_prompts_from_a_saved_hf_dataset(tmp_path):
    datasets = pytest.importorskip("datasets")

    d = tmp_path / "plus_ds"
    datasets.Dataset.from_list(_chat_rows()).save_to_disk(str(d))
    tasks = export_source(f"hf:{d}", params={"format": "trl"}, verifier="exact", instruction="Reply with the number.")
    assert len(tasks) == 6 and {t.domain for t in tasks} == {"plus_ds"}
    for t in tasks:
        i = int(t.id.split("-")[-1])
        row = _chat_rows()[i]
        assert t.prompt[0] == {"role": "system", "content": "Be brief."}
        assert t.prompt[1] == {"role": "user", "content": f"What is {i} + 4?\n\nReply with the number."}
        assert t.answer == str(i + 4) and t.metadata["difficulty"] == row["difficulty"]
        assert "ground_truth" not in t.metadata


def test_trl_answer_column_order_and_explicit_choice(tmp_path):
    rows = [{"prompt": f"q{i}", "answer": f"a{i}", "solution": f"s{i}", "ground_truth": f"g{i}"} for i in range(3)]
    src = _write(tmp_path / "both.jsonl", rows)
    first = export_source(f"jsonl:{src}", params={"format": "trl"}, verifier="exact")
    assert sorted(t.answer for t in first) == ["s0", "s1", "s2"]  # solution, then answer, then ground_truth
    assert all(t.metadata["answer"].startswith("a") and t.metadata["ground_truth"].startswith("g") for t in first)
    named = export_source(f"jsonl:{src}", params={"format": "trl", "answer_field": "ground_truth"}, verifier="exact")
    assert sorted(t.answer for t in named) == ["g0", "g1", "g2"] and all("solution" in t.metadata for t in named)
    only = export_source(f"jsonl:{src}", params={"format": "trl", "metadata_fields": ["answer"]}, verifier="exact")
    assert all(set(t.metadata) == {"answer", "split", "source"} for t in only)


def test_missing_answer_column_is_one_line_naming_the_columns(tmp_path):
    src = _write(tmp_path / "noans.jsonl", [{"prompt": "q", "hint": "h", "level": 1}])
    res = CliRunner().invoke(main, ["tasks", "export", f"jsonl:{src}", "--param", "format=trl", "--verifier", "exact",
                                    "-o", str(tmp_path / "x.jsonl")])
    assert res.exit_code == 2
    msg = res.output.strip()
    assert "\n" not in msg and "no answer field" in msg
    assert "solution, answer, ground_truth" in msg and "columns found: prompt, hint, level" in msg
    with pytest.raises(UserError, match="looked for 'result'.*columns found: prompt, hint, level"):
        export_source(f"jsonl:{src}", params={"format": "trl", "answer_field": "result"}, verifier="exact")
    src2 = _write(tmp_path / "noprompt.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(UserError, match="no prompt field .*columns found: question, answer"):
        export_source(f"jsonl:{src2}", params={"format": "trl"}, verifier="exact")


def test_bad_rows_and_params_fail_naming_the_choices(tmp_path):
    src = _write(tmp_path / "bad.jsonl", [{"prompt": [{"content": "no role"}], "answer": "1"}])
    with pytest.raises(UserError, match="row 1: the prompt must be non-empty text or a list of"):
        export_source(f"jsonl:{src}", params={"format": "trl"}, verifier="exact")
    datasets = pytest.importorskip("datasets")
    d = tmp_path / "with_bytes"
    datasets.Dataset.from_list([{"prompt": "q", "answer": "1", "image": b"\x89PNG"}]).save_to_disk(str(d))
    with pytest.raises(UserError, match="row 1: column 'image' is not JSON data \\(bytes\\)"):
        export_source(f"hf:{d}", params={"format": "trl"}, verifier="exact")
    assert export_source(f"hf:{d}", params={"format": "trl", "metadata_fields": []}, verifier="exact")[0].answer == "1"
    # unknown params and formats fail when the config is loaded, naming the valid ones
    for params, needle in [({"format": "openai"}, "unknown format 'openai'; valid: fields, trl"),
                           ({"fromat": "trl"}, ("unknown params fromat; valid: answer_after, answer_field, "
                                                "completions_field, format, id_field, metadata_fields, prompt_field")),
                           ({"format": "trl", "metadata_fields": "level"}, "metadata_fields must be a list")]:
        with pytest.raises(UserError, match=f"tasks.domains.d.params: .*{needle}"):
            load_section({"tasks": {"domains": {"d": {"source": f"jsonl:{src}", "params": params}}}}, "tasks")
    with pytest.raises(UserError, match="valid: answer_after, .*data_files, format, .*revision, split"):
        load_section({"tasks": {"domains": {"d": {"source": "hf:json", "params": {"shard": 1}}}}}, "tasks")


def test_a_verifier_sees_an_extra_column(tmp_path):
    """The code verifier runs the imports of metadata.prompt_code before the completion: a completion
    that uses `math` without importing it passes when the dataset's `prompt_code` column reached the
    task, and fails without it."""
    row = {"prompt": "Complete root(n).", "answer": "assert root(17) == 4\nassert root(0) == 0",
           "prompt_code": 'import math\n\ndef root(n):\n    """The integer square root of n."""\n', "entry_point": "root"}
    with_col = _write(tmp_path / "with.jsonl", [row])
    without = _write(tmp_path / "without.jsonl", [{k: v for k, v in row.items() if k != "prompt_code"}])
    cfg = load_section({"tasks": {"domains": {
        "with": {"source": f"jsonl:{with_col}", "params": {"format": "trl"}, "verifier": "code"},
        "without": {"source": f"jsonl:{without}", "params": {"format": "trl"}, "verifier": "code"}}}}, "tasks")
    tasks = {t.domain: t for t in build_split(cfg, "train")}
    assert tasks["with"].metadata["entry_point"] == "root" and "import math" in tasks["with"].metadata["prompt_code"]
    body = "```python\ndef root(n):\n    return math.isqrt(n)\n```"
    assert verify(body, tasks["with"]).reward == 1.0
    assert verify(body, tasks["without"]).reward == 0.0
    assert verify("```python\ndef root(n):\n    return math.isqrt(n) + 1\n```", tasks["with"]).reward == 0.0


def test_an_oversized_extra_column_is_one_line_naming_it(tmp_path):
    """Every other column is copied into every task record and rollout: one value over the cap (as
    JSON) is refused, naming the column and metadata_fields; a column the user lists is kept whole."""
    big = "x" * (MAX_EXTRA_COLUMN_BYTES - 2)  # its JSON, with the quotes, is exactly the cap
    rows = [{"prompt": "q0", "answer": "1", "level": 1, "messages": big},
            {"prompt": "q1", "answer": "2", "level": 2, "messages": big + "y"}]
    src = _write(tmp_path / "long.jsonl", rows)
    res = CliRunner().invoke(main, ["tasks", "export", f"jsonl:{src}", "--param", "format=trl", "--verifier", "exact",
                                    "-o", str(tmp_path / "x.jsonl")])
    assert res.exit_code == 2
    msg = res.output.strip()
    assert "\n" not in msg and "row 2: column 'messages'" in msg and "params.metadata_fields" in msg
    at_cap = _write(tmp_path / "at_cap.jsonl", rows[:1])
    assert export_source(f"jsonl:{at_cap}", params={"format": "trl"}, verifier="exact")[0].metadata["messages"] == big
    chosen = export_source(f"jsonl:{src}", params={"format": "trl", "metadata_fields": ["level"]}, verifier="exact")
    assert all("messages" not in t.metadata and t.metadata["level"] in (1, 2) for t in chosen)
    named = export_source(f"jsonl:{src}", params={"format": "trl", "metadata_fields": ["messages"]}, verifier="exact")
    assert sorted(len(t.metadata["messages"]) for t in named) == [len(big), len(big) + 1]


def test_columns_named_like_builder_keys_are_skipped_with_one_warning(tmp_path):
    """NuminaMath-style rows carry a `source` column: the automatic rule leaves such columns out (the
    task keeps its own source and split) and says so once, not once per row."""
    rows = [{"prompt": f"q{i}", "solution": str(i), "source": "olympiads", "split": "x", "verifier": "exact",
             "level": i} for i in range(5)]
    src = _write(tmp_path / "numina.jsonl", rows)
    with pytest.warns(UserWarning) as rec:
        tasks = export_source(f"jsonl:{src}", params={"format": "trl"}, verifier="math")
    lines = [str(w.message) for w in rec if "not copied" in str(w.message)]
    assert len(lines) == 1 and "source, split, verifier" in lines[0] and "metadata_fields: [verifier" in lines[0]
    assert len(tasks) == 5
    for t in tasks:
        assert t.metadata["source"] == f"jsonl:{src}" and t.metadata["split"] == "train" and t.verifier == "math"
        assert t.metadata["level"] == int(t.answer)
    # listing a builder key other than verifier is still an error, for either format
    for fmt in ("trl", "fields"):
        with pytest.raises(UserError, match="metadata_fields names 'source', a task metadata key mlx_ssp sets"):
            export_source(f"jsonl:{src}", params={"format": fmt, "metadata_fields": ["level", "source"]}, verifier="math")


def test_a_verifier_column_listed_in_metadata_fields_sets_each_rows_verifier(tmp_path):
    """The field mapping's per-row verifier: a `verifier` column named in metadata_fields is read by
    the task builder when the domain names no verifier (both formats)."""
    rows = [{"q": "What is 2 + 2?", "a": "4", "verifier": "math"}, {"q": "Say hi.", "a": "hi", "verifier": "exact"}]
    src = _write(tmp_path / "mixed.jsonl", rows)
    for params in ({"prompt_field": "q", "answer_field": "a", "metadata_fields": ["verifier"]},
                   {"format": "trl", "prompt_field": "q", "answer_field": "a", "metadata_fields": ["verifier"]}):
        tasks = {t.answer: t for t in export_source(f"jsonl:{src}", params=params)}
        assert tasks["4"].verifier == "math" and tasks["hi"].verifier == "exact"
        assert "verifier" not in tasks["4"].metadata
        assert verify("hi", tasks["hi"]).reward == 1.0


def test_the_field_mapping_passes_the_prompt_as_before_and_trl_checks_it(tmp_path):
    """The prompt check is the TRL format's: a field-mapping row with an empty prompt still loads
    (an instruction makes it a prompt), as it did before the TRL format existed."""
    rows = [{"prompt": "What is 1 + 1?", "answer": "2"}, {"prompt": "", "answer": "3"}, {"prompt": 7, "answer": "4"}]
    src = _write(tmp_path / "odd.jsonl", rows)
    assert [it.prompt for it in load_jsonl(str(src), {})] == ["What is 1 + 1?", "", 7]
    tasks = export_source(f"jsonl:{_write(tmp_path / 'empty.jsonl', rows[:2])}", verifier="exact", instruction="Reply.")
    assert sorted(t.prompt for t in tasks) == ["\n\nReply.", "What is 1 + 1?\n\nReply."]
    with pytest.raises(UserError, match="row 2: the prompt must be non-empty text"):
        load_jsonl(str(src), {"format": "trl"})


@pytest.mark.parametrize("key", ["prompt_field", "answer_field", "id_field", "answer_after", "completions_field"])
def test_a_field_param_that_is_not_a_string_fails_at_load_naming_it(tmp_path, key):
    src = _write(tmp_path / "a.jsonl", [{"prompt": "q", "answer": "1"}])
    with pytest.raises(UserError, match=f"tasks.domains.d.params: .*{key} must be a .*got int 3"):
        load_section({"tasks": {"domains": {"d": {"source": f"jsonl:{src}", "params": {key: 3}}}}}, "tasks")
    with pytest.raises(UserError, match=f"tasks.domains.json.params: .*{key} must be a .*got list"):
        export_source("hf:json", params={"data_files": str(src), key: ["prompt"]}, verifier="exact")


def test_the_builder_keys_are_the_keys_the_builder_sets(tmp_path):
    """BUILDER_KEYS is the task builder's own list: a task built with every option carries exactly
    those keys beside its columns (verifier is read from the row, then dropped)."""
    src = _write(tmp_path / "k.jsonl", [{"prompt": "q", "answer": "1", "level": 3, "verifier": "math"}])
    t = export_source(f"jsonl:{src}", params={"metadata_fields": ["level", "verifier"]}, sandbox={"wall_s": 3})[0]
    assert t.verifier == "math"
    assert set(t.metadata) - {"level"} == set(BUILDER_KEYS) - {"verifier"}
    assert file_sources.BUILDER_KEYS is BUILDER_KEYS  # one definition, which the builder and the sources share
