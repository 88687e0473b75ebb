"""Deleting big records frees their memory in Redis's main thread (a record HASH of fewer
than 64 fields is below UNLINK's lazy-free threshold), about a millisecond per 16 MB on the
development machine: one transaction that UNLINKs a whole page of big records stalls every
other client for all of it (issue #33's soak: a training step's delete held Redis for
100 ms and more).  Deletes are therefore cut into transactions of at most
``delete_bytes`` of records (or one record), so other clients' commands run in between.

SLOWLOG (threshold 0) shows every command Redis ran, with its arguments."""

from __future__ import annotations

import re

import pytest

from fd_routing_replay.store import open_store

pytestmark = pytest.mark.redis


def _unlinks(client) -> list[int]:
    """Keys per UNLINK of the deletes since the last reset (SLOWLOG keeps 32 arguments and
    says how many more there were)."""
    out = []
    for entry in client.slowlog_get(10000):
        command = entry["command"]
        if not command.upper().startswith(b"UNLINK "):
            continue
        more = re.search(rb"\.\.\. \((\d+) more arguments\)$", command)
        if more:
            out.append(31 - 1 + int(more.group(1)))
        else:
            out.append(len(command.split(b" ")) - 1)
    return out


@pytest.mark.parametrize("cluster", [False, True])
def test_big_records_are_deleted_a_few_at_a_time(redis_server, redis_cluster, rng, cluster):
    server = redis_cluster if cluster else redis_server
    url = server.url
    store = open_store({"type": "redis", "namespace": f"big{int(cluster)}",
                        "redis": {"url": url, "cluster": cluster}}, instrument=False)
    backend = store
    sizes = {f"big_{n}:0:0": (3 << 20) if n % 3 else 100 for n in range(24)}
    for key, size in sizes.items():
        store.put(key, rng.randbytes(size))
    nodes = server.nodes if cluster else [server]
    clients = [node.client() for node in nodes]
    for client in clients:
        client.config_set("slowlog-log-slower-than", 0)
        client.slowlog_reset()
    assert store.delete_prefix(["big"]) == {"big": 24}
    unlinked = [count for client in clients for count in _unlinks(client)]
    budget = backend.delete_bytes
    assert budget <= 32 << 20
    per_unlink = max(1, budget // (3 << 20))  # big records; small ones ride along
    assert unlinked and max(unlinked) <= per_unlink + 8, unlinked
    assert sum(unlinked) >= 24
    assert store.list("big") == []
    for client in clients:
        client.config_set("slowlog-log-slower-than", 10000)
        client.close()
    store.close()


def test_small_records_are_still_deleted_a_page_at_a_time(redis_server, rng):
    """Records of a few bytes: one transaction per page, as before (no extra round trips
    beyond the size probe)."""
    store = open_store({"type": "redis", "namespace": "small",
                        "redis": {"url": redis_server.url}}, instrument=False)
    for n in range(300):
        store.put(f"small_{n}:0:0", b"x" * 64)
    client = redis_server.client()
    client.config_set("slowlog-log-slower-than", 0)
    client.slowlog_reset()
    assert store.delete_prefix(["small"]) == {"small": 300}
    assert _unlinks(client) == [300]
    client.config_set("slowlog-log-slower-than", 10000)
    client.close()
    store.close()
