"""``only_last_turn``: exact previous-turn deletes and no resurrection of a late turn
(issue 10, items 2 and 3), through the writer and the turns module itself."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from fd_routing_replay.codec import RoutingRecord, encode_record
from fd_routing_replay.errors import InvalidRolloutId
from fd_routing_replay.keys import parse_rollout_id
from fd_routing_replay.store import open_store
from fd_routing_replay.writer.operation import completes_turn, turn_layer_count
from fd_routing_replay.writer.record import later_turn, retire_turn, turn_keys
from tests.writer.conftest import make_record, wait_until

# Other rollouts whose keys start with the previous turn's key "job:0:0" (bases with ':').
NEIGHBOURS = ["job:0:0:0:0", "job:0:0:0:1", "job:0:0_7:0:0"]


@pytest.fixture
def memory_store():
    with open_store(f"memory://turns-{uuid.uuid4().hex[:12]}") as store:
        yield store


def _record(rollout_id: str, rng: np.random.Generator, layers: int = 3) -> RoutingRecord:
    return RoutingRecord(rollout_id, rng.integers(0, 16, (layers, 4, 2)).astype(np.uint8), 16)


def _per_layer(rollout_id: str, rng: np.random.Generator, layers: int = 3):
    for layer in range(layers):
        record = RoutingRecord(rollout_id, rng.integers(0, 16, (1, 4, 2)).astype(np.uint8), 16,
                               metadata={"layer": layer, "num_layers": layers})
        yield f"{rollout_id}_{layer}", record


# -- which put completes a turn ---------------------------------------------------------------

def test_which_put_completes_a_turn_is_read_from_the_key(np_rng):
    """The writer's rule: a fused key completes its turn; a
    per-layer key only when it names the last layer of ``metadata["num_layers"]``."""
    fused = _record("job:1:0", np_rng)
    assert completes_turn("job:1:0", fused) and turn_layer_count("job:1:0", fused) == 3
    keys = [(key, record) for key, record in _per_layer("job:1:0", np_rng)]
    assert [completes_turn(key, record) for key, record in keys] == [False, False, True]
    assert [turn_layer_count(key, record) for key, record in keys] == [3, 3, 3]
    bare = RoutingRecord("job:1:0", fused.ids[:1], 16)               # no num_layers
    assert not completes_turn("job:1:0_0", bare) and turn_layer_count("job:1:0_4", bare) == 5
    with pytest.raises(InvalidRolloutId):
        completes_turn("job:2:0", fused)


# -- item 2: exact keys ------------------------------------------------------------------------

def test_writer_deletes_only_the_previous_turns_own_keys(rig, np_rng):
    for key in NEIGHBOURS:
        rig.reader.put(key, encode_record(make_record(np_rng, key)))
    rig.reader.put("job:0:0", encode_record(make_record(np_rng, "job:0:0")))
    writer = rig.writer(only_last_turn=True)
    assert writer.submit_put("job:1:0", make_record(np_rng, "job:1:0"))
    assert writer.flush(timeout=60)
    assert rig.reader.list() == sorted(NEIGHBOURS + ["job:1:0"])


def test_writer_per_layer_deletes_previous_turns_layer_keys_only(rig, np_rng):
    rng = np.random.default_rng(int(np_rng.integers(1 << 30)))
    for key, record in _per_layer("pj:0:0", rng):
        rig.reader.put(key, encode_record(record))
    for key in ("pj:0:0:0:0", "pj:0:0_x:0:0"):
        rig.reader.put(key, encode_record(make_record(np_rng, key)))
    writer = rig.writer(only_last_turn=True)
    for key, record in _per_layer("pj:1:0", rng):
        writer.submit_put(key, record)
    assert writer.flush(timeout=60)
    assert rig.reader.list() == sorted(["pj:0:0:0:0", "pj:0:0_x:0:0", "pj:1:0_0", "pj:1:0_1",
                                        "pj:1:0_2"])


# -- item 3: a late turn is never resurrected ----------------------------------------------------

def test_writer_turns_finishing_out_of_order_keep_only_the_last(rig, np_rng):
    writer = rig.writer(only_last_turn=True)
    latest = make_record(np_rng, "ooo:1:0")
    writer.submit_put("ooo:1:0", latest)
    writer.submit_put("ooo:0:0", make_record(np_rng, "ooo:0:0"))
    writer.submit_put("ooo:0:1", make_record(np_rng, "ooo:0:1"))  # other segment: kept
    assert writer.flush(timeout=60)
    assert rig.reader.list() == ["ooo:0:1", "ooo:1:0"]
    assert rig.read("ooo:1:0").ids.tobytes() == latest.ids.tobytes()
    assert writer.stats()["superseded"] == 1


def test_per_layer_turns_out_of_order_keep_only_the_last(rig, np_rng):
    rng = np.random.default_rng(int(np_rng.integers(1 << 30)))
    writer = rig.writer(only_last_turn=True)
    for rollout_id in ("pool:2:0", "pool:1:0"):
        for key, record in _per_layer(rollout_id, rng):
            writer.submit_put(key, record)
    assert writer.flush(timeout=60)
    assert rig.reader.list() == ["pool:2:0_0", "pool:2:0_1", "pool:2:0_2"]


def test_two_writers_one_spilling_do_not_resurrect_the_old_turn(rig, np_rng, tmp_path):
    """Writer A spills turn 0 (its store connection is down) while writer B stores turn 1;
    when A replays turn 0, it must not survive."""
    a_down = tmp_path / "a-down.flag"
    a_down.touch()
    a = rig.writer(only_last_turn=True, store_options={"down_flag": str(a_down)},
                   journal_dir=str(tmp_path / "ja"), dead_letter_dir=str(tmp_path / "da"))
    b = rig.writer(only_last_turn=True, journal_dir=str(tmp_path / "jb"),
                   dead_letter_dir=str(tmp_path / "db"))
    a.submit_put("two:0:0", make_record(np_rng, "two:0:0"))
    wait_until(lambda: a.stats()["journal_entries"] >= 1, "writer A to spill turn 0")
    latest = make_record(np_rng, "two:1:0")
    b.submit_put("two:1:0", latest)
    assert b.flush(timeout=60)
    assert rig.reader.list() == ["two:1:0"]
    a_down.unlink()
    assert a.flush(timeout=60)
    assert rig.reader.list() == ["two:1:0"]
    assert rig.read("two:1:0").ids.tobytes() == latest.ids.tobytes()
    assert a.stats()["superseded"] == 1


# -- the turns module: interleavings of two writers on one store ----------------------------------

def test_retire_after_both_puts_removes_the_late_turn(memory_store):
    """A puts t; B puts t+1 and retires it; A retires t: A sees t+1 and deletes t."""
    memory_store.put("r:0:0", b"t")
    memory_store.put("r:1:0", b"t+1")
    assert retire_turn(memory_store, "r:1:0", 0).previous_deleted == 1
    memory_store.put("r:0:0", b"t (late put)")
    retired = retire_turn(memory_store, "r:0:0", 0)
    assert retired.superseded_by == 1 and retired.own_deleted == 1
    assert memory_store.list() == ["r:1:0"]


def test_late_writer_listing_first_is_covered_by_the_other_writers_retirement(memory_store):
    """A puts t and lists before B's put of t+1: B's retirement deletes t."""
    memory_store.put("q:0:0", b"t")
    assert retire_turn(memory_store, "q:0:0", 0).superseded_by is None
    memory_store.put("q:1:0", b"t+1")
    retire_turn(memory_store, "q:1:0", 0)
    assert memory_store.list() == ["q:1:0"]


def test_an_incomplete_later_turn_does_not_count(memory_store):
    memory_store.put("inc:0:0", b"t")
    memory_store.put("inc:1:0_0", b"layer 0 of t+1 only")
    assert later_turn(memory_store, parse_rollout_id("inc:0:0"), 2) is None
    memory_store.put("inc:1:0_1", b"layer 1")
    assert later_turn(memory_store, parse_rollout_id("inc:0:0"), 2) == 1
    memory_store.put("inc:0:0:5:0", b"another rollout (base inc:0:0)")
    memory_store.put("inc:3:1", b"another segment")
    assert later_turn(memory_store, parse_rollout_id("inc:2:0"), 2) is None


def test_turn_keys():
    assert turn_keys("a:1:0", 2) == ["a:1:0", "a:1:0_0", "a:1:0_1"]
    assert turn_keys("a:1:0", 0) == ["a:1:0"]


def test_submit_retire_replays_a_retirement(rig, np_rng):
    for key in ("rr:0:0", "rr:0:0_0", "rr:1:0", "rr:0:0:0:0"):
        rig.reader.put(key, encode_record(make_record(np_rng, "rr:0:0")))
    writer = rig.writer()
    writer.submit_retire("rr:1:0", layer_count=1)
    assert writer.flush(timeout=60)
    assert rig.reader.list() == ["rr:0:0:0:0", "rr:1:0"]
