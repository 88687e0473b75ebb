"""Redis fixtures for every test (a pytest plugin loaded by tests/conftest.py):
throwaway servers on free loopback ports.

- ``redis_server``: a fresh single server per test (safe to stop/restart in the test).
- ``redis_server_session``: one server shared by the session; use your own namespace or
  ``redis_server_clean`` (the same server, FLUSHALL'd before the test).
- ``redis_cluster``: one 3-master Redis Cluster shared by the session.

Each skips with the reason when the binary is missing and stops what it started.
"""

from __future__ import annotations

import pytest

from fdrr_dev.testing.redis import (
    RedisCluster,
    RedisServer,
    redis_cli_binary,
    redis_server_binary,
)


def _require_redis_server() -> None:
    if redis_server_binary() is None:
        pytest.skip("redis-server binary not found (PATH or /usr/bin/redis-server); "
                    "install the Debian package redis-server")


@pytest.fixture
def redis_server():
    """A fresh redis-server for one test; stopped and removed afterwards."""
    _require_redis_server()
    server = RedisServer()
    try:
        server.start()
        yield server
    finally:
        server.cleanup()


@pytest.fixture(scope="session")
def redis_server_session():
    """One redis-server shared by the whole session."""
    _require_redis_server()
    server = RedisServer()
    try:
        server.start()
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def redis_server_clean(redis_server_session):
    """The session server, emptied (FLUSHALL) before the test."""
    if not redis_server_session.running:
        redis_server_session.start()
    redis_server_session.flushall()
    return redis_server_session


@pytest.fixture(scope="session")
def redis_cluster():
    """A 3-master Redis Cluster on loopback shared by the session."""
    _require_redis_server()
    if redis_cli_binary() is None:
        pytest.skip("redis-cli not found; it is needed to create a Redis Cluster "
                    "(Debian package redis-tools)")
    cluster = RedisCluster(3)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.cleanup()
