"""The soak rig's own logic (benchmarks/soak): the record generator, the verifier, the event
files, the accounting of every record, and — end to end on the local store — that a soak
in which a record is lost or corrupted fails."""

from __future__ import annotations

import logging
import math
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

from benchmarks.soak.accounting import Accounting, dropped_names
from benchmarks.soak.events import EventLog, Tail, read_all
from benchmarks.soak.verify import problem_with
from benchmarks.soak.workload import (
    KINDS,
    MAX_TOKENS,
    MIN_TOKENS,
    expected_ids,
    make_ids,
    owner_of,
    parse_rollout,
    rollout_id,
    schedule,
    slice_plan,
    spec_for,
    step_prefix,
)
from fd_routing_replay import RoutingReader, RoutingRecord, RoutingWriter, decode_record
from fd_routing_replay.codec import encode_record
from fd_routing_replay.keys import prefix_matches
from fd_routing_replay.store import open_store


def _ids(rng, count: int, kinds: str = "amex", turns: int = 4) -> list[str]:
    return [rollout_id("run", rng.randrange(50), rng.randrange(8), rng.choice(kinds),
                       rng.randrange(10**6), rng.randrange(turns)) for _ in range(count)]


# -- workload ---------------------------------------------------------------------------------

def test_rollout_ids_parse_back_and_steps_delete_boundary_safe(rng):
    for rid in _ids(rng, 200):
        rollout = parse_rollout(rid)
        assert rollout_id(rollout.run, rollout.step, rollout.producer, rollout.kind,
                          rollout.rollout, rollout.turn) == rid
        assert prefix_matches(rid, step_prefix("run", rollout.step))
        assert not prefix_matches(rid, step_prefix("run", rollout.step * 10 + 1))
        assert not prefix_matches(rid, step_prefix("ru", rollout.step))
    assert not prefix_matches(rollout_id("run", 10, 0, "a", 0, 0), step_prefix("run", 1))
    with pytest.raises(ValueError, match="kind"):
        rollout_id("run", 0, 0, "z", 0, 0)
    with pytest.raises(ValueError, match="not a soak rollout id"):
        parse_rollout("run_s1_p0a_r1:0:1")


def test_specs_follow_the_size_mix_and_turns_grow(rng):
    specs = [spec_for(rid) for rid in _ids(rng, 3000, "ae", turns=1)]
    assert all(MIN_TOKENS <= s.tokens <= MAX_TOKENS and 48 <= s.layers <= 60 and
               s.num_experts in (64, 128, 160) and s.top_k == 8 for s in specs)
    assert {s.layers for s in specs} == set(range(48, 61))
    # log-uniform tokens in [1k, 32k]: E = 31744 / ln 32 ≈ 9159 tokens; 54 layers; top-8
    mean = np.mean([s.nbytes for s in specs])
    assert abs(mean - 9159 * 54 * 8) / (9159 * 54 * 8) < 0.1, mean
    base = rollout_id("run", 3, 1, "m", rng.randrange(10**6), 0)[:-4]
    turns = [spec_for(f"{base}:{t}:0") for t in range(6)]
    assert len({(s.layers, s.num_experts) for s in turns}) == 1
    assert all(a.tokens <= b.tokens for a, b in zip(turns, turns[1:], strict=False))
    assert turns[-1].tokens > turns[0].tokens or turns[0].tokens == MAX_TOKENS


def test_generated_ids_are_deterministic_distinct_in_range_and_ascending_when_set(rng):
    for rid in _ids(rng, 12):
        spec = spec_for(rid)
        ids = make_ids(spec)
        assert ids.dtype == np.uint8 and ids.shape == spec.shape
        assert np.array_equal(ids, make_ids(spec_for(rid)))
        assert int(ids.max()) < spec.num_experts
        ordered = np.sort(ids, axis=-1)
        assert (np.diff(ordered.astype(int), axis=-1) > 0).all(), "a row repeats an expert"
        if KINDS[parse_rollout(rid).kind][1] == "set":
            assert np.array_equal(ids, ordered)
        else:  # the offsets keep a random order: a sorting writer would be caught
            assert not np.array_equal(ids, ordered)
        other = rid.replace(":0", ":9", 1) if ":0:0" in rid else rid.replace(":", ":0", 1)
        assert not np.array_equal(ids.reshape(-1)[:4096], make_ids(spec_for(other)).reshape(-1)[:4096])


def test_slice_plans_cover_half_the_records_and_stay_inside(rng):
    rids = _ids(rng, 400)
    plans = [slice_plan(rid) for rid in rids]
    sliced = sum(plan is not None for plan in plans)
    assert 140 < sliced < 260
    for rid, plan in zip(rids, plans, strict=True):
        if plan is None:
            continue
        spec = spec_for(rid)
        assert plan.layers and set(plan.layers) <= set(range(spec.layers))
        start, stop, _ = plan.tokens.indices(spec.tokens)
        assert 0 <= start < stop <= spec.tokens
    assert {owner_of(rid, 3) for rid in rids} == {0, 1, 2}
    base = rids[0][:-4]
    assert len({owner_of(f"{base}:{t}:0", 5) for t in range(4)}) == 1


def test_the_schedule_keeps_a_rollouts_turns_in_the_step_it_started_in(rng):
    clock = iter([0, 0, 2, 1, 5, 5, 7, 9, 9, 9])          # a step function that may dither
    records = schedule("run", 3, "m", 3, lambda: next(clock))
    got = [next(records) for _ in range(24)]
    steps = [step for step, _ in got]
    assert steps == sorted(steps) and steps[::3] == [0, 0, 2, 2, 5, 5, 7, 9]
    for number, (step, rid) in enumerate(got):
        rollout = parse_rollout(rid)
        assert (rollout.step, rollout.producer, rollout.rollout, rollout.turn) == \
            (step, 3, number // 3, number % 3)
    single = schedule("run", 0, "a", 3, lambda: 4)
    assert [parse_rollout(next(single)[1]).turn for _ in range(3)] == [0, 0, 0]


# -- verifier ---------------------------------------------------------------------------------

def _round_trip(rid: str, encoding: str) -> RoutingRecord:
    spec = spec_for(rid)
    return decode_record(encode_record(RoutingRecord(rid, make_ids(spec), spec.num_experts),
                                       encoding=encoding))


def test_verifier_accepts_the_record_through_the_codec_in_either_encoding(rng):
    for kind, encoding in (("a", "plain"), ("e", "set"), ("x", "set"), ("m", "plain")):
        rid = rollout_id("run", 1, 0, kind, rng.randrange(10**6), 0)
        assert problem_with(_round_trip(rid, encoding), rid) is None
    # a plain record through the set encoding comes back sorted: not the record any more
    rid = rollout_id("run", 1, 0, "a", rng.randrange(10**6), 0)
    assert "differ" in problem_with(_round_trip(rid, "set"), rid)


def test_verifier_catches_wrong_bytes_rows_ids_and_slices(rng):
    rid = rollout_id("run", 2, 1, "a", rng.randrange(10**6), 0)
    spec = spec_for(rid)
    ids = make_ids(spec)
    good = RoutingRecord(rid, ids, spec.num_experts)
    assert problem_with(good, rid) is None
    flipped = ids.copy()
    layer, token, k = rng.randrange(spec.layers), rng.randrange(spec.tokens), rng.randrange(8)
    flipped[layer, token, k] ^= 1
    assert "1 of" in problem_with(RoutingRecord(rid, flipped, spec.num_experts), rid)
    swapped = ids.copy()
    swapped[:, [0, 1]] = swapped[:, [1, 0]]
    assert "differ" in problem_with(RoutingRecord(rid, swapped, spec.num_experts), rid)
    other = rollout_id("run", 2, 1, "a", rng.randrange(10**6) + 10**6, 0)
    assert "rollout id" in problem_with(RoutingRecord(other, ids, spec.num_experts), rid)
    assert "num_experts" in problem_with(RoutingRecord(rid, ids, spec.num_experts + 1), rid)
    assert "ids uint8" in problem_with(RoutingRecord(rid, ids[:, :-1], spec.num_experts), rid)
    assert problem_with(None, rid) == "no record"


def test_sliced_reads_from_a_store_match_the_plan(rng, tmp_path):
    store = open_store({"type": "local", "local": {"root": str(tmp_path)}})
    reader = RoutingReader(store)
    checked = 0
    while checked < 3:
        rid = rollout_id("run", 0, 0, "a", rng.randrange(10**6), 0)
        plan = slice_plan(rid)
        if plan is None:
            continue
        spec = spec_for(rid)
        store.put(rid, encode_record(RoutingRecord(rid, make_ids(spec), spec.num_experts)))
        record = reader.get_slice(rid, layers=plan.layers, tokens=plan.tokens)
        assert problem_with(record, rid, plan) is None
        assert np.array_equal(record.ids, expected_ids(rid, plan))
        shift = 1 if plan.layers[-1] + 1 < spec.layers else -1
        other_layers = tuple(layer + shift for layer in plan.layers)
        assert problem_with(reader.get_slice(rid, layers=other_layers, tokens=plan.tokens),
                            rid, plan) is not None
        start, stop, _ = plan.tokens.indices(spec.tokens)
        moved = slice(start + 1, stop + 1) if stop < spec.tokens else slice(start - 1, stop - 1)
        assert "differ" in problem_with(reader.get_slice(rid, layers=plan.layers, tokens=moved),
                                        rid, plan)
        checked += 1
    store.close()


# -- event files ------------------------------------------------------------------------------

def test_tail_reads_whole_lines_only_and_a_restarted_log_continues(tmp_path):
    path = tmp_path / "p.jsonl"
    tail = Tail(path)
    assert tail.read() == []
    log = EventLog(path)
    log.emit("put", id="a", n=1)
    with open(path, "ab") as stream:
        stream.write(b'{"e":"put","id":"b"')  # a torn line (the writer was killed)
    assert [e["id"] for e in tail.read()] == ["a"]
    with open(path, "ab") as stream:
        stream.write(b',"n":2}\n')
    assert tail.read() == [{"e": "put", "id": "b", "n": 2}]
    log.close()
    again = EventLog(path)
    again.emit("end")
    again.close()
    assert [e["e"] for e in read_all(path)] == ["put", "put", "end"]


# -- accounting -------------------------------------------------------------------------------

def _put(rid: str, ok: bool = True, t: float = 1.0) -> dict:
    return {"e": "put", "id": rid, "t": t, "dt": 0.001, "ok": ok, "bytes": 100}


def test_every_outcome_is_told_apart():
    run = "r"
    single = [rollout_id(run, 0, 0, "a", n, 0) for n in range(8)]
    multi = [rollout_id(run, 0, 1, "m", 0, t) for t in range(3)]
    accounting = Accounting(store_losses=[(5.0, 0)])
    accounting.producer([
        *(_put(rid) for rid in single[:5]), _put(single[5], ok=False), _put(single[6], ok=False),
        _put(single[7]),
        {"e": "durable", "ids": single[:3], "t": 2.0}, {"e": "durable", "ids": [single[4]], "t": 9.0},
        *(_put(rid) for rid in multi), {"e": "durable", "ids": multi, "t": 2.0},
        {"e": "end", "stats": {"written": 8}, "dead_letter_keys": [single[3]],
         "journal_keys": [single[7]]},
    ], log_text=f"... routing writer full: dropped record {single[5]} (7 bytes) under ...")
    accounting.trainer([
        {"e": "read", "id": single[0], "ok": True, "mode": "get", "lat": 0.01, "t": 3.0},
        {"e": "read", "id": single[1], "ok": False, "mode": "slice", "lat": 0.01, "t": 3.0},
        {"e": "read", "id": multi[2], "ok": True, "mode": "get", "lat": 0.02, "t": 3.0},
        {"e": "read_error", "id": single[2], "why": "TransientStoreError"},
    ])
    outcomes = accounting.outcomes()
    assert outcomes == {
        single[0]: "read_intact", single[1]: "corrupt",
        single[2]: "lost_with_store",  # durable at 2.0, producer 0's store loss at 5.0
        single[3]: "dead_lettered", single[4]: "lost",  # durable after the loss: ours
        single[5]: "dropped", single[6]: "dropped_unnamed", single[7]: "journaled",
        multi[0]: "retired", multi[1]: "retired", multi[2]: "read_intact"}
    summary = accounting.summary()
    assert summary["ok"] is False and summary["lost"] == 1 and summary["corrupt"] == 1
    assert summary["required"] == 7 and summary["read_errors"] == 1
    assert summary["submitted"] == 11 and summary["accepted"] == 9 and summary["journaled"] == 1


def test_a_required_turn_is_the_last_accepted_one():
    rids = [rollout_id("r", 0, 0, "m", 0, t) for t in range(3)]
    accounting = Accounting()
    accounting.producer([_put(rids[0]), _put(rids[1]), _put(rids[2], ok=False)],
                        log_text=f"dropped record {rids[2]} (1 bytes)")
    assert accounting.required() == {rids[1]}
    assert accounting.outcomes() == {rids[0]: "retired", rids[1]: "lost", rids[2]: "dropped"}
    accounting.trainer([{"e": "read", "id": rids[1], "ok": True, "mode": "get", "lat": 0.0,
                         "t": 2.0}])
    assert accounting.summary()["ok"] is True


def test_an_unread_step_is_deleted_only_once_its_trainers_went_past_it(rng):
    """A trainer that is behind (a saturating run) holds its step: the driver deletes a
    step with unread last turns after the timeout only once each unread record's owner has
    read a later step (it skipped a record the store no longer has), or after 4x the
    timeout whatever happened (the soak's Redis saturate run lost 91 records to a timeout
    that deleted what two slow trainers had not reached yet)."""
    from benchmarks.soak.scenario import gone_unread

    trainers = 3
    unread = _ids(rng, 6)
    step = 5
    owners = {owner_of(rid, trainers) for rid in unread}
    past = {t: step + 1 for t in range(trainers)}
    assert gone_unread(step, unread, 61.0, 60.0, past, trainers)
    assert not gone_unread(step, unread, 59.0, 60.0, past, trainers)  # not yet timed out
    assert not gone_unread(step, unread, 61.0, 60.0, {}, trainers)    # nobody read anything
    for owner in owners:                                               # one owner still at it
        assert not gone_unread(step, unread, 61.0, 60.0, {**past, owner: step}, trainers)
    others = {t: -1 for t in range(trainers) if t not in owners}
    assert gone_unread(step, unread, 61.0, 60.0, {**others, **{o: step + 1 for o in owners}},
                       trainers)                                       # only the owners count
    assert gone_unread(step, unread, 241.0, 60.0, {}, trainers)        # the hard limit
    assert not gone_unread(step, unread, 239.0, 60.0, {}, trainers)


def test_the_writer_names_each_record_it_drops(caplog, tmp_path, rng):
    """dropped_names reads the writer's own log line (full_policy drop)."""
    writer = RoutingWriter({"type": "local", "local": {"root": str(tmp_path / "s")}},
                           {"mode": "thread", "capacity_bytes": 4096, "full_policy": "drop",
                            "journal_dir": str(tmp_path / "j"),
                            "dead_letter_dir": str(tmp_path / "d")})
    rid = rollout_id("r", 0, 0, "a", rng.randrange(10**6), 0)
    ids = np.zeros((48, 64, 8), dtype=np.uint8)  # 24 KiB: never fits a 4 KiB ring
    with caplog.at_level(logging.WARNING, logger="fd_routing_replay"):
        assert writer.submit_put(rid, RoutingRecord(rid, ids, 64)) is False
    writer.close()
    assert dropped_names(caplog.text) == {rid}


# -- end to end: a soak that loses or corrupts a record fails ---------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("sabotage,counter", [("lose-one", "lost"), ("corrupt-one", "corrupt")])
def test_a_soak_with_a_lost_or_corrupt_record_fails(sabotage, counter):
    from benchmarks.soak.scenario import Scenario, ScenarioRun

    workdir = Path(tempfile.mkdtemp(prefix="soak-test-"))
    try:
        scenario = Scenario(sabotage, "local", producers=2, trainers=2, kinds=("a", "x"),
                            rate=3.0, duration_s=6, step_s=1.0, grace_s=8,
                            fault=sabotage, fault_at_s=2,
                            writer={"capacity_bytes": 32 * 2**20})
        summary = ScenarioRun(scenario, workdir, "neg").run()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    assert summary[counter] == 1, summary
    assert summary["ok"] is False
    others = {"lost", "corrupt", "dropped_unnamed"} - {counter}
    assert all(summary[name] == 0 for name in others), summary
    assert summary["read_intact"] + summary["retired"] + 1 == summary["accepted"]
    assert not math.isnan(summary["submit_ms"][0])
