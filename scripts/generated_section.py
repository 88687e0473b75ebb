"""Keep a generated section of a hand-written doc current: the text between a BEGIN and an
END marker is produced by code, the prose around it is left untouched.  Shared by the
scripts that regenerate docs/config.md and docs/architecture.md."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def split_doc(text: str, begin: str, end: str, doc: Path) -> tuple[str, str, str]:
    """Return (before, generated section, after); ValueError without both markers."""
    head, sep, rest = text.partition(begin + "\n")
    section, sep2, tail = rest.partition(end)
    if not sep or not sep2:
        raise ValueError(f"{doc} lacks the markers {begin!r} ... {end!r}")
    return head + sep, section, sep2 + tail


def run(doc: Path, begin: str, end: str, render: Callable[[], str], script: str,
        description: str, argv: list[str] | None = None) -> int:
    """Rewrite ``doc``'s section with ``render()``; with ``--check`` only say whether it is
    current (exit 1 when stale)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--check", action="store_true", help="only verify; exit 1 if stale")
    args = parser.parse_args(argv)
    before, section, after = split_doc(doc.read_text(encoding="utf-8"), begin, end, doc)
    fresh = render()
    name = doc.relative_to(REPO)
    if section == fresh:
        print(f"{name} is up to date")
        return 0
    if args.check:
        print(f"{name} is stale: run {script}")
        return 1
    doc.write_text(before + fresh + after, encoding="utf-8")
    print(f"rewrote {name}")
    return 0
