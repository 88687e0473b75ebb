"""Paged KV block allocation with prefix caching, as an engine scheduler does it.

Blocks hold ``block_size`` consecutive positions of one sequence.  A block whose
positions have all been through the forward pass is *committed*: it gets a hash chained
over the tokens of every block before it, and a later sequence with the same prefix
reuses it instead of recomputing (prefix-cache hit).  Freed committed blocks stay
reusable until memory pressure evicts them (least recently freed first).

Why the harness needs this: a prefix-cache hit means the routing of those positions is
*not* computed in this request's forward pass; capture must fetch it from the host cache
by KV slot.  Shared and evicted blocks are exactly where such a lookup can go wrong.

With ``num_cpu_blocks`` the cache has a CPU tier, as FastDeploy's hierarchical prefix
cache does: a cached block evicted from the GPU is swapped out to a CPU block instead of
forgotten (``free_block_ids_async`` → ``_handle_free_gpu_node_with_cpu``,
cache_manager/prefix_cache_manager.py:1670-1750, :1601-1619), and a later prefix hit on it
allocates a (usually different) GPU block and swaps it back in (``_prepare_cache`` →
``_prepare_cpu_cache``, prefix_cache_manager.py:644-675).  ``swapper(gpu_blocks,
cpu_blocks, direction)`` moves the data ("to_cpu" / "to_gpu"), as FastDeploy's
``CacheTransferManager._transfer_data`` does (:mod:`fdrr_dev.harness.cpu_cache`).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

import numpy as np

_ROOT = b"fd-rr-harness-root"


def _chain_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return digest.digest()


class BlockManager:
    """Allocates KV blocks, reference-counts shared ones, and caches full prefixes."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 num_cpu_blocks: int = 0) -> None:
        if num_blocks <= 0 or block_size <= 0 or num_cpu_blocks < 0:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be positive, "
                             f"num_cpu_blocks={num_cpu_blocks} not negative")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: deque[int] = deque(range(num_blocks))
        self._refcount = np.zeros(num_blocks, dtype=np.int64)
        self._hash_to_block: dict[bytes, int] = {}
        self._block_hash: dict[int, bytes] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()   # committed, refcount 0
        self.hit_tokens = 0
        self.evictions = 0
        # CPU tier: cached blocks swapped out of the GPU, by hash, least recently swapped first
        self.num_cpu_blocks = num_cpu_blocks
        self._cpu_free: deque[int] = deque(range(num_cpu_blocks))
        self._cpu_hash_to_block: OrderedDict[bytes, int] = OrderedDict()
        self.swapper: Callable[[list[int], list[int], str], None] | None = None
        self.swapped_out = 0
        self.swapped_in = 0
        self.cpu_hit_tokens = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free plus evictable cached ones)."""
        return len(self._free) + len(self._evictable)

    def blocks_needed(self, num_positions: int) -> int:
        return -(-num_positions // self.block_size)

    # ------------------------------------------------------------------ allocation
    def allocate(self, count: int) -> list[int] | None:
        """``count`` fresh blocks, or None (nothing taken) when memory is short."""
        if count > self.num_free:
            return None
        blocks = []
        for _ in range(count):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                digest = self._block_hash.pop(block)
                del self._hash_to_block[digest]
                self.evictions += 1
                self._swap_out(block, digest)
            self._refcount[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; unreferenced committed blocks stay cached."""
        for block in blocks:
            self._refcount[block] -= 1
            if self._refcount[block] < 0:
                raise RuntimeError(f"block {block} freed more often than allocated")
            if self._refcount[block] == 0:
                if block in self._block_hash:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def _swap_out(self, block: int, digest: bytes) -> None:
        """An evicted cached block goes to the CPU tier (the oldest CPU block makes room)."""
        if not self.num_cpu_blocks:
            return
        if digest in self._cpu_hash_to_block:    # recomputed while a CPU copy was kept
            self._cpu_hash_to_block.move_to_end(digest)
            return
        if self._cpu_free:
            cpu_block = self._cpu_free.popleft()
        elif self._cpu_hash_to_block:
            _, cpu_block = self._cpu_hash_to_block.popitem(last=False)
        else:
            return                       # every CPU block is being swapped in right now
        self._transfer([block], [cpu_block], "to_cpu")
        self._cpu_hash_to_block[digest] = cpu_block
        self.swapped_out += 1

    def _swap_in(self, digest: bytes) -> int | None:
        """A GPU block holding the CPU-cached block ``digest`` (one reference), or None."""
        cpu_block = self._cpu_hash_to_block.pop(digest)    # out of reach of _swap_out's LRU
        allocated = self.allocate(1)
        if allocated is None:
            self._cpu_hash_to_block[digest] = cpu_block
            return None
        block, = allocated
        self._transfer([block], [cpu_block], "to_gpu")
        self._cpu_free.append(cpu_block)
        self._hash_to_block[digest] = block
        self._block_hash[block] = digest
        self.swapped_in += 1
        return block

    def _transfer(self, gpu_blocks: list[int], cpu_blocks: list[int], direction: str) -> None:
        if self.swapper is not None:
            self.swapper(gpu_blocks, cpu_blocks, direction)

    # ------------------------------------------------------------------ prefix cache
    def match_prefix(self, tokens: Sequence[int]) -> list[int]:
        """Take a reference on the longest cached chain of full blocks of ``tokens``.

        At least one position is always left to compute (the last block is dropped
        from a full match), because the forward pass must produce the next token.
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        max_blocks = (len(tokens) - 1) // bs
        matched: list[int] = []
        parent = _ROOT
        for index in range(max_blocks):
            digest = _chain_hash(parent, tokens[index * bs:(index + 1) * bs])
            block = self._hash_to_block.get(digest)
            if block is not None:             # on the GPU: take the reference now, so that
                if self._refcount[block] == 0:    # a swap-in below cannot evict it
                    self._evictable.pop(block, None)
                self._refcount[block] += 1
            elif digest in self._cpu_hash_to_block:
                block = self._swap_in(digest)
                if block is None:
                    break
                self.cpu_hit_tokens += bs
            else:
                break
            matched.append(block)
            parent = digest
        self.hit_tokens += len(matched) * bs
        return matched

    def commit(self, blocks: Sequence[int], tokens: Sequence[int], num_computed: int) -> None:
        """Register every block whose positions are all computed as a cacheable prefix."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        parent = _ROOT
        for index in range(min(num_computed // bs, len(blocks))):
            block = blocks[index]
            known = self._block_hash.get(block)
            if known is not None:
                parent = known
                continue
            digest = _chain_hash(parent, tokens[index * bs:(index + 1) * bs])
            if digest not in self._hash_to_block:
                self._hash_to_block[digest] = block
                self._block_hash[block] = digest
            parent = digest

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (after a weight update the cached KV is stale)."""
        for block in list(self._evictable):
            self._free.append(block)
        self._evictable.clear()
        self._hash_to_block.clear()
        self._block_hash.clear()
        self._cpu_free.extend(self._cpu_hash_to_block.values())
        self._cpu_hash_to_block.clear()
