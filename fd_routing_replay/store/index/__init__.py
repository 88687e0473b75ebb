"""The Redis prefix-bucket index that lists the keys of every indexed store (redis,
p2pstore, mooncake): boundary-safe prefix lookups and deletes in ``O(log N + matched)``,
sharded into buckets a Redis Cluster spreads over its nodes, and ``fd-rr fsck``'s check
that index and payloads agree.  Design and costs: docs/design-index.md.
"""

from __future__ import annotations

from fd_routing_replay.store.index.buckets import MAX_BUCKETS, bucket_of, rollout_base
from fd_routing_replay.store.index.layout import BucketLayout, Layout
from fd_routing_replay.store.index.members import printable, split_members
from fd_routing_replay.store.index.prefix_index import (
    DEFAULT_BATCH,
    DEFAULT_WRITE_BATCH,
    MAX_ROUNDS,
    PageRemover,
    PayloadDeleter,
    PrefixIndex,
)
from fd_routing_replay.store.index.ranges import prefix_ranges

__all__ = ["DEFAULT_BATCH", "DEFAULT_WRITE_BATCH", "MAX_BUCKETS", "MAX_ROUNDS", "BucketLayout",
           "Layout", "PageRemover", "PayloadDeleter", "PrefixIndex", "bucket_of", "prefix_ranges",
           "printable", "rollout_base", "split_members"]
