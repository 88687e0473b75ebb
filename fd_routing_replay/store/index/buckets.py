"""Which bucket of the prefix index holds a key, and the names of the buckets.

A namespace's index is ``B`` sorted sets (*buckets*).  A key's bucket is a CRC32 of its
rollout base (:func:`rollout_base`: the key without ``:turn:segment`` and ``_layer``), so
every turn, segment and layer of a rollout shares a bucket.  With ``B > 1`` bucket ``i`` is
named by the Redis Cluster hash tag ``{ns#i.salt}``, the salt chosen so the buckets' slots
spread evenly over a cluster (:func:`spread_tags`).  Pure functions: nothing here talks to
Redis (:mod:`.layout` records which count a namespace uses).
"""

from __future__ import annotations

import functools
import itertools
import re
import zlib

__all__ = ["CLUSTER_SLOTS", "MAX_BUCKETS", "bucket_of", "rollout_base", "spread_tags"]

MAX_BUCKETS = 256
"""Upper bound of ``store.redis.index_buckets`` (a prefix read costs one command per bucket)."""

CLUSTER_SLOTS = 16384

_BASE_RE = re.compile(r"(.+):(?:0|[1-9][0-9]*):(?:0|[1-9][0-9]*)(?:_[0-9]+)?", re.DOTALL)


def rollout_base(key: str) -> str:
    """The rollout base of a store key (``{base}:{turn}:{segment}`` with an optional
    ``_{layer}``), or the key itself when it has no such shape."""
    match = _BASE_RE.fullmatch(key)
    return match.group(1) if match else key


def bucket_of(key: str, buckets: int) -> int:
    """The bucket (0 .. buckets-1) holding ``key``: CRC32 of its rollout base."""
    if buckets == 1:
        return 0
    return zlib.crc32(rollout_base(key).encode("utf-8", "surrogatepass")) % buckets


@functools.lru_cache(maxsize=256)
def spread_tags(namespace: str, buckets: int) -> tuple[str, ...]:
    """Hash tags ``{ns}#{i}.{salt}`` for buckets 0 .. buckets-1: bucket i takes the first salt
    whose cluster slot lies in the i-th of ``buckets`` equal slot ranges, so the buckets
    spread over a cluster's nodes as evenly as its slot assignment allows (a cluster
    created with ``redis-cli --cluster create`` gives each master one contiguous range).
    Deterministic: every process computes the same names."""
    from redis.crc import key_slot

    tags = []
    for number in range(buckets):
        for salt in itertools.count():
            tag = f"{namespace}#{number}.{salt}"
            if key_slot(tag.encode()) * buckets // CLUSTER_SLOTS == number:
                tags.append(tag)
                break
    return tuple(tags)
