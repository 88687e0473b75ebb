"""Partial records (#25 part 4) in the writer: the key, the rules a partial
put must follow, the final superseding it only once durable, ``only_last_turn`` retiring an
earlier turn's partial, and a crash of the engine side with partials still in the ring."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import numpy as np
import pytest

from fd_routing_replay.codec import RoutingRecord, decode_record
from fd_routing_replay.errors import InvalidRolloutId, RecordError
from fd_routing_replay.keys import (
    MAX_KEY_BYTES,
    parse_rollout_id,
    partial_key,
    prefix_matches,
    split_layer_key,
    split_partial_key,
)
from fd_routing_replay.store import open_store
from fd_routing_replay.writer import RoutingWriter
from fd_routing_replay.writer.operation import Operation
from fd_routing_replay.writer.record import DurableTurns, retire_turn
from tests.writer.conftest import wait_until

REPO = Path(__file__).resolve().parents[2]


def partial(rollout_id: str, ids: np.ndarray, num_experts: int = 64, **metadata) -> RoutingRecord:
    return RoutingRecord(rollout_id, ids, num_experts,
                         metadata={"partial": True, "num_tokens": int(ids.shape[1]), **metadata})


def final(rollout_id: str, ids: np.ndarray, num_experts: int = 64, **metadata) -> RoutingRecord:
    return RoutingRecord(rollout_id, ids, num_experts, metadata={"num_tokens": int(ids.shape[1]), **metadata})


def routes(rng: np.random.Generator, tokens: int, layers: int = 3, top_k: int = 2) -> np.ndarray:
    return rng.integers(0, 64, (layers, tokens, top_k)).astype(np.uint8)


def writer_for(rig, **kwargs) -> RoutingWriter:
    writer = RoutingWriter(rig.store_config(), rig.writer_config(), **kwargs)
    rig.writers.append(writer)
    return writer


# -- the key -------------------------------------------------------------------------------------

def test_a_partial_key_never_names_a_final_record_and_prefixes_select_it(rng):
    for _ in range(200):
        base = "".join(rng.choice("ab_:0123456789") for _ in range(rng.randint(1, 12))).strip(":") or "b"
        rollout_id = f"{base}:{rng.randint(0, 30)}:{rng.randint(0, 3)}"
        try:
            parse_rollout_id(rollout_id)
        except InvalidRolloutId:
            continue
        key = partial_key(rollout_id)
        assert key == rollout_id + "_partial"
        assert split_partial_key(key).text == rollout_id
        assert split_partial_key(rollout_id) is None and split_partial_key(f"{rollout_id}_3") is None
        with pytest.raises(InvalidRolloutId):     # neither a rollout id nor a per-layer key
            split_layer_key(key)
        # whatever selects the rollout selects its partial; a longer base is never selected
        assert prefix_matches(key, rollout_id) and prefix_matches(key, base)
        assert not prefix_matches(key, rollout_id + "0")
    assert split_partial_key("x_partial") is None and split_partial_key(17) is None
    with pytest.raises(InvalidRolloutId, match="at most 512 bytes"):
        partial_key("b" * (MAX_KEY_BYTES - 8) + ":0:0")      # the id fits, its partial key does not
    with pytest.raises(InvalidRolloutId):
        partial_key("no-turn")


# -- what a partial put may be ---------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["thread"])
def test_partial_puts_are_checked_before_they_are_queued(rig, np_rng):
    writer = writer_for(rig)
    ids = routes(np_rng, 5)
    with pytest.raises(RecordError, match="only a record whose metadata says partial"):
        writer.submit_put("p:0:0_partial", final("p:0:0", ids))
    with pytest.raises(RecordError, match="its key is 'p:0:0_partial'"):
        writer.submit_put("p:0:0", partial("p:0:0", ids))
    with pytest.raises(RecordError, match="never completes a turn"):
        writer.submit_put("p:0:0_partial", partial("p:0:0", ids), final=True)
    with pytest.raises(RecordError, match="its key is 'p:0:0_partial'"):   # another rollout's
        writer.submit_put("q:0:0_partial", partial("p:0:0", ids))
    assert writer.stats()["rejected"] == 4
    raw = RoutingWriter(rig.store_config(), rig.writer_config(journal_dir=str(rig.journal_dir) + "-raw",
                                                              dead_letter_dir=str(rig.dead_dir) + "-raw"),
                        record_format="fastdeploy-raw")
    rig.writers.append(raw)
    with pytest.raises(RecordError, match="partial records are rr-v1"):
        raw.submit_put("p:0:0_partial", partial("p:0:0", ids))


def test_a_pending_partial_put_does_not_stop_prefix_omission(np_rng):
    """Prefix omission refuses an offer while a put of the rollout is in flight (its
    retirement may delete the previous turn); a partial put retires nothing."""
    turns = DurableTurns()
    stored = Operation.for_put("agent:0:0", final("agent:0:0", routes(np_rng, 4)), final=None, fmt="rr-v1")
    stored.seq, stored.provenance = 1, {"th": 77}
    turns.stored(stored)
    pending = Operation.for_put("agent:1:0_partial", partial("agent:1:0", routes(np_rng, 6)),
                                final=None, fmt="rr-v1")
    assert pending.partial and not stored.partial and not pending.final
    assert turns.prefix("agent:1:0", [pending]).rollout_id == "agent:0:0"
    assert turns.prefix("agent:1:0", [stored]) is None


# -- the final supersedes the partial, never before it is durable ---------------------------------

def test_the_partial_stays_until_the_final_is_durable_then_goes(rig, np_rng):
    writer = writer_for(rig, partials=True)
    rid = "long_7:3:0:0"
    early, late = routes(np_rng, 64), routes(np_rng, 96)
    writer.submit_put(partial_key(rid), partial(rid, early))
    writer.submit_put(partial_key(rid), partial(rid, np.concatenate([early, late[:, :32]], axis=1)))
    assert writer.flush(60)
    stored = rig.read(partial_key(rid))
    assert stored.metadata["partial"] is True and stored.ids.shape[1] == 96   # the newer one won
    np.testing.assert_array_equal(stored.ids[:, :64], early)
    rig.down()                                   # the final cannot be stored: the partial stays
    complete = np.concatenate([early, late], axis=1)
    writer.submit_put(rid, final(rid, complete))
    assert not writer.flush(timeout=1.0)
    wait_until(lambda: writer.stats()["spilled"] >= 1, "the final to be journaled")
    assert rig.reader.exists(partial_key(rid)) and not rig.reader.exists(rid)
    rig.up()
    assert writer.flush(60)
    assert not rig.reader.exists(partial_key(rid))
    np.testing.assert_array_equal(rig.read(rid).ids, complete)
    events = [(e["op"], e.get("key") or tuple(e.get("existed", ()))) for e in rig.events()]
    assert events.index(("put", rid)) < events.index(("delete", (partial_key(rid),)))


def test_the_final_retires_the_partial_only_with_partials_on(tmp_path, np_rng, make_writer):
    store_config = {"type": "local", "namespace": "wt", "local": {"root": str(tmp_path / "s")}}
    store = open_store(store_config)
    rid = "keep:0:0"
    plain = make_writer(store_config)            # partial records off: the final touches nothing
    plain.submit_put(partial_key(rid), partial(rid, routes(np_rng, 8)))
    plain.submit_put(rid, final(rid, routes(np_rng, 12)))
    assert store.list() == [rid, partial_key(rid)]
    plain.close()
    writer = make_writer(store_config, partials=True)
    other = "keep:1:0"
    writer.submit_put(partial_key(other), partial(other, routes(np_rng, 8)))
    writer.submit_put(partial_key(other), partial(other, routes(np_rng, 10)))     # replaces it
    assert store.list("keep:1") == [partial_key(other)]
    writer.submit_put(other, final(other, routes(np_rng, 12)))
    assert not store.exists(partial_key(other))
    assert store.list() == [rid, partial_key(rid), other]


def test_per_layer_finals_retire_the_partial_after_the_last_layer(tmp_path, np_rng, make_writer):
    url = f"memory://layers-{uuid.uuid4().hex[:8]}"
    store = open_store(url)
    writer = make_writer(url, partials=True)
    rid = "lay:0:0"
    writer.submit_put(partial_key(rid), partial(rid, routes(np_rng, 6)))
    for layer in range(3):
        assert store.exists(partial_key(rid))
        writer.submit_put(f"{rid}_{layer}", RoutingRecord(rid, routes(np_rng, 9, layers=1), 64,
                                                          metadata={"layer": layer, "num_layers": 3}))
    assert store.list() == [f"{rid}_{layer}" for layer in range(3)]


# -- only_last_turn: a later turn retires the earlier turn's partial too --------------------------

@pytest.mark.parametrize("partials", [True, False])
def test_a_later_turn_retires_the_earlier_turns_partial(rig, np_rng, partials):
    writer = writer_for(rig, only_last_turn=True, partials=partials)
    neighbour = "agent:0:0_7:0:0"                # another rollout whose base extends this one
    writer.submit_put(partial_key(neighbour), partial(neighbour, routes(np_rng, 4)))
    # turn 0 was aborted: only its partial is stored
    writer.submit_put(partial_key("agent:0:0"), partial("agent:0:0", routes(np_rng, 40)))
    writer.submit_put(partial_key("agent:1:0"), partial("agent:1:0", routes(np_rng, 30)))
    assert writer.flush(60)
    assert rig.reader.list("agent") == sorted([partial_key(neighbour), partial_key("agent:0:0"),
                                               partial_key("agent:1:0")])
    writer.submit_put("agent:1:0", final("agent:1:0", routes(np_rng, 50)))
    assert writer.flush(60)
    left = [partial_key(neighbour), "agent:1:0"] + ([] if partials else [partial_key("agent:1:0")])
    assert rig.reader.list("agent") == sorted(left)


def test_retire_turn_deletes_the_partials_it_owns(np_rng):
    store = open_store(f"memory://retire-{uuid.uuid4().hex[:8]}")
    for rid in ("r:0:0", "r:1:0", "r:2:0"):
        store.put(partial_key(rid), b"p")
    store.put("r:2:0", b"f")
    retired = retire_turn(store, "r:1:0", 0, only_last_turn=True, partials=True)
    # turn 2 is stored: turn 1 is superseded (its partial with it), turn 0's partial goes
    assert retired.superseded_by == 2 and retired.own_deleted == 1 and retired.previous_deleted == 1
    assert retired.partial_deleted == 0
    assert store.list() == ["r:2:0", partial_key("r:2:0")]
    retired = retire_turn(store, "r:2:0", 0, only_last_turn=False, partials=True)
    assert (retired.previous_deleted, retired.partial_deleted) == (0, 1) and store.list() == ["r:2:0"]


# -- a crash of the engine side: the partials in the ring reach the store after a restart ---------

@pytest.mark.parametrize("mode", ["process"])
def test_partials_in_the_ring_survive_an_engine_crash_and_the_restarted_writer_stores_them(rig, tmp_path,
                                                                                           np_rng):
    ids = routes(np_rng, 120)
    np.save(tmp_path / "ids.npy", ids)
    script = tmp_path / "engine.py"
    ready = tmp_path / "ready"
    script.write_text(textwrap.dedent(f"""
        import os, signal
        import numpy as np
        from fd_routing_replay.codec import RoutingRecord
        from fd_routing_replay.keys import partial_key
        from fd_routing_replay.store import register_store
        from fd_routing_replay.writer import RoutingWriter
        register_store("faulty", "tests.writer.faulty_store:open_faulty_store")
        writer = RoutingWriter({rig.store_config()!r}, {rig.writer_config()!r}, partials=True)
        ids = np.load({str(tmp_path / "ids.npy")!r})
        for n in (32, 64, 96):                  # every 32 positions, three rollouts
            for r in range(3):
                rid = f"crash_{{r}}:0:0"
                record = RoutingRecord(rid, np.ascontiguousarray(ids[:, :n]), 64,
                                       metadata={{"partial": True, "num_tokens": n}})
                writer.submit_put(partial_key(rid), record)
        writer.submit_put("crash_0:0:0", RoutingRecord("crash_0:0:0", ids, 64))   # rollout 0 finished
        with open({str(ready)!r}, "w") as handle:
            handle.write(str(writer.worker_pid))
        signal.pause()
    """))
    rig.close_gate()              # the writer process hangs in its first put: the rest waits in the ring
    env = dict(os.environ, PYTHONPATH=str(REPO))
    engine = subprocess.Popen([sys.executable, str(script)], env=env, cwd=str(tmp_path))
    try:
        wait_until(lambda: ready.exists() and ready.read_text(), "the engine to submit its partials")
        engine.send_signal(signal.SIGKILL)
        engine.wait(30)
    finally:
        if engine.poll() is None:
            engine.kill()
    rig.open_gate()
    writer = writer_for(rig, partials=True)   # waits for the orphaned writer process, replays the journal
    assert writer.flush(60)
    assert rig.reader.list("crash") == ["crash_0:0:0", partial_key("crash_1:0:0"), partial_key("crash_2:0:0")]
    for r in (1, 2):
        stored = rig.read(partial_key(f"crash_{r}:0:0"))
        assert stored.metadata == {"partial": True, "num_tokens": 96}   # the last one submitted
        np.testing.assert_array_equal(stored.ids, ids[:, :96])
    np.testing.assert_array_equal(decode_record(rig.reader.get("crash_0:0:0")).ids, ids)
