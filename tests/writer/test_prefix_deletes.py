"""Prefix omission after deletes: the writer never offers a turn it has deleted.

An engine that follows the protocol (``durable_prefix``, then a tail put with that prefix,
else a full put) must get every turn's complete record into the store, whatever this
writer deleted before: an acknowledged delete forgets the turn, a pending one hides it.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from fd_routing_replay.codec import RoutingRecord, encode_record
from fd_routing_replay.codec.record import Provenance, tokens_digest
from fd_routing_replay.keys import parse_rollout_id

LAYERS = (1, 2, 3)
PRODUCER = {"v": "test", "h": "host", "p": 1}


def _turn(rng, rollout_id, tokens, token_ids, base_ids=None):
    """The full record of a turn: ``base_ids`` (the previous turn's rows) + new rows."""
    fresh = tokens - (0 if base_ids is None else base_ids.shape[1])
    new = rng.integers(0, 64, size=(len(LAYERS), fresh, 4), dtype=np.int64).astype(np.uint8)
    ids = new if base_ids is None else np.concatenate([base_ids, new], axis=1)
    return RoutingRecord(rollout_id, np.ascontiguousarray(ids), 64, layers=LAYERS, created=1.5e9,
                         producer=PRODUCER, metadata={"turn": rollout_id},
                         provenance=Provenance(tokens_hash=tokens_digest(token_ids[:tokens])))


def _hand_over(writer, record):
    """What the engine does at a turn's end (capture/finisher.py): a tail after the
    offered prefix when there is one, else the whole record.  Returns the prefix used."""
    prefix = writer.durable_prefix(record.rollout_id)
    if prefix is None:
        writer.submit_put(record.rollout_id, record)
    else:
        tail = replace(record, ids=np.ascontiguousarray(record.ids[:, prefix.num_tokens:]))
        writer.submit_put(record.rollout_id, tail, prefix=prefix)
    return prefix


@pytest.fixture
def tokens(np_rng):
    return np_rng.integers(0, 50_000, size=400)


@pytest.mark.parametrize("how", ["delete", "delete_prefix_base", "delete_prefix_turn"])
def test_a_deleted_turn_is_forgotten_once_the_delete_is_acknowledged(rig, np_rng, tokens, how):
    writer = rig.writer()
    turn0 = _turn(np_rng, "del_1:0:0", 60, tokens)
    writer.submit_put("del_1:0:0", turn0)
    assert writer.flush(timeout=60)
    assert writer.durable_prefix("del_1:1:0") is not None
    if how == "delete":
        writer.submit_delete("del_1:0:0")
    else:
        writer.submit_delete_prefix("del_1" if how == "delete_prefix_base" else "del_1:0")
    assert writer.flush(timeout=60)
    assert rig.reader.get("del_1:0:0") is None
    assert writer.durable_prefix("del_1:1:0") is None
    # the engine hands turn 1 over whole: it is stored, nothing is dead-lettered
    turn1 = _turn(np_rng, "del_1:1:0", 110, tokens, base_ids=turn0.ids)
    assert _hand_over(writer, turn1) is None
    assert writer.flush(timeout=60)
    assert rig.reader.get("del_1:1:0") == encode_record(turn1)
    assert writer.stats()["dead_lettered"] == 0
    # turn 1 is durable now: turn 2 continues it
    turn2 = _turn(np_rng, "del_1:2:0", 150, tokens, base_ids=turn1.ids)
    assert _hand_over(writer, turn2).rollout_id == "del_1:1:0"
    assert writer.flush(timeout=60)
    assert rig.reader.get("del_1:2:0") == encode_record(turn2)


def test_deletes_of_other_keys_keep_the_offer(rig, np_rng, tokens):
    """Boundary-safe: ``del_2x`` and ``del_2:1`` do not select ``del_2:0:0``; a per-layer
    key of it is not the fused record."""
    writer = rig.writer()
    turn0 = _turn(np_rng, "del_2:0:0", 30, tokens)
    writer.submit_put("del_2:0:0", turn0)
    writer.submit_delete_prefix(["del_2x", "del_2:1", "del_2:0:1"])
    writer.submit_delete(["del_2:0:0_0", "del_2:1:0"])
    assert writer.flush(timeout=60)
    assert rig.reader.get("del_2:0:0") is not None
    assert writer.durable_prefix("del_2:1:0") is not None


def test_a_turn_put_again_after_its_delete_is_offered_again(rig, np_rng, tokens):
    writer = rig.writer()
    turn0 = _turn(np_rng, "del_3:0:0", 40, tokens)
    writer.submit_put("del_3:0:0", turn0)
    writer.submit_delete("del_3:0:0")
    writer.submit_put("del_3:0:0", turn0)
    assert writer.flush(timeout=60)
    assert rig.reader.get("del_3:0:0") == encode_record(turn0)
    assert writer.durable_prefix("del_3:1:0").rollout_id == "del_3:0:0"


@pytest.mark.parametrize("how", ["delete", "delete_prefix", "retire"])
def test_a_pending_delete_hides_the_turn(rig, np_rng, tokens, how):
    """Submitted, not yet acknowledged (queued behind a put the store holds up): the
    engine is not offered a prefix the delete will remove before its tail arrives."""
    writer = rig.writer(store_options={"gate": str(rig.gate)})
    turn0 = _turn(np_rng, "del_4:0:0", 50, tokens)
    writer.submit_put("del_4:0:0", turn0)
    assert writer.flush(timeout=60)
    assert writer.durable_prefix("del_4:1:0") is not None
    rig.close_gate()                                               # the store hangs on puts
    try:
        writer.submit_put("other:0:0", _turn(np_rng, "other:0:0", 10, tokens))
        if how == "delete":
            writer.submit_delete("del_4:0:0")
        elif how == "delete_prefix":
            writer.submit_delete_prefix("del_4:0")
        else:
            writer.submit_retire("del_4:1:0")                      # deletes turn 0
        assert writer.durable_prefix("del_4:1:0") is None
        turn1 = _turn(np_rng, "del_4:1:0", 80, tokens, base_ids=turn0.ids)
        assert _hand_over(writer, turn1) is None
    finally:
        rig.open_gate()
    assert writer.flush(timeout=60)
    assert rig.reader.get("del_4:0:0") is None
    assert rig.reader.get("del_4:1:0") == encode_record(turn1)
    assert writer.stats()["dead_lettered"] == 0


def test_an_explicit_retirement_forgets_the_previous_turn(rig, np_rng, tokens):
    writer = rig.writer()
    writer.submit_put("del_5:0:0", _turn(np_rng, "del_5:0:0", 20, tokens))
    assert writer.flush(timeout=60)
    writer.submit_retire("del_5:1:0")
    assert writer.flush(timeout=60)
    assert rig.reader.get("del_5:0:0") is None
    assert writer.durable_prefix("del_5:1:0") is None


def test_a_superseded_turn_is_forgotten(rig, np_rng, tokens):
    """only_last_turn: turn 1 arrives after turn 2 is stored (by another writer), so its
    retirement deletes it again; it must not be offered to turn 2."""
    writer = rig.writer(only_last_turn=True)
    turn1 = _turn(np_rng, "del_6:1:0", 40, tokens)
    turn2 = _turn(np_rng, "del_6:2:0", 70, tokens, base_ids=turn1.ids)
    rig.reader.put("del_6:2:0", encode_record(turn2))
    writer.submit_put("del_6:1:0", turn1)
    assert writer.flush(timeout=60)
    assert writer.stats()["superseded"] == 1
    assert rig.reader.get("del_6:1:0") is None
    assert writer.durable_prefix("del_6:2:0") is None


def _selects(prefix, key):
    """Boundary-safe prefix selection, written out: ``key`` is ``prefix`` or continues it
    at a separator."""
    return key == prefix or key.startswith(prefix + ":") or key.startswith(prefix + "_")


def test_an_offered_prefix_is_always_stored(rig, np_rng, tokens):
    """Random puts, deletes, prefix deletes and retirements over rollouts whose bases
    extend one another (``job:7:0`` is turn 7 of ``job``, ``job:7:3:0`` turn 3 of
    ``job:7``): every prefix offered — with operations pending or not — names a record
    the store still holds once they are applied, with the offered tokens; every turn
    handed over is stored whole."""
    only_last_turn = bool(np_rng.integers(2))
    writer = rig.writer(only_last_turn=only_last_turn)
    bases = ["job", "job_a", "jobx", "job:7"]
    prefixes = ["job", "job_a", "jobx", "job:7", "job:1", "job:0:0", "job_a:2"]
    rollouts = [f"{base}:{turn}:0" for base in bases for turn in range(1, 8)]
    latest: dict[str, RoutingRecord] = {}
    stored: dict[str, bytes] = {}                     # what the store must hold (a model)
    offered = 0
    for _ in range(12):
        for op in range(int(np_rng.integers(1, 5))):
            # each round hands a turn over first: without, ~1 seed in 1e5 never offered one
            choice = 0 if op == 0 else int(np_rng.integers(5))
            base = bases[int(np_rng.integers(len(bases)))]
            if choice <= 1:                                   # next turn, engine protocol
                previous = latest.get(base)
                turn = 0 if previous is None else parse_rollout_id(previous.rollout_id).turn + 1
                start = 0 if previous is None else previous.num_tokens
                record = _turn(np_rng, f"{base}:{turn}:0", start + int(np_rng.integers(1, 30)),
                               tokens, None if previous is None else previous.ids)
                _hand_over(writer, record)
                latest[base] = record
                stored[record.rollout_id] = encode_record(record)
                if only_last_turn:
                    stored.pop(f"{base}:{turn - 1}:0", None)
            elif choice == 2:
                key = f"{base}:{int(np_rng.integers(4))}:0"
                writer.submit_delete(key)
                stored.pop(key, None)
            elif choice == 3:
                prefix = prefixes[int(np_rng.integers(len(prefixes)))]
                writer.submit_delete_prefix(prefix)
                for key in [k for k in stored if _selects(prefix, k)]:
                    del stored[key]
            else:
                turn = int(np_rng.integers(1, 4))
                writer.submit_retire(f"{base}:{turn}:0")
                stored.pop(f"{base}:{turn - 1}:0", None)
                if any(parse_rollout_id(k).base == base and parse_rollout_id(k).turn > turn
                       for k in stored):
                    stored.pop(f"{base}:{turn}:0", None)
        pending = {r: p for r in rollouts if (p := writer.durable_prefix(r)) is not None}
        assert writer.flush(timeout=60)
        assert writer.stats()["dead_lettered"] == 0
        settled = {r: p for r in rollouts if (p := writer.durable_prefix(r)) is not None}
        for rollout_id, prefix in [*pending.items(), *settled.items()]:
            record = rig.read(prefix.rollout_id)
            assert record is not None, f"{rollout_id} was offered {prefix.rollout_id}: gone"
            assert (record.num_tokens, record.tokens_hash) == (prefix.num_tokens,
                                                               prefix.tokens_hash)
        offered += len(settled)
        assert sorted([*rig.reader.list("job"), *rig.reader.list("jobx")]) == sorted(stored)
        for key, value in stored.items():
            assert rig.reader.get(key) == value, key
    assert offered > 0


# -- the ledger's side of the protocol, message by message (no writer, no timing) ----------
def _put_op(rng, tokens, rollout_id, num_tokens, seq):
    from fd_routing_replay.writer.operation import Operation

    op = Operation.for_put(rollout_id, _turn(rng, rollout_id, num_tokens, tokens), final=None,
                           fmt="rr-v1")
    op.seq = seq
    return op


def _ledger():
    from fd_routing_replay.writer.ring import Ledger, RingAllocator

    return Ledger(RingAllocator(1 << 16))


def test_the_ledger_forgets_by_acknowledgement_and_submission_order(np_rng, tokens):
    from fd_routing_replay.writer.operation import Operation, OperationKind

    ledger = _ledger()
    first = _put_op(np_rng, tokens, "led_1:0:0", 20, seq=10)
    ledger.add(first)
    ledger.apply(["done", 10, 100, 0.001])
    assert ledger.durable.prefix("led_1:1:0", []).rollout_id == "led_1:0:0"
    delete = Operation.for_delete(OperationKind.DELETE, ["led_1:0:0"])
    delete.seq = 11
    again = _put_op(np_rng, tokens, "led_1:0:0", 20, seq=12)
    ledger.add(delete)
    ledger.add(again)
    assert ledger.durable.prefix("led_1:1:0", ledger.ops.values()) is None   # both pending
    ledger.apply(["done", 11])
    assert ledger.durable.get("led_1:0:0") is None
    ledger.apply(["done", 12, 100, 0.001])
    assert ledger.durable.prefix("led_1:1:0", ledger.ops.values()).rollout_id == "led_1:0:0"
    # an acknowledged delete submitted before the entry's put leaves it alone
    early = Operation.for_delete(OperationKind.DELETE_PREFIX, ["led_1"])
    early.seq = 5
    ledger.add(early)
    ledger.apply(["done", 5])
    assert ledger.durable.get("led_1:0:0").seq == 12


def test_a_delete_finished_by_a_dead_writer_generation_is_forgotten(np_rng, tokens):
    """The writer process applied a journaled delete and died before saying so: the next
    generation does not find it on disk, and the ledger counts it done."""
    from fd_routing_replay.writer.operation import Operation, OperationKind, OperationState

    ledger = _ledger()
    ledger.add(_put_op(np_rng, tokens, "led_2:0:0", 20, seq=10))
    ledger.apply(["done", 10, 100, 0.001])
    delete = Operation.for_delete(OperationKind.DELETE_PREFIX, ["led_2:0"])
    delete.seq, delete.state = 11, OperationState.JOURNAL
    ledger.add(delete)
    assert ledger.durable.prefix("led_2:1:0", ledger.ops.values()) is None
    ledger.begin_restart()
    ledger.apply(["started", 1234, []])
    assert not ledger.ops and ledger.durable.get("led_2:0:0") is None


def test_durable_turns_are_bounded(np_rng, tokens):
    from fd_routing_replay.writer.record import DurableTurns

    turns = DurableTurns(limit=2)
    for seq, rollout_id in enumerate(["b_1:0:0", "b_2:0:0", "b_3:0:0"]):
        turns.stored(_put_op(np_rng, tokens, rollout_id, 5, seq=seq))
    assert len(turns) == 2 and turns.get("b_1:0:0") is None
    assert turns.prefix("b_3:1:0", []).rollout_id == "b_3:0:0"
