"""Journal and dead-letter files: atomic entries, replay order, debris, locking."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fd_routing_replay.codec import RoutingRecord, decode_record, encode_record_parts
from fd_routing_replay.errors import ConfigError, RecordError
from fd_routing_replay.writer.journal import (
    DeadLetters,
    DirectoryLock,
    Journal,
    JournalEntry,
    entry_name,
)
from fd_routing_replay.writer.operation import Operation


def make_sidecar(kind, seq, sub, reason, *, key="", rollout_id="", final=False, targets=()):
    return Operation(kind, seq, sub, key=key, rollout_id=rollout_id, final=final,
                     targets=list(targets)).sidecar(reason)


def test_entries_round_trip_in_submission_order(tmp_path, np_rng, rng):
    journal = Journal(tmp_path / "j")
    records = {}
    seqs = rng.sample(range(1, 10**15), 20)
    for seq in seqs:
        rid = f"j:0:{seq % 1000}"
        ids = np_rng.integers(0, 9, size=(2, 3, 2)).astype(np.uint8)
        record = RoutingRecord(rid, ids, 9)
        records[seq] = record
        journal.write(entry_name(seq), make_sidecar("put", seq, 0, "test", key=rid,
                                                    rollout_id=rid, final=True),
                      list(encode_record_parts(record)))
    journal.write(entry_name(seqs[0], 1), make_sidecar("delete_prefix", seqs[0], 1, "t",
                                                       targets=["j:0"]))
    entries = journal.scan()
    assert [(e.seq, e.sub) for e in entries] == sorted([(s, 0) for s in seqs] + [(seqs[0], 1)])
    for entry in entries:
        op = journal.load_op(entry)
        if entry.sub:
            assert op["prefixes"] == ["j:0"]
            continue
        stored = decode_record(journal.read_record(entry))
        assert stored.ids.tobytes() == records[entry.seq].ids.tobytes()
        assert op["key"] == records[entry.seq].rollout_id
    assert journal.max_seq() == max(seqs)
    assert not [p for p in journal.directory.iterdir() if p.name.startswith(".tmp-")]
    for entry in entries:
        journal.remove(entry)
    assert journal.scan() == [] and list(journal.directory.iterdir()) == []


def test_an_entry_exists_only_once_its_sidecar_is_written(tmp_path):
    journal = Journal(tmp_path)
    (tmp_path / f"{entry_name(5)}.rr").write_bytes(b"record without sidecar")
    (tmp_path / ".tmp-123").write_bytes(b"interrupted write")
    (tmp_path / "unrelated.json").write_text("{}")
    assert journal.scan() == []
    assert journal.remove_debris() == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["unrelated.json"]


@pytest.mark.parametrize("text, needle", [("{oops", "unreadable"), ("[1]", "JSON object"),
                                          ('{"op": "rename"}', "'op'"),
                                          ('{"op": "put", "key": 3}', "key"),
                                          ('{"op": "delete", "keys": "k"}', "keys")])
def test_malformed_sidecars_are_reported(tmp_path, text, needle):
    journal = Journal(tmp_path)
    (tmp_path / f"{entry_name(7)}.json").write_text(text)
    with pytest.raises(RecordError, match=needle):
        journal.load_op(JournalEntry(7, 0, entry_name(7)))


def test_dead_letters_keep_record_reason_and_error(tmp_path):
    journal = Journal(tmp_path / "j")
    dead = DeadLetters(tmp_path / "d")
    journal.write(entry_name(3), make_sidecar("put", 3, 0, "r", key="k:0:0", rollout_id="k:0:0"),
                  [b"payload"])
    entry = journal.scan()[0]
    path = dead.adopt(journal, entry, journal.load_op(entry), "store said no",
                      ValueError("too large"))
    assert journal.scan() == [] and dead.count() == 1
    sidecar = json.loads(path.read_text())
    assert sidecar["reason"] == "store said no" and sidecar["error_type"] == "ValueError"
    assert (tmp_path / "d" / f"{entry_name(3)}.rr").read_bytes() == b"payload"
    assert "too large" in (tmp_path / "d" / f"{entry_name(3)}.reason").read_text()
    second = dead.add(entry_name(3), {"op": "delete", "keys": ["k"]}, "again")
    assert second != path and dead.count() == 2  # same name: a suffix, never an overwrite


def test_directory_lock_is_exclusive(tmp_path):
    first = DirectoryLock(tmp_path)
    first.acquire(1)
    second = DirectoryLock(tmp_path)
    with pytest.raises(ConfigError, match="in use"):
        second.acquire(0.05)
    first.release()
    second.acquire(1)
    second.release()


def test_previous_turn_prefix_deletes_of_older_journals_replay_as_exact_deletes():
    """A sub-1 ``delete_prefix`` (written before retirements existed) would also hit other
    rollouts whose base extends the previous turn's key: it is replayed as an exact delete."""
    old = {"v": 1, "op": "delete_prefix", "seq": 9, "sub": 1, "prefixes": ["job:0:0"]}
    op = Operation.from_sidecar(9, 1, old)
    assert op.kind == "delete" and op.targets == ["job:0:0"]
    user = Operation.from_sidecar(9, 0, dict(old, sub=0))
    assert user.kind == "delete_prefix"  # a user's prefix delete stays one


def test_operations_round_trip_through_wire_and_sidecar():
    put = Operation("put", 5, 0, key="a:1:0_2", rollout_id="a:1:0", final=True, layer_count=3,
                    dtype="|u1", shape=[1, 2, 3], num_experts=8, fill_value=255,
                    metadata={"i": 1}, layers=[7], created=1.5, offset=64, nbytes=6)
    assert Operation.from_wire(put.to_wire()).__dict__ == put.__dict__
    retire = put.retirement()
    assert (retire.kind, retire.seq, retire.sub, retire.layer_count) == ("retire", 5, 1, 3)
    back = Operation.from_sidecar(5, 1, retire.sidecar("r"))
    assert (back.kind, back.rollout_id, back.layer_count) == ("retire", "a:1:0", 3)
    with pytest.raises(ValueError, match="different versions"):
        Operation.from_wire(put.to_wire()[:-1])
