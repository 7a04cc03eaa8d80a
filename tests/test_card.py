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
