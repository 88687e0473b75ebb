"""A put racing a delete of the same key, in every interleaving of their Redis round trips,
on one server and on a 3-master cluster: the record ends with both its payload and its
index entry, or with neither — never a payload ``list`` and prefix deletes cannot see, nor
an entry without payload.  Interleavings are forced step by step (tests/store/interleave.py),
never by timing."""

from __future__ import annotations

import pytest

from fd_routing_replay.errors import TransientStoreError
from fd_routing_replay.store import open_store
from fd_routing_replay.store.index.fsck import fsck
from tests.store.interleave import every_schedule, run_schedule

pytestmark = pytest.mark.redis

KEY, OLD, NEW = "race_1:0:0", b"old record", b"new record"
DELETES = {
    "delete_prefix": lambda store: store.delete_prefix(["race_1"]),
    "delete": lambda store: store.delete([KEY]),
    "clear": lambda store: store.clear(),
}


@pytest.fixture(params=["single", "cluster"])
def backing(request):
    """(url, flush) for a server or a cluster of our own."""
    if request.param == "single":
        server = request.getfixturevalue("redis_server")
        return server.url, server.flushall
    cluster = request.getfixturevalue("redis_cluster")
    cluster.flushall()
    return cluster.url, cluster.flushall


class _Race:
    """A deleter and a putter on their own clients, reset before every schedule."""

    def __init__(self, url: str, flush, delete_name: str, initially_stored: bool,
                 max_rounds: int = 1) -> None:
        self.flush = flush
        self.delete = DELETES[delete_name]
        self.initially_stored = initially_stored
        self.admin = open_store({"url": url, "namespace": "race"}, instrument=False)
        self.deleter = open_store({"url": url, "namespace": "race"}, instrument=False)
        self.putter = open_store({"url": url, "namespace": "race"}, instrument=False)
        self.raw = {id(s): s.client for s in (self.deleter, self.putter)}
        for store in (self.deleter, self.putter):
            # Each re-check round multiplies the schedules; one round already shows a race
            # (the op gives up and is retried, as callers do), two show the redo itself.
            store.index.max_rounds = max_rounds
        self.outcomes: set[bytes | None] = set()

    def _unstep(self) -> None:
        for store in (self.deleter, self.putter):
            store.client = store.index.client = self.raw[id(store)]

    def run(self, choices) -> tuple[list[int], list[int]]:
        """One schedule (choices, or a chooser: see interleave.run_schedule)."""
        self._unstep()
        self.flush()
        if self.initially_stored:
            self.admin.put(KEY, OLD)
        made, options, results = run_schedule(
            [(self.deleter, lambda: self.delete(self.deleter)),
             (self.putter, lambda: self.putter.put(KEY, NEW))], choices)
        self._unstep()
        for result, retry in zip(results, (lambda: self.delete(self.deleter),
                                           lambda: self.putter.put(KEY, NEW)), strict=True):
            if isinstance(result, TransientStoreError):  # it gave up: callers retry
                retry()
            elif isinstance(result, BaseException):
                raise result
        self.check(made)
        return made, options

    def check(self, schedule: list[int]) -> None:
        report = fsck(self.admin)
        assert report.consistent, (schedule, report.to_text())
        value = self.admin.get(KEY)
        assert value in (None, NEW), schedule
        assert self.admin.list() == ([] if value is None else [KEY]), schedule
        self.outcomes.add(value)

    def close(self) -> None:
        self._unstep()
        for store in (self.admin, self.deleter, self.putter):
            store.close()


@pytest.mark.parametrize("delete_name", sorted(DELETES))
@pytest.mark.parametrize("initially_stored", [True, False], ids=["overwrite", "create"])
def test_put_racing_a_delete_ends_with_both_or_neither(backing, delete_name,
                                                       initially_stored):
    url, flush = backing
    race = _Race(url, flush, delete_name, initially_stored)
    try:
        schedules = list(every_schedule(race.run))
    finally:
        race.close()
    assert len(schedules) >= 2  # at least: the put before, and after, the delete
    assert race.outcomes == {None, NEW}  # both orders happened


@pytest.mark.parametrize("delete_name", ["delete_prefix", "delete"])
def test_cluster_redo_rounds_settle_in_every_interleaving(redis_cluster, delete_name):
    """Two rounds each: the delete redoes a key a put re-indexed, the put redoes a write a
    delete removed, and every interleaving of those redos still ends with both or neither."""
    redis_cluster.flushall()
    race = _Race(redis_cluster.url, redis_cluster.flushall, delete_name, True, max_rounds=2)
    try:
        schedules = list(every_schedule(race.run))
    finally:
        race.close()
    assert max(len(schedule) for schedule in schedules) > 7  # some went to a second round
    assert race.outcomes == {None, NEW}


@pytest.mark.parametrize("where", ["single", "cluster"])
def test_a_whole_put_between_two_steps_of_a_prefix_delete(where, request):
    """The reported case: a prefix delete removed the payload (UNLINK), a put of the key
    ran, then the delete removed the index entry (ZREM) and left the new payload unindexed.
    Here the put runs whole before each round trip of the delete in turn."""
    if where == "single":
        server = request.getfixturevalue("redis_server")
        url, flush = server.url, server.flushall
    else:
        cluster = request.getfixturevalue("redis_cluster")
        url, flush = cluster.url, cluster.flushall
    race = _Race(url, flush, "delete_prefix", True)
    try:
        for position in range(8):  # deleter is actor 0, putter actor 1
            def choose(step, waiting, position=position):
                # The deleter's first `position` round trips, then the whole put.
                return 0 if (step < position and 0 in waiting) or 1 not in waiting else 1

            race.run(choose)
        assert race.outcomes == {None, NEW}
    finally:
        race.close()


def test_cluster_delete_gives_up_after_max_rounds_and_a_retry_settles(redis_cluster):
    """A put that re-indexes the key after every removal round makes the delete raise a
    TransientStoreError naming the key, never return with the store inconsistent."""
    from fd_routing_replay.store.index.prefix_index import PrefixIndex

    redis_cluster.flushall()
    store = open_store({"url": redis_cluster.url, "namespace": "race"})
    store.put(KEY, OLD)
    index: PrefixIndex = store.index
    index.max_rounds = 2

    def unlink_and_put_again(keys):  # a put lands after every payload delete
        flags = store.unlink_payloads(keys)
        store.put(KEY, NEW)
        return flags

    with pytest.raises(TransientStoreError, match="race_1:0:0.*concurrent put.*retry"):
        index.remove_then_delete([KEY], unlink_and_put_again)
    assert store.delete([KEY]) == 1
    assert fsck(store).consistent and store.list() == [] and store.get(KEY) is None
    store.close()


def test_cluster_put_gives_up_after_max_rounds(redis_cluster):
    redis_cluster.flushall()
    store = open_store({"url": redis_cluster.url, "namespace": "race"})
    store.index.max_rounds = 3
    writes = []

    def write_then_lose():  # a delete removes the payload after every write
        writes.append(1)
        store.client.unlink(store.pkey(KEY))

    with pytest.raises(TransientStoreError, match="race_1:0:0.*3 times.*retry the put"):
        store.index.add_confirmed(KEY, write_then_lose, store.payloads_exist)
    assert len(writes) == 3
    store.put(KEY, NEW)
    assert fsck(store).consistent and store.get(KEY) == NEW
    store.close()
