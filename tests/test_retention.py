"""Retention: the sweeper (fake clock), the writer's sweeper thread, fd-rr rm --older-than."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from fd_routing_replay.cli import main
from fd_routing_replay.codec import RoutingRecord, encode_record
from fd_routing_replay.errors import ConfigError
from fd_routing_replay.retention import parse_duration, sweep
from fd_routing_replay.store import open_store
from fd_routing_replay.store.memory import MemoryStore

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
    from fd_routing_replay.writer import RoutingWriter
    from fd_routing_replay.writing.directories import RankIdentity
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
        assert other._sweeper is None
    with RoutingWriter.from_config(config) as writer:
        wait_until(lambda: writer._sweeper.sweeps >= 1 and "old:0:0" not in store.list(),
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
