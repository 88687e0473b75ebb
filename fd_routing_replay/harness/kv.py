"""Paged KV block allocation with prefix caching, as an engine scheduler does it.

Blocks hold ``block_size`` consecutive positions of one sequence.  A block whose
positions have all been through the forward pass is *committed*: it gets a hash chained
over the tokens of every block before it, and a later sequence with the same prefix
reuses it instead of recomputing (prefix-cache hit).  Freed committed blocks stay
reusable until memory pressure evicts them (least recently freed first).

Why the harness needs this: a prefix-cache hit means the routing of those positions is
*not* computed in this request's forward pass; capture must fetch it from the host cache
by KV slot.  Shared and evicted blocks are exactly where such a lookup can go wrong.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Sequence

import numpy as np

_ROOT = b"fd-rr-harness-root"


def _chain_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return digest.digest()


class BlockManager:
    """Allocates KV blocks, reference-counts shared ones, and caches full prefixes."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be positive")
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
                del self._hash_to_block[self._block_hash.pop(block)]
                self.evictions += 1
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
            if block is None:
                break
            matched.append(block)
            parent = digest
        for block in matched:
            if self._refcount[block] == 0:
                self._evictable.pop(block, None)
            self._refcount[block] += 1
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
