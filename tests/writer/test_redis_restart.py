"""A real redis-server stopped and restarted under the writer: zero records lost."""

from __future__ import annotations

import pytest

from fd_routing_replay.codec import decode_record
from fd_routing_replay.store import open_store
from fd_routing_replay.writer import RoutingWriter
from tests.writer.conftest import NAMESPACE, make_record, wait_until

pytestmark = pytest.mark.redis


def test_redis_restart_loses_nothing(redis_server, tmp_path, mode, np_rng):
    store_config = {"url": redis_server.url, "namespace": NAMESPACE,
                    "redis": {"socket_timeout_s": 2.0}}
    writer = RoutingWriter(store_config, {
        "mode": mode, "journal_dir": str(tmp_path / "j"), "dead_letter_dir": str(tmp_path / "d"),
        "retry_deadline_s": 0.3, "retry_initial_backoff_s": 0.01, "retry_max_backoff_s": 0.2})
    try:
        expected = {}
        for index in range(50):
            key = f"redis_a:0:{index}"
            record = make_record(np_rng, key)
            expected[key] = record.ids.tobytes()
            writer.submit_put(key, record)
        assert writer.flush(timeout=60)
        redis_server.stop(save=True)
        for index in range(100):
            key = f"redis_b:0:{index}"
            record = make_record(np_rng, key)
            expected[key] = record.ids.tobytes()
            writer.submit_put(key, record)
        writer.submit_delete([f"redis_a:0:{i}" for i in range(10)])
        for index in range(10):
            expected.pop(f"redis_a:0:{index}")
        wait_until(lambda: writer.stats()["spilled"] > 0 and writer.stats()["store_errors"] >= 3,
                   "the writer to spill while Redis is down")
        redis_server.start()  # same port, data reloaded from the snapshot
        assert writer.flush(timeout=60)
        assert writer.stats()["dropped"] == 0 and writer.stats()["dead_lettered"] == 0
    finally:
        writer.close(timeout=10)
    reader = open_store(store_config)
    try:
        assert reader.list() == sorted(expected)
        for key, payload in expected.items():
            assert decode_record(reader.get(key)).ids.tobytes() == payload
    finally:
        reader.close()


def test_redis_password_rotation_is_retried_not_dead_lettered(tmp_path, mode, np_rng):
    """The writer already has the new password while the server still has the old one
    (WRONGPASS); the server switches within retry_deadline_s: nothing is dead-lettered."""
    from fdrr_dev.testing.redis import RedisServer
    from tests.redis_fixtures import _require_redis_server

    _require_redis_server()
    server = RedisServer(password="old-secret")
    server.start()
    store_config = {"url": f"redis://{server.host}:{server.port}/0", "namespace": NAMESPACE,
                    "redis": {"password": "new-secret", "socket_timeout_s": 2.0}}
    writer = RoutingWriter(store_config, {
        "mode": mode, "journal_dir": str(tmp_path / "j"), "dead_letter_dir": str(tmp_path / "d"),
        "retry_deadline_s": 30.0, "retry_initial_backoff_s": 0.01, "retry_max_backoff_s": 0.1})
    try:
        expected = {}
        for index in range(5):
            key = f"rotate:0:{index}"
            record = make_record(np_rng, key)
            expected[key] = record.ids.tobytes()
            writer.submit_put(key, record)
        wait_until(lambda: writer.stats()["store_errors"] >= 2, "WRONGPASS refusals")
        server.command("CONFIG", "SET", "requirepass", "new-secret")
        server.password = "new-secret"
        assert writer.flush(timeout=60)
        assert writer.stats()["dead_lettered"] == 0
        reader = open_store(store_config)
        try:
            for key, payload in expected.items():
                assert decode_record(reader.get(key)).ids.tobytes() == payload
        finally:
            reader.close()
    finally:
        writer.close(timeout=10)
        server.cleanup()
