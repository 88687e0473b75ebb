"""Retention: the sweeper (fake clock), the writer's sweeper thread, fd-rr rm --older-than,
and Redis applying ``ttl_s`` itself (expiry at write time, purge, fsck)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from fd_routing_replay.cli import main
from fd_routing_replay.codec import RoutingRecord, encode_record
from fd_routing_replay.errors import ConfigError
from fd_routing_replay.store import open_store
from fd_routing_replay.store.memory import MemoryStore
from fd_routing_replay.store.retention import apply_retention, parse_duration, sweep

NOW = 1_800_000_000.0


def _put(store, key, created, tokens=4):
    ids = np.zeros((2, tokens, 2), dtype=np.uint8)
    ids[..., 1] = 1
    value = encode_record(RoutingRecord(key, ids, 8, created=created))
    store.put(key, value)
    return len(value)


@pytest.fixture(params=["local", "memory"])
def store(request, tmp_path):
    url = f"local://{tmp_path}" if request.param == "local" else f"memory://ret-{time.time_ns()}"
    with open_store(url, "ret") as opened:
        yield opened


def test_ttl_deletes_exactly_the_records_older_than_it(store, seed):
    rng = np.random.default_rng(seed)
    ages = {f"r_{i}:0:0": float(rng.integers(0, 7200)) for i in range(30)}
    ages["edge:0:0"] = 3600.0                                  # exactly ttl old: kept
    for key, age in ages.items():
        _put(store, key, NOW - age)
    store.put("foreign:0:0", b"not a record")                   # unknown age: kept
    report = sweep(store, ttl_s=3600, clock=lambda: NOW)
    expected = sorted(key for key, age in ages.items() if age > 3600)
    assert sorted(report.expired) == expected and report.deleted == len(expected)
    assert report.unknown_age == 1
    assert sorted(store.list()) == sorted(set(ages) - set(expected) | {"foreign:0:0"})
    assert sweep(store, ttl_s=3600, clock=lambda: NOW).deleted == 0   # idempotent


def test_max_bytes_evicts_the_oldest_first_and_dry_run_deletes_nothing(store):
    sizes = {f"m_{i}:0:0": _put(store, f"m_{i}:0:0", NOW - 100 * (10 - i)) for i in range(10)}
    total = sum(sizes.values())
    limit = total - 2 * sizes["m_0:0:0"] - 1                     # needs three evictions
    dry = sweep(store, max_bytes=limit, dry_run=True, clock=lambda: NOW)
    assert dry.evicted == ["m_0:0:0", "m_1:0:0", "m_2:0:0"] and dry.deleted == 0
    assert len(store.list()) == 10 and dry.bytes_after <= limit
    report = sweep(store, max_bytes=limit, clock=lambda: NOW)
    assert report.deleted == 3 and "m_0:0:0" not in store.list()
    assert report.bytes_after == total - 3 * sizes["m_0:0:0"] <= limit


def test_a_record_replaced_during_the_sweep_is_kept():
    class Racing(MemoryStore):
        def delete(self, keys):
            keys = list(keys)
            if keys == ["a:0:0"]:                     # a writer replaces b meanwhile
                _put(self, "b:0:0", NOW)
            return super().delete(keys)

    store = Racing("racing", "ret")
    _put(store, "a:0:0", NOW - 9000)
    _put(store, "b:0:0", NOW - 8000)
    report = sweep(store, ttl_s=3600, clock=lambda: NOW)
    assert report.expired == ["a:0:0", "b:0:0"]
    assert report.deleted == 1 and report.kept_replaced == 1 and store.list() == ["b:0:0"]


@pytest.mark.parametrize("text, seconds", [("90", 90), ("90s", 90), ("30m", 1800), ("2h", 7200),
                                           ("1.5d", 129600)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "2 hours", "-1h", "1h30m", "١h", "2H"])
def test_bad_durations_are_refused(text):
    with pytest.raises(ConfigError, match="invalid duration"):
        parse_duration(text)


def test_the_writer_of_rank_0_sweeps_and_other_ranks_do_not(tmp_path):
    from fd_routing_replay.config import config_from_dict
    from fd_routing_replay.core.paths import RankIdentity
    from fd_routing_replay.writer import RoutingWriter
    from tests.writer.conftest import wait_until

    config = config_from_dict({
        "store": {"type": "local", "namespace": "sw", "local": {"root": str(tmp_path / "s")}},
        "writer": {"mode": "thread", "journal_dir": str(tmp_path / "j{dp_rank}"),
                   "dead_letter_dir": str(tmp_path / "d{dp_rank}")},
        "retention": {"ttl_s": 3600, "sweep_interval_s": 0.05}}, source="test")
    store = open_store(config.store)
    _put(store, "old:0:0", time.time() - 7200)
    _put(store, "new:0:0", time.time())
    with RoutingWriter.from_config(config, identity=RankIdentity(dp_rank=1, tp_rank=0)) as other:
        assert other.sweeper is None
    with RoutingWriter.from_config(config) as writer:
        wait_until(lambda: writer.sweeper.sweeps >= 1 and "old:0:0" not in store.list(),
                   "the sweeper to delete the expired record")
        assert store.list() == ["new:0:0"]


def test_rm_older_than(tmp_path, capsys):
    store = open_store(f"local://{tmp_path}", "cli", instrument=False)
    _put(store, "old_1:0:0", time.time() - 7200)
    _put(store, "old_2:0:0", time.time() - 7200)
    _put(store, "new_1:0:0", time.time())
    opts = [f"--store=local://{tmp_path}", "--namespace=cli"]
    assert main(["rm", "--older-than", "1h", "--dry-run", *opts]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[:2] == ["old_1:0:0", "old_2:0:0"] and "would delete 2" in out
    assert len(store.list()) == 3
    assert main(["rm", "--older-than", "1h", "old_1", "--yes", "--json", *opts]) == 0
    assert json.loads(capsys.readouterr().out)["deleted"] == 1
    assert store.list() == ["new_1:0:0", "old_2:0:0"]
    assert main(["rm", "--older-than", "soon", *opts]) == 1
    assert "invalid duration 'soon'" in capsys.readouterr().err
    assert main(["rm", "--dry-run", "x:0:0", *opts]) == 1
    assert "--dry-run goes with --older-than" in capsys.readouterr().err


def test_apply_retention_sweeps_stores_that_cannot_expire_records(store):
    assert not store.supports_expiry()
    _put(store, "old:0:0", NOW - 7200)
    _put(store, "new:0:0", NOW)
    report = apply_retention(store, ttl_s=3600, clock=lambda: NOW)
    assert report.expired == ["old:0:0"] and report.deleted == 1 and report.purged == 0
    assert store.list() == ["new:0:0"]
    with pytest.raises(NotImplementedError, match="cannot expire"):
        store.expire_records_after(60)


# -- retention by Redis expiry (store/redis_expiry.py) -----------------------------------------

def _record(key, created, tokens=4):
    ids = np.zeros((2, tokens, 2), dtype=np.uint8)
    ids[..., 1] = 1
    return encode_record(RoutingRecord(key, ids, 8, created=created))


def _let_expire(store, client, key):
    """What the passing of its TTL does to a stored record (no sleeping): Redis drops the
    payload, and the expiry time recorded at the put is now in the past."""
    bare = store.inner
    assert client.zscore(bare.expiry.key, key) is not None, f"{key} has no expiry entry"
    client.pexpireat(bare.pkey(key), 1)
    client.zadd(bare.expiry.key, {key: 1})


@pytest.fixture(params=["single", "cluster"])
def redis_ttl(request):
    """(store with retention.ttl_s = 3600, raw redis-py client, cluster?) on a real server."""
    if request.param == "single":
        server = request.getfixturevalue("redis_server_clean")
        client = server.client()
        url = server.url
    else:
        cluster = request.getfixturevalue("redis_cluster")
        cluster.flushall()
        client = cluster.client()
        url = cluster.url
    store = open_store({"url": url, "namespace": f"ttl{time.time_ns()}",
                        "redis": {"chunk_bytes": 64, "index_buckets": 4}})
    store.expire_records_after(3600)
    yield store, client
    store.close()
    client.close()


def _entries(store, client):
    """(index members, expiry-set members) of the store's namespace."""
    bare = store.inner
    index = sorted(m.decode() for name in bare.index.layout.read_keys
                   for m in client.zrange(name, 0, -1))
    expiring = sorted(m.decode() for m in client.zrange(bare.expiry.key, 0, -1))
    return index, expiring


@pytest.mark.redis
def test_redis_expires_a_record_ttl_after_it_was_created(redis_ttl):
    store, client = redis_ttl
    now = time.time()
    fresh, old = _record("fresh:0:0", now, tokens=64), _record("old:0:0", now - 3601)
    store.put("fresh:0:0", fresh)
    store.put("old:0:0", old)                      # already past its TTL: never stored
    store.put("raw:0:0", b"no rr-v1 header")       # age unknown: no expiry
    assert store.get("fresh:0:0") == fresh and store.get("old:0:0") is None
    assert store.list() == ["fresh:0:0", "raw:0:0"]
    pkey = store.inner.pkey
    # Every chunk is a field of the record's one HASH: one expiry covers them all.
    assert client.hlen(pkey("fresh:0:0")) > 3
    assert client.pexpiretime(pkey("fresh:0:0")) == round((now + 3600) * 1000)
    assert client.pexpiretime(pkey("raw:0:0")) == -1
    assert _entries(store, client) == (["fresh:0:0", "raw:0:0"], ["fresh:0:0"])
    assert store.read_ranges("fresh:0:0", [(0, 10)]) == [fresh[:10]]


@pytest.mark.redis
def test_rewriting_a_key_resets_its_expiry(redis_ttl):
    store, client = redis_ttl
    pkey = store.inner.pkey("turn:0:0")
    first = time.time() - 3000
    store.put("turn:0:0", _record("turn:0:0", first))
    assert client.pexpiretime(pkey) == round((first + 3600) * 1000)
    second = time.time()
    store.put("turn:0:0", _record("turn:0:0", second, tokens=40))
    assert client.pexpiretime(pkey) == round((second + 3600) * 1000)
    assert client.zscore(store.inner.expiry.key, "turn:0:0") == round((second + 3600) * 1000)
    store.expire_records_after(0)                  # a writer without a TTL rewrites it
    store.put("turn:0:0", b"kept for good")
    assert client.pexpiretime(pkey) == -1


@pytest.mark.redis
def test_expired_entries_are_hidden_purged_and_told_from_corruption(redis_ttl):
    from fd_routing_replay.store.index.fsck import fsck

    store, client = redis_ttl
    for key in ("gone_1:0:0", "gone_2:1:0"):
        store.put(key, _record(key, time.time()))
        _let_expire(store, client, key)
    store.put("live:0:0", _record("live:0:0", time.time()))
    store.put("lost:0:0", _record("lost:0:0", time.time()))
    client.delete(store.inner.pkey("lost:0:0"))   # lost behind our back: corruption
    assert store.get("gone_1:0:0") is None
    assert _entries(store, client)[0] == ["gone_1:0:0", "gone_2:1:0", "live:0:0", "lost:0:0"]
    assert store.list() == ["live:0:0", "lost:0:0"]          # due entries are not listed
    report = fsck(store)
    assert report.expired == ["gone_1:0:0", "gone_2:1:0"] and report.dangling == ["lost:0:0"]
    assert "expired entries  2" in report.to_text() and not report.consistent
    repaired = fsck(store, repair=True)
    assert repaired.repaired and "purged" in repaired.to_text()
    # The lost record's expiry entry stays until it is due; then the purge drops it.
    assert _entries(store, client) == (["live:0:0"], ["live:0:0", "lost:0:0"])
    assert fsck(store).consistent and not fsck(store).expired
    client.zadd(store.inner.expiry.key, {"lost:0:0": 1})
    assert store.purge_expired() == 1
    assert _entries(store, client) == (["live:0:0"], ["live:0:0"])


@pytest.mark.redis
def test_the_sweeper_pass_purges_expired_entries_and_keeps_the_rest(redis_ttl):
    store, client = redis_ttl
    for number in range(5):
        store.put(f"e_{number}:0:0", _record(f"e_{number}:0:0", time.time()))
        _let_expire(store, client, f"e_{number}:0:0")
    store.put("live:0:0", _record("live:0:0", time.time()))
    store.put("raw:0:0", b"no header")
    store.inner.expiry.batch = 2                   # several pages
    report = apply_retention(store, ttl_s=3600)
    assert report.purged == 5 and report.deleted == 0 and report.examined == 0
    assert _entries(store, client) == (["live:0:0", "raw:0:0"], ["live:0:0"])
    assert apply_retention(store, ttl_s=3600).purged == 0
    # max_bytes is still the sweeper's job on Redis: oldest first.
    store.put("older:0:0", _record("older:0:0", time.time() - 60))
    report = apply_retention(store, ttl_s=3600, max_bytes=1)
    assert report.evicted == ["older:0:0", "live:0:0"] and report.unknown_age == 1


@pytest.mark.redis
def test_deletes_drop_expiry_entries_too(redis_ttl):
    store, client = redis_ttl
    now = time.time()
    for key in ("d_1:0:0", "d_1:1:0", "d_2:0:0", "d_3:0:0"):
        store.put(key, _record(key, now))
    assert store.delete_prefix(["d_1"]) == {"d_1": 2}
    assert store.delete(["d_2:0:0"]) == 1
    assert _entries(store, client) == (["d_3:0:0"], ["d_3:0:0"])
    assert store.clear() == 1
    assert _entries(store, client) == ([], [])


@pytest.mark.redis
def test_a_put_racing_the_purge_keeps_its_entries(redis_ttl):
    """The purge drops the entries of a payload it saw gone; a put that lands before its
    re-check gets them back, with its own expiry."""
    store, client = redis_ttl
    store.put("race:0:0", _record("race:0:0", time.time()))
    _let_expire(store, client, "race:0:0")
    expiry = store.inner.expiry
    real = expiry.payloads_exist
    calls = []

    def exist_then_put(keys):
        calls.append(list(keys))
        found = real(keys)
        if len(calls) == 1:                        # between the check and the removal
            store.put("race:0:0", _record("race:0:0", now))
        return found

    now = time.time()
    expiry.payloads_exist = exist_then_put
    assert store.purge_expired() == 0
    assert len(calls) == 2
    assert _entries(store, client) == (["race:0:0"], ["race:0:0"])
    assert client.zscore(expiry.key, "race:0:0") == round((now + 3600) * 1000)
    assert store.list() == ["race:0:0"]


@pytest.mark.redis
def test_the_writer_gives_a_redis_store_its_ttl(tmp_path, redis_server_clean):
    from fd_routing_replay.config import config_from_dict
    from fd_routing_replay.writer import RoutingWriter

    config = config_from_dict({
        "store": {"url": redis_server_clean.url, "namespace": "wttl"},
        "writer": {"mode": "thread", "journal_dir": str(tmp_path / "j"),
                   "dead_letter_dir": str(tmp_path / "d")},
        "retention": {"ttl_s": 3600, "sweep_interval_s": 3600}}, source="test")
    created = time.time()
    ids = np.zeros((2, 4, 2), dtype=np.uint8)
    with RoutingWriter.from_config(config) as writer:
        writer.submit_put("w_1:0:0", RoutingRecord("w_1:0:0", ids, 8, created=created))
        assert writer.flush(timeout=60)
    client = redis_server_clean.client()
    assert client.pexpiretime("rr:{wttl/w_1:0:0}") == round((created + 3600) * 1000)
    client.close()


@pytest.mark.redis
def test_doctor_does_not_flag_expired_entries(redis_ttl):
    from fd_routing_replay.cli.doctor import FAIL, OK, check_index

    store, client = redis_ttl
    store.put("live:0:0", _record("live:0:0", time.time()))
    store.put("gone:0:0", _record("gone:0:0", time.time()))
    _let_expire(store, client, "gone:0:0")
    assert check_index(store, 100).status == OK
    client.delete(store.inner.pkey("live:0:0"))   # a lost record still fails the check
    assert check_index(store, 100).status == FAIL
