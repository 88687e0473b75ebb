"""Index members that are not valid store keys: the page validator agrees with
``check_key`` on every input, and what fsck prints is escaped.  No Redis needed."""

from __future__ import annotations

import pytest

from fd_routing_replay.errors import InvalidRolloutId
from fd_routing_replay.keys import check_key
from fd_routing_replay.store.index.members import printable, split_members
from tests.store_conformance import BAD_KEYS, random_keys

ODD = ["a\nb:0:0", ".a:0:0", "a..b", "a/b", "a\\b", "a b", "\x1b[2J", "a\u200bb", "a\u202eb",
       "", "é" * 300, "x" * 512, "x" * 513, "数据_1:0:0", "a\x7f", "\n", "a\n", "\na",
       ".", "a.b:0:0", "a:.:0"]


def _reference(raws):
    keys, invalid = [], []
    for raw in raws:
        try:
            keys.append(check_key(raw.decode("utf-8")))
        except (UnicodeDecodeError, InvalidRolloutId):
            invalid.append(raw)
    return keys, invalid


def test_split_members_agrees_with_check_key(rng):
    pool = [k.encode() for k in random_keys(rng, 200)]
    pool += [k.encode("utf-8", "surrogatepass") for k in ODD + BAD_KEYS]
    pool += [b"\xff", b"ok:\xc3", b"\xed\xa0\x80:0:0"]  # not UTF-8, truncated, surrogate
    for _ in range(300):
        page = rng.sample(pool, rng.randint(1, 12))
        assert split_members(page) == _reference(page), page
    clean = [k.encode() for k in random_keys(rng, 50)]
    assert split_members(clean) == ([k.decode() for k in clean], [])
    assert split_members([k.decode() for k in clean]) == ([k.decode() for k in clean], [])
    assert split_members([]) == ([], [])


@pytest.mark.parametrize(("name", "shown"), [
    ("exp_1:0:0", "exp_1:0:0"),
    ("数据_1:0:0", "数据_1:0:0"),
    ("a\nb:0:0", "'a\\nb:0:0'"),
    ("../../evil:0:0", "'../../evil:0:0'"),
    ("\x1b[31mred", "'\\x1b[31mred'"),
    ("a\u202eb", "'a\\u202eb'"),
    (b"bad\xff", "b'bad\\xff'"),
    (b"ok_1:0:0", "ok_1:0:0"),
    ("x" * 600, "'" + "x" * 80 + "'... (600 chars)"),
])
def test_printable_escapes_what_is_not_a_valid_key(name, shown):
    assert printable(name) == shown
    assert printable(name).isprintable()
