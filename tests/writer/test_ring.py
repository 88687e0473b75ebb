"""The ring allocator against a model of its invariants, and the shared ring memory."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fd_routing_replay.writer.ring import ALIGNMENT, RingAllocator, RingMemory


def _check_invariants(ring: RingAllocator, live: list) -> None:
    spans = sorted((b.offset, b.end) for b in live)
    for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
        assert end <= start, f"overlapping blocks {spans}"
    for block in live:
        assert block.offset % ALIGNMENT == 0
        assert 0 <= block.offset and block.end <= ring.capacity
        assert block.size >= block.nbytes
    assert ring.used_bytes == sum(b.nbytes for b in live)


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(ALIGNMENT, 64 * ALIGNMENT),
       steps=st.lists(st.tuples(st.booleans(), st.integers(0, 40 * ALIGNMENT),
                                st.integers(0, 10_000)), max_size=120))
def test_random_alloc_and_free_never_overlap(capacity, steps):
    ring = RingAllocator(capacity)
    live = []
    for is_alloc, nbytes, pick in steps:
        if is_alloc or not live:
            block = ring.alloc(nbytes)
            if block is None:
                assert live or -(-max(nbytes, 1) // ALIGNMENT) * ALIGNMENT > ring.capacity
            else:
                live.append(block)
        else:
            ring.free(live.pop(pick % len(live)))
        _check_invariants(ring, live)
    for block in live:
        ring.free(block)
    assert ring.used_bytes == 0
    assert ring.alloc(ring.capacity) is not None  # an empty ring gives all of itself


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(1, 8 * ALIGNMENT), min_size=1, max_size=200))
def test_fifo_frees_never_fail_below_half_capacity(sizes):
    """With in-order frees, a request always fits while the ring is at most half full."""
    ring = RingAllocator(32 * ALIGNMENT)
    live = []
    for nbytes in sizes:
        size = -(-nbytes // ALIGNMENT) * ALIGNMENT
        while live and sum(b.size for b in live) + size > ring.capacity // 2:
            ring.free(live.pop(0))
        block = ring.alloc(nbytes)
        assert block is not None, (nbytes, [(b.offset, b.size) for b in live])
        live.append(block)
        _check_invariants(ring, live)


def test_exact_fill_and_wrap():
    ring = RingAllocator(4 * ALIGNMENT)
    blocks = [ring.alloc(ALIGNMENT) for _ in range(4)]
    assert [b.offset for b in blocks] == [0, 64, 128, 192]
    assert ring.alloc(1) is None
    ring.free(blocks[1])  # out of order: not reusable until block 0 is free
    assert ring.alloc(1) is None
    ring.free(blocks[0])
    wrapped = ring.alloc(2 * ALIGNMENT)
    assert wrapped.offset == 0
    assert ring.alloc(1) is None
    assert not ring.fits_ever(5 * ALIGNMENT) and ring.fits_ever(4 * ALIGNMENT)


def test_capacity_below_alignment_is_rejected():
    with pytest.raises(ValueError, match="at least"):
        RingAllocator(ALIGNMENT - 1)


def test_shared_ring_is_visible_through_a_second_mapping(np_rng):
    ring = RingMemory(1 << 20, shared=True)
    try:
        other = RingMemory.attach(os.dup(ring.fd), 1 << 20)
        data = np_rng.integers(0, 2**16, size=(3, 5, 7), dtype=np.uint16)
        ring.view(128, data.nbytes, data.dtype, data.shape)[...] = data
        assert np.array_equal(other.view(128, data.nbytes, data.dtype, data.shape), data)
        thread = ring.prefault_in_background()
        if thread is not None:
            thread.join(30)
        assert np.array_equal(other.view(128, data.nbytes, data.dtype, data.shape), data)
        other.close()
    finally:
        ring.close()
