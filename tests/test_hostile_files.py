"""Hostile files and paths are one-line errors: safetensors headers that lie (negative or
overflowing shapes, bad offsets), JSON nested too deeply or not UTF-8 in the files ``mlx_ssp merge``
reads, tokenizer ids that are not integers, outputs in /proc, /sys, /dev or on a device."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
from click.testing import CliRunner

from mlx_ssp.cli import main
from mlx_ssp.errors import UserError

DEEP = "[" * 3000 + "]" * 3000


def _safetensors(path: Path, header: dict, data: bytes) -> Path:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


@pytest.mark.parametrize("entry, needle", [
    ({"dtype": "F32", "shape": [-1, -64], "data_offsets": [0, 256]}, "shape"),  # product 64: the real count
    ({"dtype": "F32", "shape": [True, 64], "data_offsets": [0, 256]}, "shape"),
    ({"dtype": "F32", "shape": [1.0, 64], "data_offsets": [0, 256]}, "shape"),
    ({"dtype": "F32", "shape": ["1", 64], "data_offsets": [0, 256]}, "shape"),
    ({"dtype": "F32", "shape": [2 ** 62, 2 ** 62], "data_offsets": [0, 0]}, "expected"),  # int64 product wraps to 0
    ({"dtype": "F32", "shape": [64], "data_offsets": [256, 0]}, "data_offsets"),
    ({"dtype": "F32", "shape": [64], "data_offsets": [0, 256, 512]}, "data_offsets"),
    ({"dtype": "F32", "shape": [64], "data_offsets": [-256, 0]}, "data_offsets"),
    ({"dtype": ["F32"], "shape": [64], "data_offsets": [0, 256]}, "dtype"),
    ({"dtype": "F32", "shape": [64]}, "data_offsets"),
    ([1, 2], "expected an object"),
])
def test_lying_safetensors_header_is_refused(tmp_path, entry, needle):
    from mlx_ssp.merge.safetensors_io import scan_file

    p = _safetensors(tmp_path / "m.safetensors", {"w": entry}, b"\0" * 256)
    with pytest.raises(UserError, match=needle) as e:
        scan_file(p)
    assert "'w'" in str(e.value)


def test_good_safetensors_header_and_its_bounds(tmp_path):
    from mlx_ssp.merge.safetensors_io import scan_file

    good = {"a": {"dtype": "F32", "shape": [2, 32], "data_offsets": [0, 256]},
            "b": {"dtype": "BF16", "shape": [], "data_offsets": [256, 258]},
            "e": {"dtype": "I8", "shape": [0, 5], "data_offsets": [258, 258]}}
    infos = scan_file(_safetensors(tmp_path / "ok.safetensors", good, b"\0" * 258))
    assert infos["a"].shape == (2, 32) and infos["b"].nbytes == 2 and infos["e"].nbytes == 0
    with pytest.raises(UserError, match="truncated"):
        scan_file(_safetensors(tmp_path / "short.safetensors", good, b"\0" * 257))
    overlap = {**good, "b": {"dtype": "BF16", "shape": [], "data_offsets": [254, 256]}}
    with pytest.raises(UserError, match="overlap"):
        scan_file(_safetensors(tmp_path / "overlap.safetensors", overlap, b"\0" * 258))


@pytest.mark.parametrize("text, needle", [
    ('{"x": ' + DEEP + "}", "JSON nested too deeply"),
    ('{"\xff": 1}', "not valid UTF-8"),
])
def test_safetensors_header_deep_or_not_utf8(tmp_path, text, needle):
    from mlx_ssp.merge.safetensors_io import scan_file

    raw = text.encode("latin-1") if "\xff" in text else text.encode()
    p = tmp_path / "m.safetensors"
    p.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(UserError, match=f"corrupt safetensors header: {needle}"):
        scan_file(p)


def _two_models(tmp_path):
    import mlx.core as mx

    models = []
    for i in range(2):
        d = tmp_path / f"m{i}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 1, "vocab_size": 8}))
        mx.save_safetensors(str(d / "model.safetensors"), {"w.weight": mx.ones((8, 4)) * i}, metadata={"format": "pt"})
        models.append(d)
    cfg = tmp_path / "merge.yml"
    cfg.write_text(json.dumps({"merge_method": "linear",
                               "models": [{"model": str(m), "parameters": {"weight": 0.5}} for m in models]}))
    return cfg, models


def test_negative_shape_is_refused_by_the_merge(tmp_path):
    cfg, models = _two_models(tmp_path)
    for m in models:  # both: the shapes agree, so only the header check can see it
        f = m / "model.safetensors"
        raw = f.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = raw[8:8 + n].replace(b'"shape":[8,4]', b'"shape":[-8,-4]')
        assert header != raw[8:8 + n]
        f.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + n:])  # same bytes: 8 x 4 = -8 x -4
    res = CliRunner().invoke(main, ["merge", str(cfg), str(tmp_path / "out"), "--quiet", "--workers", "1"])
    assert res.exit_code == 2 and "shape [-8, -4]" in res.output and len(res.output.splitlines()) == 1, res.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("content, needle", [
    ('{"model_type": "llama", "x": ' + DEEP + "}", "nested too deeply"),
    (b'{"model_type": "ll\xffama"}', "not valid UTF-8"),
    ('{"model_type": "llama", "vocab_size": "8"}', "vocab_size is '8'"),
])
def test_bad_config_json_in_a_merge_is_one_line(tmp_path, content, needle):
    cfg, models = _two_models(tmp_path)
    f = models[1] / "config.json"
    f.write_bytes(content) if isinstance(content, bytes) else f.write_text(content)
    res = CliRunner().invoke(main, ["merge", str(cfg), str(tmp_path / "out"), "--quiet", "--workers", "1"])
    assert res.exit_code == 2 and needle in res.output and len(res.output.splitlines()) == 1, res.output


@pytest.mark.parametrize("vocab, added, needle", [
    ({"a": 0, "b": "1"}, [], "'b' to '1'"),
    ({"a": 0, "b": 1.5}, [], "'b' to 1.5"),
    ({"a": 0, "b": True}, [], "'b' to True"),
    ({"a": 0, "b": -2}, [], "'b' to -2"),
    ({"a": 0}, [{"id": "7", "content": "<t>"}], "'<t>' to '7'"),
    ({"a": 0}, [{"id": 1, "content": 5}], "5 to 1"),
])
def test_tokenizer_ids_must_be_integers(vocab, added, needle):
    from mlx_ssp.merge.tokenizer import vocab_of

    text = json.dumps({"model": {"type": "BPE", "vocab": vocab, "merges": []}, "added_tokens": added})
    with pytest.raises(UserError, match=needle):
        vocab_of(text, None, "m")


def test_tokenizer_files_deep_or_not_utf8(tmp_path):
    from mlx_ssp.merge.tokenizer import VocabPlan, read_tokenizer_json, vocab_of, write_tokenizer

    with pytest.raises(UserError, match="tokenizer.json: JSON nested too deeply"):
        vocab_of('{"model": ' + DEEP + "}", None, "m")
    (tmp_path / "tokenizer.json").write_bytes(b'{"model": "\xff"}')
    with pytest.raises(UserError, match="not valid UTF-8"):
        read_tokenizer_json(tmp_path, "m")
    out = tmp_path / "out"
    out.mkdir()
    vp = VocabPlan(n_vocab=1, rows=1, perms={}, rules={}, forced=set(), limits={}, tokenizer_json="{}",
                   tokenizer_from=tmp_path)
    for content, needle in [('{"a": ' + DEEP + "}", "nested too deeply"), (b'{"\xff": 1}', "not valid UTF-8"),
                            ("[1]", "expected a JSON object")]:
        f = tmp_path / "tokenizer_config.json"
        f.write_bytes(content) if isinstance(content, bytes) else f.write_text(content)
        with pytest.raises(UserError, match=needle):
            write_tokenizer(vp, out)


# ------------------------------------------------------------ output paths


def test_check_output_path(tmp_path):
    from mlx_ssp.io import check_output_path

    for bad in ["/proc/self/mem", "/dev/null", "/sys/kernel/x", "/proc"]:
        with pytest.raises(UserError, match="a special filesystem"):
            check_output_path(bad, "o")
    link = tmp_path / "link.jsonl"
    link.symlink_to("/proc/self/mem")
    with pytest.raises(UserError, match="is in /proc"):
        check_output_path(link, "o")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(UserError, match="a device, pipe or socket"):
        check_output_path(fifo, "o", kind=None)
    with pytest.raises(UserError, match="is a directory, not a regular file"):
        check_output_path(tmp_path, "o")
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError, match="is a regular file, not a directory"):
        check_output_path(tmp_path / "f", "o", kind="dir")
    assert check_output_path(tmp_path / "f", "o") == tmp_path / "f"
    assert check_output_path(tmp_path / "new" / "x.jsonl", "o") == tmp_path / "new" / "x.jsonl"
    assert check_output_path(tmp_path, "o", kind="dir") == tmp_path


def test_the_writers_refuse_special_paths(tmp_path):
    from mlx_ssp.io import JsonlAppender, atomic_dir, write_json_atomic

    # through links: a writer without the check replaces the link, not the device
    (tmp_path / "mem").symlink_to("/proc/self/mem")
    (tmp_path / "null").symlink_to("/dev/null")
    with pytest.raises(UserError, match="/proc"):
        JsonlAppender(tmp_path / "mem")
    with pytest.raises(UserError, match="/dev"):
        write_json_atomic(tmp_path / "null", {})
    with pytest.raises(UserError, match="/dev"):
        with atomic_dir(tmp_path / "null", overwrite=True):
            pass
    assert os.path.realpath(tmp_path / "null") == "/dev/null"


def test_rollout_output_in_proc_is_one_line(tmp_path):
    from mlx_ssp.tasks import Task, write_tasks

    tasks = tmp_path / "t.jsonl"
    write_tasks(tasks, [Task(id="a", domain="d", prompt="p", answer="1", verifier="exact")])
    res = CliRunner().invoke(main, ["rollout", "--model", str(tmp_path / "no-model"), "--tasks", str(tasks),
                                    "--set", "rollout.output=/proc/self/mem", "--no-progress"])
    assert res.exit_code == 2, res.output
    assert res.output == "error: rollout.output /proc/self/mem is in /proc, a special filesystem, " \
                         "not a place for outputs; choose another path\n"
