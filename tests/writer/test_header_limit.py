"""Records whose rr-v1 header would exceed the limit are refused at submit, and no record
that fails later can take other records, flush() or close() down with it (issue 10, item 1).
"""

from __future__ import annotations

import logging

import msgpack
import numpy as np
import pytest

from fd_routing_replay.codec import MAX_HEADER_BYTES, encode_record_parts
from fd_routing_replay.codec.rr_v1 import encoded_header_bound, quick_header_bound
from fd_routing_replay.errors import RecordError
from fd_routing_replay.writer import client as writer_client
from fd_routing_replay.writer import ring as writer_spill
from fd_routing_replay.writer.operation import Operation
from tests.writer.conftest import make_record, wait_until


def _header_length(record) -> int:
    head, _ = encode_record_parts(record)
    return int.from_bytes(head[6:10], "little")


def test_oversized_metadata_is_refused_at_submit_naming_rollout_and_sizes(rig, np_rng):
    writer = rig.writer()
    big = make_record(np_rng, "big_1:0:0", metadata={"blob": "x" * (70 * 1024)})
    with pytest.raises(RecordError) as info:
        writer.submit_put("big_1:0:0", big)
    message = str(info.value)
    assert "big_1:0:0" in message and str(MAX_HEADER_BYTES) in message
    assert "metadata" in message
    good = make_record(np_rng, "good_1:0:0")
    assert writer.submit_put("good_1:0:0", good)
    assert writer.flush(timeout=60)
    stats = writer.stats()
    assert stats["rejected"] == 1 and stats["submitted"] == 1 and stats["written"] == 1
    assert stats["dead_lettered"] == 0
    assert rig.reader.list() == ["good_1:0:0"]
    assert list(rig.dead_dir.glob("*.json")) == []


def test_header_bound_matches_the_encoder(np_rng):
    """The submit-time size is the encoder's own (never below it, at most 12 bytes above)."""
    for index in range(40):
        shape = (int(np_rng.integers(1, 5)), int(np_rng.integers(0, 3000)), 8)
        metadata = {"i": index, "pad": "y" * int(np_rng.integers(0, 5000))}
        record = make_record(np_rng, f"hb:0:{index}", shape=shape, num_experts=300,
                             dtype=np.uint16, metadata=metadata)
        if index % 2:
            record.producer = {"v": "test", "p": 10**6 + index}
        if index % 3 == 0:
            record.layers = sorted(int(i) for i in np_rng.choice(300, size=shape[0],
                                                                 replace=False))
        bound = encoded_header_bound(record)
        actual = _header_length(record)
        assert actual <= bound <= actual + 12, (shape, bound, actual)
        metadata_bytes = len(msgpack.packb(record.metadata, use_bin_type=True))
        assert quick_header_bound(record, metadata_bytes) >= actual


@pytest.mark.parametrize("excess, accepted", [(0, True), (1, False)])
def test_the_limit_is_the_encoders_limit(np_rng, excess, accepted):
    """A header of exactly MAX_HEADER_BYTES is queued; one byte more is refused."""
    record = make_record(np_rng, "edge_h:0:0", shape=(2, 500, 4), metadata={"pad": ""})
    record.created, record.producer = 1.0, {"v": "t"}
    target = MAX_HEADER_BYTES + excess
    pad = MAX_HEADER_BYTES - 200
    for _ in range(10):  # the string's own length prefix grows with it: converge
        record.metadata = {"pad": "z" * pad}
        try:
            length = _header_length(record)
        except RecordError as exc:  # over the limit: read the size from the message
            length = int(str(exc).split("header is ")[1].split(" bytes")[0])
        if length == target:
            break
        pad += target - length
    assert length == target
    if accepted:
        op = Operation.for_put("edge_h:0:0", record, final=None, fmt="rr-v1")
        assert op.created == 1.0 and op.layer_count == 2
    else:
        with pytest.raises(RecordError, match="edge_h:0:0"):
            Operation.for_put("edge_h:0:0", record, final=None, fmt="rr-v1")


PAYLOAD = 16 * 1024
CAPACITY = 4 * PAYLOAD


def test_a_record_that_cannot_be_journaled_never_blocks_the_others(rig, np_rng, monkeypatch,
                                                                   caplog):
    """Engine-side spill: one record failing to encode is dead-lettered; the ones queued
    after it are journaled and written, flush() returns True, close() does not raise and
    lets go of the journal lock."""
    real_encode = writer_spill.encode_record_parts

    def encode(record):
        if record.rollout_id == "poison_s:0:0":
            raise RecordError("record 'poison_s:0:0': cannot be encoded (injected)")
        return real_encode(record)

    monkeypatch.setattr(writer_spill, "encode_record_parts", encode)
    writer = rig.writer(capacity_bytes=CAPACITY, full_policy="spill")
    rig.close_gate()
    expected = {}
    keys = [f"sp:0:{i}" for i in range(4)] + ["poison_s:0:0"] + [f"sp:1:{i}" for i in range(4)]
    with caplog.at_level(logging.ERROR, logger="fd_routing_replay.writer"):
        for key in keys:
            record = make_record(np_rng, key, shape=(1, PAYLOAD // 4, 4))
            assert writer.submit_put(key, record)
            if not key.startswith("poison"):
                expected[key] = record.ids.copy()
        wait_until(lambda: writer.stats()["dead_lettered"] == 1, "the poison to be filed")
        wait_until(lambda: writer.stats()["spilled"] >= 4, "the records behind it to be spilled")
    assert any("poison_s:0:0" in r.getMessage() for r in caplog.records)
    rig.open_gate()
    assert writer.flush(timeout=60)
    for key, ids in expected.items():
        assert rig.read(key).ids.tobytes() == ids.tobytes(), key
    sidecars = [p.name for p in rig.dead_dir.glob("*.json")]
    assert len(sidecars) == 1
    writer.close(timeout=10)
    monkeypatch.setattr(writer_client, "_LOCK_WAIT_S", 0.5)
    rig.writer().close(timeout=10)  # the journal lock was released


def test_close_releases_the_journal_lock_even_when_leftovers_fail(rig, np_rng, monkeypatch):
    """A record still waiting for the spill thread at close that cannot be encoded is filed
    as a dead letter; close() returns and the next writer can take the journal."""
    real_encode = writer_spill.encode_record_parts

    def encode(record):
        if record.rollout_id.startswith("late"):
            raise RecordError("cannot be encoded (injected)")
        return real_encode(record)

    writer = rig.writer(capacity_bytes=CAPACITY, full_policy="spill")
    rig.close_gate()
    rig.down()
    for index in range(4):
        key = f"fill:0:{index}"
        writer.submit_put(key, make_record(np_rng, key, shape=(1, PAYLOAD // 4, 4)))
    monkeypatch.setattr(writer_spill, "encode_record_parts", encode)
    assert writer.submit_put("late:0:0", make_record(np_rng, "late:0:0",
                                                     shape=(1, PAYLOAD // 4, 4)))
    rig.open_gate()
    writer.close(timeout=1)
    assert writer.stats()["dead_lettered"] >= 1
    monkeypatch.setattr(writer_client, "_LOCK_WAIT_S", 0.5)
    rig.up()
    second = rig.writer()
    assert second.flush(timeout=60)
    assert sorted(rig.reader.list()) == [f"fill:0:{i}" for i in range(4)]
