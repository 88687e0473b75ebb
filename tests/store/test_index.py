"""The prefix-bucket index against real Redis (one server and a 3-master cluster),
checked against an independent reference: ``sorted`` + ``prefix_matches`` on Python lists."""

from __future__ import annotations

import pytest

from fd_routing_replay.errors import InvalidRolloutId
from fd_routing_replay.keys import SEPARATORS, prefix_matches
from fd_routing_replay.store.index.prefix_index import PrefixIndex
from fd_routing_replay.store.index.ranges import prefix_ranges
from tests.store_conformance import random_keys

pytestmark = pytest.mark.redis

EDGE_KEYS = ["x:1", "x:1:0:0", "x:1:1:0", "x:1_3", "x:1_3:0", "x:10:0:0", "x:100:0:0",
             "x:1a:0", "x:1;:0", "x:1`:0", "x:1~:0", "x:0:9", "x:2:0:0", "x_1:0:0", "x",
             "y:1:0:0", "数据_7:0:0", "ünï_cødé:3:1", "x:1:é", "x:1_数"]
EDGE_PREFIXES = ["x:1", "x:1:", "x:1_", "x:10", "x", "x:", "x_", "x:1:0", "x:1_3", "数据",
                 "ünï_", "y", "z", "x:1:0:0"]


def _clients(request):
    import redis

    if request.param == "single":
        server = request.getfixturevalue("redis_server_clean")
        return redis.Redis(port=server.port)
    cluster = request.getfixturevalue("redis_cluster")
    cluster.flushall()
    return redis.RedisCluster(host=cluster.nodes[0].host, port=cluster.nodes[0].port)


@pytest.fixture(params=["single", "cluster"])
def client(request):
    client = _clients(request)
    yield client
    client.close()


def _reference(keys, prefix):
    return sorted(k for k in keys if prefix_matches(k, prefix))


def test_edge_prefixes_match_reference(client):
    index = PrefixIndex(client, "ns", batch=3)  # tiny pages exercise the cursor
    index.add(EDGE_KEYS)
    assert list(index.all()) == sorted(EDGE_KEYS)
    assert len(index) == len(EDGE_KEYS)
    for prefix in EDGE_PREFIXES:
        expected = _reference(EDGE_KEYS, prefix)
        assert list(index.match(prefix)) == expected, prefix
        assert index.count(prefix) == len(expected), prefix
    assert list(index.match("x:1")) == ["x:1", "x:1:0:0", "x:1:1:0", "x:1:é", "x:1_3",
                                        "x:1_3:0", "x:1_数"]


def test_random_keys_and_prefixes_match_reference(client, rng):
    keys = random_keys(rng, 300)
    index = PrefixIndex(client, "rand", batch=rng.randint(1, 50))
    index.add(rng.sample(keys, len(keys)))
    prefixes = {k[: rng.randint(1, len(k))] for k in rng.sample(keys, 40)}
    prefixes |= {k.rsplit(":", 1)[0] for k in keys[:20]}
    for prefix in sorted(p for p in prefixes if not p.endswith(".") and ".." not in p):
        expected = _reference(keys, prefix)
        pages = list(index.match_pages(prefix))
        assert [k for page in pages for k in page] == expected, prefix
        assert all(0 < len(page) <= index.batch for page in pages)
        assert index.count(prefix) == len(expected)


def test_namespaces_are_separate(client):
    one, two = PrefixIndex(client, "one"), PrefixIndex(client, "two")
    one.add(["a:1:0", "a:2:0"])
    two.add(["a:1:0", "b:1:0"])
    assert one.delete_prefix("a", lambda keys: None) == 2
    assert list(one.all()) == []
    assert list(two.all()) == ["a:1:0", "b:1:0"]
    assert two.clear() == 2
    assert len(two) == 0


def test_delete_prefix_removes_entries_before_payloads(client):
    index = PrefixIndex(client, "order", batch=2)
    keys = [f"e_1:{turn}:0" for turn in range(7)] + ["e_10:0:0", "e_1"]
    index.add(keys)
    seen = []

    def delete_payloads(page):
        # Entries go first: a put racing this delete can never keep a payload unindexed.
        assert not any(index.contains(key) for key in page)
        assert 0 < len(page) <= 2  # one page at a time
        seen.extend(page)
        return None

    assert index.delete_prefix("e_1", delete_payloads) == 8  # index entries removed
    assert sorted(seen) == sorted(k for k in keys if k != "e_10:0:0")
    assert list(index.all()) == ["e_10:0:0"]


def test_add_remove_are_idempotent_and_pipelinable(client):
    index = PrefixIndex(client, "idem", batch=4)
    keys = [f"k_{i}:0:0" for i in range(10)]
    pipe = client.pipeline(transaction=False)
    index.add(keys, pipeline=pipe)
    assert len(index) == 0  # queued only
    pipe.execute()
    index.add(keys[:5])
    assert len(index) == 10
    assert index.remove(keys[:3] + ["absent:0:0"]) == 3
    assert index.remove(keys[:3]) == 0
    assert list(index.all()) == sorted(keys[3:])
    assert index.add([]) is None and index.remove([]) == 0


def test_bad_prefixes_are_rejected(client):
    index = PrefixIndex(client, "bad")
    index.add(["keep:0:0"])
    for bad in ["", "a/b", "a b", "a\x00"]:
        with pytest.raises(InvalidRolloutId):
            list(index.match(bad))
        with pytest.raises(InvalidRolloutId):
            index.count(bad)
    assert list(index.all()) == ["keep:0:0"]


def test_index_key_is_one_slot_per_namespace(client):
    index = PrefixIndex(client, "tagged")
    assert index.key == "rr:idx:{tagged}"
    with pytest.raises(ValueError):
        PrefixIndex(client, "tagged", batch=0)
    with pytest.raises(InvalidRolloutId):
        PrefixIndex(client, "bad namespace")


def test_writes_are_cut_into_commands_of_write_batch_members(redis_server_clean):
    """A page of ``batch`` keys goes out as ZADD/ZREM commands of at most ``write_batch``
    members (what keeps every index command short at 10M keys), in one round trip."""
    import redis

    client = redis.Redis(port=redis_server_clean.port)
    index = PrefixIndex(client, "wb", batch=10, write_batch=3)
    keys = [f"w_{number}:0:0" for number in range(10)]
    client.config_resetstat()
    index.add(keys)
    assert client.info("commandstats")["cmdstat_zadd"]["calls"] == 4     # 3 + 3 + 3 + 1
    assert index.delete_prefix("w_1") == 1 and index.remove(keys) == 9
    assert client.info("commandstats")["cmdstat_zrem"]["calls"] == 1 + 4
    assert len(index) == 0
    assert PrefixIndex(client, "wb", batch=2).write_batch == 2           # never above batch
    with pytest.raises(ValueError, match="write_batch"):
        PrefixIndex(client, "wb", write_batch=0)
    client.close()


def test_prefix_ranges_shape():
    assert prefix_ranges("a:") == [(b"[a:", b"(a:\xff")]
    ranges = prefix_ranges("a")
    assert ranges[0] == (b"[a", b"[a")
    assert [low for low, _ in ranges[1:]] == [b"[a" + s.encode() for s in sorted(SEPARATORS)]


def test_delete_prefixes_in_shared_rounds_match_reference(client, rng):
    keys = random_keys(rng, 200)
    index = PrefixIndex(client, "many", batch=rng.randint(1, 7))
    index.add(keys)
    prefixes = [k[: rng.randint(1, len(k))] for k in rng.sample(keys, 15)]
    prefixes = [p for p in prefixes if not p.endswith(".")] + ["nothing", prefixes[0]]
    deleted: list[str] = []

    def delete_payloads(page):
        assert not any(index.contains(key) for key in page)
        deleted.extend(page)

    counts = index.delete_prefixes(prefixes, delete_payloads,
                                   ranges_per_round=rng.randint(1, 10))
    matched = {k for k in keys for p in prefixes if prefix_matches(k, p)}
    assert sorted(deleted) == sorted(matched)  # each matched key exactly once
    assert set(counts) == set(prefixes) and counts["nothing"] == 0
    assert sum(counts.values()) == len(matched)
    for prefix, count in counts.items():
        assert count <= len([k for k in matched if prefix_matches(k, prefix)])
    assert list(index.all()) == sorted(set(keys) - matched)


def test_delete_skips_the_gap_between_separator_ranges(redis_server_clean, rng):
    """Keys between ``p:`` and ``p_`` (``pA…``, ``p@…``) cost at most one page to skip."""
    import redis

    client = redis.Redis(port=redis_server_clean.port)
    index = PrefixIndex(client, "gap", batch=4)
    matching = ["g", "g:0", "g:1:2", "g:9", "g_0", "g_1:0", "g_9"]
    gap = [f"g{c}{i}" for c in ";<=>?@AZ[]^" for i in range(5)]
    others = ["g0:1", "g9", "g`0", "ga", "g~", "f:1", "h_1"]
    index.add(matching + gap + others)
    client.config_resetstat()
    assert index.delete_prefixes(["g"], lambda keys: None) == {"g": len(matching)}
    stats = client.info("commandstats")["cmdstat_zrangebylex"]
    # page 1: g:0 g:1:2 g:9 g;0 (full, ends in the gap) -> jump to [g_ ; page 2: g_0 g_1:0 g_9
    assert stats["calls"] == 2, stats
    assert sorted(index.all()) == sorted(gap + others)
    client.close()


def test_invalid_members_are_skipped_by_reads_and_deletes(client, caplog):
    index = PrefixIndex(client, "junk", batch=2)
    good = ["j_1", "j_1:0:0", "j_1:1:0", "j_2:0:0"]
    bad = [b"j_1:\xff", b"j_1:a b", b"j_1_\n"]
    index.add(good)
    client.zadd(index.key, dict.fromkeys(bad, 0))
    with caplog.at_level("WARNING", logger="fd_routing_replay.store.index"):
        assert list(index.all()) == good
        assert list(index.match("j_1")) == good[:3]
        assert all(page for page in index.match_pages("j_1", batch=1))  # never empty
    assert "j_1" in caplog.text and "not valid store keys" in caplog.text
    assert index.count("j_1") == 6 and len(index) == 7  # ZLEXCOUNT / ZCARD count them
    assert sorted(m for page in index.raw_pages(2) for m in page) == sorted(
        [k.encode() for k in good] + bad)
    seen = []
    assert index.delete_prefix("j_1", seen.extend) == 3
    assert sorted(seen) == good[:3]
    assert index.clear(seen.extend) == 1
    assert sorted(m for page in index.raw_pages() for m in page) == sorted(bad)
    assert index.remove(bad) == 3 and len(index) == 0


def test_present_and_page_removers(client):
    index = PrefixIndex(client, "present", batch=3)
    keys = [f"p_{i}:0:0" for i in range(8)]
    index.add(keys[:5])
    assert index.present(keys) == [True] * 5 + [False] * 3
    assert index.present([]) == []
    pages = []

    def remove_page(page):  # a store that removes entries and payloads together
        pages.append(page)
        return index.remove(page)

    assert index.delete_prefixes(["p_1", "p_3", "p_7"], remove_page=remove_page) == {
        "p_1": 1, "p_3": 1, "p_7": 0}
    assert all(len(page) <= 3 for page in pages)
    with pytest.raises(TypeError, match="not both"):
        index.delete_prefix("p_0", lambda keys: None, remove_page=remove_page)
    assert index.clear(remove_page=remove_page) == 3 and len(index) == 0
    with pytest.raises(ValueError, match="max_rounds"):
        PrefixIndex(client, "present", max_rounds=0)


def test_remove_then_delete_removes_entries_first_and_redoes_reindexed_keys(client):
    index = PrefixIndex(client, "redo")
    index.add(["r_1:0:0", "r_2:0:0", "r_3:0:0"])
    calls = []

    def delete_payloads(keys):
        calls.append(list(keys))
        assert not any(index.present(keys))  # entries are gone before payloads
        if len(calls) == 1:
            index.add(["r_1:0:0"])  # a put re-indexed r_1 after our ZREM...
        return [key in ("r_1:0:0", "r_2:0:0") for key in keys]  # r_3, r_4: no payload

    assert index.remove_then_delete(["r_1:0:0", "r_2:0:0", "r_3:0:0", "r_4:0:0"],
                                    delete_payloads) == (3, 2)
    assert calls == [["r_1:0:0", "r_2:0:0", "r_3:0:0", "r_4:0:0"], ["r_1:0:0"]]
    assert len(index) == 0
