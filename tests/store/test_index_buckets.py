"""The prefix index spread over buckets (``store.redis.index_buckets``), on one server and on
a 3-master cluster: same answers as one set, one bucket per rollout, the layout recorded in
Redis, and migration between bucket counts (``fd-rr fsck --migrate-index``)."""

from __future__ import annotations

import pytest

from fd_routing_replay.keys import prefix_matches
from fd_routing_replay.store import open_store
from fd_routing_replay.store.index.buckets import bucket_of, rollout_base
from fd_routing_replay.store.index.fsck import fsck
from fd_routing_replay.store.index.prefix_index import PrefixIndex
from tests.store.test_index import EDGE_KEYS, EDGE_PREFIXES
from tests.store_conformance import StoreConformance, random_keys

pytestmark = pytest.mark.redis


def _reference(keys, prefix):
    return sorted(k for k in keys if prefix_matches(k, prefix))


@pytest.fixture(params=["single", "cluster"])
def client(request):
    import redis

    if request.param == "single":
        server = request.getfixturevalue("redis_server_clean")
        client = redis.Redis(port=server.port)
    else:
        cluster = request.getfixturevalue("redis_cluster")
        cluster.flushall()
        client = redis.RedisCluster(host=cluster.nodes[0].host, port=cluster.nodes[0].port)
    yield client
    client.close()


def test_rollout_base_and_bucket():
    assert rollout_base("exp_7:3:0:1") == "exp_7:3"
    assert rollout_base("exp_7:3:0:1_59") == "exp_7:3"
    assert rollout_base("a:b:c:10:0") == "a:b:c"
    assert rollout_base("x:1") == "x:1" and rollout_base("x:01:0") == "x:01:0"
    rollout = ["exp_7:3:0:0", "exp_7:3:0:1", "exp_7:3:1:0", "exp_7:3:1:0_12"]
    assert len({bucket_of(key, 16) for key in rollout}) == 1
    assert {bucket_of(f"exp_{n}:0:0:0", 16) for n in range(200)} == set(range(16))
    assert bucket_of("anything", 1) == 0


@pytest.mark.parametrize("buckets", [2, 7])
def test_bucketed_index_matches_reference(client, rng, buckets):
    index = PrefixIndex(client, "bk", batch=rng.randint(1, 7), buckets=buckets)
    keys = sorted(set(EDGE_KEYS) | set(random_keys(rng, 200)))
    index.add(rng.sample(keys, len(keys)))
    assert index.buckets == buckets and len(index) == len(keys)
    assert list(index.all()) == keys
    prefixes = set(EDGE_PREFIXES) | {k[: rng.randint(1, len(k))] for k in rng.sample(keys, 30)}
    for prefix in sorted(p for p in prefixes if not p.endswith(".") and ".." not in p):
        expected = _reference(keys, prefix)
        pages = list(index.match_pages(prefix))
        assert [k for page in pages for k in page] == expected, prefix
        assert all(0 < len(page) <= index.batch for page in pages)
        assert index.count(prefix) == len(expected), prefix
    assert index.present([keys[0], "absent:0:0", keys[-1]]) == [True, False, True]
    chosen = sorted({k[: rng.randint(1, len(k))] for k in rng.sample(keys, 12)})
    chosen = [p for p in chosen if not p.endswith(".") and ".." not in p]
    remaining = set(keys)
    counts = index.delete_prefixes(chosen, batch=rng.randint(1, 9))
    removed = {k for k in keys if any(prefix_matches(k, p) for p in chosen)}
    assert sum(counts.values()) == len(removed)
    remaining -= removed
    assert list(index.all()) == sorted(remaining)
    assert index.remove(sorted(remaining)[:5]) == min(5, len(remaining))
    assert index.clear() == max(0, len(remaining) - 5) and len(index) == 0


def test_a_rollout_lives_in_one_bucket_and_buckets_spread_over_nodes(redis_cluster):
    import redis

    redis_cluster.flushall()
    client = redis.RedisCluster(host=redis_cluster.nodes[0].host,
                                port=redis_cluster.nodes[0].port)
    try:
        index = PrefixIndex(client, "spread", buckets=16)
        rollout = [f"exp_9:2:{turn}:{seg}" for turn in range(3) for seg in range(2)]
        index.add(rollout + [f"{rollout[0]}_{layer}" for layer in range(4)])
        holding = [name for name in index.layout.keys if client.zcard(name)]
        assert len(holding) == 1  # exact keys and whole rollouts touch one bucket
        nodes = {client.get_node_from_key(name).name for name in index.layout.keys}
        assert len(nodes) == 3  # the buckets land on every node
    finally:
        client.close()


def test_layout_is_recorded_and_wins_over_the_configuration(client):
    writer = PrefixIndex(client, "rec", buckets=4)
    writer.add(["a_1:0:0", "b_1:0:0"])
    reader = PrefixIndex(client, "rec")  # configured with one set
    assert reader.buckets == 4 and list(reader.all()) == ["a_1:0:0", "b_1:0:0"]
    assert not client.exists(reader.key)  # no single set was created


def test_single_set_is_read_until_migrated_then_moved(client):
    old = PrefixIndex(client, "mig")
    old.add([f"k_{n}:0:0" for n in range(50)])
    new = PrefixIndex(client, "mig", buckets=5, batch=7)
    assert new.buckets == 5 and new.layout.old == (1,)
    new.add(["k_new:0:0"])                       # goes to the buckets
    assert len(list(new.all())) == 51            # both layouts are read
    assert new.delete_prefix("k_3") == 1         # and cleaned
    assert new.remove(["k_4:0:0", "k_new:0:0"]) == 2
    assert new.migrate() == 48
    assert new.layout.old == () and not client.exists(new.key)
    assert list(new.all()) == sorted(f"k_{n}:0:0" for n in range(50) if n not in (3, 4))
    assert PrefixIndex(client, "mig").buckets == 5
    back = PrefixIndex(client, "mig", batch=4)
    assert back.migrate(1) == 48 and back.buckets == 1
    assert not client.exists(back.meta_key) and client.zcard(back.key) == 48
    assert list(back.all()) == list(new.reload_layout() and new.all())


def test_fsck_migrate_index_on_a_redis_store(redis_server_clean):
    url = redis_server_clean.url
    single = open_store({"url": url, "namespace": "fm"}, instrument=False)
    for n in range(30):
        single.put(f"r_{n}:0:0", b"v%d" % n)
    single.close()
    store = open_store({"url": url, "namespace": "fm", "redis": {"index_buckets": 8}},
                       instrument=False)
    try:
        assert store.list("r_1") == ["r_1:0:0"]  # readable before the migration
        report = fsck(store, migrate_index=True)
        assert report.consistent and report.migrated == 30 and report.index_buckets == 8
        assert "30 moved into them" in report.to_text()
        assert store.index.layout.old == () and len(store.list()) == 30
        assert store.delete_prefix(["r_2"]) == {"r_2": 1}
    finally:
        store.close()


def test_cli_fsck_migrate_index(redis_server_clean, capsys, tmp_path):
    from fd_routing_replay.cli import main

    url = redis_server_clean.url
    store = open_store({"url": url, "namespace": "cli"}, instrument=False)
    store.put("c_1:0:0", b"v")
    store.close()
    config = tmp_path / "rr.yaml"
    config.write_text(f"store:\n  url: {url}\n  namespace: cli\n  redis:\n"
                      "    index_buckets: 3\n")
    code = main(["fsck", "--migrate-index", "--config", str(config)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "1 in 3 bucket(s) (1 moved into them)" in out


class TestBucketedRedisClusterConformance(StoreConformance):
    @pytest.fixture
    def make_store(self, redis_cluster):
        redis_cluster.flushall()
        stores = []

        def _open(namespace: str):
            store = open_store({"url": redis_cluster.url, "namespace": namespace,
                                "redis": {"index_buckets": 4}}, instrument=False)
            stores.append(store)
            return store

        yield _open
        for store in stores:
            store.close()
