"""Shared fixtures: a fresh random generator per test whose seed is printed on failure."""

from __future__ import annotations

import gc
import os
import random

import pytest

pytest_plugins = ["tests.redis_fixtures"]

# The FastDeploy contract tier runs in its own environment (`make contract`, .venv-fd),
# one FastDeploy version per process; the main suite does not collect it.
if os.environ.get("FD_CONTRACT_TIER") != "1":
    collect_ignore = ["fastdeploy_contract"]


@pytest.fixture(autouse=True, scope="module")
def _collect_cycles_after_each_module():
    """A background writer's ring (writer.capacity_bytes, 1 GiB by default, pre-faulted) is
    unmapped when its last view goes; views caught in reference cycles go only when the
    cyclic GC runs.  One production process holds one writer; a test session builds
    hundreds, so collect after each module to keep the session's memory flat."""
    yield
    gc.collect()


@pytest.fixture
def seed(request) -> int:
    value = int(os.environ.get("FD_ROUTING_REPLAY_TEST_SEED", random.SystemRandom().randrange(2**32)))
    request.node.user_properties.append(("seed", value))
    return value


@pytest.fixture
def rng(seed) -> random.Random:
    return random.Random(seed)


def pytest_runtest_makereport(item, call):
    if call.when == "call" and call.excinfo is not None:
        for name, value in item.user_properties:
            if name == "seed":
                item.add_report_section("call", "seed",
                                        f"reproduce with FD_ROUTING_REPLAY_TEST_SEED={value}")
