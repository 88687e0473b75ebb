#!/usr/bin/env python3
"""Regenerate the key table in docs/config.md from the config dataclass tree.

The table between the BEGIN/END GENERATED markers is produced by
``fd_routing_replay.config.render_config_doc()``; the prose around it is hand-written
and left untouched.  ``--check`` exits non-zero when the committed table is stale
(tests/test_config.py runs the same comparison).

    .venv/bin/python scripts/gen_config_doc.py          # rewrite docs/config.md
    .venv/bin/python scripts/gen_config_doc.py --check  # verify only
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from fd_routing_replay.config import render_config_doc  # noqa: E402

BEGIN = "<!-- BEGIN GENERATED: config keys (scripts/gen_config_doc.py) -->"
END = "<!-- END GENERATED: config keys -->"
DOC = REPO / "docs" / "config.md"


def split_doc(text: str) -> tuple[str, str, str]:
    """Return (before, generated table, after) of docs/config.md; ValueError without markers."""
    head, sep, rest = text.partition(BEGIN + "\n")
    table, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise ValueError(f"{DOC} lacks the markers {BEGIN!r} ... {END!r}")
    return head + sep, table, sep2 + tail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only verify; exit 1 if stale")
    args = parser.parse_args(argv)
    before, table, after = split_doc(DOC.read_text(encoding="utf-8"))
    fresh = render_config_doc()
    if table == fresh:
        print(f"{DOC.relative_to(REPO)} is up to date")
        return 0
    if args.check:
        print(f"{DOC.relative_to(REPO)} is stale: run {Path(__file__).relative_to(REPO)}")
        return 1
    DOC.write_text(before + fresh + after, encoding="utf-8")
    print(f"rewrote the key table in {DOC.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
