"""Members of the prefix index as Redis returns them: raw bytes, which may or may not be
valid store keys (written by something else, or by hand), and the paging every bounded
index command uses.

Every other module of the index reads members through these helpers, so one rule decides
what the index returns (:func:`split_members`), how a foreign member is printed
(:func:`printable`) and how work is cut into pages (:func:`pages`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from fd_routing_replay.errors import InvalidRolloutId
from fd_routing_replay.keys import MAX_KEY_BYTES, check_key

__all__ = ["pages", "printable", "raw_member", "split_members", "warn_invalid_members"]

log = logging.getLogger("fd_routing_replay.store.index")

# Anything a valid key never holds, in a page joined with "\n" (ASCII fast path).
_PAGE_SUSPECT_RE = re.compile(r"[\x00-\x09\x0b-\x20\x7f/\\]|\.\.|^\.|\n\.")
_SHOW_MEMBER = 80


def raw_member(member: bytes | str) -> bytes:
    """``member`` as the bytes Redis holds (a ``str`` reply, with ``decode_responses``,
    encoded back losslessly)."""
    return member if isinstance(member, bytes) else member.encode("utf-8", "surrogatepass")


def pages(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    """``items`` in lists of at most ``size`` (a lone ``str``/``bytes`` is one item)."""
    if isinstance(items, str | bytes):
        items = [items]
    page: list[Any] = []
    for item in items:
        page.append(item)
        if len(page) == size:
            yield page
            page = []
    if page:
        yield page


def split_members(members: Sequence[bytes | str]) -> tuple[list[str], list[bytes]]:
    """Split raw index members into ``(valid store keys, raw members that are not)``.

    Valid means UTF-8 and accepted by :func:`~fd_routing_replay.keys.check_key`.  A page of
    plain ASCII keys is checked with one join and one regex; anything else key by key.
    """
    raws = [raw_member(m) for m in members]
    if raws and 0 < min(map(len, raws)) and max(map(len, raws)) <= MAX_KEY_BYTES:
        joined = b"\n".join(raws)
        if joined.isascii():
            text = joined.decode("ascii")
            keys = text.split("\n")  # more parts than members: a member holds "\n"
            if len(keys) == len(raws) and _PAGE_SUSPECT_RE.search(text) is None:
                return keys, []
    keys: list[str] = []
    invalid: list[bytes] = []
    for raw in raws:
        try:
            keys.append(check_key(raw.decode("utf-8")))
        except (UnicodeDecodeError, InvalidRolloutId):
            invalid.append(raw)
    return keys, invalid


def printable(name: bytes | str) -> str:
    """``name`` safe to print on one line: a valid key as it is, anything else quoted with
    every control, format and non-UTF-8 byte escaped (``'a\\nb'``, ``b'\\xff'``), and
    shortened when huge."""
    if isinstance(name, str):
        text = name
    else:
        try:
            text = name.decode("utf-8")
        except UnicodeDecodeError:
            shown = repr(name[:_SHOW_MEMBER])
            return shown if len(name) <= _SHOW_MEMBER else f"{shown}... ({len(name)} bytes)"
    try:
        return check_key(text)
    except InvalidRolloutId:
        pass
    shown = repr(text[:_SHOW_MEMBER])
    return shown if len(text) <= _SHOW_MEMBER else f"{shown}... ({len(text)} chars)"


def warn_invalid_members(index_key: str, invalid: list[bytes]) -> None:
    """Log that a read skipped ``invalid`` members of the index ``index_key``."""
    log.warning("%s: skipped %d member(s) that are not valid store keys, e.g. %s; "
                "`fd-rr fsck` lists them and `fd-rr fsck --repair` drops them",
                index_key, len(invalid), printable(invalid[0]))
