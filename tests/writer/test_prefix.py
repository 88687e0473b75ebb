"""Multi-turn prefix omission: a tail put completed by the writer from the stored turn."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from fd_routing_replay.codec import RoutingRecord, encode_record
from fd_routing_replay.codec.record import Provenance, tokens_digest
from fd_routing_replay.errors import RecordError
from fd_routing_replay.writer.operation import Operation
from fd_routing_replay.writer.record import TurnPrefix, complete_record
from tests.writer.conftest import wait_until

PRODUCER = {"v": "test", "h": "host", "p": 1}


def _turn(rng, rollout_id, tokens, token_ids, base_ids=None):
    """The full record of a turn: ``base_ids`` (the previous turn's rows) + new rows."""
    new = rng.integers(0, 64, size=(3, tokens - (0 if base_ids is None else base_ids.shape[1]), 4),
                       dtype=np.int64).astype(np.uint8)
    ids = new if base_ids is None else np.concatenate([base_ids, new], axis=1)
    return RoutingRecord(rollout_id, np.ascontiguousarray(ids), 64, layers=(1, 2, 3), created=1.5e9,
                         producer=PRODUCER, metadata={"turn": rollout_id},
                         provenance=Provenance(tokens_hash=tokens_digest(token_ids[:tokens])))


def _tail(record, prefix_tokens):
    return replace(record, ids=np.ascontiguousarray(record.ids[:, prefix_tokens:]))


@pytest.fixture
def tokens(np_rng):
    return np_rng.integers(0, 50_000, size=400)


def test_a_tail_is_stored_byte_identical_to_the_full_record(rig, np_rng, tokens):
    writer = rig.writer(only_last_turn=True)
    turn0 = _turn(np_rng, "agent_1:0:0", 100, tokens)
    assert writer.durable_prefix("agent_1:1:0") is None            # nothing stored yet
    writer.submit_put("agent_1:0:0", turn0)
    assert writer.flush(timeout=60)
    prefix = writer.durable_prefix("agent_1:1:0")
    assert prefix == TurnPrefix("agent_1:0:0", 100, turn0.tokens_hash)
    assert writer.durable_prefix("agent_1:0:0") is None            # turn 0 has no prefix
    assert writer.durable_prefix("agent_1:2:0") is None            # turn 1 is not stored
    assert writer.durable_prefix("agent_1:1:1") is None            # another segment
    turn1 = _turn(np_rng, "agent_1:1:0", 260, tokens, base_ids=turn0.ids)
    writer.submit_put("agent_1:1:0", _tail(turn1, 100), prefix=prefix)
    assert writer.flush(timeout=60)
    assert rig.reader.get("agent_1:1:0") == encode_record(turn1)   # as if handed over whole
    assert rig.reader.get("agent_1:0:0") is None                   # only_last_turn retired it
    # and the next turn continues the completed record
    prefix = writer.durable_prefix("agent_1:2:0")
    assert prefix == TurnPrefix("agent_1:1:0", 260, turn1.tokens_hash)
    turn2 = _turn(np_rng, "agent_1:2:0", 400, tokens, base_ids=turn1.ids)
    writer.submit_put("agent_1:2:0", _tail(turn2, 260), prefix=prefix)
    assert writer.flush(timeout=60)
    assert rig.reader.get("agent_1:2:0") == encode_record(turn2)


def test_no_prefix_while_a_put_of_the_same_rollout_is_in_flight(rig, np_rng, tokens):
    writer = rig.writer(store_options={"gate": str(rig.gate)})
    turn0 = _turn(np_rng, "agent_2:0:0", 50, tokens)
    writer.submit_put("agent_2:0:0", turn0)
    assert writer.flush(timeout=60)
    rig.close_gate()                                               # the store hangs
    try:
        writer.submit_put("agent_2:1:0", _turn(np_rng, "agent_2:1:0", 80, tokens, turn0.ids))
        assert writer.durable_prefix("agent_2:1:0") is None        # turn 1 already queued
    finally:
        rig.open_gate()
    assert writer.flush(timeout=60)


def test_a_tail_waits_in_the_journal_while_the_store_is_down(rig, np_rng, tokens):
    writer = rig.writer()
    turn0 = _turn(np_rng, "agent_3:0:0", 64, tokens)
    writer.submit_put("agent_3:0:0", turn0)
    assert writer.flush(timeout=60)
    prefix = writer.durable_prefix("agent_3:1:0")
    rig.down()
    turn1 = _turn(np_rng, "agent_3:1:0", 90, tokens, turn0.ids)
    writer.submit_put("agent_3:1:0", _tail(turn1, 64), prefix=prefix)
    wait_until(lambda: writer.stats()["journal_entries"] >= 1, "the tail to be journaled")
    sidecars = [json.loads(p.read_text()) for p in rig.journal_dir.glob("*.json")]
    assert [s.get("prefix") for s in sidecars] == [["agent_3:0:0", 64, turn0.tokens_hash]]
    rig.up()
    assert writer.flush(timeout=60)
    assert rig.reader.get("agent_3:1:0") == encode_record(turn1)


def test_a_missing_or_different_prefix_is_dead_lettered_never_written(rig, np_rng, tokens):
    writer = rig.writer()
    turn0 = _turn(np_rng, "agent_4:0:0", 40, tokens)
    writer.submit_put("agent_4:0:0", turn0)
    assert writer.flush(timeout=60)
    prefix = writer.durable_prefix("agent_4:1:0")
    turn1 = _turn(np_rng, "agent_4:1:0", 70, tokens, turn0.ids)
    rig.reader.delete(["agent_4:0:0"])                              # removed behind our back
    writer.submit_put("agent_4:1:0", _tail(turn1, 40), prefix=prefix)
    assert writer.flush(timeout=60)
    assert rig.reader.get("agent_4:1:0") is None
    assert writer.stats()["dead_lettered"] == 1
    reason = next(rig.dead_dir.glob("*.reason")).read_text()
    assert "no longer stored" in reason
    # a stored prefix with other tokens: refused as well
    writer.submit_put("agent_4:0:0", turn0)
    assert writer.flush(timeout=60)
    wrong = TurnPrefix("agent_4:0:0", 40, turn0.tokens_hash ^ 1)
    writer.submit_put("agent_4:1:0", _tail(turn1, 40), prefix=wrong)
    assert writer.flush(timeout=60)
    assert rig.reader.get("agent_4:1:0") is None and writer.stats()["dead_lettered"] == 2


def test_prefixes_are_checked_at_submit(np_rng, tokens):
    turn1 = _turn(np_rng, "agent_5:1:0", 10, tokens)
    for key, prefix, message in [
        ("agent_5:1:0", TurnPrefix("agent_5:5:0", 4, 1), "not the previous turn"),
        ("agent_5:1:0", TurnPrefix("other:0:0", 4, 1), "not the previous turn"),
        ("agent_5:1:0", TurnPrefix("agent_5:0:1", 4, 1), "not the previous turn"),
        ("agent_5:1:0", TurnPrefix("agent_5:0:0", 0, 1), "num_tokens must be a positive"),
        ("agent_5:1:0", TurnPrefix("agent_5:0:0", 4, -1), "tokens_hash must be a uint64"),
        ("agent_5:1:0_0", TurnPrefix("agent_5:0:0", 4, 1), "fused rr-v1"),
    ]:
        with pytest.raises(RecordError, match=message):
            Operation.for_put(key, turn1, final=None, fmt="rr-v1", prefix=prefix)
    with pytest.raises(RecordError, match="fused rr-v1"):
        Operation.for_put("agent_5:1:0", turn1, final=None, fmt="fastdeploy-raw",
                          prefix=TurnPrefix("agent_5:0:0", 4, 1))


def test_complete_record_names_every_mismatch(np_rng, tokens):
    turn0 = _turn(np_rng, "agent_6:0:0", 20, tokens)
    turn1 = _turn(np_rng, "agent_6:1:0", 30, tokens, turn0.ids)
    prefix = TurnPrefix("agent_6:0:0", 20, turn0.tokens_hash)
    full = complete_record(turn0, _tail(turn1, 20), prefix)
    np.testing.assert_array_equal(full.ids, turn1.ids)
    assert full.provenance == turn1.provenance and full.metadata == turn1.metadata
    for previous, message in [
        (replace(turn0, rollout_id="agent_6:9:0"), "belongs to 'agent_6:9:0'"),
        (replace(turn0, ids=turn0.ids[:, :19].copy()), "has 19 tokens"),
        (replace(turn0, provenance=Provenance()), "tokens hash differs"),
        (replace(turn0, layers=(0, 1, 2)), "layer_map"),
        (replace(turn0, ids=turn0.ids.astype(np.uint16), fill_value=65535), "dtype"),
        (replace(turn0, num_experts=32), "num_experts"),
    ]:
        with pytest.raises(RecordError, match=message):
            complete_record(previous, _tail(turn1, 20), prefix)


def test_a_dead_lettered_tail_replays_as_a_tail_once_its_prefix_is_back(rig, np_rng, tokens, capsys):
    from fd_routing_replay.cli import dead_letters as dl
    from tests.writer.test_dead_letters_cli import _args, _config

    writer = rig.writer()
    turn0 = _turn(np_rng, "agent_7:0:0", 30, tokens)
    writer.submit_put("agent_7:0:0", turn0)
    assert writer.flush(timeout=60)
    prefix = writer.durable_prefix("agent_7:1:0")
    rig.reader.delete(["agent_7:0:0"])
    turn1 = _turn(np_rng, "agent_7:1:0", 45, tokens, turn0.ids)
    writer.submit_put("agent_7:1:0", _tail(turn1, 30), prefix=prefix)
    assert writer.flush(timeout=60) and writer.stats()["dead_lettered"] == 1
    writer.close()
    rig.reader.put("agent_7:0:0", encode_record(turn0))              # the prefix is back
    assert dl.cmd_replay(_args(all=True), _config(rig)) == 0
    assert "replayed" in capsys.readouterr().out
    assert rig.reader.get("agent_7:1:0") == encode_record(turn1)     # whole, not the tail
