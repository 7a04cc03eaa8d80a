"""The ``tasks:`` config section into tasks: one split (``train`` | ``probe`` | ``eval``) over every
domain (:func:`build_split`), and one source shorthand into tasks (:func:`export_source`, ``mlx_ssp
tasks export``). Kept out of the package's ``__init__`` so that the task record (:class:`.Task`) and
its file I/O load without the source registry (which imports every source, BFCL's and the testbeds'
among them, and those import the task record)."""

from __future__ import annotations

from mlx_ssp.config import validate
from mlx_ssp.errors import UserError
from mlx_ssp.tasks import Task, check_tasks
from mlx_ssp.tasks.config import SPLITS, DomainConfig, TasksConfig
from mlx_ssp.tasks.sources import default_domain_name, domain_items, parse_source


def _to_task(domain: str, dcfg: DomainConfig, item, split: str) -> Task:
    src, _ = parse_source(dcfg.source)
    md = dict(item.metadata)
    verifier = dcfg.verifier or md.pop("verifier", None) or src.verifier
    if verifier is None:
        raise UserError(f"domain '{domain}': source '{dcfg.source}' needs 'verifier:' (e.g. math, code, exact)")
    instruction = src.instruction if dcfg.instruction is None else dcfg.instruction
    prompt = item.prompt
    if instruction:
        if isinstance(prompt, str):
            prompt = f"{prompt}\n\n{instruction}"
        else:
            prompt = [dict(m) for m in prompt]
            last = max(i for i, m in enumerate(prompt) if m.get("role") == "user") if any(
                m.get("role") == "user" for m in prompt) else len(prompt) - 1
            prompt[last]["content"] = f"{prompt[last]['content']}\n\n{instruction}"
    system = src.system if dcfg.system is None else dcfg.system
    if system:
        msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if not any(m.get("role") == "system" for m in msgs):
            prompt = [{"role": "system", "content": system}] + msgs
    md.update({"split": split, "source": dcfg.source})
    if verifier in ("math", "reasoning_gym"):
        md["answer_extraction"] = dcfg.answer_extraction
    if dcfg.sandbox:
        md["sandbox"] = dict(dcfg.sandbox)
    if item.domain is not None:
        domain = f"{domain}_{item.domain}"
    return Task(id=f"{domain}-{item.key}", domain=domain, prompt=prompt, answer=item.answer, verifier=verifier, metadata=md)


def build_split(cfg: TasksConfig, split: str) -> list[Task]:
    """The tasks of one split (``train`` | ``probe`` | ``eval``) over every domain, deterministic from
    ``cfg.seed``; the three splits of a domain never share a problem (see tasks/sources.py)."""
    if split not in SPLITS:
        raise UserError(f"unknown split '{split}'; valid: {', '.join(SPLITS)}")
    if not cfg.domains:
        raise UserError("tasks.domains is empty: configure at least one domain")
    tasks = []
    for name, dcfg in cfg.domains.items():
        tasks += [_to_task(name, dcfg, it, split) for it in domain_items(name, dcfg, cfg.seed, split)]
    check_tasks(tasks, source=f"tasks ({split})")
    return tasks


def export_source(
    source: str,
    *,
    size: int | None = None,
    seed: int | None = None,
    split: str = "train",
    params: dict | None = None,
    domain: str | None = None,
    **domain_options,
) -> list[Task]:
    """Tasks from one source shorthand (``gsm8k:PATH``, ``reasoning_gym:NAME``, ``humaneval``,
    ``bfcl:CAT``, ``jsonl:PATH``, ``hf:ID``): ``size`` tasks of ``split`` (default: every row of a
    file source; the source's default_size for procedural ones). ``seed`` None: ``tasks.seed``'s default
    (:class:`TasksConfig`). ``domain_options`` are DomainConfig keys (instruction, system, verifier,
    answer_extraction, sandbox)."""
    if split not in SPLITS:
        raise UserError(f"unknown split '{split}'; valid: {', '.join(SPLITS)}")
    try:
        src, _ = parse_source(source)
    except ValueError as e:
        raise UserError(str(e)) from None
    if size is None:
        if src.default_size is not None:
            size = src.default_size
        elif split != "train":
            raise UserError(f"--size is needed with --split {split}")
    sizes = {"train": 0} if split != "train" else {}
    sizes[split] = size
    name = domain or default_domain_name(source)
    opts = {k: v for k, v in domain_options.items() if v is not None}
    cfg = validate(
        TasksConfig,
        {**({} if seed is None else {"seed": seed}),
         "domains": {name: {"source": source, "params": params or {}, "sizes": sizes, **opts}}},
        source="tasks export",
        prefix="tasks",
    )
    return build_split(cfg, split)
