"""Model cards: front matter in the Hub's schema, the body's recipe, the held-out section, and that
only our own cards are ever rewritten."""

from __future__ import annotations

import pytest
from huggingface_hub import ModelCard

from mlx_ssp.card import KINDS, Card, add_eval_table, hub_ids, read_card, render, with_eval_table, write_card

TABLE = "| model | p@1 |\n|---|---|\n| rl | 0.5 |"


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_kind_renders_hub_front_matter(kind):
    card = ModelCard(render(Card(kind, ("SomeOrg/base",), {"learning rate": 1e-5},
                                data_files=("data/train.jsonl",))))
    assert card.data.library_name == "mlx" and card.data.pipeline_tag == "text-generation"
    assert card.data.base_model == "SomeOrg/base"
    assert set(card.data.tags) >= {"mlx", "mlx_ssp", *KINDS[kind].tags}
    assert card.data.datasets is None  # a local file is named in the body only
    assert "data/train.jsonl" in card.text and "| learning rate | 1e-05 |" in card.text


def test_local_inputs_give_no_base_model_but_a_hub_cache_snapshot_does(tmp_path):
    snap = tmp_path / "hub" / "models--Org--Name" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    plain = tmp_path / "plain"
    plain.mkdir()
    assert hub_ids(str(snap)) == ["Org/Name"]
    assert hub_ids(str(plain)) == []
    card = ModelCard(render(Card("merge", (str(plain), str(snap), "Other/model"), datasets=("org/dataset",))))
    assert card.data.base_model == ["Org/Name", "Other/model"]
    assert card.data.datasets == ["org/dataset"]


def test_merge_card_holds_the_config_as_yaml():
    text = render(Card("merge", ("a/b", "c/d"), {"merge method": "ties"}, config_yaml="merge_method: ties\n"))
    assert "```yaml\nmerge_method: ties\n```" in text
    assert ModelCard(text).data.base_model == ["a/b", "c/d"]


def test_eval_table_section_is_replaced_not_repeated():
    text = render(Card("grpo", ("a/b",)))
    once = with_eval_table(text, TABLE)
    twice = with_eval_table(once, TABLE.replace("0.5", "0.7"))
    assert twice.count("## Held-out evaluation") == 1 and "0.7" in twice and "| rl | 0.5 |" not in twice
    assert twice.startswith(text.rstrip("\n"))
    assert ModelCard(twice).data.base_model == "a/b"


def test_add_eval_table_touches_only_our_cards(tmp_path):
    ours, users = tmp_path / "ours", tmp_path / "users"
    ours.mkdir()
    users.mkdir()
    write_card(ours, Card("lora", ("a/b",)))
    (users / "README.md").write_text("---\nlicense: mit\n---\n\n# My model\n")
    before = (users / "README.md").read_bytes()
    assert add_eval_table(ours, TABLE) is True
    assert add_eval_table(users, TABLE) is False
    assert add_eval_table(tmp_path / "nothing", TABLE) is False
    assert "| rl | 0.5 |" in (ours / "README.md").read_text()
    assert (users / "README.md").read_bytes() == before
    assert not (tmp_path / "nothing").exists()


def test_a_card_of_ours_passes_its_base_model_on(tmp_path):
    write_card(tmp_path, Card("lora", ("Org/base",)))
    assert read_card(tmp_path).data.base_model == "Org/base"
    assert hub_ids(str(tmp_path)) == ["Org/base"]


def test_fuse_and_save_writes_the_given_card(tmp_path):
    """A fused specialist's README.md is our card, not mlx-lm's blank template."""
    from mlx_ssp.finetune.fuse import fuse_and_save
    from mlx_ssp.finetune.lora import LoRAConfig, attach_lora
    from mlx_ssp.models import load_model
    from mlx_ssp.testing import make_tiny_model

    base = make_tiny_model(tmp_path / "base", arch="llama", num_layers=1)
    model, tok, path = load_model(str(base))
    attach_lora(model, LoRAConfig(rank=2, num_layers=1), 0)
    fuse_and_save(model, tok, path, tmp_path / "fused", dequantize=False, overwrite=False,
                  card=Card("lora", (str(base),), {"rank": 2}, title="math specialist"))
    card = ModelCard.load(tmp_path / "fused" / "README.md")
    assert card.text.lstrip().startswith("# math specialist") and "| rank | 2 |" in card.text
    assert "mlx_ssp" in card.data.tags and "lora" in card.data.tags


def test_no_absolute_local_path_reaches_a_card(tmp_path):
    """A card is shared: local models, data files, path-valued settings and the merge config's paths
    appear by their last component (a Hub cache snapshot by its id), never as the maker's paths."""
    import yaml

    spec = tmp_path / "run" / "sft" / "specialists" / "math"
    snap = tmp_path / "hub" / "models--Org--Name" / "snapshots" / "abc123"
    for d in (spec, snap):
        d.mkdir(parents=True)
    data = tmp_path / "run" / "select" / "math.jsonl"
    config = yaml.safe_dump({"merge_method": "ties", "base_model": str(snap),
                             "models": [{"model": str(spec), "parameters": {"weight": 1.0}}, {"model": "Other/model"}],
                             "tokenizer": {"source": str(tmp_path / "tok")}})
    text = render(Card("merge", (str(spec), str(snap), "Other/model", "~/models/mine"),
                       {"base model": str(snap), "tokenizer source": str(tmp_path / "tok"), "method": "ties"},
                       data_files=(str(data), "../outside/x.jsonl"), config_yaml=config))
    assert str(tmp_path) not in text and "~/" not in text and "../" not in text
    assert "- `math` (a local directory)" in text and "- `Org/Name`\n" in text and "- `Other/model`" in text
    assert "- `mine` (a local directory)" in text
    assert "- `math.jsonl` (a local file)" in text and "- `x.jsonl` (a local file)" in text
    assert "| base model | Org/Name |" in text and "| tokenizer source | tok |" in text
    shown_cfg = yaml.safe_load(text.split("```yaml\n")[1].split("```")[0])
    assert shown_cfg["models"][0]["model"] == "math" and shown_cfg["models"][1]["model"] == "Other/model"
    assert shown_cfg["base_model"] == "Org/Name" and shown_cfg["merge_method"] == "ties"
    assert ModelCard(text).data.base_model == ["Org/Name", "Other/model"]  # the front matter keeps Hub ids


def test_a_config_without_local_paths_is_shown_as_written():
    config = "# two specialists of one base\nmerge_method: linear\nmodels:\n  - model: a/b\n  - model: c/d\n"
    assert "```yaml\n" + config + "```" in render(Card("merge", ("a/b", "c/d"), config_yaml=config))


@pytest.mark.parametrize("fine_tune_type, how", [("lora", "LoRA adapters fused"), ("full", "every weight trained")])
def test_rl_card_says_how_the_weights_were_trained(tmp_path, fine_tune_type, how):
    from mlx_ssp.config import validate
    from mlx_ssp.rl.config import RLConfig
    from mlx_ssp.rl.phases import rl_card

    cfg = validate(RLConfig, {"fine_tune_type": fine_tune_type, "tasks": str(tmp_path / "train.jsonl")})
    text = render(rl_card(cfg, tmp_path / "run" / "merge" / "model", {"steps": 3, "tasks": 8}, seed=0))
    first = next(line for line in text.splitlines() if line.startswith("This model is"))
    assert how in first and ("LoRA" not in first) == (fine_tune_type == "full")
    assert str(tmp_path) not in text and "- `train.jsonl` (a local file)" in text
