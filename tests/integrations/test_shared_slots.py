"""The shared slot cache of FastDeploy 2.6's split: slots and the workers' counter rows."""

from __future__ import annotations

import os

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from fd_routing_replay.capture import render_capture
from fd_routing_replay.capture.slots import STAT_FIELDS, SharedSlotCache, shared_slots_name
from fd_routing_replay.errors import ConfigError
from fd_routing_replay.metrics import SnapshotCollector


@pytest.fixture
def name():
    return shared_slots_name(f"test-{os.getpid()}-{np.random.default_rng().integers(1 << 30)}")


def test_worker_counters_reach_the_engine_through_the_segment(name, seed):
    rng = np.random.default_rng(seed)
    engine = SharedSlotCache(name, 32, 3, 2, np.uint8, 255, create=True, stat_ranks=2)
    worker = SharedSlotCache(name, 32, 3, 2, np.uint8, 255, create=False, stat_ranks=2)
    try:
        assert engine.rank_stats() == {}                       # nobody published yet
        assert (worker.array == 255).all()
        rows = rng.integers(0, 255, size=(5, 3, 2), dtype=np.uint8)
        worker.array[[1, 7, 8, 20, 31]] = rows                  # slots still shared
        np.testing.assert_array_equal(engine.array[[1, 7, 8, 20, 31]], rows)
        stats = {key: int(rng.integers(0, 1 << 40)) for key in STAT_FIELDS}
        stats["hook_seconds"] = 0.25
        worker.publish(1, {**stats, "dtype": "uint8", "unrelated": 3})
        assert engine.rank_stats() == {1: {key: float(v) for key, v in stats.items()}}
        worker.publish(1, {"steps": 9})                          # missing keys read as 0
        assert engine.rank_stats()[1]["steps"] == 9 and engine.rank_stats()[1]["hook_errors"] == 0
        with pytest.raises(ValueError, match="rank 2"):
            worker.publish(2, stats)
    finally:
        worker.close()
        engine.close()


def test_a_worker_expecting_more_ranks_than_the_engine_made_is_refused(name):
    engine = SharedSlotCache(name, 64, 2, 2, np.uint8, 255, create=True, stat_ranks=1)
    try:
        with pytest.raises(ConfigError, match="disagree"):
            SharedSlotCache(name, 64, 2, 2, np.uint8, 255, create=False, stat_ranks=4096)
    finally:
        engine.close()
    with pytest.raises(FileNotFoundError):                      # the owner unlinked it
        SharedSlotCache(name, 64, 2, 2, np.uint8, 255, create=False)


def test_engine_metrics_carry_one_series_per_worker_rank():
    registry = CollectorRegistry()
    labels = {"namespace": "ns", "store": "local", "rank": "dp2-tp0"}
    snapshot = {"records_failed": 1, "ranks": {"dp2-tp0": {"hook_errors": 0.0, "bad_expert_ids": 3.0},
                                               "dp2-tp1": {"hook_errors": 5.0, "bad_expert_ids": 0.0}}}
    registry.register(SnapshotCollector(lambda: snapshot, render_capture, labels))
    assert registry.get_sample_value("fd_rr_capture_records_failed_total", labels) == 1
    assert registry.get_sample_value("fd_rr_capture_bad_expert_ids_total", labels) == 3
    assert registry.get_sample_value("fd_rr_capture_hook_errors_total",
                                     {**labels, "rank": "dp2-tp1"}) == 5
    assert registry.get_sample_value("fd_rr_capture_records_failed_total",
                                     {**labels, "rank": "dp2-tp1"}) is None
