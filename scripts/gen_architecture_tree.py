#!/usr/bin/env python3
"""Regenerate the package tree in docs/architecture.md from the modules' own docstrings.

The tree between the BEGIN/END GENERATED markers lists every module of the package, grouped
by floor, each with the first sentence of its docstring, so the map cannot go stale the way
hand-kept module lists in ``__init__`` docstrings did.  ``--check`` exits non-zero when the
committed tree is stale (tests/test_layering.py runs the same comparison).

    .venv/bin/python scripts/gen_architecture_tree.py          # rewrite docs/architecture.md
    .venv/bin/python scripts/gen_architecture_tree.py --check  # verify only
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from generated_section import run  # noqa: E402

PACKAGE = REPO / "fd_routing_replay"
DOC = REPO / "docs" / "architecture.md"
BEGIN = "<!-- BEGIN GENERATED: package tree (scripts/gen_architecture_tree.py) -->"
END = "<!-- END GENERATED: package tree -->"
SUMMARY_CHARS = 96


def summary(path: Path) -> str:
    """The first sentence of a module's docstring, on one line."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    text = " ".join(doc.split("\n\n", 1)[0].split())
    text = text.split(". ", 1)[0].rstrip(".")
    return text if len(text) <= SUMMARY_CHARS else text[:SUMMARY_CHARS - 1].rstrip() + "…"


def render_tree() -> str:
    """One line per module and package, indented by depth: ``path — summary``."""
    lines = ["```"]
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] in ("_ops", "_csrc"):
            continue
        if path.name == "__init__.py":  # a package: its folder, at its own depth
            folder = relative.parent
            name = (folder.name or PACKAGE.name) + "/"
            depth = len(folder.parts)
        else:
            name, depth = path.name, len(relative.parts)
        lines.append(f"{'  ' * depth}{name:<{max(1, 30 - 2 * depth)}} {summary(path)}".rstrip())
    lines.append("```")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    return run(DOC, BEGIN, END, render_tree, "scripts/gen_architecture_tree.py",
               __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    sys.exit(main())
