"""The writer's unrouted-token count (writer/record.py ``count_unrouted``): the C library's
pass (custom_ops/unrouted.cc) against a NumPy oracle on seeded random records of every
routing dtype and row width, and the error where the C library is absent."""

from __future__ import annotations

import os

import numpy as np
import pytest

from fd_routing_replay.core import native
from fd_routing_replay.writer import record
from fd_routing_replay.writer.record import count_unrouted


def oracle(ids: np.ndarray, fill: int) -> int:
    """Tokens with ``fill`` in some layer, by a loop over tokens."""
    return sum(bool((ids[:, t] == fill).any()) for t in range(ids.shape[1]))


def test_the_c_library_counts(seed: int) -> None:
    if os.environ.get("FD_RR_OPS") != "compiled":
        pytest.skip("runs under FD_RR_OPS=compiled (make test)")
    assert native.c_library().handle is not None


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32])
def test_count_matches_the_oracle(seed: int, dtype) -> None:
    """Rows of whole 64-bit words (1, 2, 4 words) and odd widths; the dtype's maximum and a
    lower fill; lost rows in one layer only, in every layer, at the edges."""
    rng = np.random.default_rng(seed)
    top = int(np.iinfo(dtype).max)
    for layers, tokens, top_k in ((1, 1, 1), (3, 50, 4), (7, 333, 8), (2, 64, 16), (5, 97, 3), (4, 40, 32),
                                  (2, 0, 2), (0, 5, 8)):
        for fill in (top, int(rng.integers(300, 65536)) if dtype != np.uint8 else 200):
            ids = rng.integers(0, 150, (layers, tokens, top_k)).astype(dtype)
            if tokens and layers:
                for _ in range(int(rng.integers(0, tokens))):
                    ids[rng.integers(layers), rng.integers(tokens), rng.integers(top_k)] = fill
                ids[:, -1, 0] = fill                                    # the last token, every layer
                ids[-1, 0, -1] = fill                                   # the first, in one layer
            assert count_unrouted(ids, fill) == oracle(ids, fill), (layers, tokens, top_k, fill)
            flipped = ids[:, ::-1]                                      # a view: made contiguous
            assert count_unrouted(flipped, fill) == oracle(np.ascontiguousarray(flipped), fill)


def test_a_fill_lane_only_counts_where_it_is_whole(seed: int) -> None:
    """uint16 fill 0x00FF: bytes 0xFF next to other bytes must not read as a fill lane."""
    rng = np.random.default_rng(seed)
    ids = np.full((3, 40, 8), 0xFF00, np.uint16)       # high byte 0xFF everywhere, no fill
    ids[1, rng.integers(40)] = 0x01FF                   # low byte 0xFF, still no fill
    assert count_unrouted(ids, 0x00FF) == 0
    ids[2, 7, 3] = 0x00FF
    assert count_unrouted(ids, 0x00FF) == 1


def test_without_the_c_library_the_count_names_why(seed: int, monkeypatch) -> None:
    from fd_routing_replay.errors import OpsError

    ids = np.random.default_rng(seed).integers(0, 250, (4, 100, 8)).astype(np.uint8)
    monkeypatch.setattr(record, "c_library", lambda: native.CLibrary(None, "absent for the test"))
    with pytest.raises(OpsError, match="needs the compiled C library: absent for the test"):
        count_unrouted(ids, 255)
