"""scripts/bench_rl.py's bad input: a peer that is not installed is a one-line note, and a shape over
the memory limit is refused by the memory model before any model is built."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_rl.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_rl", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_rl"] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_missing_peers_are_notes_and_an_oversized_shape_is_refused_before_building(tmp_path, capsys):
    bench = _bench()
    code = bench.main(["--model", "qwen3-0.6b", "--memory-limit-gb", "1", "--lora-python", str(tmp_path / "nopython"),
                       "--mlxrl-python", sys.executable, "--batch", "1", "--group", "4", "--max-tokens", "256",
                       "--steps", "2", "--warmup", "1", "--work", str(tmp_path)])
    out = capsys.readouterr().out.splitlines()
    assert code == 2
    assert [x for x in out if x.startswith("# mlx-lm-lora skipped: ")] and [x for x in out if "has no mlxrl package" in x]
    refusal = [x for x in out if x.startswith("bench_rl: qwen3-0.6b: refused before loading")]
    # the step peaks in generation, where gen_fold_lora holds the adapted layers' folded copy (~1.7 GiB here)
    assert len(refusal) == 1 and "limit of 1.0 GiB" in refusal[0] and "predicted to peak at 4.6 GiB" in refusal[0]
    assert not (tmp_path / "qwen3-0.6b" / "model").exists()  # nothing built
    assert bench.peer_version(None, bench.PEERS["mlxrl"])[0] is None
