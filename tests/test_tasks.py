"""Task sources, the tasks: config section, disjoint splits, prompt rendering and the CLIs."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from mlx_ssp.cli import main
from mlx_ssp.config import load_section
from mlx_ssp.errors import UserError
from mlx_ssp.tasks import load_tasks, render_prompt
from mlx_ssp.tasks.build import build_split, export_source
from mlx_ssp.tasks.config import TasksConfig

ADD = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "operators": ["+"]}


def _cfg(shared_data, **over):
    data = {
        "tasks": {
            "seed": 7,
            "domains": {
                "addition": {
                    "source": "reasoning_gym:basic_arithmetic",
                    "params": ADD,
                    "instruction": "Give your final answer on the last line in the form:\nAnswer: <your answer>",
                    "answer_extraction": "lenient",
                    "sizes": {"train": 30, "probe": 10, "eval": 20},
                },
                "gsm8k": {
                    "source": f"gsm8k:{shared_data / 'gsm8k' / 'train.jsonl'}",
                    "system": "You are a careful math tutor.",
                    "sizes": {"train": 50, "probe": 10, "eval": 25},
                },
            },
            **over,
        }
    }
    return load_section(data, "tasks")


def test_splits_are_disjoint_deterministic_and_sized(shared_data):
    cfg = _cfg(shared_data)
    splits = {s: build_split(cfg, s) for s in ("train", "probe", "eval")}
    for dom, sizes in (("addition", (30, 10, 20)), ("gsm8k", (50, 10, 25))):
        got = [sum(t.domain == dom for t in splits[s]) for s in ("train", "probe", "eval")]
        assert tuple(got) == sizes
    ids = [t.id for s in splits.values() for t in s]
    assert len(ids) == len(set(ids))
    # no problem shared between splits (compare the raw questions)
    def q(t):
        rg = t.metadata.get("reasoning_gym")
        return rg["key"] if rg else t.messages()[-1]["content"]
    sets = {s: {q(t) for t in ts} for s, ts in splits.items()}
    assert not (sets["train"] & sets["probe"]) and not (sets["train"] & sets["eval"]) and not (sets["probe"] & sets["eval"])
    # deterministic from the seed; another seed gives other problems
    again = build_split(_cfg(shared_data), "eval")
    assert [t.model_dump() for t in again] == [t.model_dump() for t in splits["eval"]]
    other = build_split(_cfg(shared_data, seed=8), "eval")
    assert [t.id for t in other] != [t.id for t in splits["eval"]]
    # eval does not move when train grows
    bigger = _cfg(shared_data)
    bigger.domains["gsm8k"].sizes.train = 80
    assert [t.id for t in build_split(bigger, "eval")] == [t.id for t in splits["eval"]]


def test_instruction_system_and_metadata(shared_data):
    cfg = _cfg(shared_data)
    t = next(t for t in build_split(cfg, "train") if t.domain == "addition")
    assert t.prompt.endswith("Answer: <your answer>") and t.metadata["answer_extraction"] == "lenient"
    assert t.metadata["split"] == "train" and t.verifier == "reasoning_gym"
    g = next(t for t in build_split(cfg, "probe") if t.domain == "gsm8k")
    assert g.prompt[0] == {"role": "system", "content": "You are a careful math tutor."}
    assert g.prompt[1]["content"].endswith("Answer: <your answer>")
    assert g.verifier == "math" and g.metadata["answer_extraction"] == "strict"
    cfg.domains["addition"].instruction = ""
    t2 = next(t for t in build_split(cfg, "train") if t.domain == "addition")
    assert "Answer:" not in t2.prompt


def test_config_errors_name_the_key(shared_data):
    bad = {"tasks": {"domains": {"a": {"source": "nosuch:x"}}}}
    with pytest.raises(UserError, match="valid kinds"):
        load_section(bad, "tasks")
    with pytest.raises(UserError, match="unknown key 'tasks.domains.a.sizez'"):
        load_section({"tasks": {"domains": {"a": {"source": "humaneval", "sizez": {}}}}}, "tasks")
    with pytest.raises(UserError, match="answer_extraction"):
        load_section({"tasks": {"domains": {"a": {"source": "humaneval", "answer_extraction": "fuzzy"}}}}, "tasks")
    with pytest.raises(UserError, match="unknown verifier"):
        load_section({"tasks": {"domains": {"a": {"source": "humaneval", "verifier": "nope"}}}}, "tasks")
    with pytest.raises(UserError, match="sandbox limit"):
        load_section({"tasks": {"domains": {"a": {"source": "humaneval", "sandbox": {"wall": 1}}}}}, "tasks")
    too_many = load_section({"tasks": {"domains": {"tiny": {"source": "reasoning_gym:basic_arithmetic", "params": {
        "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"], "allow_parentheses": False,
        "allow_negation": False}, "sizes": {"train": 100, "eval": 30}}}}}, "tasks")
    with pytest.raises(UserError, match="distinct"):
        build_split(too_many, "train")
    gs = load_section({"tasks": {"domains": {"g": {"source": f"gsm8k:{shared_data / 'gsm8k' / 'test.jsonl'}", "sizes": {"train": 1300, "eval": 100}}}}}, "tasks")
    with pytest.raises(UserError, match="1319 distinct problems"):
        build_split(gs, "train")


def test_jsonl_mapping_and_hf_local(tmp_path):
    rows = [{"q": f"What is {i} + {i}?", "sol": f"Double it. #### {2 * i}", "level": i % 3} for i in range(12)]
    p = tmp_path / "mine.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    params = {"prompt_field": "q", "answer_field": "sol", "answer_after": "####", "metadata_fields": ["level"]}
    ts = export_source(f"jsonl:{p}", params=params, verifier="math", instruction="Reply with 'Answer: N'.")
    assert len(ts) == 12 and ts[0].domain == "mine"
    t5 = next(t for t in ts if t.id == "mine-5")
    assert t5.answer == "10" and t5.metadata["level"] == 2 and t5.prompt.endswith("Reply with 'Answer: N'.")
    with pytest.raises(UserError, match="needs 'verifier:'"):
        export_source(f"jsonl:{p}", params=params)
    with pytest.raises(UserError, match="no prompt field"):
        export_source(f"jsonl:{p}", verifier="math", params={"answer_field": "sol"})
    hf = export_source("hf:json", params={"data_files": str(p), **params}, verifier="math", size=5)
    assert len(hf) == 5 and all(t.verifier == "math" for t in hf)


class _PlainTemplateTokenizer:
    """A tokenizer whose chat template knows nothing about tools (like SmolLM2's)."""

    chat_template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, **kw):
        assert "tools" not in kw
        self.text = "".join(f"<|{m['role']}|>{m['content']}" for m in messages)
        return list(range(len(self.text)))


def test_render_prompt_with_tools_and_chat_template(shared_data):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    t = export_source("bfcl:simple", size=1)[0]
    real = load_tokenizer(shared_data / "tokenizers" / "qwen3")  # the real Qwen3 template (tools)
    text = real.decode(render_prompt(real, t))
    assert "<tools>" in text and t.metadata["tools"][0]["function"]["name"] in text
    assert '"type": "object"' in text  # BFCL "dict" became JSON-schema "object"
    plain = _PlainTemplateTokenizer()
    render_prompt(plain, t)
    assert plain.text.startswith("<|system|>You can call these functions")  # described in a system message
    assert t.metadata["functions"][0]["name"] in plain.text


def test_cli_export_and_verify(tmp_path, shared_data):
    r = CliRunner()
    out = tmp_path / "t.jsonl"
    res = r.invoke(main, ["tasks", "export", "reasoning_gym:basic_arithmetic", "-o", str(out), "--size", "6",
                          "--seed", "3", "--param", "max_digits=1", "--param", "operators=[+]", "--answer-extraction", "lenient"])
    assert res.exit_code == 0, res.output
    tasks = load_tasks(out)
    assert len(tasks) == 6 and all("+" in t.metadata["reasoning_gym"]["question"] for t in tasks)
    yml = tmp_path / "run.yaml"
    yml.write_text(
        "tasks:\n  seed: 5\n  domains:\n    addition:\n      source: reasoning_gym:basic_arithmetic\n"
        "      params: {min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 2, operators: ['+']}\n"
        "      sizes: {train: 8, probe: 2, eval: 4}\n"
        f"    he:\n      source: humaneval\n      sizes: {{train: 2, probe: 1, eval: 1}}\n"
    )
    out2 = tmp_path / "all.jsonl"
    res = r.invoke(main, ["tasks", "export", str(yml), "-o", str(out2), "--set", "tasks.domains.he.sizes.train=3"])
    assert res.exit_code == 0, res.output
    all_tasks = load_tasks(out2)
    assert len(all_tasks) == 14 + 5 and {t.metadata["split"] for t in all_tasks} == {"train", "probe", "eval"}
    res = r.invoke(main, ["tasks", "show", str(out2)])
    assert res.exit_code == 0 and "addition" in res.output
    # verify: full task records and task_id + --tasks
    comp = tmp_path / "comp.jsonl"
    lines = []
    for i, t in enumerate(all_tasks):
        good = i % 2 == 0
        if t.verifier == "code":
            c = f"```python\n{t.metadata['prompt_code']}{t.metadata['canonical_solution'] if good else '    return None'}\n```"
        else:
            c = f"Answer: {t.answer if good else 'nope'}"
        lines.append({"task": t.model_dump(), "completion": c, "sample": 0} if i < 10 else {"task_id": t.id, "completion": c})
    comp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    scored = tmp_path / "scored.jsonl"
    res = r.invoke(main, ["verify", str(comp), "-o", str(scored), "--tasks", str(out2), "--no-progress", "--workers", "2"])
    assert res.exit_code == 0, res.output
    recs = [json.loads(l) for l in scored.read_text().splitlines()]
    assert [x["reward"] for x in recs] == [1.0 if i % 2 == 0 else 0.0 for i in range(len(recs))]
    assert all(x["sample"] == 0 for x in recs[:10]) and "mean reward" in res.output
    # errors are one line, exit 2, before any scoring
    comp.write_text(json.dumps({"task_id": "missing", "completion": "x"}) + "\n")
    res = r.invoke(main, ["verify", str(comp), "-o", str(tmp_path / "x.jsonl"), "--tasks", str(out2)])
    assert res.exit_code == 2 and "not in" in res.output
    res = r.invoke(main, ["tasks", "export", "bogus:x", "-o", str(tmp_path / "y.jsonl")])
    assert res.exit_code == 2 and "valid kinds" in res.output


def test_unavailable_verifier_is_explained(monkeypatch):
    from mlx_ssp import verify as v
    from mlx_ssp.tasks import Task, check_tasks

    monkeypatch.setitem(v.UNAVAILABLE, "fancy", "it needs the Python package 'fancy_pkg'")
    with pytest.raises(UserError, match="fancy_pkg"):
        check_tasks([Task(id="a", domain="d", prompt="p", answer="1", verifier="fancy")])


def test_bug_in_own_verifier_module_is_not_swallowed(tmp_path, monkeypatch):
    """Only a missing third-party package may disable a verifier; our own ImportError propagates."""
    import importlib
    import sys

    import mlx_ssp.verify as v

    real = importlib.import_module

    def fake(name, *a, **k):
        if name == "mlx_ssp.verify.toolcall":
            raise ModuleNotFoundError("No module named 'mlx_ssp.verify.helpers'", name="mlx_ssp.verify.helpers")
        if name == "mlx_ssp.verify.code":
            raise ModuleNotFoundError("No module named 'somepkg'", name="somepkg")
        return real(name, *a, **k)

    saved = {k: m for k, m in sys.modules.items() if k.startswith("mlx_ssp.verify")}
    monkeypatch.setattr(importlib, "import_module", fake)
    try:
        import types

        src = open(v.__file__).read()
        mod = types.ModuleType("mlx_ssp_verify_copy")
        sys.modules[mod.__name__] = mod
        with pytest.raises(ModuleNotFoundError, match="helpers"):
            exec(compile(src, v.__file__, "exec"), mod.__dict__)
        assert mod.UNAVAILABLE.get("code", "").startswith("it needs the Python package 'somepkg'")
    finally:
        sys.modules.pop("mlx_ssp_verify_copy", None)
        sys.modules.update(saved)


def test_sources_are_registry_entries():
    """Each source kind carries its own functions (a split's items, the default domain name, its
    `tasks list` line); nothing outside the registry branches on the kind."""
    from mlx_ssp.tasks.sources import SOURCES, default_domain_name

    assert all(callable(s.split_items) for s in SOURCES.values())
    assert [k for k, s in SOURCES.items() if s.catalogue] == ["reasoning_gym", "bfcl", "bfcl_multi_turn", "instruct", "testbed",
                                                              "testbed_tools"]
    assert [k for k, s in SOURCES.items() if s.default_size] == ["reasoning_gym", "instruct", "testbed", "testbed_tools"]
    names = {
        "reasoning_gym:basic_arithmetic": "basic_arithmetic", "bfcl:simple": "bfcl_simple",
        "jsonl:/x/my data.v2.jsonl": "my_data", "jsonl:.hidden": "jsonl", "hf:org/name/": "name",
        "gsm8k:/x/train.jsonl": "gsm8k", "humaneval": "humaneval", "hf:json": "json",
        "episodes:/x/shelf.jsonl": "shelf",
    }
    assert {s: default_domain_name(s) for s in names} == names


def test_bfcl_multi_turn_source_one_domain_per_backend(tmp_path):
    """`tasks export bfcl_multi_turn:base` writes all 200 entries, a domain per backend; a backend
    param draws one backend's entries; excluded and held-back functions are not offered at the start."""
    res = CliRunner().invoke(main, ["tasks", "export", "bfcl_multi_turn:base", "-o", str(tmp_path / "mt.jsonl")])
    assert res.exit_code == 0, res.output
    ts = load_tasks(tmp_path / "mt.jsonl")
    assert len(ts) == 200 and len({t.metadata["bfcl_id"] for t in ts}) == 200
    doms = {t.domain for t in ts}
    assert {"bfcl_mt_base_file_system", "bfcl_mt_base_trading", "bfcl_mt_base_travel",
            "bfcl_mt_base_vehicle_control"} <= doms
    assert all(t.domain == f"bfcl_mt_base_{t.metadata['backend']}" for t in ts)
    t0 = next(t for t in ts if t.metadata["bfcl_id"] == "multi_turn_base_0")
    offered = {x["function"]["name"] for x in t0.metadata["tools"]}
    assert "cp" not in offered and {"mv", "mkdir", "post_tweet"} <= offered  # cp is excluded_function there
    ep = t0.metadata["episode"]
    assert len(ep["user_turns"]) == len(ep["ground_truth"]) == 4 and t0.verifier == "bfcl_multi_turn"

    mf = export_source("bfcl_multi_turn:miss_func", params={"backend": "vehicle_control"})
    assert mf and all(t.domain == "bfcl_mt_miss_func" for t in mf)
    for t in mf:
        ep = t.metadata["episode"]
        for turn, names in ep["held_out"].items():
            assert not set(names) & set(ep["offered"])
            assert all(n in ep["user_turns"][int(turn)][0]["content"] for n in names)
    # disjoint splits, as for every file source
    cfg = TasksConfig.model_validate({"seed": 3, "domains": {"fs": {"source": "bfcl_multi_turn:base",
                                      "params": {"backend": "file_system"}, "sizes": {"train": 30, "eval": 10}}}})
    ids = {s: {t.id for t in build_split(cfg, s)} for s in ("train", "eval")}
    assert len(ids["train"]) == 30 and len(ids["eval"]) == 10 and not ids["train"] & ids["eval"]
    with pytest.raises(UserError, match="valid: file_system"):
        export_source("bfcl_multi_turn:base", params={"backend": "nope"})
