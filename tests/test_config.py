"""Config loading: YAML + --set precedence, strict keys, errors that name file, key and choices."""

from __future__ import annotations

from typing import Literal

import pytest

from mlx_ssp.config import StrictModel, apply_overrides, load_file, load_section, validate
from mlx_ssp.errors import UserError


class Inner(StrictModel):
    rank: int = 8
    mode: Literal["a", "b", "c"] = "a"


class Stage(StrictModel):
    lr: float = 1e-4
    inner: Inner = Inner()


def test_defaults_then_yaml_then_set(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("seed: 3\nmodel: demo\nrl:\n  x: 1\n")
    data = load_file(f, ["model.dtype=float32", "seed=7"])
    assert data["seed"] == 7
    assert data["model"] == {"path": "demo", "dtype": "float32"}
    m = load_section(data, "model", source=str(f))
    assert m.path == "demo" and m.dtype == "float32"
    assert validate(Stage, {"inner": {"rank": 4}}).inner.rank == 4
    over = apply_overrides({"inner": {"rank": 4}}, ["inner.rank=16", "lr=0.5"])
    s = validate(Stage, over)
    assert s.inner.rank == 16 and s.lr == 0.5
    assert s.inner.mode == "a"  # untouched default


def test_set_parses_yaml_values():
    out = apply_overrides({}, ["a.b=[1, 2]", "c=true", "d=hello", "e=1e-3"])
    assert out == {"a": {"b": [1, 2]}, "c": True, "d": "hello", "e": 1e-3}


def test_unknown_key_names_file_key_and_valid_keys():
    with pytest.raises(UserError) as ei:
        validate(Stage, {"inner": {"rnk": 4}}, source="x.yaml", prefix="sft")
    msg = str(ei.value)
    assert "x.yaml" in msg and "sft.inner.rnk" in msg and "mode, rank" in msg


def test_bad_choice_lists_valid_choices():
    with pytest.raises(UserError) as ei:
        validate(Stage, {"inner": {"mode": "z"}}, source="x.yaml", prefix="sft")
    msg = str(ei.value)
    assert "sft.inner.mode" in msg and "'a', 'b' or 'c'" in msg and "'z'" in msg


def test_unknown_section_and_bad_yaml(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("modle: demo\n")
    with pytest.raises(UserError, match="unknown key 'modle'.*model"):
        load_file(f)
    f.write_text("model: [unclosed\n")
    with pytest.raises(UserError, match="not valid YAML"):
        load_file(f)
    with pytest.raises(UserError, match="not found"):
        load_file(tmp_path / "missing.yaml")
    with pytest.raises(UserError, match="KEY=VALUE"):
        apply_overrides({}, ["novalue"])


def test_atomic_and_jsonl_io(tmp_path):
    from mlx_ssp.io import JsonlAppender, atomic_path, read_jsonl

    p = tmp_path / "out.txt"
    with pytest.raises(RuntimeError):
        with atomic_path(p) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed")
    assert not p.exists() and not list(tmp_path.iterdir())  # nothing left behind

    j = tmp_path / "r.jsonl"
    with JsonlAppender(j) as w:
        w.write({"a": 1})
    with open(j, "a") as f:
        f.write('{"a": 2, "tor')  # a crash mid-line
    with JsonlAppender(j) as w:  # reopening repairs the torn tail
        w.write({"a": 3})
    assert [r["a"] for r in read_jsonl(j)] == [1, 3]
    b = tmp_path / "bg.jsonl"  # the background writer: same lines, same order, all there after close
    with JsonlAppender(b, background=True) as w:
        for i in range(50):
            w.write_many([{"i": i, "j": k} for k in range(3)])
    assert [(r["i"], r["j"]) for r in read_jsonl(b)] == [(i, k) for i in range(50) for k in range(3)]
    w = JsonlAppender(b, background=True)
    w.write({"bad": object()})  # not JSON: the error surfaces in the caller, not lost in the thread
    with pytest.raises(OSError, match="bg.jsonl"):
        w.close()
    assert len(read_jsonl(b)) == 150
    j.write_text('{"a": 1}\nnot json\n')
    with pytest.raises(UserError, match=r"r.jsonl:2"):
        read_jsonl(j)


def test_pass_at_k():
    from math import comb

    from mlx_ssp.metrics import pass_at_k

    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - comb(n - c, k) / comb(n, k)
                assert abs(pass_at_k(n, c, k) - exact) < 1e-12
    assert pass_at_k(8, 1, 1) == pytest.approx(1 / 8)
