"""The README's "Layout" block names every module and package of the tree (it is the map users read)."""

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
