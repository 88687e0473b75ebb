"""Block allocation with prefix caching: sharing, reference counts, eviction."""

from __future__ import annotations

from fd_routing_replay.harness.kv import BlockManager


def test_prefix_match_shares_committed_blocks_and_leaves_one_token():
    bm = BlockManager(8, 4)
    tokens = list(range(1, 13))                       # 3 full blocks
    blocks = bm.allocate(3)
    bm.commit(blocks, tokens, 12)
    assert bm.match_prefix(tokens) == blocks[:2]      # never the whole sequence
    assert bm.match_prefix(tokens + [99]) == blocks
    assert bm.match_prefix([0] + tokens) == []
    assert bm.hit_tokens == 8 + 12


def test_freed_cached_blocks_are_evicted_last_and_forgotten():
    bm = BlockManager(3, 2)
    a = bm.allocate(2)
    bm.commit(a, [1, 2, 3, 4], 4)
    bm.free(a)
    assert bm.num_free == 3
    c = bm.allocate(2)                                # the never-cached block first, then LRU
    assert a[0] in c and bm.evictions == 1
    assert bm.match_prefix([1, 2, 3, 4, 5]) == []      # chain broken at block 0


def test_refcounts_and_reset():
    bm = BlockManager(4, 2)
    a = bm.allocate(2)
    bm.commit(a, [1, 2, 3, 4], 4)
    shared = bm.match_prefix([1, 2, 3, 4, 9])
    bm.free(a)
    assert bm.num_free == 2                           # still referenced by the match
    bm.free(shared)
    bm.reset_prefix_cache()
    assert bm.num_free == 4 and bm.match_prefix([1, 2, 3, 4, 9]) == []
    assert bm.allocate(5) is None
