"""Shared fixtures: a random generator per test whose seed is printed on failure.

Seeds are fixed by default (``make test`` is deterministic): each test's seed is the CRC-32
of its node id mixed with a base, 0 unless ``FD_ROUTING_REPLAY_TEST_SEED`` names another.
``FD_ROUTING_REPLAY_TEST_SEED=random`` (``make test-random``) draws a fresh base per run to
hunt for seed-dependent failures; a failing test prints the seed that reproduces it.
"""

from __future__ import annotations

import gc
import os
import random
import zlib

import pytest

pytest_plugins = ["tests.redis_fixtures"]

# The FastDeploy contract tier runs in its own environment (`make contract`, .venv-fd),
# one FastDeploy version per process; the main suite does not collect it.  Nor the live
# tier (`make live`: FastDeploy's real server on a CPU, tests/live).
collect_ignore = []
if os.environ.get("FD_CONTRACT_TIER") != "1":
    collect_ignore.append("fastdeploy_contract")
if os.environ.get("FDRR_LIVE_TIER") != "1":
    collect_ignore.append("live")


@pytest.fixture(autouse=True, scope="module")
def _collect_cycles_after_each_module():
    """A background writer's ring (writer.capacity_bytes, 1 GiB by default, pre-faulted) is
    unmapped when its last view goes; views caught in reference cycles go only when the
    cyclic GC runs.  One production process holds one writer; a test session builds
    hundreds, so collect after each module to keep the session's memory flat."""
    yield
    gc.collect()


def _seed_base() -> int:
    text = os.environ.get("FD_ROUTING_REPLAY_TEST_SEED", "0").strip()
    if text == "random":
        return random.SystemRandom().randrange(2**32)
    try:
        return int(text)
    except ValueError:
        raise pytest.UsageError(f"FD_ROUTING_REPLAY_TEST_SEED must be an integer or 'random', "
                                f"got {text!r}") from None


_SEED_BASE = _seed_base()


@pytest.fixture
def seed(request) -> int:
    """This test's seed: fixed per test unless ``FD_ROUTING_REPLAY_TEST_SEED`` says otherwise.

    A failure prints ``FD_ROUTING_REPLAY_TEST_SEED=<base>`` with ``<base>`` the run's base; the
    per-test mix makes every test draw different inputs under one base."""
    value = (zlib.crc32(request.node.nodeid.encode()) ^ _SEED_BASE) & 0xFFFFFFFF
    request.node.user_properties.append(("seed", value))
    request.node.user_properties.append(("seed_base", _SEED_BASE))
    return value


@pytest.fixture
def rng(seed) -> random.Random:
    return random.Random(seed)


@pytest.fixture
def make_writer(tmp_path):
    """``make_writer(store, namespace=None, **options)``: an inline-mode
    :class:`~fd_routing_replay.writer.RoutingWriter` (every submit returns once stored: the
    production writer, without the wait) with its journal under ``tmp_path``, closed after
    the test.  ``store``: a URL, a dict or a config; ``options``: writer keywords."""
    from fdrr_dev.harness.wiring import inline_writer

    writers = []

    def make(store, namespace=None, **options):
        writer = inline_writer(store, namespace, state_dir=tmp_path / f"writer-{len(writers)}", **options)
        writers.append(writer)
        return writer

    yield make
    for writer in writers:
        writer.close()


def pytest_runtest_makereport(item, call):
    if call.when == "call" and call.excinfo is not None:
        props = dict(item.user_properties)
        if "seed" in props:
            item.add_report_section("call", "seed",
                                    f"this test's seed {props['seed']}; reproduce with "
                                    f"FD_ROUTING_REPLAY_TEST_SEED={props['seed_base']}")
