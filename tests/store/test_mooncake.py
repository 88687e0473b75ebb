"""The Mooncake Store backend against a real ``mooncake_master`` on loopback (TCP transport)
with its prefix index in a throwaway Redis."""

from __future__ import annotations

import importlib.util
import time

import pytest

from fd_routing_replay.config.stores.mooncake import mooncake_settings
from fd_routing_replay.errors import ConfigError, PermanentStoreError, TransientStoreError
from fd_routing_replay.store import open_store
from fd_routing_replay.store.index.fsck import fsck
from fd_routing_replay.store.mooncake.store import FRAME
from fdrr_dev.testing.mooncake import MooncakeMaster, mooncake_master_binary
from tests.store_conformance import StoreConformance

pytestmark = [pytest.mark.mooncake, pytest.mark.redis]

MISSING = [name for name in ("mooncake", "redis") if importlib.util.find_spec(name) is None]
REASON = (f"not installed: {', '.join(MISSING)} (pip install 'fd-routing-replay[mooncake]'; "
          "needs Debian libibverbs1)" if MISSING else
          "mooncake_master not found (it comes with mooncake-transfer-engine-non-cuda)")
SKIP = bool(MISSING) or mooncake_master_binary() is None
MiB = 2**20


def _require_client() -> None:
    if SKIP:
        pytest.skip(REASON)
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except ImportError as exc:  # e.g. libibverbs.so.1 missing
        pytest.skip(f"Mooncake's client does not import here: {exc} (Debian libibverbs1)")


def start_master(*extra: str) -> MooncakeMaster:
    _require_client()
    return MooncakeMaster(extra_args=extra).start()


@pytest.fixture
def master():
    server = start_master()
    try:
        yield server
    finally:
        server.cleanup()


def mooncake_config(master: MooncakeMaster, index_url: str, namespace: str, **section) -> dict:
    settings = {"master_server": master.address, "index_url": index_url,
                "master_http": master.admin, "global_segment_size": 64 * MiB,
                "local_buffer_size": 16 * MiB, "protocol": "tcp", **section}
    return {"type": "mooncake", "namespace": namespace, "mooncake": settings}


@pytest.fixture
def open_mc(master, redis_server_clean):
    """open_mc(namespace, **section) -> store on this test's master; all closed after."""
    stores = []

    def _open(namespace: str = "ns", *, on=None, **section):
        config = mooncake_config(on or master, redis_server_clean.url, namespace, **section)
        store = open_store(config, instrument=False)
        stores.append(store)
        return store

    yield _open
    for store in stores:
        store.close()


@pytest.fixture(scope="module")
def shared_master():
    server = start_master()
    try:
        yield server
    finally:
        server.cleanup()


class TestMooncakeConformance(StoreConformance):
    @pytest.fixture
    def master(self, shared_master):  # one master for the suite: its tests leave it running
        return shared_master

    @pytest.fixture
    def make_store(self, open_mc):
        return open_mc


# -- semantics --------------------------------------------------------------------------------

def test_put_replaces_and_frames_values(open_mc):
    store = open_mc()
    store.put("a_1:0:0", b"first")
    store.put("a_1:0:0", b"")  # Mooncake's own put would keep "first"; an empty value is fine
    assert bytes(store.get("a_1:0:0")) == b""
    raw = store.client.get("ns/a_1:0:0")
    assert raw == FRAME


def test_delete_right_after_get_is_forced_by_default(open_mc):
    store = open_mc()
    store.put("lease_1:0:0", b"v")
    assert bytes(store.get("lease_1:0:0")) == b"v"  # the read takes a lease
    assert store.client.remove("ns/lease_1:0:0") == -706  # what a plain remove gets
    assert store.delete(["lease_1:0:0"]) == 1
    assert store.get("lease_1:0:0") is None and store.list() == []


def test_leased_delete_without_force_fails_and_keeps_the_record():
    master = start_master("--default_kv_lease_ttl=10m")  # the lease outlives the test
    try:
        with _redis() as redis_url:
            store = open_store(mooncake_config(master, redis_url, "lease", force_remove=False,
                                               lease_wait_s=0), instrument=False)
            try:
                store.put("held_1:0:0", b"v")
                store.get("held_1:0:0")
                with pytest.raises(TransientStoreError, match="-706 OBJECT_HAS_LEASE"):
                    store.delete(["held_1:0:0"])
                with pytest.raises(TransientStoreError, match="leased"):
                    store.delete_prefix(["held_1"])
                assert store.list() == ["held_1:0:0"]  # entry restored, object kept
                assert bytes(store.get("held_1:0:0")) == b"v"
            finally:
                store.close()
    finally:
        master.cleanup()


def test_leased_delete_without_force_waits_for_the_lease():
    master = start_master("--default_kv_lease_ttl=300ms")
    try:
        with _redis() as redis_url:
            store = open_store(mooncake_config(master, redis_url, "wait", force_remove=False,
                                               lease_wait_s=60), instrument=False)
            try:
                store.put("wait_1:0:0", b"v")
                store.get("wait_1:0:0")
                assert store.delete(["wait_1:0:0"]) == 1
                assert store.get("wait_1:0:0") is None
            finally:
                store.close()
    finally:
        master.cleanup()


def test_record_larger_than_the_local_buffer_is_a_permanent_error(open_mc):
    store = open_mc(local_buffer_size=MiB)
    with pytest.raises(PermanentStoreError, match="local_buffer_size"):
        store.put("big_1:0:0", bytes(MiB))
    assert store.list() == [] and store.get("big_1:0:0") is None
    store.put("fits_1:0:0", bytes(MiB - len(FRAME)))
    assert len(store.get("fits_1:0:0")) == MiB - len(FRAME)


def test_full_store_refuses_puts_and_evicts_nothing_with_hard_pin(open_mc):
    store = open_mc(global_segment_size=16 * MiB, local_buffer_size=8 * MiB)
    value = bytes(3 * MiB)
    written = []
    with pytest.raises(TransientStoreError, match="NO_AVAILABLE_HANDLE"):
        for number in range(20):
            store.put(f"fill_{number}:0:0", value)
            written.append(f"fill_{number}:0:0")
    assert written, "not even one record fitted"
    assert store.list() == sorted(written)
    for key in written:  # nothing was evicted to make room
        assert len(store.get(key)) == len(value)
    assert store.delete_prefix(["fill_0"]) == {"fill_0": 1}
    store.put("after_1:0:0", value)  # room again


def test_no_segment_anywhere_is_a_clear_error(open_mc):
    store = open_mc(global_segment_size=0)
    with pytest.raises(TransientStoreError, match="no mounted segment has room"):
        store.put("nowhere_1:0:0", b"v")
    assert store.list() == []


def test_objects_of_another_namespace_and_foreign_objects_are_left_alone(open_mc):
    store, other = open_mc("mine"), open_mc("other")
    other.put("k_1:0:0", b"theirs")
    store.client.upsert("foreign-key", b"not ours")
    store.put("k_1:0:0", b"mine")
    assert store.clear() == 1
    assert bytes(other.get("k_1:0:0")) == b"theirs"
    assert store.client.get("foreign-key") == b"not ours"


# -- crash and restart ------------------------------------------------------------------------

def _put_until_accepted(store, key: str, value: bytes, deadline_s: float = 60.0) -> None:
    """Puts fail (transiently) until the client has re-registered with a new master."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            store.put(key, value)
            return
        except TransientStoreError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_master_crash_is_transient_and_restart_loses_the_objects(open_mc, master):
    store = open_mc()
    store.put("before_1:0:0", b"v1")
    store.put("before_2:0:0", b"v2")
    master.kill()  # a crash: SIGKILL
    with pytest.raises(TransientStoreError):
        store.put("during_1:0:0", b"x")
    with pytest.raises(TransientStoreError):
        store.get("before_1:0:0")  # an error, never a silent None
    assert "during_1:0:0" not in store.list()
    master.start()  # same ports, empty: the master keeps metadata in memory only
    _put_until_accepted(store, "after_1:0:0", b"v3")
    assert bytes(store.get("after_1:0:0")) == b"v3"
    assert store.get("before_1:0:0") is None  # forgotten with the old master
    assert not store.exists("before_2:0:0")
    assert store.list() == ["after_1:0:0", "before_1:0:0", "before_2:0:0"]
    report = fsck(store)
    assert report.dangling == ["before_1:0:0", "before_2:0:0"]
    assert fsck(store, repair=True).repaired
    assert store.list() == ["after_1:0:0"]
    assert fsck(store).consistent


def test_fsck_indexes_objects_missing_from_the_index(open_mc):
    store = open_mc()
    store.put("a_1:0:0", b"a")
    store.client.upsert("ns/orphan_1:0:0", FRAME + b"o")  # a put that crashed before its ZADD
    report = fsck(store)
    assert report.unindexed == ["orphan_1:0:0"] and report.dangling == []
    assert fsck(store, repair=True).repaired
    assert store.list() == ["a_1:0:0", "orphan_1:0:0"]


def test_fsck_without_master_http_says_what_is_missing(open_mc):
    store = open_mc(master_http="")
    with pytest.raises(PermanentStoreError, match="master_http"):
        fsck(store)


# -- config and doctor ------------------------------------------------------------------------

def test_url_options_override_the_section():
    from fd_routing_replay.config import load_config

    config = load_config(overrides={"store": {
        "url": "mooncake://10.0.0.5:50051?index_url=redis%3A%2F%2F10.0.0.6%3A6379%2F0"
               "&protocol=rdma&replica_num=2&force_remove=false&pin=soft"}})
    settings = mooncake_settings(config.store)
    assert settings.master_server == "10.0.0.5:50051"
    assert settings.index_url == "redis://10.0.0.6:6379/0"
    assert (settings.protocol, settings.replica_num, settings.force_remove, settings.pin) == \
        ("rdma", 2, False, "soft")


@pytest.mark.parametrize("query, message", [
    ("colour=red", r"unknown option\(s\) colour"),
    ("replica_num=0", r"store\.mooncake\.replica_num: must be >= 1"),
    ("pin=sticky", r"store\.mooncake\.pin: invalid value 'sticky'"),
    ("force_remove=maybe", r"store\.mooncake\.force_remove"),
    ("master_server=h%3A2", "the master is the URL's host:port"),
])
def test_url_options_are_checked_as_the_section_declares_them_at_load(query, message):
    """A URL's options go through the typed section: a bad one fails loading the config."""
    from fd_routing_replay.config import load_config

    with pytest.raises(ConfigError, match=message):
        load_config(overrides={"store": {"url": f"mooncake://h:1?index_url=redis%3A%2F%2Fh%3A6379&{query}"}})


def test_missing_master_or_index_is_a_config_error():
    from fd_routing_replay.config import load_config

    with pytest.raises(ConfigError, match="master_server is required"):
        load_config(overrides={"store": {"type": "mooncake"}})
    with pytest.raises(ConfigError, match="index_url is required"):
        load_config(overrides={"store": {"type": "mooncake", "mooncake": {"master_server": "h:1"}}})
    with pytest.raises(ConfigError, match="index_url is required"):   # a StoreConfig built without load
        open_store({"url": "mooncake://h:1"})


def test_doctor_checks_a_mooncake_store(master, redis_server_clean):
    from fd_routing_replay.cli.doctor import diagnose
    from fd_routing_replay.config import load_config

    config = load_config(overrides={"store": mooncake_config(master, redis_server_clean.url,
                                                             "doc")})
    report = diagnose(config.store, timeout_s=5)
    status = {check.name: check.status for check in report.checks}
    assert status == {"config": "ok", "rdma": "ok", "redis": "ok", "mooncake": "ok",
                      "store": "ok", "roundtrip": "ok", "index": "ok"}, report.to_text()
    assert "store.mooncake.protocol is tcp" in report.checks[1].summary
    master.stop()
    report = diagnose(config.store, timeout_s=2)
    checks = {check.name: check for check in report.checks}
    assert report.failed and checks["mooncake"].status == "fail"
    assert "does not answer" in checks["mooncake"].summary


class _redis:
    """A throwaway redis-server for tests that need their own master: ``with _redis() as url``."""

    def __enter__(self) -> str:
        from fdrr_dev.testing.redis import RedisServer, redis_server_binary

        if redis_server_binary() is None:
            pytest.skip("redis-server not found (Debian package redis-server)")
        self.server = RedisServer().start()
        return self.server.url

    def __exit__(self, *exc: object) -> None:
        self.server.cleanup()


def test_records_outlive_their_writer_in_a_dedicated_segment_holder(open_mc):
    from fdrr_dev.testing.mooncake import MooncakeSegmentHolder

    master = start_master("--client_ttl=2")  # a dead holder is dropped after 2 s
    holder = MooncakeSegmentHolder(master).start()
    try:
        writer = open_mc("kept", on=master, global_segment_size=0)  # contributes no memory
        writer.put("kept_1:0:0", b"survives")
        writer.close()
        reader = open_mc("kept", on=master, global_segment_size=0)
        assert bytes(reader.get("kept_1:0:0")) == b"survives"
        holder.stop()  # the memory holding it goes away: errors, then None
        assert _eventually_gone(reader, "kept_1:0:0")
    finally:
        holder.stop()
        master.cleanup()


def test_records_in_a_closed_writers_segment_are_gone(open_mc):
    writer = open_mc("gone")  # mounts a segment: its records live there
    reader = open_mc("gone", global_segment_size=0)
    writer.put("w_1:0:0", b"v")
    assert bytes(reader.get("w_1:0:0")) == b"v"
    writer.close()  # unmounts the segment; the master drops its objects
    assert reader.get("w_1:0:0") is None
    assert reader.list() == ["w_1:0:0"]  # until fsck --repair
    assert fsck(reader, repair=True).dangling == ["w_1:0:0"]
    assert reader.list() == []


def _eventually_gone(store, key: str, deadline_s: float = 60.0) -> bool:
    """After a holder dies the master drops its segment once the client TTL lapses."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            if store.get(key) is None:
                return True
        except TransientStoreError:
            pass  # the transfer from the dead holder failed: an error, not stale bytes
        time.sleep(0.2)
    return False


def test_a_master_whose_random_port_was_taken_starts_on_others():
    """fdrr_dev.testing: a port taken between picking it and binding it is picked again at
    the first start (the soak's servers start one after another for an hour)."""
    import socket

    _require_client()
    master = MooncakeMaster()
    taken = master.metrics_port
    with socket.socket() as blocker:
        blocker.bind((master.host, taken))
        blocker.listen()
        try:
            master.start()
            assert master.healthy() and master.metrics_port != taken
            master.kill()
            master.start()  # a restart keeps the ports clients know
            assert master.healthy() and master.metrics_port not in (taken, 0)
        finally:
            master.cleanup()
