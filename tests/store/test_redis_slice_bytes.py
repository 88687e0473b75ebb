"""A sliced read on Redis fetches the chunk holding the header and the chunks holding the
requested bytes — with the default ``store.redis.chunk_bytes`` a small share of a large
record, not all of it (issue #33: with 8 MiB chunks ``get_slice`` cost as much as ``get``).

Bytes are counted by the server (``INFO stats`` ``total_net_output_bytes``), so the check
does not depend on how the client asks."""

from __future__ import annotations

import numpy as np
import pytest

from fd_routing_replay.codec import RoutingRecord, encode_record
from fd_routing_replay.config.stores.redis import RedisStoreConfig
from fd_routing_replay.reader import RoutingReader
from fd_routing_replay.store import open_store

pytestmark = pytest.mark.redis

OVERHEAD = 16 * 1024  # protocol framing and the INFO reply itself


def _sent(server) -> int:
    return int(server.info("stats")["total_net_output_bytes"])


def _record(rng, layers: int, tokens: int, experts: int = 128):
    rid = f"slice_{rng.randrange(10**6)}:0:0"
    ids = np.random.default_rng(rng.randrange(2**32)).integers(
        0, experts, size=(layers, tokens, 8), dtype=np.uint8)
    return rid, RoutingRecord(rid, ids, experts)


def _chunks_touched(offsets: list[tuple[int, int]], chunk: int) -> int:
    return len({n for start, length in offsets
                for n in range(start // chunk, (start + length - 1) // chunk + 1)})


@pytest.mark.parametrize("layers,tokens", [(48, 16384), (60, 32768)])
def test_a_slice_fetches_its_chunks_not_the_record(redis_server, rng, layers, tokens):
    """Default chunk size: a trainer rank's share (a pipeline stage's layers, a context-
    parallel chunk of the tokens) costs the chunks it lies in plus the header's."""
    store = open_store({"type": "redis", "namespace": f"wire{layers}",
                        "redis": {"url": redis_server.url}}, instrument=False)
    chunk = RedisStoreConfig().chunk_bytes
    rid, record = _record(rng, layers, tokens)
    value = encode_record(record)
    store.put(rid, value)
    reader = RoutingReader(store)
    offset = len(value) - record.ids.nbytes
    row = tokens * 8
    stage = 8 * rng.randrange(layers // 8)
    for wanted, span in ((list(range(stage, stage + 8)), slice(0, tokens // 8)),
                         ([rng.randrange(layers)], slice(0, tokens))):
        before = _sent(redis_server)
        got = reader.get_slice(rid, layers=wanted, tokens=span)
        sent = _sent(redis_server) - before
        assert np.array_equal(got.ids, record.ids[wanted, span])
        ranges = [(0, 4096)] + [(offset + layer * row + span.start * 8,
                                 (span.stop - span.start) * 8) for layer in wanted]
        assert sent <= _chunks_touched(ranges, chunk) * chunk + OVERHEAD, (sent, chunk)
        assert sent < len(value) / 2
    store.close()


def test_the_default_chunk_keeps_puts_and_gets_of_big_records_whole(redis_server, rng):
    """Records span several default chunks and come back byte for byte, whole or sliced."""
    store = open_store({"type": "redis", "namespace": "wire_whole",
                        "redis": {"url": redis_server.url}}, instrument=False)
    rid, record = _record(rng, 52, 20000)
    value = encode_record(record)
    store.put(rid, value)
    fields = redis_server.command("HGET", store.pkey(rid), "n")
    assert int(fields) == -(-len(value) // RedisStoreConfig().chunk_bytes) > 1
    assert bytes(store.get(rid)) == value
    reader = RoutingReader(store)
    assert np.array_equal(reader.get(rid).ids, record.ids)
    got = reader.get_slice(rid, layers=[51], tokens=slice(19000, 20000))
    assert np.array_equal(got.ids, record.ids[[51], 19000:20000])
    store.close()
