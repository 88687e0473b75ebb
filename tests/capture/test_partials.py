"""Partial records (#25 part 4) on the capture side: the table-API manager's per-step check
and FastDeploy 2.6's engine side, against a NumPy reference of the rule (a partial
whenever a request has forwarded ``N`` positions more than its last one)."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from fd_routing_replay import ops
from fd_routing_replay.capture import handoff as handoff_module
from fd_routing_replay.capture.device import save_routing_to_buffer
from fd_routing_replay.capture.fd26 import EngineRouting
from fd_routing_replay.capture.handoff import Handoff
from fd_routing_replay.capture.slots import CaptureGeometry, HostSlotCache
from fd_routing_replay.codec.record import tokens_digest
from fd_routing_replay.config import config_from_dict
from fd_routing_replay.keys import partial_key
from tests.capture.steps import Driver, ListWriter, expected_record, rid

GEOMETRY = CaptureGeometry(max_num_seqs=4, max_model_len=96, num_moe_layers=3, top_k=2,
                           num_experts=8, block_size=4, total_block_num=64)


def make(seed, every, **kwargs):
    sink = kwargs.pop("sink", None) or ListWriter()
    driver = Driver(GEOMETRY, seed, writer=sink, options={"partial_every_tokens": every}, **kwargs)
    return driver, sink


def test_the_table_manager_writes_a_partial_every_n_positions_then_the_final(seed):
    rng = np.random.default_rng(seed)
    every = int(rng.integers(2, 9))
    d, sink = make(seed, every)
    requests = {0: "exp_1:0:0:0", 2: "exp_2:0:0:0"}
    blocks = {0: list(range(1, 21)), 2: list(range(30, 50))}
    rows: dict[int, dict[int, np.ndarray]] = {slot: {} for slot in requests}
    prompt = {slot: int(rng.integers(3, 30)) for slot in requests}
    total = {slot: prompt[slot] + int(rng.integers(2, 40)) for slot in requests}
    done = {slot: 0 for slot in requests}
    last = {slot: 0 for slot in requests}
    expected: list[tuple[str, int]] = []
    for slot, user in requests.items():
        d.set_blocks(slot, blocks[slot])
        d.manager.register_request(batch_id=slot, request_id=rid(user))
    while any(done[slot] < total[slot] for slot in requests):
        entries, encoder, finished = {}, set(), set()
        for slot in requests:
            if done[slot] >= total[slot]:
                continue
            if done[slot] < prompt[slot]:                  # chunked prefill of random size
                count = min(int(rng.integers(1, 9)), prompt[slot] - done[slot])
                encoder.add(slot)
            else:
                count = 1
            entries[slot] = (done[slot], count)
            if done[slot] + count == total[slot]:
                finished.add(slot)
        drawn = d.step(entries, encoder=encoder, finished=finished)
        for (slot, position), row in drawn.items():
            rows[slot][position] = row
        for slot, (start, count) in sorted(entries.items()):
            done[slot] = start + count
            if slot not in finished and done[slot] - last[slot] >= every:   # the rule
                expected.append((requests[slot], done[slot]))
                last[slot] = done[slot]
        for slot in sorted(finished):
            expected.append((requests[slot], -1))
    got = []
    for key, record in sink.log:
        if key.endswith("_partial"):
            assert key == partial_key(record.rollout_id)
            assert record.metadata["partial"] is True and record.metadata["num_tokens"] == record.num_tokens
            assert record.metadata["request_id"].startswith(f"chatcmpl-{record.rollout_id}-")
            slot = next(s for s, user in requests.items() if user == record.rollout_id)
            np.testing.assert_array_equal(record.ids, expected_record(rows[slot], record.num_tokens))
            assert list(record.layers) == list(range(3))
            got.append((record.rollout_id, record.num_tokens))
        else:
            assert "partial" not in record.metadata
            got.append((key, -1))
    assert sorted(got, key=str) == sorted(expected, key=str)
    # per request, in order: partials growing by at least ``every``, then the final
    for user in requests.values():
        mine = [n for r, n in got if r == user]
        assert mine[-1] == -1 and all(b - a >= every for a, b in zip(mine, mine[1:-1], strict=False))
    stats = d.manager.stats()
    assert stats["partials_submitted"] == len(expected) - len(requests) and stats["partials_failed"] == 0
    assert d.manager.handoff.progress == {}             # finished: forgotten


def test_a_preempted_request_never_shrinks_its_partial_and_an_abort_keeps_it(seed):
    d, sink = make(seed, 4)
    user = "exp_3:0:0:0"
    d.set_blocks(1, [4, 5, 6, 7])
    d.manager.register_request(batch_id=1, request_id=rid(user))
    rows = d.step({1: (0, 10)}, encoder={1})                 # prefill: partial of 10
    assert [r.num_tokens for _, r in sink.log] == [10]
    d.manager.clear_request(batch_id=1)                      # preempted: blocks freed
    d.set_blocks(3, [12, 13, 14, 15])
    d.manager.register_request(batch_id=3, request_id=rid(user))   # recomputed in another slot
    rows = d.step({3: (0, 11)}, encoder={3})                 # 11 < 10 + 4: nothing new
    assert [r.num_tokens for _, r in sink.log] == [10]
    rows.update(d.step({3: (11, 1)}))
    rows.update(d.step({3: (12, 1)}))
    rows.update(d.step({3: (13, 1)}))                        # 14 = 10 + 4
    assert [r.num_tokens for _, r in sink.log] == [10, 14]
    np.testing.assert_array_equal(sink.log[-1][1].ids, expected_record({p: rows[(3, p)] for p in range(14)}, 14))
    d.manager.clear_request(batch_id=3)                      # aborted: nothing is deleted or written
    assert list(sink.items) == [partial_key(user)] and sink.items[partial_key(user)].num_tokens == 14


def failing_hook(manager, kwargs):
    """The MoE hook with layer 0's recording failing (top-k ids of the wrong width)."""
    if kwargs["layer_idx"] == 0:
        kwargs = dict(kwargs, topk_ids=paddle.to_tensor(np.zeros((1, 1), np.int64)))
    save_routing_to_buffer(**kwargs)


def test_no_partials_for_damaged_suspended_or_unkeyed_requests(seed, monkeypatch):
    d, sink = make(seed, 2)
    d.set_blocks(0, [1, 2, 3])
    d.set_blocks(1, [5, 6, 7])
    d.manager.register_request(batch_id=0, request_id="no rollout id here")
    d.manager.register_request(batch_id=1, request_id=rid("exp_4:0:0:0"))
    d.step({0: (0, 5), 1: (0, 5)}, encoder={0, 1}, group_hook=failing_hook)   # routing lost in capture
    assert sink.log == []
    monkeypatch.setenv("FD_SUSPEND_ROUTING_REPLAY", "1")
    d.manager.update_suspend_routing_replay()
    d.set_blocks(2, [8, 9, 10])
    d.manager.register_request(batch_id=2, request_id=rid("exp_5:0:0:0"))
    d.step({2: (0, 6)}, encoder={2})
    assert sink.log == []
    monkeypatch.setenv("FD_SUSPEND_ROUTING_REPLAY", "0")
    d.manager.update_suspend_routing_replay()
    d.step({2: (6, 1)})
    assert [(key, r.num_tokens) for key, r in sink.log] == [(partial_key("exp_5:0:0:0"), 7)]


def test_a_failing_partial_put_is_counted_and_the_final_still_comes(seed):
    sink = ListWriter(fail_keys={partial_key("exp_6:0:0:0")})
    d, _ = make(seed, 3, sink=sink)
    d.set_blocks(0, [1, 2])
    d.manager.register_request(batch_id=0, request_id=rid("exp_6:0:0:0"))
    d.step({0: (0, 4)}, encoder={0})
    d.step({0: (4, 1)}, finished={0})
    assert list(sink.items) == ["exp_6:0:0:0"]
    assert d.manager.counters["partials_failed"] == 1 and d.manager.counters["records_submitted"] == 1


def test_off_is_the_no_op_and_only_rank_zero_writes(seed):
    d, sink = make(seed, 0, tp_size=2)
    assert all(m.partials is None for m in d.managers)
    d2, sink2 = make(seed, 3, tp_size=2)
    assert d2.managers[0].partials is not None and d2.managers[1].partials is None
    for driver in (d, d2):
        driver.set_blocks(0, [1, 2])
        driver.manager.register_request(batch_id=0, request_id=rid("exp_7:0:0:0"))
        driver.managers[1].register_request(batch_id=0, request_id=rid("exp_7:0:0:0"))
        driver.step({0: (0, 6)}, encoder={0})
    assert sink.log == [] and [r.num_tokens for _, r in sink2.log] == [6]


def test_an_rl_weight_update_forgets_the_progress(seed):
    d, sink = make(seed, 4)
    d.set_blocks(0, [1, 2, 3])
    d.manager.register_request(batch_id=0, request_id=rid("exp_8:0:0:0"))
    d.step({0: (0, 8)}, encoder={0})
    d.manager.clear_all_request()
    assert d.manager.handoff.progress == {} and not d.manager.partials.last.any()
    d.manager.register_request(batch_id=0, request_id=rid("exp_8:0:0:0"))
    d.step({0: (0, 5)}, encoder={0})                          # new weights: a partial of 5
    assert [r.num_tokens for _, r in sink.log] == [8, 5]


# -- FastDeploy 2.6's engine side ---------------------------------------------------------------

def engine_side(rng, every, sink=None):
    dtype = ops.routing_dtype(8)
    host = HostSlotCache(64 * 4, 3, 2, dtype, ops.fill_value(dtype))
    host.array[...] = rng.integers(0, 8, host.array.shape).astype(dtype)
    geometry = CaptureGeometry(max_num_seqs=4, max_model_len=96, num_moe_layers=3, top_k=2, num_experts=8,
                               block_size=4, total_block_num=64, layer_map=(1, 2, 3))
    config = config_from_dict({"enabled": True, "capture": {"partial_every_tokens": every}})
    sink = sink if sink is not None else ListWriter()
    return EngineRouting(config, geometry, host, writer=sink, metadata={"engine": "test"}), host, sink


def test_the_engine_side_writes_partials_by_block_table_and_forgets_at_finish(seed):
    rng = np.random.default_rng(seed)
    every = int(rng.integers(3, 12))
    finisher, host, sink = engine_side(rng, every)
    blocks = rng.permutation(64)[:20]
    request = rid("exp_9:2:1:0")
    tokens = rng.integers(0, 1000, 80).tolist()
    progress, written, last = 0, [], 0
    while progress < 70:
        progress += int(rng.integers(1, 6))
        handed = finisher.progress(request, blocks, progress, tokens[:progress + 1])
        assert handed == (progress - last >= every)
        if handed:
            last = progress
            written.append(progress)
    slots = (blocks[:, None] * 4 + np.arange(4)).reshape(-1)
    assert [r.num_tokens for _, r in sink.log] == written
    for n, (key, record) in zip(written, sink.log, strict=True):
        assert key == "exp_9:2:1:0_partial" and record.metadata["partial"] is True
        np.testing.assert_array_equal(record.ids, np.transpose(host.array[slots[:n]], (1, 0, 2)))
        assert record.tokens_hash == tokens_digest(np.asarray(tokens[:n])) and list(record.layers) == [1, 2, 3]
    finisher.finish(request, blocks, 75, tokens)
    assert sink.log[-1][0] == "exp_9:2:1:0" and finisher.handoff.progress == {}
    assert finisher.counters["partials_submitted"] == len(written)


def test_the_engine_side_skips_unkeyed_requests_and_has_none_without_a_writer(seed):
    rng = np.random.default_rng(seed)
    finisher, host, sink = engine_side(rng, 4)
    assert not finisher.progress("chatcmpl-not-a-rollout", list(range(4)), 8)
    assert not finisher.progress("chatcmpl-not-a-rollout", list(range(4)), 9)   # not retried at once
    assert not finisher.progress(rid("exp_10:0:0:0"), [-1] * 4, 8)             # no slots: counted
    assert sink.log == [] and finisher.counters["partials_failed"] == 1
    assert Handoff(host, None, num_experts=8, layer_map=(1, 2, 3),             # response mode
                   partial_every_tokens=4).partial_every == 0


def test_progress_is_bounded_and_the_rule_refuses_nonsense(seed, monkeypatch):
    dtype = ops.routing_dtype(8)
    host = HostSlotCache(16, 3, 2, dtype, ops.fill_value(dtype))
    handoff = Handoff(host, ListWriter(), num_experts=8, layer_map=(0, 1, 2), partial_every_tokens=5)
    monkeypatch.setattr(handoff_module, "TRACKED_REQUESTS", 3)
    for i in range(5):
        handoff.partial(None, f"r{i}", [0], 10, 4)        # no rollout id: progress kept, nothing written
    assert list(handoff.progress) == ["r2", "r3", "r4"] and handoff.last_partial("r0") == 0
    for bad in (-3, True, 2.5):
        with pytest.raises(ValueError, match="partial_every_tokens"):
            Handoff(host, ListWriter(), num_experts=8, layer_map=(0, 1, 2), partial_every_tokens=bad)
