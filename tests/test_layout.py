"""The README's "Layout" block names every module and package of the tree (it is the map users read),
and the code stays within its size limits."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def layout_block() -> str:
    text = (ROOT / "README.md").read_text()
    block = text[text.index("## Layout"):]
    block = block[block.index("```") + 3:]
    return block[: block.index("```")]


def test_readme_layout_names_every_module_and_package():
    block = layout_block()
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", block))
    pkg = ROOT / "mlx_ssp"
    missing = []
    for path in sorted(pkg.rglob("*.py")):
        if path.stem in ("__init__", "__main__"):
            continue
        top = path.parent == pkg
        if (path.name not in block) if top else (path.stem not in words):
            missing.append(str(path.relative_to(ROOT)))
    for init in sorted(pkg.rglob("__init__.py")):
        d = init.parent
        if d != pkg and f"{d.name}/" not in block:
            missing.append(f"{d.relative_to(ROOT)}/")
    assert not missing, f"README's Layout block does not name: {missing}"


def test_no_file_over_500_lines_and_no_function_over_80():
    """Small modules with one job: the size limits the code is kept to (package, scripts and tests)."""
    too_long = []
    for root in ("mlx_ssp", "scripts", "tests"):
        for path in sorted((ROOT / root).rglob("*.py")):
            src = path.read_text()
            rel = path.relative_to(ROOT)
            if src.count("\n") > 500:
                too_long.append(f"{rel}: {src.count(chr(10))} lines")
            for node in ast.walk(ast.parse(src)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = node.end_lineno - node.lineno + 1
                    if n > 80:
                        too_long.append(f"{rel}::{node.name}: {n} lines")
    assert not too_long, too_long
