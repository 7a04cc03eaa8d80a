"""``mlx_ssp select`` on files: read a rollouts file (one run's records, each (task, sample) once),
offer gold episodes, decontaminate against held-out and benchmark prompts, pseudo-label by majority
vote, select (:mod:`.policy`) and write ``OUT_DIR/<domain>/{train,valid}.jsonl`` and
``spectrum.json`` atomically; the report's table."""

from __future__ import annotations

import hashlib
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Optional

from mlx_ssp import trackers
from mlx_ssp.agents.episode import is_episode
from mlx_ssp.agents.gold import gold_record
from mlx_ssp.errors import UserError
from mlx_ssp.io import atomic_dir, iter_jsonl_numbered, read_jsonl, write_json_atomic, write_jsonl_atomic
from mlx_ssp.rollout.resume import read_meta, sidecar
from mlx_ssp.select.config import DecontaminateConfig, PseudoLabelConfig, SelectConfig
from mlx_ssp.select.policy import DROP_REASONS, select
from mlx_ssp.select.quality import ANSWER_RULES, find_contaminated, prompt_text, vote_task
from mlx_ssp.tasks import load_tasks


def dedupe_records(records: list[dict], source: str | Path) -> tuple[list[dict], int]:
    """(records with each (task, sample) once, copies dropped). Copies must agree on what selection
    reads (prompt, completion, reward, finish reason, task fingerprint); records from different
    runs (``run_fingerprint``) or disagreeing copies are a UserError naming them."""
    runs = {r["run_fingerprint"] for r in records if r.get("run_fingerprint") is not None}
    if len(runs) > 1:
        raise UserError(f"{source}: records from {len(runs)} different runs (model, seed or sampling) are mixed in one file; "
                        "select from one run's rollouts")
    first: dict[tuple, tuple[int, tuple]] = {}
    keep = []
    for i, r in enumerate(records, 1):
        key = (r["task_id"], r["sample"])
        body = (json.dumps(r["prompt"], sort_keys=True), r["completion"], r["reward"], r.get("finish_reason"),
                r.get("task_fingerprint"))
        if key in first:
            j, seen = first[key]
            if seen != body:
                raise UserError(f"{source}: records {j} and {i} are both task '{key[0]}' sample {key[1]} but differ; "
                                "the file mixes two runs")
            continue
        first[key] = (i, body)
        keep.append(r)
    return keep, len(records) - len(keep)


def gold_records(tasks: list, tokenizer, system: Optional[str] = None) -> list[dict]:
    """The gold episode of every episode task, as a candidate record after the sampled ones (sample
    index -1: the farthest-point walk starts from it, the canonical strategy)."""
    return [{**gold_record(t, tokenizer, system), "sample": -1} for t in tasks if is_episode(t)]


def reference_prompts(paths: list[str | Path], fields: list[str]) -> list[str]:
    """The prompts of held-out task files and benchmark files (JSONL): each row's first field of
    ``fields`` that it has (a string or chat messages)."""
    out = []
    for p in paths:
        for line, row in iter_jsonl_numbered(p, what="benchmark"):
            f = next((f for f in fields if row.get(f) is not None), None)
            if f is None:
                raise UserError(f"{p}:{line}: no prompt field (looked for {', '.join(fields)}; "
                                "set select.decontaminate.fields)")
            out.append(prompt_text(row[f]))
    return out


def contamination(records: list[dict], cfg: DecontaminateConfig, held_out: list[str | Path]) -> tuple[dict, dict]:
    """(task id -> shared n-gram, the report's ``decontamination`` entry) for the training prompts of
    ``records`` against the held-out files (when ``cfg.held_out``) and ``cfg.against``."""
    files = [str(p) for p in (held_out if cfg.held_out else [])] + list(cfg.against)
    if not files:
        raise UserError("select.decontaminate has nothing to compare with: name benchmark files in "
                        "select.decontaminate.against (or held-out task files: --held-out)")
    ref = reference_prompts(files, cfg.fields)
    train, domain = {}, {}
    for r in records:
        train.setdefault(r["task_id"], prompt_text(r.get("prompt")))
        domain.setdefault(r["task_id"], r["domain"])
    found = find_contaminated(train, ref, cfg.n, cfg.boilerplate_fraction, groups=domain)
    return found, {"n": cfg.n, "against": files, "reference_prompts": len(ref), "train_prompts": len(train),
                   "contaminated_prompts": len(found)}


def pseudo_labels(records: list[dict], tasks: list, cfg: PseudoLabelConfig,
                  skip: frozenset | set = frozenset()) -> tuple[list[dict], dict]:
    """(task records labelled by majority vote, the report's ``pseudo_labels`` entry per domain).
    Votes are over every sample of a task (its verifier's answer rule, :data:`mlx_ssp.quality.ANSWER_RULES`);
    a label is written when at least ``min_votes`` samples and ``min_agreement`` of all agree. Tasks
    in ``skip`` (decontaminated), episodes and tasks whose verifier has no answer rule are not voted on."""
    by_task: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        if r.get("sample", 0) >= 0:  # gold episodes (sample -1) are not samples
            by_task[r["task_id"]].append(r)
    out: list[dict] = []
    stats: dict[str, dict] = {}
    for t in tasks:
        recs = sorted(by_task.get(t.id, []), key=lambda r: r["sample"])
        if not recs or t.id in skip or t.verifier not in ANSWER_RULES or any(r.get("kind") == "episode" for r in recs):
            continue
        st = stats.setdefault(t.domain, {"voted": 0, "written": 0, "below_threshold": 0, "agreement_sum": 0.0,
                                         "with_answer": 0, "vote_equals_answer": 0})
        v = vote_task([r["completion"] for r in recs], t.verifier, t.metadata)
        st["voted"] += 1
        st["agreement_sum"] += v.agreement
        has_answer = t.answer is not None and str(t.answer).strip() != ""
        if has_answer and v.answer is not None:
            st["with_answer"] += 1
            st["vote_equals_answer"] += bool(ANSWER_RULES[t.verifier].same(str(t.answer).strip(), v.answer))
        elif has_answer:
            st["with_answer"] += 1
        if has_answer and cfg.only_unlabelled:
            continue
        if v.answer is None or v.votes < cfg.min_votes or v.agreement < cfg.min_agreement - 1e-9:
            st["below_threshold"] += 1
            continue
        label = {"agreement": v.agreement, "votes": v.votes, "k": v.k, "n_distinct": v.n_distinct}
        if has_answer:
            label["replaced_answer"] = t.answer
        task = t.model_dump(mode="json")
        task["answer"] = v.answer
        task["metadata"] = {**task["metadata"], "pseudo_label": label}
        out.append(task)
        st["written"] += 1
    report = {}
    for dom, st in sorted(stats.items()):
        report[dom] = {"voted": st["voted"], "written": st["written"], "below_threshold": st["below_threshold"],
                       "mean_agreement": st["agreement_sum"] / st["voted"],
                       "with_answer": st["with_answer"],
                       "vote_accuracy": st["vote_equals_answer"] / st["with_answer"] if st["with_answer"] else None}
    return out, report


def safe_dirname(domain: str) -> str:
    name = re.sub(r"[^\w.\-]+", "_", domain).strip("._")
    return name or "domain"


#: the pseudo-labelled task file in OUT_DIR (``select.pseudo_label``)
PSEUDO_LABELS = "pseudo_labels.jsonl"


def run_select(rollouts: str | Path, cfg: SelectConfig, out_dir: str | Path, *, overwrite: bool = False,
               gold: Optional[list[dict]] = None, held_out: Optional[list[str | Path]] = None,
               tasks_path: Optional[str | Path] = None) -> dict:
    """Read rollouts, select, write OUT_DIR/<domain>/{train,valid}.jsonl + spectrum.json atomically.
    ``gold``: gold episode records (:func:`gold_records`) offered beside the sampled ones.
    ``held_out``: task files whose prompts training must not overlap (``select.decontaminate``).
    ``tasks_path``: the task file the rollouts came from (``select.pseudo_label``: the tasks labelled
    into OUT_DIR/pseudo_labels.jsonl)."""
    rollouts = Path(rollouts)
    records = read_jsonl(rollouts, what="rollouts")
    if not records:
        raise UserError(f"{rollouts}: no rollout records")
    need = ("task_id", "domain", "sample", "prompt", "completion", "reward")
    for i, r in enumerate(records, 1):
        miss = [k for k in need if k not in r]
        if miss:
            raise UserError(f"{rollouts}: record {i} lacks {', '.join(miss)} (not an mlx_ssp rollouts file?)")
    if all(r["reward"] is None for r in records) and cfg.pseudo_label is None:
        raise UserError(f"{rollouts}: no record has a reward (generated without verification?)")
    records, repeated = dedupe_records(records, rollouts)
    if cfg.gold and gold is None:
        raise UserError("select.gold needs the task file and the model's tokenizer (--tasks and --model)")
    records += gold or []
    meta = read_meta(sidecar(rollouts, "meta"))  # a corrupt meta file is one line, not a traceback
    system = meta.get("system") if meta else None
    contaminated, decon_report = None, None
    if cfg.decontaminate is not None:
        contaminated, decon_report = contamination(records, cfg.decontaminate, list(held_out or []))
    labelled, label_report = None, None
    if cfg.pseudo_label is not None:
        if tasks_path is None:
            raise UserError("select.pseudo_label needs the task file the rollouts came from (--tasks)")
        # tasks without an answer are what pseudo-labels are for: do not ask the verifiers for one
        labelled, label_report = pseudo_labels(records, load_tasks(tasks_path, check_verifiers=False),
                                               cfg.pseudo_label, skip=set(contaminated or ()))
    data, report = select(records, cfg, system=system, contaminated=contaminated)
    report["input"] = str(rollouts)
    report["repeated_records_dropped"] = repeated
    if decon_report is not None:
        report["decontamination"] = decon_report
    if label_report is not None:
        report["pseudo_labels"] = {"output": PSEUDO_LABELS, "written": len(labelled), "domains": label_report}
    names: dict[str, str] = {}
    with atomic_dir(out_dir, overwrite=overwrite) as tmp:
        for dom, parts in data.items():
            name = safe_dirname(dom)
            if name in names.values():
                name = f"{name}_{hashlib.blake2b(dom.encode(), digest_size=3).hexdigest()}"
            names[dom] = name
            if not parts["train"]:
                continue
            write_jsonl_atomic(tmp / name / "train.jsonl", parts["train"])
            write_jsonl_atomic(tmp / name / "valid.jsonl", parts["valid"])
        if labelled is not None:
            write_jsonl_atomic(tmp / PSEUDO_LABELS, labelled)
        for dom, row in report["domains"].items():
            row["dir"] = names[dom] if data[dom]["train"] else None
        write_json_atomic(tmp / "spectrum.json", report)
    trackers.log("", trackers.without(report, "config"), step=0)  # `mlx_ssp run`: select/domains/<domain>/n_train...
    return report


def format_report(report: dict) -> str:
    head = ["domain", "prompts", "no_correct", "distinct/prompt", "strategies/prompt", "selected/prompt", "mean_dist",
            "train", "valid"]
    # samples dropped per reason: only in reports made with a quality option (select.repetition ...)
    drops = any("dropped" in d for d in report["domains"].values())
    if drops:
        head += [*DROP_REASONS, "decontaminated"]
    rows = []
    for dom, d in report["domains"].items():
        md = d["mean_pairwise_distance"]
        rows.append([dom, str(d["n_prompts"]), str(d["prompts_no_correct"]), f"{d['mean_distinct_correct_per_prompt']:.2f}",
                     f"{d.get('mean_strategies_per_prompt', 0):.2f}", f"{d['mean_selected_per_prompt']:.2f}", "-" if md is None else f"{md:.3f}", str(d["n_train"]),
                     str(d["n_valid"]) + (" (=train)" if d["valid_is_train"] else "")])
        if drops:
            dr = d.get("dropped", {})
            rows[-1] += [str(dr.get(k, 0)) for k in DROP_REASONS]
            rows[-1].append(f"{dr.get('decontaminated', 0)} ({d.get('decontaminated_prompts', 0)} prompts)")
    w = [max(len(head[i]), *(len(r[i]) for r in rows)) if rows else len(head[i]) for i in range(len(head))]
    fmt = lambda cells: "  ".join(c.ljust(x) if i == 0 else c.rjust(x) for i, (c, x) in enumerate(zip(cells, w)))  # noqa: E731
    lines = [fmt(head), fmt(["-" * x for x in w]), *(fmt(r) for r in rows)]
    pl = report.get("pseudo_labels")
    if pl:
        for dom, st in pl["domains"].items():
            acc = "-" if st["vote_accuracy"] is None else f"{st['vote_accuracy']:.3f}"
            lines.append(f"pseudo-labels {dom}: {st['written']} written of {st['voted']} voted "
                         f"({st['below_threshold']} below threshold), mean agreement {st['mean_agreement']:.3f}, "
                         f"vote = answer on {acc} of {st['with_answer']} labelled")
        lines.append(f"pseudo-labels: {pl['written']} tasks -> {pl['output']}")
    return "\n".join(lines)
