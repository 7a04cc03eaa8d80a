"""The import graph of mlx_ssp, read from the source (imports made inside functions included, those
under ``if TYPE_CHECKING:`` not): no module takes part in an import cycle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import mlx_ssp

ROOT = Path(mlx_ssp.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def _resolve(name: str, mods: dict) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(module_level: bool = False) -> dict[str, set[str]]:
    """module -> the modules it imports (``module_level``: only the imports that run when it is
    imported, i.e. not those inside functions)."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                for n in ast.walk(node)}
        pkg = m if path.name == "__init__.py" else m.rpartition(".")[0]
        inner = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for n in ast.walk(f)} if module_level else set()
        for node in ast.walk(tree):
            if id(node) in skip or id(node) in inner:
                continue
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg
                    for _ in range(node.level - 1):
                        up = up.rpartition(".")[0]
                    base = f"{up}.{base}" if base else up
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                if t.startswith("mlx_ssp"):
                    r = _resolve(t, mods)
                    if r and r != m:
                        graph[m].add(r)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (iterative Tarjan)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_cycle_finder_finds_a_planted_cycle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(g) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_takes_part_in_an_import_cycle():
    graph = import_graph()
    assert "mlx_ssp.agents.bfcl.source" in graph and graph["mlx_ssp.agents.score"]  # the graph is real
    assert len(graph) > 150 and "mlx_ssp.rl.objectives" in graph["mlx_ssp.rl.loss"]
    assert cycles(graph) == []


def _ancestors(m: str) -> set[str]:
    parts = m.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def import_time_graph() -> dict[str, set[str]]:
    """What runs when a module is imported: its module-level imports and the packages Python runs
    first for each (a target's parent packages that are not the importer's own: those are already
    initialised, or initialising, when it runs). The verifier registry's imports by name are left out:
    they take no names from the module they load, so a module still initialising serves them."""
    graph = import_graph(module_level=True)
    out = {m: {t for t in ts if t not in _ancestors(m)} for m, ts in graph.items()}
    for m, ts in graph.items():
        for t in ts:
            out[m] |= {p for p in _ancestors(t) if p in graph and p not in _ancestors(m) and p != m}
    return out


def test_every_module_imports_on_its_own():
    """No cycle among the imports that run at import time (through package __init__s included): in
    such a cycle, the module imported first asks a module that is still initialising for a name it
    has not defined yet, and the import fails."""
    graph = import_time_graph()
    assert "mlx_ssp.tasks.file_sources" in graph["mlx_ssp.agents.bfcl.source"]  # the graph is real
    assert cycles(graph) == []


#: what ``mlx_ssp merge`` must not load before it merges: other stages, and the heavy libraries a merge
#: only needs for an option (distributed: trackers; the Hub client: an upload, an input's README.md)
NOT_FOR_A_MERGE = ("mlx_ssp.distributed", "mlx_ssp.stage_config", "mlx_ssp.testbed", "mlx_ssp.agents",
                   "mlx_ssp.verify", "mlx_ssp.tasks", "mlx_ssp.rollout", "mlx_ssp.sft", "mlx_ssp.rl", "mlx_lm",
                   "huggingface_hub.hf_api", "huggingface_hub.repocard", "huggingface_hub.file_download")


def test_the_merge_command_loads_only_what_a_merge_uses():
    code = ("import sys, mlx_ssp.cli, mlx_ssp.commands.merge; "
            "print(' '.join(m for m in sys.modules if m.startswith(('mlx_ssp', 'mlx_lm', 'huggingface_hub'))))")
    loaded = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                cwd=ROOT.parent).stdout.split())
    assert "mlx_ssp.merge.engine" in loaded and "mlx_ssp.card" in loaded  # the probe is real
    assert sorted(m for m in loaded if any(m == p or m.startswith(p + ".") for p in NOT_FOR_A_MERGE)) == []
