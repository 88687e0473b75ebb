"""fsck on the Redis store: crash debris of both kinds is found, reported and repaired."""

from __future__ import annotations

import pytest

from fd_routing_replay import cli
from fd_routing_replay.cli.common import EXIT_FSCK_ERROR
from fd_routing_replay.store import open_store
from fd_routing_replay.store.index.fsck import FsckReport, fsck

pytestmark = pytest.mark.redis


@pytest.fixture(params=["single", "cluster"])
def url(request):
    if request.param == "single":
        return request.getfixturevalue("redis_server_clean").url
    cluster = request.getfixturevalue("redis_cluster")
    cluster.flushall()
    return cluster.url


def _crash_debris(store, rng):
    """Simulate crashes: payloads written but never indexed, indexes never cleaned."""
    keys = [f"f_{i}:{t}:0" for i in range(rng.randint(5, 40)) for t in range(2)]
    for key in keys:
        store.put(key, key.encode())
    unindexed = sorted(rng.sample(keys, rng.randint(1, 8)))
    rest = [k for k in keys if k not in unindexed]
    dangling = sorted(rng.sample(rest, rng.randint(1, min(8, len(rest)))))
    store.index.remove(unindexed)  # crash after the payload write, before the index add
    store.unlink_payloads(dangling)  # the payload deleted without its entry (by hand)
    return keys, unindexed, dangling


def test_fsck_finds_and_repairs_both_kinds(url, rng):
    store = open_store({"url": url, "namespace": "fsck"})
    other = open_store({"url": url, "namespace": "fsck-other"})
    other.put("f_0:0:0", b"other")
    keys, unindexed, dangling = _crash_debris(store, rng)
    report = fsck(store, repair=False, batch=rng.randint(1, 10))
    assert isinstance(report, FsckReport)
    assert (report.unindexed, report.dangling) == (unindexed, dangling)
    assert report.indexed == len(keys) - len(unindexed)
    assert report.payloads == len(keys) - len(dangling)
    assert not report.consistent and "INCONSISTENT" in report.to_text()
    # the dry run changed nothing
    assert fsck(store).unindexed == unindexed
    repaired = fsck(store, repair=True)
    assert repaired.repaired and "repaired" in repaired.to_text()
    after = fsck(store)
    assert after.consistent and after.indexed == after.payloads == len(keys) - len(dangling)
    assert store.list() == sorted(set(keys) - set(dangling))
    assert all(store.get(k) == k.encode() for k in unindexed)  # no record was lost
    expected = len([k for k in keys if k.startswith("f_0:") and k not in dangling])
    assert store.delete_prefix(["f_0"]) == {"f_0": expected}
    assert other.list() == ["f_0:0:0"]
    store.close()
    other.close()


def test_fsck_command_line(redis_server_clean, rng, capsys):
    url = redis_server_clean.url
    store = open_store({"url": url, "namespace": "cli"})
    _, unindexed, dangling = _crash_debris(store, rng)
    args = ["fsck", "--store", url, "--namespace", "cli"]
    assert cli.main([*args, "--dry-run"]) == 1
    out = capsys.readouterr().out
    assert f"unindexed        {len(unindexed)}" in out
    assert f"dangling: {dangling[0]}" in out
    assert cli.main([*args, "--repair"]) == 0
    assert cli.main(args) == 0
    assert "result: consistent" in capsys.readouterr().out
    store.close()


def test_fsck_command_reports_unreachable_store(redis_server, capsys):
    url = redis_server.url
    redis_server.stop()
    code = cli.main(["fsck", "--store", url, "--namespace", "down"])
    assert code == EXIT_FSCK_ERROR  # could not check
    err = capsys.readouterr().err
    assert err.startswith("error: fsck of redis") and "Connection refused" in err, err


_WRITER = """
import sys
from fd_routing_replay.store import open_store
store = open_store({"url": sys.argv[1], "namespace": "crash"})
mode = sys.argv[2]
if mode == "put":
    for i in range(100000):
        key = f"c_{i % 50}:{i}:0"
        store.put(key, key.encode())
        print(key, flush=True)
else:
    for i in range(50):
        store.delete_prefix([f"c_{i}"])
        print(i, flush=True)
"""


def test_killed_writer_and_deleter_leave_only_repairable_debris(url):
    """SIGKILL mid-run: one node leaves no debris at all (one transaction per put and per
    page of a delete); a cluster leaves at worst unindexed payloads (entries go first on
    both sides) of the put or prefix in flight; every acknowledged put survives, every
    acknowledged delete stays done, and fsck --repair makes the store consistent."""
    import subprocess
    import sys

    def run_until(mode: str, lines: int) -> list[str]:
        proc = subprocess.Popen([sys.executable, "-c", _WRITER, url, mode],
                                stdout=subprocess.PIPE, text=True)
        done = [proc.stdout.readline().strip() for _ in range(lines)]
        proc.kill()
        proc.wait(timeout=30)
        proc.stdout.close()
        return done

    acknowledged = run_until("put", 600)
    store = open_store({"url": url, "namespace": "crash"})
    report = fsck(store)
    assert report.dangling == [] and len(report.unindexed) <= 1  # at most the put in flight
    fsck(store, repair=True)
    assert fsck(store).consistent
    assert all(store.get(key) == key.encode() for key in acknowledged)
    deleted_prefixes = run_until("delete", 20)
    report = fsck(store)
    assert report.dangling == []  # entries are removed first, never left behind
    in_flight = {key.split(":")[0] for key in report.unindexed}
    assert len(in_flight) <= 1 and not in_flight & {f"c_{i}" for i in deleted_prefixes}
    if not store.cluster:
        assert report.consistent
    fsck(store, repair=True)  # an unacknowledged delete's payloads are indexed again
    assert fsck(store).consistent
    for i in map(int, deleted_prefixes):
        assert store.list(f"c_{i}") == []
    store.close()


# -- record integrity, invalid keys and members, escaping ------------------------------------

def _raw_client(url):
    import redis

    if url.startswith("redis+cluster://"):
        return redis.RedisCluster.from_url("redis" + url[len("redis+cluster"):])
    return redis.Redis.from_url(url)


def test_fsck_finds_and_quarantines_records_that_cannot_be_read(url):
    """Missing chunks, a size that does not add up, a bad header and payloads of the wrong
    Redis type (indexed or not) are corrupt, not "consistent"; repair moves them to
    quarantine, untouched, and drops their entries."""
    from fd_routing_replay.errors import PermanentStoreError

    store = open_store({"url": url, "namespace": "integrity", "redis": {"chunk_bytes": 4}})
    raw = _raw_client(url)
    for key in ("chunk_1:0:0", "size_1:0:0", "head_1:0:0", "fine_1:0:0"):
        store.put(key, b"0123456789")  # three chunks of at most 4 bytes
    raw.hdel("rr:{integrity/chunk_1:0:0}", "1")
    raw.hset("rr:{integrity/size_1:0:0}", "2", b"8")
    raw.hset("rr:{integrity/head_1:0:0}", "n", b"three")
    raw.set("rr:{integrity/str_1:0:0}", b"not a hash")
    store.index.add(["str_1:0:0"])  # indexed, but a string
    raw.rpush("rr:{integrity/list_1:0:0}", b"x")  # unindexed, and a list
    with pytest.raises(PermanentStoreError):
        store.get("chunk_1:0:0")

    report = fsck(store)
    assert not report.consistent and report.layout_checked
    assert sorted(report.corrupt) == ["chunk_1:0:0", "head_1:0:0", "list_1:0:0", "size_1:0:0",
                                      "str_1:0:0"]
    assert "1 of its 3 chunk(s) are missing" in report.corrupt["chunk_1:0:0"]
    assert "hold 9 bytes but its header says 10" in report.corrupt["size_1:0:0"]
    assert "n=b'three'" in report.corrupt["head_1:0:0"]
    assert "wrong Redis type 'string'" in report.corrupt["str_1:0:0"]
    assert "wrong Redis type 'list'" in report.corrupt["list_1:0:0"]
    assert report.unindexed == [] and report.dangling == []  # the list is not "unindexed"
    text = report.to_text()
    assert "corrupt records  5" in text and "with --repair, quarantined payloads" in text

    repaired = fsck(store, repair=True)
    assert repaired.repaired and repaired.unresolved == []
    assert sorted(repaired.quarantined) == sorted(report.corrupt)
    for key, where in repaired.quarantined.items():
        assert where.startswith("'rr:quarantine:") and where.endswith(f"rr:{{integrity/{key}}}'")
        assert raw.exists(where[1:-1]) and not raw.exists(f"rr:{{integrity/{key}}}")
    moved = {name.decode() for name in raw.scan_iter(match="rr:quarantine:*")}
    assert len(moved) == 5
    assert raw.type(next(n for n in moved if n.endswith("str_1:0:0}"))) == b"string"
    assert "rr:quarantine:*" in repaired.to_text()
    after = fsck(store)
    assert after.consistent and store.list() == ["fine_1:0:0"]
    assert store.get("fine_1:0:0") == b"0123456789"
    store.close()
    raw.close()


def test_deep_fsck_verifies_rr_v1_checksums(redis_server_clean):
    import numpy as np

    from fd_routing_replay.codec import RoutingRecord, encode_record

    url = redis_server_clean.url
    store = open_store({"url": url, "namespace": "deep"})
    ids = np.arange(2 * 5 * 2, dtype=np.uint8).reshape(2, 5, 2) % 16
    good = encode_record(RoutingRecord("good_1:0:0", ids, num_experts=16))
    store.put("good_1:0:0", good)
    store.put("flip_1:0:0", good[:-1] + bytes([good[-1] ^ 1]))  # payload byte flipped
    store.put("raw_1:0:0", bytes(ids))  # fastdeploy-raw: no header, no checksum
    shallow = fsck(store)
    assert shallow.consistent and not shallow.deep  # the layout is fine
    deep = fsck(store, deep=True)
    assert list(deep.corrupt) == ["flip_1:0:0"]
    assert "checksum mismatch" in deep.corrupt["flip_1:0:0"]
    assert (deep.verified, deep.unverified) == (1, 1)
    assert "1 checksum(s) verified, 1 record(s) without a checksum" in deep.to_text()
    assert fsck(store, repair=True, deep=True).repaired
    assert store.list() == ["good_1:0:0", "raw_1:0:0"]
    assert fsck(store, deep=True).consistent
    store.close()


EVIL_NAMES = [b"../../evil:0:0", b"a\nb:0:0", b"\x1b[31mred:0:0", b"sp ace:0:0",
              b"bad\xff:0:0", b""]


def test_repair_quarantines_payloads_with_invalid_keys_instead_of_indexing_them(url, capsys):
    raw = _raw_client(url)
    store = open_store({"url": url, "namespace": "evil"})
    store.put("ok_1:0:0", b"ok")
    names = [b"rr:{evil/" + name + b"}" for name in EVIL_NAMES] + [b"rr:{evil/no-brace"]
    for name in names:
        raw.hset(name, mapping={"n": 1, "s": 2, "0": b"xx"})
    report = fsck(store)
    assert report.payloads == len(names) + 1 and report.unindexed == []
    assert sorted(report.invalid_payloads) == sorted(
        ["'../../evil:0:0'", "'a\\nb:0:0'", "'\\x1b[31mred:0:0'", "'sp ace:0:0'",
         "b'rr:{evil/bad\\xff:0:0}'", "''", "'rr:{evil/no-brace'"])
    text = report.to_text()
    assert "\x1b" not in text and "a\nb" not in text and "invalid payloads 7" in text

    repaired = fsck(store, repair=True)
    assert repaired.repaired, repaired.to_text()
    assert store.list() == ["ok_1:0:0"]  # nothing invalid was indexed
    assert list(store.index.raw_pages()) == [[b"ok_1:0:0"]]
    assert len(repaired.quarantined) == len(names)
    for name in names:
        assert not raw.exists(name)
    moved = list(raw.scan_iter(match="rr:quarantine:*"))
    assert sorted(m.split(b":", 3)[3] for m in moved) == sorted(names)
    assert all(raw.hget(m, "0") == b"xx" for m in moved)  # moved, not rewritten
    assert fsck(store).consistent

    # The command line prints the same escaped names.
    for name in names[:3]:
        raw.hset(name, mapping={"n": 1, "s": 2, "0": b"xx"})
    assert cli.main(["fsck", "--store", url, "--namespace", "evil"]) == 1
    out = capsys.readouterr().out
    assert "\x1b" not in out and "invalid payload: '../../evil:0:0'" in out
    assert "invalid payload: 'a\\nb:0:0'" in out
    assert cli.main(["fsck", "--store", url, "--namespace", "evil", "--repair"]) == 0
    assert "quarantined: '../../evil:0:0' -> 'rr:quarantine:" in capsys.readouterr().out
    store.close()
    raw.close()


def test_invalid_index_members_are_reported_not_fatal(url, caplog, capsys):
    """A member that is not UTF-8, or not a valid key, breaks neither ``ls`` nor ``fsck``:
    reads and deletes skip it with a warning, fsck lists it escaped, --repair drops it."""
    raw = _raw_client(url)
    store = open_store({"url": url, "namespace": "members"})
    for key in ("m_1:0:0", "m_1:1:0", "m_2:0:0"):
        store.put(key, b"v")
    bad = [b"m_1:\xff:0", b"m_1:\n:0", b"../m:0:0"]
    raw.zadd("rr:idx:{members}", dict.fromkeys(bad, 0))
    with caplog.at_level("WARNING", logger="fd_routing_replay.store.index"):
        assert store.list() == ["m_1:0:0", "m_1:1:0", "m_2:0:0"]
        assert store.list("m_1") == ["m_1:0:0", "m_1:1:0"]
    assert "not valid store keys" in caplog.text and "fd-rr fsck" in caplog.text
    assert cli.main(["ls", "--store", url, "--namespace", "members"]) == 0
    assert capsys.readouterr().out.split() == ["m_1:0:0", "m_1:1:0", "m_2:0:0"]

    report = fsck(store)
    assert report.indexed == 6 and report.dangling == []
    assert sorted(report.invalid_entries) == sorted(["b'm_1:\\xff:0'", "'m_1:\\n:0'",
                                                     "'../m:0:0'"])
    assert store.delete_prefix(["m_1"]) == {"m_1": 2}  # the valid ones only
    assert store.clear() == 1
    assert fsck(store, repair=True).repaired
    assert raw.zcard("rr:idx:{members}") == 0 and fsck(store).consistent
    store.close()
    raw.close()


def test_fsck_of_a_store_without_quarantine_leaves_and_reports(redis_server_clean):
    """A backend without ``quarantine`` (P2PStore) never indexes an invalid key; the repair
    leaves it in place, says so, and does not claim success."""
    store = open_store({"url": redis_server_clean.url, "namespace": "noq"})
    raw = _raw_client(redis_server_clean.url)
    raw.hset(b"rr:{noq/../x:0:0}", mapping={"n": 1, "s": 1, "0": b"x"})

    from fd_routing_replay.store.redis.store import RedisStore

    class WithoutQuarantine(RedisStore):  # an indexed backend without the optional hooks
        def supports_quarantine(self) -> bool:
            return False

        def supports_record_check(self) -> bool:
            return False

        def quarantine(self, items):
            raise AssertionError("fsck quarantined through a store that announced no quarantine")

        def payload_problems(self, keys):
            raise AssertionError("fsck checked layouts through a store that announced no check")

    bare = WithoutQuarantine(raw, "noq")
    report = fsck(bare, repair=True)
    assert not report.repaired and not report.layout_checked
    assert report.unresolved == [f"'../x:0:0': left in place and not indexed "
                                 f"({bare.describe()} cannot quarantine)"]
    assert "INCONSISTENT, 1 problem(s) left" in report.to_text()
    assert "not checked by this backend" in report.to_text()
    assert len(store.index) == 0
    store.close()
    raw.close()
