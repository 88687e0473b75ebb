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

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from generated_section import run  # noqa: E402

from fd_routing_replay.config import render_config_doc  # noqa: E402

BEGIN = "<!-- BEGIN GENERATED: config keys (scripts/gen_config_doc.py) -->"
END = "<!-- END GENERATED: config keys -->"
DOC = REPO / "docs" / "config.md"


def main(argv: list[str] | None = None) -> int:
    return run(DOC, BEGIN, END, render_config_doc, "scripts/gen_config_doc.py",
               __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    sys.exit(main())
