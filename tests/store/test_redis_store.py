"""The Redis backend: conformance on one server and on a 3-master cluster, plus faults,
TLS, ACL, chunking and cross-process reads against real redis-server processes."""

from __future__ import annotations

import pytest

from fd_routing_replay.store import open_store
from tests.store_conformance import StoreConformance

pytestmark = pytest.mark.redis


def _open(url: str, namespace: str, **redis_options):
    config = {"url": url, "namespace": namespace}
    if redis_options:
        config["redis"] = redis_options
    return open_store(config)


class TestRedisStore(StoreConformance):
    @pytest.fixture
    def make_store(self, redis_server_clean):
        opened = []

        def make(namespace):
            store = _open(redis_server_clean.url, namespace, chunk_bytes=1024 * 1024)
            opened.append(store)
            return store

        yield make
        for store in opened:
            store.close()


class TestRedisClusterStore(StoreConformance):
    @pytest.fixture
    def make_store(self, redis_cluster):
        redis_cluster.flushall()
        opened = []

        def make(namespace):
            store = _open(redis_cluster.url, namespace, chunk_bytes=1024 * 1024)
            opened.append(store)
            return store

        yield make
        for store in opened:
            store.close()


class TestRedisStoreWithTTL(StoreConformance):
    """The same contract while the store applies retention.ttl_s itself (rr-v1 records of
    the suite are fresh, so none expires; other values get no expiry)."""

    @pytest.fixture
    def make_store(self, redis_server_clean):
        opened = []

        def make(namespace):
            store = _open(redis_server_clean.url, namespace, chunk_bytes=1024 * 1024)
            store.expire_records_after(30 * 86400)
            opened.append(store)
            return store

        yield make
        for store in opened:
            store.close()


# -- chunking and layout ------------------------------------------------------------------

def test_large_records_are_chunked_and_overwrites_leave_no_stale_chunks(redis_server, rng):
    import redis

    store = _open(redis_server.url, "chunks", chunk_bytes=1000)
    raw = redis.Redis(port=redis_server.port)
    value = rng.randbytes(3500)
    store.put("big_1:0:0", value)
    fields = raw.hgetall("rr:{chunks/big_1:0:0}")
    assert sorted(fields) == [b"0", b"1", b"2", b"3", b"n", b"s"]
    assert [len(fields[str(i).encode()]) for i in range(4)] == [1000, 1000, 1000, 500]
    assert store.get("big_1:0:0") == value
    store.put("big_1:0:0", value[:10])
    assert sorted(raw.hgetall("rr:{chunks/big_1:0:0}")) == [b"0", b"n", b"s"]
    assert store.get("big_1:0:0") == value[:10]
    store.close()


def test_put_parts_chunks_across_part_boundaries(redis_server, rng):
    store = _open(redis_server.url, "parts", chunk_bytes=rng.randint(1, 700))
    for index in range(20):
        parts = [rng.randbytes(rng.randint(0, 2000)) for _ in range(rng.randint(0, 5))]
        views = [memoryview(p) if rng.random() < 0.5 else bytearray(p) for p in parts]
        store.put_parts(f"p_{index}:0:0", views)
        assert store.get(f"p_{index}:0:0") == b"".join(parts)
    store.close()


def test_corrupt_record_is_a_permanent_error(redis_server):
    import redis

    from fd_routing_replay.errors import PermanentStoreError

    store = _open(redis_server.url, "corrupt", chunk_bytes=4)
    store.put("c_1:0:0", b"0123456789")
    redis.Redis(port=redis_server.port).hdel("rr:{corrupt/c_1:0:0}", "1")
    with pytest.raises(PermanentStoreError, match="c_1:0:0"):
        store.get("c_1:0:0")
    store.close()


# -- faults ----------------------------------------------------------------------------------

def test_redis_restart_mid_run(redis_server):
    """Down: TransientStoreError on every call.  Back: same store object works again."""
    from fd_routing_replay.errors import TransientStoreError

    store = _open(redis_server.url, "fault", socket_timeout_s=2.0)
    for key in ("x:1:0:0", "x:1:1:0", "x:1_2", "x:10:0:0", "x:100:0:0"):
        store.put(key, key.encode())
    redis_server.stop(save=True)
    for call in (lambda: store.put("x:1:2:0", b"v"), lambda: store.get("x:1:0:0"),
                 lambda: store.exists("x:1:0:0"), lambda: store.delete(["x:1:0:0"]),
                 lambda: store.delete_prefix(["x:1"]), lambda: store.list("x:1"),
                 lambda: store.clear()):
        with pytest.raises(TransientStoreError, match="fault"):
            call()
    redis_server.start()  # same port, data back from the RDB snapshot
    assert store.get("x:1:0:0") == b"x:1:0:0"
    store.put("x:1:2:0", b"after")
    assert store.delete_prefix(["x:1"]) == {"x:1": 4}
    assert store.list() == sorted(["x:10:0:0", "x:100:0:0"])
    redis_server.restart(keep_data=False)
    assert store.list() == [] and store.get("x:10:0:0") is None
    store.close()


def test_writes_retried_across_a_restart_lose_nothing(redis_server):
    """A caller retrying TransientStoreError (as the writer does) loses no record."""
    from fd_routing_replay.errors import TransientStoreError

    store = _open(redis_server.url, "retry", socket_timeout_s=2.0)
    keys = [f"r_{i}:0:0" for i in range(30)]
    pending = list(keys)
    failures = 0
    for step in range(200):
        if step == 10:
            redis_server.stop(save=True)
        if step == 15:
            redis_server.start()
        if not pending:
            break
        try:
            store.put(pending[0], pending[0].encode())
            pending.pop(0)
        except TransientStoreError:
            failures += 1
    assert pending == [] and failures == 5
    assert store.list() == sorted(keys)
    assert all(store.get(k) == k.encode() for k in keys)
    store.close()


def test_unreachable_server_is_transient(redis_server):
    from fd_routing_replay.errors import TransientStoreError

    url = redis_server.url
    redis_server.stop()
    store = _open(url, "down", socket_timeout_s=1.0)
    with pytest.raises(TransientStoreError, match="127.0.0.1"):
        store.get("a:0:0")
    store.close()


def test_closed_store_refuses_calls(redis_server):
    from fd_routing_replay.errors import PermanentStoreError

    store = _open(redis_server.url, "closed")
    store.close()
    with pytest.raises(PermanentStoreError, match="closed"):
        store.get("a:0:0")


def test_cluster_url_with_database_is_rejected(redis_cluster):
    from fd_routing_replay.errors import PermanentStoreError

    url = redis_cluster.url.rsplit("/", 1)[0] + "/3"
    with pytest.raises(PermanentStoreError, match="database"):
        _open(url, "db")


# -- another process ----------------------------------------------------------------------

_READER = """
import hashlib, json, sys
from fd_routing_replay.store import open_store
store = open_store({"url": sys.argv[1], "namespace": sys.argv[2],
                    "redis": {"chunk_bytes": 4096}})
out = {key: hashlib.sha256(store.get(key)).hexdigest() for key in store.list(sys.argv[3])}
print(json.dumps(out))
"""


@pytest.mark.parametrize("where", ["single", "cluster"])
def test_reader_in_another_process(where, request, rng):
    import hashlib
    import json
    import subprocess
    import sys

    if where == "single":
        url = request.getfixturevalue("redis_server").url
    else:
        cluster = request.getfixturevalue("redis_cluster")
        cluster.flushall()
        url = cluster.url
    store = _open(url, "xproc", chunk_bytes=4096)
    values = {f"xp_1:{i}:0": rng.randbytes(rng.randint(0, 20000)) for i in range(12)}
    values["xp_10:0:0"] = b"not under xp_1"
    for key, value in values.items():
        store.put(key, value)
    result = subprocess.run([sys.executable, "-c", _READER, url, "xproc", "xp_1"],
                            capture_output=True, text=True, timeout=60, check=True)
    expected = {k: hashlib.sha256(v).hexdigest() for k, v in values.items()
                if k.startswith("xp_1:")}
    assert json.loads(result.stdout) == expected
    store.close()


# -- TLS and ACL -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    from fdrr_dev.testing.redis import make_tls_files

    try:
        return make_tls_files(tmp_path_factory.mktemp("tls"))
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


def test_tls_round_trip(tls_files, rng):
    from fd_routing_replay.errors import TransientStoreError
    from fdrr_dev.testing.redis import RedisServer, redis_server_binary

    if redis_server_binary() is None:
        pytest.skip("redis-server binary not found")
    with RedisServer(tls=tls_files) as server:
        assert server.url.startswith("rediss://")
        store = _open(server.url, "tls", ssl_ca_certs=tls_files[2], chunk_bytes=1000)
        value = rng.randbytes(5000)
        store.put("t_1:0:0", value)
        assert store.get("t_1:0:0") == value
        assert store.delete_prefix(["t_1"]) == {"t_1": 1}
        store.close()
        plain = _open(server.url.replace("rediss://", "redis://"), "tls", socket_timeout_s=1.0)
        with pytest.raises(TransientStoreError):
            plain.get("t_1:0:0")
        plain.close()


def test_acl_user_and_password(redis_server):
    from fd_routing_replay.errors import PermanentStoreError
    from fd_routing_replay.store.index.fsck import fsck

    # The exact grant docs/stores.md recommends must be enough for every operation.
    redis_server.command("ACL", "SETUSER", "writer", "on", ">s3cret", "~rr:*", "+@read",
                         "+@write", "+@keyspace", "+@transaction")
    by_config = _open(redis_server.url, "acl", username="writer", password="s3cret")
    for key in ("a_1:0:0", "a_1:1:0", "a_10:0:0", "b_1:0:0"):
        by_config.put(key, key.encode())
    assert by_config.delete_prefix(["a_1"]) == {"a_1": 2}
    assert by_config.delete(["b_1:0:0"]) == 1 and by_config.exists("a_10:0:0")
    assert fsck(by_config, repair=True).consistent
    by_config.client.hset(b"rr:{acl/bad key:0:0}", mapping={"n": 1, "s": 1, "0": b"x"})
    quarantined = fsck(by_config, repair=True, deep=True)  # RENAMENX, HSTRLEN, ... allowed
    assert quarantined.repaired and list(quarantined.quarantined) == ["'bad key:0:0'"]
    assert by_config.clear() == 1
    by_config.put("a_1:0:0", b"v")
    host = redis_server.address
    by_url = _open(f"redis://writer:s3cret@{host}/0", "acl")
    assert by_url.get("a_1:0:0") == b"v"
    wrong = _open(f"redis://writer:wrong@{host}/0", "acl")
    with pytest.raises(PermanentStoreError, match="password"):
        wrong.get("a_1:0:0")
    redis_server.command("ACL", "SETUSER", "reader", "on", ">r", "~rr:*", "+@read")
    reader = _open(redis_server.url, "acl", username="reader", password="r")
    assert reader.get("a_1:0:0") == b"v"
    with pytest.raises(PermanentStoreError, match="NoPermission|NOPERM"):
        reader.put("a_2:0:0", b"v")
    for store in (by_config, by_url, wrong, reader):
        store.close()
    assert "s3cret" not in repr(by_url)


def test_example_config_file_opens_a_working_store(redis_server):
    """configs/redis.yaml, pointed at the test server, with the password from the env."""
    from pathlib import Path

    from fd_routing_replay.config import load_config

    redis_server.command("ACL", "SETUSER", "routing_replay", "on", ">pw", "~rr:*", "+@read",
                         "+@write", "+@keyspace", "+@transaction")
    path = Path(__file__).resolve().parents[2] / "configs" / "redis.yaml"
    config = load_config(path, overrides={"store": {"redis": {"url": redis_server.url}}},
                         env={"FD_RR_STORE__REDIS__PASSWORD": "pw"})
    with open_store(config) as store:
        store.put("cfg_1:0:0", b"from the example config")
        assert store.get("cfg_1:0:0") == b"from the example config"
        assert store.supports_cross_process()
        assert "pw" not in store.describe()


def test_read_ranges_fetches_only_the_chunks_it_needs(redis_server, rng):
    import random

    store = _open(redis_server.url, "ranges", chunk_bytes=1000)
    value = rng.randbytes(3500)
    store.put("r_1:0:0", value)
    backend = store.inner
    asked: list[list[bytes]] = []
    hmget = backend.client.hmget

    def spy(name, fields):
        asked.append(list(fields))
        return hmget(name, fields)

    backend.client.hmget = spy
    pipeline = backend.client.pipeline

    def spied_pipeline(*args, **kwargs):
        pipe = pipeline(*args, **kwargs)
        original = pipe.hmget

        def hmget_in_pipe(name, fields):
            asked.append(list(fields))
            return original(name, fields)

        pipe.hmget = hmget_in_pipe
        return pipe

    backend.client.pipeline = spied_pipeline
    local = random.Random(rng.random())
    for _ in range(50):
        ranges = [(local.randrange(0, 4000), local.randrange(0, 1500)) for _ in range(local.randrange(1, 4))]
        assert store.read_ranges("r_1:0:0", ranges) == [value[o:o + n] for o, n in ranges]
    asked.clear()
    assert store.read_ranges("r_1:0:0", [(1500, 100)]) == [value[1500:1600]]
    assert asked[-1] == [b"n", b"s", b"1"]                    # one chunk of four, not the record
    assert store.read_ranges("r_1:9:0", [(0, 10)]) is None
    store.close()


def test_read_ranges_of_a_record_replaced_meanwhile_read_it_whole(redis_server, rng):
    store = _open(redis_server.url, "ranges2", chunk_bytes=1000)
    old, new = rng.randbytes(3500), rng.randbytes(2500)
    store.put("r_2:0:0", old)
    backend = store.inner
    pipeline = backend.client.pipeline
    calls = []

    def replace_between_round_trips(*args, **kwargs):
        calls.append(kwargs)
        if len(calls) == 2:                     # the second round trip is about to start
            backend.client.pipeline = pipeline
            store.put("r_2:0:0", new)
        return pipeline(*args, **kwargs)

    backend.client.pipeline = replace_between_round_trips
    assert store.read_ranges("r_2:0:0", [(100, 2000)]) == [new[100:2100]]   # never a mix
    assert len(calls) == 2
    store.close()


def test_sliced_reads_on_redis_equal_numpy_slicing(redis_server, rng):
    import numpy as np

    from fd_routing_replay.codec import RoutingRecord, encode_record
    from fd_routing_replay.reader import RoutingReader

    store = _open(redis_server.url, "slices", chunk_bytes=4096)
    gen = np.random.default_rng(rng.randrange(2**32))
    ids = gen.integers(0, 64, size=(6, 500, 4)).astype(np.uint8)
    store.put("s_1:0:0", encode_record(RoutingRecord("s_1:0:0", ids, 64, layers=tuple(range(2, 8)))))
    got = RoutingReader(store).get_slice("s_1:0:0", layers=[3, 6], tokens=slice(120, 333))
    np.testing.assert_array_equal(got.ids, ids[[1, 4], 120:333])
    store.close()


def test_get_many_is_one_round_trip_per_page_and_reads_like_get(redis_server, rng):
    import numpy as np

    from fd_routing_replay.codec import RoutingRecord, encode_record
    from fd_routing_replay.reader import RoutingReader

    store = _open(redis_server.url, "many", chunk_bytes=300)
    gen = np.random.default_rng(rng.randrange(2**32))
    records = {f"m_{i}:0:0": RoutingRecord(f"m_{i}:0:0", gen.integers(0, 64, size=(2, 40, 4)).astype(
        np.uint8), 64) for i in range(300)}
    for key, record in records.items():
        store.put(key, encode_record(record))
    per_layer = RoutingRecord("m_pl:0:0", gen.integers(0, 64, size=(1, 5, 4)).astype(np.uint8), 64)
    store.put("m_pl:0:0_0", encode_record(per_layer))
    backend = store.inner
    pipeline = backend.client.pipeline
    rounds = []

    def counted(*args, **kwargs):
        rounds.append(1)
        return pipeline(*args, **kwargs)

    backend.client.pipeline = counted
    wanted = list(records) + ["m_none:0:0", "m_pl:0:0"]
    got = RoutingReader(store).get_many(wanted)
    backend.client.pipeline = pipeline
    assert list(got) == wanted and got["m_none:0:0"] is None
    for key, record in records.items():
        np.testing.assert_array_equal(got[key].ids, record.ids)
    np.testing.assert_array_equal(got["m_pl:0:0"].ids, per_layer.ids)     # read on its own
    assert len(rounds) == 2                  # 302 keys: two pages of 256, not 302 round trips
    assert store.get_many(["m_0:0:0", "m_none:0:0"]) == [store.get("m_0:0:0"), None]
    store.close()
