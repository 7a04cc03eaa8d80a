"""Several merges in one config (``mlx_ssp merge`` on a multimerge YAML): equal to the merges run by
hand, cached by fingerprint, resumed after a failure, refused with one line when malformed."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

import mlx_ssp  # noqa: F401  (loads OpenBLAS before mlx.core)
import mlx.core as mx

from mlx_ssp.cli import main
from mlx_ssp.config import load_yaml_documents, load_yaml_text
from mlx_ssp.errors import UserError
from mlx_ssp.merge import multi, torch_math
from mlx_ssp.merge.config import load_merge_config
from mlx_ssp.merge.engine import plan_merge, write_skeleton
from mlx_ssp.merge.multi import STAMP, load_multimerge, read_stamp
from mlx_ssp.merge.outdir import is_merge_output
from mlx_ssp.merge.safetensors_io import read_header
from mlx_ssp.testing import make_tiny_model

#: the files that hold the model (the card and the saved config name the paths, so they differ)
MODEL_FILES = ("model.safetensors", "model.safetensors.index.json", "config.json", "tokenizer.json")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Three tiny float32 qwen3 models sharing one tokenizer, and one with another width."""
    root = tmp_path_factory.mktemp("multimerge_models")
    a = make_tiny_model(root / "a", seed=1, hidden_size=32, intermediate_size=64, vocab_size=256)
    out = {"a": a}
    for name, seed in (("b", 2), ("c", 3)):
        out[name] = make_tiny_model(root / name, seed=seed, tokenizer_dir=a, hidden_size=32, intermediate_size=64)
    out["wide"] = make_tiny_model(root / "wide", seed=4, tokenizer_dir=a, hidden_size=64, intermediate_size=64)
    return out


def docs_yaml(*docs: dict) -> str:
    return "---\n".join(yaml.safe_dump(d, sort_keys=False) for d in docs)


def two_level(m, t: float = 0.3, first_model_b: str | None = None) -> list[dict]:
    """first = linear(a, b); second = slerp(first -> c); final = task_arithmetic on a of (second, b)."""
    first = {"name": "first", "merge_method": "linear",
             "models": [{"model": str(m["a"]), "parameters": {"weight": 0.5}},
                        {"model": first_model_b or str(m["b"]), "parameters": {"weight": 0.5}}]}
    second = {"name": "second", "merge_method": "slerp", "base_model": "first",
              "models": [{"model": str(m["c"])}], "parameters": {"t": t}}
    final = {"merge_method": "task_arithmetic", "base_model": str(m["a"]),
             "models": [{"model": "second", "parameters": {"weight": 0.7}},
                        {"model": str(m["b"]), "parameters": {"weight": 0.3}}]}
    return [first, second, final]


def run_cli(*args: str):
    return CliRunner().invoke(main, ["merge", *map(str, args), "--quiet"])


def ok(r) -> dict:
    assert r.exit_code == 0, (r.exit_code, r.output, r.exception)
    return json.loads(r.stdout)


def refused(r, *needles: str, after: int = 0) -> str:
    """Exit 2 with one error line (after ``after`` lines of progress: the merges that did run)."""
    assert r.exit_code == 2, (r.exit_code, r.output, r.exception)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == after + 1 and "Traceback" not in r.stderr, r.stderr
    err = lines[-1]
    assert err.startswith("error: "), err
    for n in needles:
        assert n in err, (n, err)
    return err


def actions(res: dict) -> dict[str, str]:
    return {m["name"]: m["action"] for m in res["merges"]}


def mtimes(d: Path) -> dict[str, int]:
    return {f.name: f.stat().st_mtime_ns for f in sorted(d.iterdir())}


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def by_hand(tmp: Path, docs: list[dict]) -> Path:
    """Each merge on its own, one after another, names replaced by the outputs' paths."""
    done: dict[str, str] = {}
    out = None
    for i, doc in enumerate(docs):
        doc = json.loads(json.dumps(doc))
        name = doc.pop("name", None) or "final"
        for m in doc["models"]:
            m["model"] = done.get(m["model"], m["model"])
        if "base_model" in doc:
            doc["base_model"] = done.get(doc["base_model"], doc["base_model"])
        cfg = write(tmp / f"hand_{i}.yml", yaml.safe_dump(doc))
        out = tmp / "hand" / name
        ok(run_cli(cfg, out))
        done[name] = str(out)
    return out


# ------------------------------------------------------------------ equal to the merges by hand


def test_two_level_equals_merges_by_hand_and_rerun_keeps_everything(models, tmp_path):
    docs = two_level(models)
    cfg = write(tmp_path / "multi.yml", docs_yaml(*docs))
    out, inter = tmp_path / "out", tmp_path / "inter"
    res = ok(run_cli(cfg, out, "--intermediate-dir", inter))
    assert actions(res) == {"first": "merged", "second": "merged", "(final)": "merged"}
    assert sorted(p.name for p in inter.iterdir()) == ["first", "second"]
    hand = by_hand(tmp_path, docs)
    for f in MODEL_FILES:
        assert (out / f).read_bytes() == (hand / f).read_bytes(), f
    for name in ("first", "second"):
        assert (inter / name / "model.safetensors").read_bytes() == (tmp_path / "hand" / name / "model.safetensors").read_bytes()

    # a second run writes nothing: every merge kept, no file touched
    before = {d: mtimes(d) for d in (out, inter / "first", inter / "second")}
    res = ok(run_cli(cfg, out, "--intermediate-dir", inter))
    assert actions(res) == {"first": "kept", "second": "kept", "(final)": "kept"}
    assert {d: mtimes(d) for d in before} == before
    # --no-lazy redoes every merge (same bytes: the merge is deterministic)
    res = ok(run_cli(cfg, out, "--intermediate-dir", inter, "--no-lazy"))
    assert set(actions(res).values()) == {"merged"}
    assert (out / "model.safetensors").read_bytes() == (hand / "model.safetensors").read_bytes()


def test_a_changed_merge_is_redone_with_its_dependents_only(models, tmp_path):
    cfg = write(tmp_path / "multi.yml", docs_yaml(*two_level(models, t=0.3)))
    out = tmp_path / "out"
    ok(run_cli(cfg, out))  # intermediates default to OUT.intermediates beside OUT
    inter = tmp_path / "out.intermediates"
    first, second = mtimes(inter / "first"), (inter / "second" / "model.safetensors").read_bytes()
    final = (out / "model.safetensors").read_bytes()

    write(cfg, docs_yaml(*two_level(models, t=0.8)))
    res = ok(run_cli(cfg, out))
    assert actions(res) == {"first": "kept", "second": "merged", "(final)": "merged"}
    assert mtimes(inter / "first") == first
    assert (inter / "second" / "model.safetensors").read_bytes() != second
    assert (out / "model.safetensors").read_bytes() != final

    # a changed input file (same config) is a change too
    c2 = tmp_path / "c2"
    shutil.copytree(models["c"], c2)
    docs = two_level(models, t=0.8)
    docs[1]["models"][0]["model"] = str(c2)
    write(cfg, docs_yaml(*docs))
    ok(run_cli(cfg, out))
    data = bytearray((c2 / "model.safetensors").read_bytes())
    data[-4:] = b"\x00\x00\x80\x3f"  # the last float32 becomes 1.0
    (c2 / "model.safetensors").write_bytes(bytes(data))
    res = ok(run_cli(cfg, out))
    assert actions(res) == {"first": "kept", "second": "merged", "(final)": "merged"}


def test_a_failed_run_resumes_after_the_last_finished_merge(models, tmp_path):
    bad = tmp_path / "c_bad"
    shutil.copytree(models["c"], bad)
    (bad / "model.safetensors").write_bytes((models["c"] / "model.safetensors").read_bytes()[:1000])  # truncated
    docs = two_level(models)
    docs[1]["models"][0]["model"] = str(bad)
    cfg = write(tmp_path / "multi.yml", docs_yaml(*docs))
    out, inter = tmp_path / "out", tmp_path / "inter"
    r = run_cli(cfg, out, "-I", inter)
    refused(r, "c_bad", "truncated", after=1)  # after "merge first: ... merging"
    assert (inter / "first" / STAMP).is_file()  # the first merge finished
    assert not (inter / "second").exists() and not out.exists()  # nothing half-written is left
    assert [p.name for p in inter.iterdir()] == ["first"]
    first = mtimes(inter / "first")

    shutil.rmtree(bad)
    shutil.copytree(models["c"], bad)  # the input repaired
    res = ok(run_cli(cfg, out, "-I", inter))
    assert actions(res) == {"first": "kept", "second": "merged", "(final)": "merged"}
    assert mtimes(inter / "first") == first


# ------------------------------------------------------------------ dry run


def test_dry_run_plans_every_merge_and_writes_nothing(models, tmp_path):
    cfg = write(tmp_path / "multi.yml", docs_yaml(*two_level(models)))
    out, inter = tmp_path / "out", tmp_path / "inter"
    res = ok(run_cli(cfg, out, "-I", inter, "--dry-run"))
    assert [(m["name"], m["action"]) for m in res["merges"]] == [("first", "merge"), ("second", "merge"), ("(final)", "merge")]
    assert res["merges"][2]["models"][0] == "second" and res["merges"][2]["tensors"] > 0
    assert not out.exists() and not inter.exists()
    # the fingerprints it shows are the run's: after the run everything is kept
    run = ok(run_cli(cfg, out, "-I", inter))
    assert [m["fingerprint"] for m in run["merges"]] == [m["fingerprint"] for m in res["merges"]]
    again = ok(run_cli(cfg, out, "-I", inter, "--dry-run"))
    assert {m["action"] for m in again["merges"]} == {"keep"}


def test_dry_run_finds_a_problem_in_a_merge_of_an_intermediate(models, tmp_path):
    """The final merge reads 'first' (not built): planned on first's skeleton, its shape mismatch with
    a wider model is found before anything is merged."""
    docs = two_level(models)
    docs[2]["models"][1]["model"] = str(models["wide"])
    cfg = write(tmp_path / "multi.yml", docs_yaml(*docs))
    refused(run_cli(cfg, tmp_path / "out", "--dry-run"), "final merge")
    assert not (tmp_path / "out.intermediates").exists()


# ------------------------------------------------------------------ refused at load


@pytest.mark.parametrize("case, needles", [
    ("cycle", ("cycle", "'x' -> 'y' -> 'x'")),
    ("self", ("'x' reads its own output",)),
    ("unknown", ("'frist'", "neither a merge")),
    ("duplicate", ("two merges are named 'x'", "documents 1 and 2")),
    ("two_unnamed", ("both have no name",)),
    ("unused", ("'y'", "used by no other merge")),
    ("bad_name", ("name 'a/b'",)),
    ("bad_key", ("merge 'x'", "unknown key 'mergemethod'")),
])
def test_malformed_configs_are_refused_with_one_line(models, tmp_path, case, needles):
    a, b = str(models["a"]), str(models["b"])

    def lin(*refs, name=None):
        d = {"merge_method": "linear", "models": [{"model": r, "parameters": {"weight": 1.0}} for r in refs]}
        return {"name": name, **d} if name else d

    docs = {
        "cycle": [lin(a, "y", name="x"), lin(b, "x", name="y"), lin(a, "x")],
        "self": [lin(a, "x", name="x"), lin(a, "x")],
        "unknown": [lin(a, b, name="first"), lin(a, "frist")],
        "duplicate": [lin(a, b, name="x"), lin(a, b, name="x"), lin(a, "x")],
        "two_unnamed": [lin(a, b, name="x"), lin(a, "x"), lin(b, "x")],
        "unused": [lin(a, b, name="x"), lin(a, b, name="y"), lin(a, "x")],
        "bad_name": [lin(a, b, name="a/b"), lin(a, "a/b")],
        "bad_key": [{**lin(a, b, name="x"), "mergemethod": "ties"}, lin(a, "x")],
    }[case]
    cfg = write(tmp_path / "multi.yml", docs_yaml(*docs))
    refused(run_cli(cfg, tmp_path / "out"), *needles)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.intermediates").exists()


def test_set_and_intermediate_dir_are_refused_where_they_do_not_apply(models, tmp_path):
    multi = write(tmp_path / "multi.yml", docs_yaml(*two_level(models)))
    refused(CliRunner().invoke(main, ["merge", str(multi), str(tmp_path / "o"), "--set", "dtype=float32"]), "--set")
    single = write(tmp_path / "one.yml", yaml.safe_dump(two_level(models)[2] | {"base_model": str(models["a"]),
                                                                             "models": [{"model": str(models["b"])}]}))
    refused(run_cli(single, tmp_path / "o", "-I", tmp_path / "i"), "--intermediate-dir")
    refused(run_cli(single, tmp_path / "o", "--no-lazy"), "--no-lazy")
    assert not (tmp_path / "o").exists()


def test_intermediate_dir_inside_out_is_refused(models, tmp_path):
    cfg = write(tmp_path / "multi.yml", docs_yaml(*two_level(models)))
    refused(run_cli(cfg, tmp_path / "out", "-I", tmp_path / "out" / "inter"), "intermediate directory")
    refused(run_cli(cfg, tmp_path / "out", "-I", tmp_path), "intermediate directory")  # OUT inside it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["multi.yml"]


# ------------------------------------------------------------------ mergekit's own format


MERGEKIT_EXAMPLE = """\
name: first-merge
merge_method: linear
models:
  - model: mistralai/Mistral-7B-v0.1
  - model: BioMistral/BioMistral-7B
parameters:
  weight: 0.5
---
name: second-merge
merge_method: slerp
base_model: first-merge  # the merge above
models:
  - model: NousResearch/Hermes-2-Pro-Mistral-7B
parameters:
  t: 0.5
---
# the final merge: no name
merge_method: dare_ties
base_model: mistralai/Mistral-7B-v0.1
models:
  - model: second-merge
    parameters:
      density: 0.6
      weight: 0.5
  - model: teknium/OpenHermes-2.5-Mistral-7B
    parameters:
      density: 0.8
      weight: 0.5
"""


def test_mergekit_multimerge_example_loads(tmp_path):
    mm = load_multimerge(write(tmp_path / "mergekit.yml", MERGEKIT_EXAMPLE))
    assert [s.name for s in mm.steps] == ["first-merge", "second-merge", None]
    assert [s.deps for s in mm.steps] == [(), ("first-merge",), ("second-merge",)]
    # the final merge may come first in the file: the order follows what each merge reads
    first, second, final = MERGEKIT_EXAMPLE.split("---\n")
    mm = load_multimerge(write(tmp_path / "reordered.yml", "---\n".join([final, second, first])))
    assert [s.name for s in mm.steps] == ["first-merge", "second-merge", None]


def test_all_named_config_writes_the_merge_nothing_uses_to_out(models, tmp_path):
    docs = two_level(models)
    docs[2]["name"] = "last"
    cfg = write(tmp_path / "multi.yml", docs_yaml(*docs))
    res = ok(run_cli(cfg, tmp_path / "out"))
    assert actions(res) == {"first": "merged", "second": "merged", "last": "merged"}
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert sorted(p.name for p in (tmp_path / "out.intermediates").iterdir()) == ["first", "second"]


def test_an_intermediate_that_would_replace_an_input_model_is_refused(models, tmp_path):
    """-I at the models' folder with a merge named like a model there: refused before any merge."""
    root = models["a"].parent
    docs = two_level(models)
    docs[0]["name"] = "c"  # root/c is an input of 'second'
    docs[1]["base_model"] = "c"
    cfg = write(tmp_path / "multi.yml", docs_yaml(*docs))
    before = mtimes(models["c"])
    refused(run_cli(cfg, tmp_path / "out", "-I", root), "input model")
    assert mtimes(models["c"]) == before and not (tmp_path / "out").exists()


def test_the_shipped_example_loads_and_its_models_are_checked(tmp_path):
    root = Path(__file__).resolve().parents[1]
    mm = load_multimerge(root / "configs" / "multimerge.yml", check_models=False)
    assert [(s.name, s.deps) for s in mm.steps] == [("arith", ()), (None, ("arith",))]
    # with the models checked, a model that is not there is named (here: no quickstart run)
    if not (root / "runs" / "quickstart").exists():
        with pytest.raises(UserError, match="runs/quickstart/sft/specialists/addition"):
            load_multimerge(root / "configs" / "multimerge.yml")


def test_a_merge_read_with_a_lora_adapter(models, tmp_path):
    """``first+ADAPTER``: the intermediate with an mlx-lm LoRA adapter fused on read, as by hand."""
    ad = tmp_path / "adapter"
    r = CliRunner().invoke(main, ["extract-lora", str(models["a"]), str(models["c"]), str(ad), "--rank", "4"])
    assert r.exit_code == 0, (r.output, r.exception)
    first = two_level(models)[0]
    final = {"merge_method": "linear", "models": [{"model": f"first+{ad}", "parameters": {"weight": 0.5}},
                                                  {"model": str(models["b"]), "parameters": {"weight": 0.5}}]}
    cfg = write(tmp_path / "multi.yml", docs_yaml(first, final))
    assert [s.deps for s in load_multimerge(cfg).steps] == [(), ("first",)]
    ok(run_cli(cfg, tmp_path / "out"))
    # the dry run (on a skeleton of 'first', with the adapter) computes the run's fingerprints
    assert {m["action"] for m in ok(run_cli(cfg, tmp_path / "out", "--dry-run"))["merges"]} == {"keep"}
    ok(run_cli(write(tmp_path / "f.yml", yaml.safe_dump({k: v for k, v in first.items() if k != "name"})),
               tmp_path / "hand_first"))
    final["models"][0]["model"] = f"{tmp_path / 'hand_first'}+{ad}"
    ok(run_cli(write(tmp_path / "g.yml", yaml.safe_dump(final)), tmp_path / "hand_final"))
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (tmp_path / "hand_final" / "model.safetensors").read_bytes()
    # a changed adapter (same config) redoes the merge that reads it, and only that one
    cfg_ad = json.loads((ad / "adapter_config.json").read_text())
    cfg_ad["lora_parameters"]["scale"] *= 2
    (ad / "adapter_config.json").write_text(json.dumps(cfg_ad))
    assert actions(ok(run_cli(cfg, tmp_path / "out"))) == {"first": "kept", "(final)": "merged"}
    # and the adapter differs from no adapter at all
    final["models"][0]["model"] = str(tmp_path / "hand_first")
    ok(run_cli(write(tmp_path / "h.yml", yaml.safe_dump(final)), tmp_path / "plain_final"))
    assert (tmp_path / "out" / "model.safetensors").read_bytes() != (tmp_path / "plain_final" / "model.safetensors").read_bytes()


# ------------------------------------------------------------------ the merger's version and the dry run's stand-ins


def test_a_new_merger_version_redoes_every_merge(models, tmp_path, monkeypatch):
    """An engine change that alters outputs raises MERGER_VERSION: no intermediate is kept across it."""
    cfg = write(tmp_path / "multi.yml", docs_yaml(*two_level(models)))
    out = tmp_path / "out"
    ok(run_cli(cfg, out))
    assert set(actions(ok(run_cli(cfg, out))).values()) == {"kept"}
    monkeypatch.setattr(multi, "MERGER_VERSION", multi.MERGER_VERSION + 1)
    assert set(actions(ok(run_cli(cfg, out))).values()) == {"merged"}


def test_another_float32_math_backend_redoes_every_merge(models, tmp_path, monkeypatch):
    """oneMKL's and NumPy's float32 acos / sin / cos differ in the last bits: the backend is part of
    the fingerprint, so switching it (MLX_SSP_TORCH_MATH=numpy) redoes the merges where it changes."""
    cfg = write(tmp_path / "multi.yml", docs_yaml(*two_level(models)))
    out = tmp_path / "out"
    before = torch_math.backend()
    ok(run_cli(cfg, out))
    monkeypatch.setenv(torch_math.ENV, "numpy")
    assert torch_math.backend() == "numpy"
    want = {"merged"} if before == "mkl" else {"kept"}
    assert set(actions(ok(run_cli(cfg, out))).values()) == want
    assert set(actions(ok(run_cli(cfg, out))).values()) == {"kept"}


def test_stand_ins_are_never_merge_outputs_and_always_removed(models, tmp_path, monkeypatch):
    """A dry run's skeleton has the planned layout but not the merge mark nor a fingerprint, and its
    temporary directory is gone after the dry run, whether it succeeds or fails."""
    job = plan_merge(load_merge_config(write(tmp_path / "one.yml", yaml.safe_dump(
        {k: v for k, v in two_level(models)[0].items() if k != "name"})))[0])
    sk = tmp_path / "sk"
    write_skeleton(job, sk)
    assert not is_merge_output(sk) and read_stamp(sk) is None
    header, _ = read_header(sk / "model.safetensors")
    assert sorted(k for k in header if k != "__metadata__") == sorted(p.name for p in job.plans)
    assert not any(mx.load(str(sk / "model.safetensors"))[p.name].any().item() for p in job.plans)

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    docs = two_level(models)
    cfg = write(tmp_path / "multi.yml", docs_yaml(*docs))
    ok(run_cli(cfg, tmp_path / "out", "--dry-run"))
    assert list(scratch.iterdir()) == []
    docs[2]["models"][1]["model"] = str(models["wide"])  # fails in the final merge, after two stand-ins
    refused(run_cli(write(cfg, docs_yaml(*docs)), tmp_path / "out", "--dry-run"), "final merge")
    assert list(scratch.iterdir()) == []


def test_out_dir_of_another_config_needs_overwrite(models, tmp_path):
    """A rerun of the same config file replaces its OUT_DIR; another config's needs --overwrite."""
    out = tmp_path / "out"
    one = write(tmp_path / "one.yml", docs_yaml(*two_level(models, t=0.3)))
    ok(run_cli(one, out))
    before = (out / "model.safetensors").read_bytes()
    other = write(tmp_path / "other.yml", docs_yaml(*two_level(models, t=0.8)))
    refused(run_cli(other, out, "-I", tmp_path / "i2"), "--overwrite")
    assert (out / "model.safetensors").read_bytes() == before and not (tmp_path / "i2").exists()
    assert actions(ok(run_cli(other, out, "-I", tmp_path / "i2", "--overwrite")))["(final)"] == "merged"
    write(one, docs_yaml(*two_level(models, t=0.5)))  # not the config that wrote OUT_DIR last
    refused(run_cli(one, out), "--overwrite")


def test_alias_bound_counts_every_document_together():
    """The alias-expansion bound of one YAML document holds for the whole stream: documents each
    under it are refused together once their sum is over (otherwise N documents give N times it)."""
    doc = "a: &a [" + ", ".join(["1"] * 1000) + "]\nb: [" + ", ".join(["*a"] * 60) + "]\n"  # ~61,000 values
    assert len(load_yaml_documents(doc, "one")) == 1
    with pytest.raises(UserError, match="expands to more than"):
        load_yaml_documents(doc + "---\n" + doc, "two")
    with pytest.raises(UserError, match="not valid YAML|expected a single document"):
        load_yaml_text(doc + "---\n" + doc, "two")  # one-document readers still take one
