"""``capture.encoding: set`` end to end: writer (thread and process mode) → local store →
RoutingReader, checked against the sorted input; and the paths around it (engine-side
spills re-encoded at replay, rows that are no sets written plain)."""

from __future__ import annotations

import numpy as np

from fd_routing_replay.codec import RoutingRecord, read_header
from fd_routing_replay.config import config_from_dict
from fd_routing_replay.reader import RoutingReader
from fd_routing_replay.writer import RoutingWriter
from tests.writer.conftest import wait_until

NUM_EXPERTS, TOP_K = 160, 6


def set_record(np_rng: np.random.Generator, rollout_id: str, layers: int = 3,
               tokens: int = 50) -> RoutingRecord:
    """Rows of TOP_K distinct expert ids in router order, a few padding rows."""
    keys = np_rng.random((layers * tokens, NUM_EXPERTS))
    ids = np.argsort(keys, axis=1)[:, :TOP_K].astype(np.uint8).reshape(layers, tokens, TOP_K)
    ids[np_rng.random((layers, tokens)) < 0.1] = 255
    return RoutingRecord(rollout_id, ids, NUM_EXPERTS, metadata={"turn": 0})


def test_set_encoded_records_read_back_sorted(tmp_path, mode, np_rng):
    config = config_from_dict({
        "store": {"type": "local", "namespace": "sets", "local": {"root": str(tmp_path / "s")}},
        "writer": {"mode": mode, "journal_dir": str(tmp_path / "j"),
                   "dead_letter_dir": str(tmp_path / "d")},
        "capture": {"encoding": "set"},
    })
    expected = {}
    writer = RoutingWriter.from_config(config)
    try:
        for index in range(6):
            record = set_record(np_rng, f"exp_sets_{index}:0:0", tokens=int(np_rng.integers(0, 80)))
            expected[record.rollout_id] = record.ids.copy()
            assert writer.submit_put(record.rollout_id, record)
        not_a_set = set_record(np_rng, "exp_sets_dup:0:0")
        not_a_set.ids[1, 0, :2] = 7  # a duplicate: stored plain, exactly as given
        duplicate = not_a_set.ids.copy()
        assert writer.submit_put("exp_sets_dup:0:0", not_a_set)
        assert writer.flush(timeout=60)
        assert writer.stats()["written"] == 7
    finally:
        writer.close(timeout=30)
    with RoutingReader(config.store) as reader:
        for rollout_id, ids in expected.items():
            record = reader.get(rollout_id)
            assert record is not None and record.ids.dtype == ids.dtype
            np.testing.assert_array_equal(record.ids, np.sort(ids, axis=2))
            assert record.metadata == {"turn": 0}
            stored = reader.store.get(rollout_id)
            assert read_header(stored).encoding == "set"
            plain_bytes = ids.nbytes
            assert read_header(stored).payload_length < plain_bytes or not ids.size
        stored = reader.store.get("exp_sets_dup:0:0")
        assert read_header(stored).encoding == "plain"
        np.testing.assert_array_equal(reader.get("exp_sets_dup:0:0").ids, duplicate)


PAYLOAD_ROWS = 512
CAPACITY = 4 * 3 * PAYLOAD_ROWS * TOP_K  # four records fit in the ring


def test_records_spilled_by_the_engine_are_stored_set_encoded(rig, np_rng):
    """The engine-side spill journals plain records (no encoding on the engine's side);
    the worker re-encodes them when it replays the journal."""
    writer = RoutingWriter(rig.store_config(), rig.writer_config(capacity_bytes=CAPACITY,
                                                                full_policy="spill"),
                           encoding="set")
    rig.writers.append(writer)
    rig.close_gate()
    expected = {}
    for index in range(10):
        record = set_record(np_rng, f"spill:0:{index}", tokens=PAYLOAD_ROWS)
        expected[record.rollout_id] = record.ids.copy()
        writer.submit_put(record.rollout_id, record)
    wait_until(lambda: writer.stats()["spilled"] >= 6, "six records spilled")
    rig.open_gate()
    assert writer.flush(timeout=60)
    for rollout_id, ids in expected.items():
        stored = rig.reader.get(rollout_id)
        assert read_header(stored).encoding == "set", rollout_id
        np.testing.assert_array_equal(rig.read(rollout_id).ids, np.sort(ids, axis=2))
