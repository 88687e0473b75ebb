"""fsck on the Redis store: crash debris of both kinds is found, reported and repaired."""

from __future__ import annotations

import pytest

from fd_routing_replay import cli
from fd_routing_replay.store import open_store
from fd_routing_replay.store.fsck import FsckReport, fsck

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
    dangling = sorted(rng.sample(rest, rng.randint(1, 8)))
    store.index.remove(unindexed)  # crash after the payload write, before the index add
    store._delete_payloads(dangling)  # crash after the payload delete, before the index remove
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
    assert code == 2
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
    """SIGKILL mid-run: puts leave at worst unindexed payloads, deletes at worst dangling
    entries; every acknowledged put survives; fsck --repair makes the store consistent."""
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
    assert report.unindexed == []  # a killed delete leaves only dangling entries
    fsck(store, repair=True)
    assert fsck(store).consistent
    for i in map(int, deleted_prefixes):
        assert store.list(f"c_{i}") == []
    store.close()
