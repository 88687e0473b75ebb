"""RoutingWriter against a real local store with injected faults, in thread and process mode.

Every test checks what actually landed in the store (read back and decoded) against the
numpy arrays that were submitted.  Synchronisation uses flush(), writer stats and fault
files — never sleeps.
"""

from __future__ import annotations

import logging
import os
import signal

import numpy as np
import pytest

from fd_routing_replay.codec import RoutingRecord, decode_record
from fd_routing_replay.errors import InvalidRolloutId, RecordError, RoutingReplayError
from tests.writer.conftest import make_record, wait_until


def _assert_stored(rig, expected: dict[str, np.ndarray]) -> None:
    missing = [key for key in expected if rig.reader.get(key) is None]
    assert not missing, f"{len(missing)} records missing, e.g. {missing[:5]}"
    for key, ids in expected.items():
        record = rig.read(key)
        assert key.startswith(record.rollout_id)
        assert record.ids.dtype == ids.dtype and record.ids.shape == ids.shape, key
        assert record.ids.tobytes() == ids.tobytes(), f"payload of {key} differs"


def test_burst_of_10k_records_all_readable_byte_identical(rig, np_rng):
    writer = rig.writer()
    expected = {}
    for index in range(10_000):
        key = f"burst:0:{index}"
        record = make_record(np_rng, key, shape=(2, 8, 4))
        expected[key] = record.ids.copy()
        assert writer.submit_put(key, record)
    assert writer.flush(timeout=120)
    stats = writer.stats()
    assert stats["submitted"] == 10_000 and stats["written"] == 10_000
    assert stats["dropped"] == 0 and stats["dead_lettered"] == 0 and stats["pending_ops"] == 0
    assert sorted(rig.reader.list("burst")) == sorted(expected)
    _assert_stored(rig, expected)


def test_submit_copies_the_payload(rig, np_rng):
    """The caller may reuse its buffer as soon as submit_put returns."""
    writer = rig.writer()
    rig.close_gate()  # nothing is written while we scribble over the source
    record = make_record(np_rng, "copy:0:0")
    original = record.ids.copy()
    writer.submit_put("copy:0:0", record)
    record.ids[...] = 0
    rig.open_gate()
    assert writer.flush(timeout=60)
    assert rig.read("copy:0:0").ids.tobytes() == original.tobytes()


def test_store_unavailable_then_back_loses_nothing(rig, np_rng):
    writer = rig.writer()
    rig.down()
    expected = {}
    for index in range(300):
        key = f"down:{index % 7}:{index}"
        record = make_record(np_rng, key)
        expected[key] = record.ids.copy()
        writer.submit_put(key, record)
    writer.submit_put("gone:0:0", make_record(np_rng, "gone:0:0"))
    writer.submit_delete(["gone:0:0"])
    # Down long enough to give up retrying, spill, and fail several probes.
    wait_until(lambda: writer.stats()["spilled"] > 0 and writer.stats()["store_errors"] >= 5,
               "spills and repeated store errors while the store is down")
    assert writer.flush(timeout=0.2) is False
    assert rig.reader.list() == []
    rig.up()
    assert writer.flush(timeout=60)
    _assert_stored(rig, expected)
    assert rig.reader.get("gone:0:0") is None
    stats = writer.stats()
    assert stats["written"] >= 301 and stats["journal_entries"] == 0
    assert stats["retries"] > 0 and stats["dropped"] == 0
    assert writer.journal.scan() == []


@pytest.mark.parametrize("mode", ["process"])
def test_writer_process_sigkilled_midstream_loses_nothing_and_keeps_key_order(rig, np_rng):
    writer = rig.writer()
    keys = [f"kill:0:{i}" for i in range(200)]
    last: dict[str, np.ndarray] = {}
    first_pid = writer.worker_pid

    def submit_round(version: int) -> None:
        for key in keys:
            record = make_record(np_rng, key, metadata={"version": version})
            last[key] = record.ids.copy()
            writer.submit_put(key, record)

    submit_round(0)
    wait_until(lambda: writer.stats()["written"] >= 50, "the writer to be mid-stream")
    submit_round(1)
    os.kill(first_pid, signal.SIGKILL)
    submit_round(2)
    writer.submit_delete(keys[:10])
    for key in keys[:10]:
        last.pop(key)
    assert writer.flush(timeout=120)
    stats = writer.stats()
    assert stats["restarts"] >= 1 and writer.worker_pid != first_pid
    for key in keys[:10]:
        assert rig.reader.get(key) is None
    _assert_stored(rig, last)
    for key in last:
        assert rig.read(key).metadata == {"version": 2}


@pytest.mark.parametrize("mode", ["process"])
def test_writer_process_killed_while_store_hangs(rig, np_rng):
    writer = rig.writer()
    rig.close_gate()
    expected = {}
    for index in range(20):
        key = f"hang:0:{index}"
        record = make_record(np_rng, key)
        expected[key] = record.ids.copy()
        writer.submit_put(key, record)
    pid = writer.worker_pid
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: writer.stats()["restarts"] >= 1 and writer.worker_pid != pid,
               "the writer process to be restarted")
    rig.open_gate()
    assert writer.flush(timeout=60)
    _assert_stored(rig, expected)


def _fill_ring(rig, writer, np_rng, count: int, payload: int) -> dict[str, np.ndarray]:
    expected = {}
    for index in range(count):
        key = f"full:0:{index}"
        record = make_record(np_rng, key, shape=(1, payload // 4, 4))
        expected[key] = record.ids.copy()
        writer.submit_put(key, record)
    return expected


PAYLOAD = 16 * 1024
CAPACITY = 4 * PAYLOAD  # exactly four records fit


def test_full_queue_spill_loses_nothing(rig, np_rng):
    writer = rig.writer(capacity_bytes=CAPACITY, full_policy="spill")
    rig.close_gate()
    expected = _fill_ring(rig, writer, np_rng, 12, PAYLOAD)
    wait_until(lambda: writer.stats()["spilled"] >= 8, "eight records spilled")
    assert writer.stats()["dropped"] == 0
    rig.open_gate()
    assert writer.flush(timeout=60)
    _assert_stored(rig, expected)


def test_full_queue_block_times_out_then_spills(rig, np_rng):
    writer = rig.writer(capacity_bytes=CAPACITY, full_policy="block", block_timeout_s=0.05)
    rig.close_gate()
    expected = _fill_ring(rig, writer, np_rng, 6, PAYLOAD)
    wait_until(lambda: writer.stats()["spilled"] >= 2, "the two late records to be spilled")
    rig.open_gate()
    assert writer.flush(timeout=60)
    _assert_stored(rig, expected)


def test_full_queue_block_waits_for_room(rig, np_rng):
    import threading

    writer = rig.writer(capacity_bytes=CAPACITY, full_policy="block", block_timeout_s=600)
    rig.close_gate()
    expected = _fill_ring(rig, writer, np_rng, 4, PAYLOAD)
    extra = make_record(np_rng, "full:1:0", shape=(1, PAYLOAD // 4, 4))
    expected["full:1:0"] = extra.ids.copy()
    done = threading.Event()
    thread = threading.Thread(target=lambda: (writer.submit_put("full:1:0", extra), done.set()))
    thread.start()
    wait_until(lambda: writer.stats()["blocked_submits"] == 1, "submit to block")
    assert not done.is_set()
    rig.open_gate()
    assert done.wait(60)
    thread.join()
    assert writer.flush(timeout=60)
    assert writer.stats()["spilled"] == 0
    _assert_stored(rig, expected)


def test_full_queue_drop_counts_and_logs_exactly_what_it_dropped(rig, np_rng, caplog):
    writer = rig.writer(capacity_bytes=CAPACITY, full_policy="drop")
    rig.close_gate()
    results = {}
    with caplog.at_level(logging.WARNING, logger="fd_routing_replay.writer"):
        for index in range(10):
            key = f"full:0:{index}"
            results[key] = writer.submit_put(key, make_record(
                np_rng, key, shape=(1, PAYLOAD // 4, 4)))
    dropped = sorted(k for k, accepted in results.items() if not accepted)
    assert len(dropped) == 6 and writer.stats()["dropped"] == 6
    drop_lines = [r.getMessage() for r in caplog.records if "dropped record" in r.getMessage()]
    assert len(drop_lines) == 6
    for key in dropped:
        assert sum(key + " " in line for line in drop_lines) == 1
    rig.open_gate()
    assert writer.flush(timeout=60)
    assert rig.reader.list() == sorted(k for k, accepted in results.items() if accepted)


def test_turn_order_previous_turn_deleted_only_after_new_turn_is_readable(rig, np_rng):
    writer = rig.writer(only_last_turn=True)
    rig.close_gate()  # puts hang until released: the slow store
    for turn in range(3):
        for segment in range(2):
            rid = f"exp_a_1:0:{turn}:{segment}"
            writer.submit_put(rid, make_record(np_rng, rid))
    wait_until(lambda: writer.stats()["pending_ops"] == 6, "all six puts queued")
    assert rig.reader.list() == []
    rig.open_gate()
    assert writer.flush(timeout=60)
    assert rig.reader.list() == ["exp_a_1:0:2:0", "exp_a_1:0:2:1"]
    deletes = [e for e in rig.events() if e["op"] == "delete"]
    assert sorted(k for e in deletes for k in e["existed"]) == [
        "exp_a_1:0:0:0", "exp_a_1:0:0:1", "exp_a_1:0:1:0", "exp_a_1:0:1:1"]
    for event in deletes:
        assert event["successor_readable"] and all(event["successor_readable"].values()), event
    assert writer.stats()["deleted"] == 0  # generated deletes are not user deletes


def test_turn_order_previous_turn_kept_while_new_turn_is_spilled(rig, np_rng):
    writer = rig.writer(only_last_turn=True)
    writer.submit_put("exp_b:0:0:0", make_record(np_rng, "exp_b:0:0:0"))
    assert writer.flush(timeout=60)
    rig.down()
    new = make_record(np_rng, "exp_b:0:1:0")
    writer.submit_put("exp_b:0:1:0", new)
    wait_until(lambda: writer.stats()["journal_entries"] >= 1, "the new turn to be spilled")
    assert rig.reader.list() == ["exp_b:0:0:0"]
    rig.up()
    assert writer.flush(timeout=60)
    assert rig.reader.list() == ["exp_b:0:1:0"]
    assert rig.read("exp_b:0:1:0").ids.tobytes() == new.ids.tobytes()


def test_turn_order_previous_turn_kept_when_new_turn_is_rejected(rig, np_rng):
    writer = rig.writer(only_last_turn=True, store_options={"poison": "bad"})
    writer.submit_put("bad_c:0:0:0", make_record(np_rng, "bad_c:0:0:0"))
    assert writer.flush(timeout=60)
    assert rig.reader.list() == []
    writer.submit_put("ok_c:0:0:0", make_record(np_rng, "ok_c:0:0:0"))
    assert writer.flush(timeout=60)
    rig.reader.put("bad_d:0:0:0", b"kept")  # turn 0 written by someone else
    writer.submit_put("bad_d:0:1:0", make_record(np_rng, "bad_d:0:1:0"))
    assert writer.flush(timeout=60)
    assert rig.reader.get("bad_d:0:0:0") == b"kept"
    assert writer.stats()["dead_lettered"] == 2


def test_per_layer_keys_delete_previous_turn_after_final_layer(rig, np_rng):
    writer = rig.writer(only_last_turn=True)
    layers = 3
    for turn in range(2):
        rid = f"pl:0:{turn}:0"
        for layer in range(layers):
            record = make_record(np_rng, rid, shape=(1, 8, 4),
                                 metadata={"layer": layer, "num_layers": layers})
            writer.submit_put(f"{rid}_{layer}", record)
    assert writer.flush(timeout=60)
    assert rig.reader.list() == [f"pl:0:1:0_{layer}" for layer in range(layers)]
    deletes = [e for e in rig.events() if e["op"] == "delete"]
    assert len(deletes) == 1
    assert deletes[0]["existed"] == [f"pl:0:0:0_{layer}" for layer in range(layers)]


def test_operations_on_one_key_apply_in_submission_order(rig, np_rng, rng):
    """Random puts/deletes/prefix deletes over few keys vs a dict model of the store."""
    writer = rig.writer()
    model: dict[str, bytes] = {}
    keys = [f"ord_{b}:{t}:0" for b in range(3) for t in range(3)]
    for _ in range(400):
        action = rng.random()
        if action < 0.7:
            key = rng.choice(keys)
            record = make_record(np_rng, key)
            writer.submit_put(key, record)
            model[key] = record.ids.tobytes()
        elif action < 0.9:
            chosen = rng.sample(keys, 2)
            writer.submit_delete(chosen)
            for key in chosen:
                model.pop(key, None)
        else:
            prefix = f"ord_{rng.randrange(3)}"
            writer.submit_delete_prefix([prefix])
            for key in [k for k in model if k.startswith(prefix + ":")]:
                del model[key]
    assert writer.flush(timeout=60)
    assert rig.reader.list() == sorted(model)
    for key, payload in model.items():
        assert rig.read(key).ids.tobytes() == payload


@pytest.mark.parametrize("make_bad, error, needle", [
    (lambda r: RoutingRecord("ok:0:0", r.integers(0, 8, (2, 4, 2)), 8), RecordError, "int64"),
    (lambda r: RoutingRecord("ok:0:0", r.random((2, 4, 2)).astype(np.float32), 8), RecordError,
     "float32"),
    (lambda r: RoutingRecord("ok:0:0", np.zeros((4, 2), np.uint8), 8), RecordError, "3-D"),
    (lambda r: RoutingRecord("ok:0:0", np.zeros((2, 4, 2), np.uint8), 300), RecordError, "300"),
    (lambda r: RoutingRecord("a/b:0:0", np.zeros((2, 4, 2), np.uint8), 8), InvalidRolloutId,
     "a/b:0:0"),
    (lambda r: RoutingRecord("no-turn", np.zeros((2, 4, 2), np.uint8), 8), InvalidRolloutId,
     "no-turn"),
    (lambda r: RoutingRecord("x:01:0", np.zeros((2, 4, 2), np.uint8), 8), InvalidRolloutId,
     "01"),
    (lambda r: RoutingRecord("ok:0:0", np.zeros((2, 4, 2), np.uint8), 8,
                             metadata={"bad": object()}), RecordError, "msgpack"),
    (lambda r: np.zeros((2, 4, 2), np.uint8), RecordError, "ndarray"),
])
def test_bad_records_are_rejected_at_submit_and_the_writer_keeps_running(
        rig, np_rng, make_bad, error, needle):
    writer = rig.writer()
    bad = make_bad(np_rng)
    key = getattr(bad, "rollout_id", "ok:0:0")
    with pytest.raises(error, match=needle.replace("/", ".")):
        writer.submit_put(key, bad)
    good = make_record(np_rng, "good:0:0")
    assert writer.submit_put("good:0:0", good)
    assert writer.flush(timeout=60)
    stats = writer.stats()
    assert stats["rejected"] == 1 and stats["submitted"] == 1 and stats["written"] == 1
    assert rig.reader.list() == ["good:0:0"]


def test_bad_keys_are_rejected(rig, np_rng):
    writer = rig.writer()
    record = make_record(np_rng, "ok:0:0")
    with pytest.raises(InvalidRolloutId, match="does not belong"):
        writer.submit_put("other:0:0", record)
    with pytest.raises(InvalidRolloutId, match="does not belong"):
        writer.submit_put("ok:0:0_x", record)
    with pytest.raises(InvalidRolloutId, match="empty"):
        writer.submit_delete_prefix([""])
    with pytest.raises(InvalidRolloutId, match=r"\.\."):
        writer.submit_delete(["a..b"])
    assert writer.stats()["rejected"] == 4
    writer.submit_put("ok:0:0_3", record)
    assert writer.flush(timeout=60)
    assert rig.reader.list() == ["ok:0:0_3"]


def test_permanent_error_goes_to_dead_letters_and_can_be_replayed(rig, np_rng, tmp_path):
    writer = rig.writer(store_options={"poison": "poison"})
    bad = make_record(np_rng, "poison_1:0:0")
    good = make_record(np_rng, "fine_1:0:0")
    writer.submit_put("poison_1:0:0", bad)
    writer.submit_put("fine_1:0:0", good)
    assert writer.flush(timeout=60)
    assert writer.stats()["dead_lettered"] == 1
    assert rig.reader.list() == ["fine_1:0:0"]
    files = sorted(p.name for p in rig.dead_dir.iterdir() if not p.name.startswith("."))
    stems = {name.rsplit(".", 1)[0] for name in files}
    assert len(stems) == 1
    stem = stems.pop()
    assert files == [f"{stem}.json", f"{stem}.reason", f"{stem}.rr"]
    assert "poisoned" in (rig.dead_dir / f"{stem}.reason").read_text()
    kept = decode_record((rig.dead_dir / f"{stem}.rr").read_bytes())
    assert kept.ids.tobytes() == bad.ids.tobytes() and kept.rollout_id == "poison_1:0:0"
    writer.close()
    # Recovery: fix the cause, move the entry into the journal, start a writer.
    for suffix in (".rr", ".json"):
        os.replace(rig.dead_dir / f"{stem}{suffix}", rig.journal_dir / f"{stem}{suffix}")
    fixed = rig.writer()
    assert fixed.flush(timeout=60)
    assert rig.read("poison_1:0:0").ids.tobytes() == bad.ids.tobytes()


def test_journal_is_replayed_when_the_next_writer_starts(rig, np_rng, caplog):
    first = rig.writer()
    rig.down()
    expected = {}
    for index in range(30):
        key = f"replay:0:{index}"
        record = make_record(np_rng, key)
        expected[key] = record.ids.copy()
        first.submit_put(key, record)
    wait_until(lambda: first.stats()["spilled"] > 0, "a spill")
    with caplog.at_level(logging.WARNING, logger="fd_routing_replay.writer"):
        first.close(timeout=0.5)
    assert any("not yet in the store" in r.getMessage() and "replay:0:" in r.getMessage()
               for r in caplog.records)
    assert len(first.journal.scan()) == 30
    with pytest.raises(RoutingReplayError, match="closed"):
        first.submit_put("replay:0:0", make_record(np_rng, "replay:0:0"))
    rig.up()
    second = rig.writer()
    assert second.flush(timeout=60)
    _assert_stored(rig, expected)
    assert second.journal.scan() == []


def test_nothing_is_cleared_at_start_unless_asked(rig, np_rng):
    rig.reader.put("old:0:0", b"old")
    writer = rig.writer()
    writer.submit_put("new:0:0", make_record(np_rng, "new:0:0"))
    assert writer.flush(timeout=60)
    writer.close()
    assert rig.reader.list() == ["new:0:0", "old:0:0"]
    cleared = rig.writer(clear_on_start=True)
    cleared.submit_put("newer:0:0", make_record(np_rng, "newer:0:0"))
    assert cleared.flush(timeout=60)
    assert rig.reader.list() == ["newer:0:0"]


def test_fastdeploy_raw_format_stores_the_payload_only(rig, np_rng):
    writer = rig.writer(record_format="fastdeploy-raw")
    record = make_record(np_rng, "raw:0:0", shape=(3, 10, 2), num_experts=300, dtype=np.uint16)
    writer.submit_put("raw:0:0", record)
    assert writer.flush(timeout=60)
    assert rig.reader.get("raw:0:0") == record.ids.tobytes()


def test_a_second_writer_on_the_same_journal_is_refused(rig, monkeypatch):
    from fd_routing_replay.errors import ConfigError
    from fd_routing_replay.writer import client as writer_client

    monkeypatch.setattr(writer_client, "_LOCK_WAIT_S", 0.05)
    rig.writer()
    with pytest.raises(ConfigError, match="journal_dir"):
        rig.writer()


@pytest.mark.parametrize("shape, num_experts, dtype", [
    ((4, 0, 8), 64, np.uint8),          # a request with no tokens
    ((1, 1, 1), 2, np.uint8),           # a single id
    ((3, 50, 6), 40_000, np.uint16),    # ids above 256 (bfloat16 mix-ups would show)
    ((2, 30, 4), 70_000, np.uint32),
])
def test_edge_shapes_and_dtypes_round_trip(rig, np_rng, shape, num_experts, dtype):
    writer = rig.writer()
    record = make_record(np_rng, "edge:0:0", shape=shape, num_experts=num_experts, dtype=dtype)
    if record.ids.size:
        record.ids.flat[0] = num_experts - 1  # the largest valid id is present
    writer.submit_put("edge:0:0", record)
    assert writer.flush(timeout=60)
    stored = rig.read("edge:0:0")
    assert stored.ids.dtype == np.dtype(dtype) and stored.ids.shape == shape
    assert np.array_equal(stored.ids, record.ids)
    assert stored.num_experts == num_experts and stored.fill_value == np.iinfo(dtype).max


def test_large_and_small_messages_keep_their_order(rig, np_rng):
    """Messages above the pipe's atomic size take another path; order must not change."""
    writer = rig.writer()
    last = None
    for index in range(60):
        metadata = {"i": index, "pad": "x" * (6000 if index % 3 == 1 else 10)}
        last = make_record(np_rng, "order:0:0", metadata=metadata)
        writer.submit_put("order:0:0", last)
    assert writer.flush(timeout=60)
    stored = rig.read("order:0:0")
    assert stored.metadata["i"] == 59 and stored.ids.tobytes() == last.ids.tobytes()
    assert [e["i"] for e in rig.events() if e["op"] == "put"] == list(range(60))


def test_layer_map_survives_ring_spill_and_replay(rig, np_rng):
    """The layer map travels with the record on every path: ring, journal, next writer."""
    writer = rig.writer(capacity_bytes=CAPACITY, full_policy="spill")
    maps = {}
    for index in range(10):
        key = f"lm:0:{index}"
        record = make_record(np_rng, key, shape=(3, PAYLOAD // 12, 4))
        layers = sorted(int(i) for i in np_rng.choice(200, size=3, replace=False))
        record.layers = layers
        maps[key] = tuple(layers)
        if index == 2:
            rig.close_gate()  # from here the ring fills and the engine side spills
        writer.submit_put(key, record)
    wait_until(lambda: writer.stats()["spilled"] > 0, "a spill")
    rig.down()
    rig.open_gate()
    writer.close(timeout=0.5)  # what is left goes to the journal
    rig.up()
    second = rig.writer()
    assert second.flush(timeout=60)
    for key, layers in maps.items():
        assert rig.read(key).layers == layers, key
