"""Block allocation with prefix caching: sharing, reference counts, eviction."""

from __future__ import annotations

from fdrr_dev.harness.kv import BlockManager


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


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, gpu_blocks, cpu_blocks, direction):
        self.calls.append((direction, list(gpu_blocks), list(cpu_blocks)))


def test_cpu_tier_swaps_evicted_blocks_out_and_back_into_other_blocks():
    bm = BlockManager(3, 2, num_cpu_blocks=2)
    bm.swapper = swaps = Recorder()
    a = bm.allocate(2)
    bm.commit(a, [1, 2, 3, 4], 4)
    bm.free(a)
    b = bm.allocate(3)                                # the free block, then both cached ones
    assert swaps.calls == [("to_cpu", [a[0]], [0]), ("to_cpu", [a[1]], [1])]
    assert bm.swapped_out == 2 and bm.match_prefix([1, 2, 3, 4, 5]) == []   # no GPU room
    bm.free(b[:2])                                    # two uncached blocks back
    matched = bm.match_prefix([1, 2, 3, 4, 5])
    assert len(matched) == 2 and bm.swapped_in == 2 and bm.cpu_hit_tokens == 4
    assert [call[0] for call in swaps.calls[2:]] == ["to_gpu", "to_gpu"]
    assert [call[2] for call in swaps.calls[2:]] == [[0], [1]]
    assert [call[1][0] for call in swaps.calls[2:]] == matched
    assert bm.match_prefix([1, 2, 3, 4, 5]) == matched   # now cached on the GPU again
    bm.free(matched + matched)
    bm.reset_prefix_cache()
    assert bm.match_prefix([1, 2, 3, 4, 5]) == [] and bm.swapped_in == 2


def test_cpu_tier_keeps_the_newest_and_never_evicts_a_block_being_swapped_in():
    bm = BlockManager(2, 2, num_cpu_blocks=1)
    bm.swapper = swaps = Recorder()
    for tokens in ([1, 2], [3, 4], [5, 6]):           # each cached, then pushed out of the GPU
        block = bm.allocate(2)
        bm.commit(block[:1], tokens, 2)
        bm.free(block)
    assert bm.match_prefix([1, 2, 9]) == []           # the CPU block went to a newer one
    held = bm.allocate(1)                             # the GPU: one free block left, [5, 6]
    matched = bm.match_prefix([3, 4, 9])              # needs [5, 6]'s GPU block, while the only
    assert len(matched) == 1                          # CPU block is the one swapped in
    assert swaps.calls[-1] == ("to_gpu", matched, [0])
    bm.free(held + matched)
    assert bm.match_prefix([5, 6, 9]) == []           # dropped: no CPU block to take it
