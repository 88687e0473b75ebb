"""RoutingReplayManager driven by hand in FastDeploy's order, against a NumPy reference."""

from __future__ import annotations

import inspect
import logging

import numpy as np

from fd_routing_replay.capture.device import save_routing_to_buffer
from fd_routing_replay.capture.fd25 import (
    CaptureGeometry,
    NoopRoutingReplayManager,
    RoutingReplayManager,
)
from fdrr_dev.harness.paddle_runtime import paddle
from fdrr_dev.harness.parallel import LocalGroup
from tests.capture.steps import Driver, ListWriter, expected_record, rid

GEOMETRY = CaptureGeometry(max_num_seqs=4, max_model_len=64, num_moe_layers=3, top_k=2,
                           num_experts=8, block_size=4, total_block_num=32)


def make(seed, **kwargs) -> tuple[Driver, ListWriter]:
    sink = kwargs.pop("writer", None) or ListWriter()
    return Driver(kwargs.pop("geometry", GEOMETRY), seed, writer=sink, **kwargs), sink


def test_chunked_prefill_then_decode_covers_last_forwarded_token(seed):
    d, sink = make(seed)
    d.set_blocks(0, [5, 2, 9, 11])
    d.manager.register_request(batch_id=0, request_id=rid("exp_1:0:0:0"))
    rows = {}
    rows.update(d.step({0: (0, 4)}, encoder={0}))            # chunk 1 of a 10-token prompt
    d.manager.register_request(batch_id=0, request_id=rid("exp_1:0:0:0"))   # chunk 2 re-registers
    rows.update(d.step({0: (4, 4)}, encoder={0}))
    rows.update(d.step({0: (8, 2)}, encoder={0}))            # last chunk samples token 10
    rows.update(d.step({0: (10, 1)}))                         # decode feeds token 10
    assert sink.items == {}
    rows.update(d.step({0: (11, 1)}, finished={0}))          # feeds token 11, samples EOS
    record = sink.items["exp_1:0:0:0"]
    assert record.ids.shape == (3, 12, 2)                     # positions 0..11: last one included
    np.testing.assert_array_equal(record.ids, expected_record({p: rows[(0, p)] for p in range(12)}, 12))
    assert d.manager.counters["re_registered"] == 1
    assert d.manager.routing_batch_to_request == {}


def test_prefix_cache_hit_rows_come_from_the_slot_cache(seed):
    d, sink = make(seed)
    d.set_blocks(0, [3, 7, 1])
    d.manager.register_request(batch_id=0, request_id=rid("exp_2:0:0:0"))
    rows_a = d.step({0: (0, 9)}, encoder={0})
    d.step({0: (9, 1)}, finished={0})
    # request B shares A's first two blocks (8 cached positions) and computes the rest
    d.set_blocks(1, [3, 7, 12])
    d.manager.register_request(batch_id=1, request_id=rid("exp_2:0:1:0"))
    rows_b = d.step({1: (8, 3)}, encoder={1})
    d.step({1: (11, 1)}, stopped={1})                          # length stop, no EOS
    record = sink.items["exp_2:0:1:0"]
    assert record.num_tokens == 12
    expected = {p: rows_a[(0, p)] for p in range(8)}
    expected.update({p: rows_b[(1, p)] for p in range(8, 11)})
    np.testing.assert_array_equal(record.ids[:, :11], expected_record(expected, 11))


def test_preempted_request_is_cleared_and_slot_reused(seed):
    d, sink = make(seed)
    d.set_blocks(2, [4, 5])
    d.manager.register_request(batch_id=2, request_id=rid("exp_3:0:0:0"))
    d.step({2: (0, 6)}, encoder={2})
    d.manager.clear_request(batch_id=2)                        # preempted
    assert d.manager.counters["cleared"] == 1
    d.set_blocks(2, [8, 9])
    d.manager.register_request(batch_id=2, request_id=rid("exp_4:0:0:0"))
    rows = d.step({2: (0, 5)}, encoder={2}, finished={2})
    assert list(sink.items) == ["exp_4:0:0:0"]
    np.testing.assert_array_equal(sink.items["exp_4:0:0:0"].ids, expected_record(
        {p: rows[(2, p)] for p in range(5)}, 5))
    assert d.manager.stats()["missing_layer_steps"] == 0


def test_unfinished_prefill_chunk_cannot_finish(seed):
    d, sink = make(seed)
    d.set_blocks(0, [1, 2])
    d.manager.register_request(batch_id=0, request_id=rid("exp_5:0:0:0"))
    prompt_lens = paddle.to_tensor(np.array([[8], [0], [0], [0]], dtype=np.int64))
    d.step({0: (0, 4)}, encoder={0}, finished={0}, extra={"prompt_lens": prompt_lens})
    assert sink.items == {}
    d.step({0: (4, 4)}, encoder={0}, finished={0}, extra={"prompt_lens": prompt_lens})
    assert sink.items["exp_5:0:0:0"].num_tokens == 8


def test_slot_conflict_and_invalid_ids_are_counted_not_raised(seed, caplog):
    d, sink = make(seed)
    d.set_blocks(0, [1])
    d.set_blocks(1, [2])
    with caplog.at_level(logging.WARNING):
        d.manager.register_request(batch_id=0, request_id=rid("exp_6:0:0:0"))
        d.manager.register_request(batch_id=0, request_id=rid("exp_7:0:0:0"))
        d.manager.register_request(batch_id=1, request_id="cmpl-no-user-here")
    assert d.manager.counters["slot_conflicts"] == 1
    assert d.manager.counters["invalid_request_ids"] == 1
    assert "exp_6:0:0:0" in caplog.text
    d.step({0: (0, 3), 1: (0, 2)}, encoder={0, 1}, finished={0, 1})
    assert list(sink.items) == ["exp_7:0:0:0"]


def test_a_dropped_put_is_counted_and_does_not_stop_the_others(seed):
    """The writer dropped one record (it logs that by key): the hand-off counts it lost."""
    d, sink = make(seed, writer=ListWriter(fail_keys={"exp_8:0:0:0"}))
    for slot, user in ((0, "exp_8:0:0:0"), (1, "exp_9:0:0:0")):
        d.set_blocks(slot, [slot])
        d.manager.register_request(batch_id=slot, request_id=rid(user))
    d.step({0: (0, 3), 1: (0, 3)}, encoder={0, 1}, finished={0, 1})
    assert list(sink.items) == ["exp_9:0:0:0"]
    assert d.manager.counters["records_failed"] == 1 and d.manager.counters["records_submitted"] == 1


def test_lost_rows_mark_the_request_and_skip_its_record(seed, caplog):
    d, sink = make(seed)
    d.set_blocks(0, [1])                                        # covers positions 0..3 only
    d.set_blocks(1, [2, 3])
    d.manager.register_request(batch_id=0, request_id=rid("exp_10:0:0:0"))
    d.manager.register_request(batch_id=1, request_id=rid("exp_11:0:0:0"))
    with caplog.at_level(logging.ERROR):
        d.step({0: (0, 6), 1: (0, 6)}, encoder={0, 1}, finished={0, 1})
    assert list(sink.items) == ["exp_11:0:0:0"]
    assert d.manager.counters["unmapped_positions"] == 2
    assert d.manager.counters["records_failed"] == 1
    assert "exp_10:0:0:0" in caplog.text


def test_only_rank_zero_offloads_and_writes(seed):
    d, sink = make(seed, tp_size=2)
    rank1 = d.managers[1]
    assert rank1.host_cache is None and rank1.writer is None
    d.set_blocks(0, [0, 1])
    for manager in d.managers:
        manager.register_request(batch_id=0, request_id=rid("exp_12:0:0:0"))
    d.step({0: (0, 5)}, encoder={0}, finished={0})
    assert list(sink.items) == ["exp_12:0:0:0"]
    assert rank1.counters["tokens_offloaded"] == 0 and rank1.binding.calls == 3


def test_tp_ep_hook_gathers_shards_before_recording(seed):
    geometry = GEOMETRY
    d, sink = make(seed, tp_size=2)
    d.set_blocks(0, [0, 1])
    d.set_blocks(1, [2])
    for manager in d.managers:
        manager.register_request(batch_id=0, request_id=rid("exp_13:0:0:0"))
        manager.register_request(batch_id=1, request_id=rid("exp_14:0:0:0"))

    def sharded(manager, kwargs):
        topk = kwargs["topk_ids"]
        per_rank = -(-topk.shape[0] // 2)                   # 7 tokens -> shards of 4, 4 (padded)
        padded = paddle.concat([topk, paddle.full([per_rank * 2 - topk.shape[0], geometry.top_k],
                                                  99, dtype=topk.dtype)])
        shards = [padded[:per_rank], padded[per_rank:]]
        mine = shards[manager.tp_rank]
        save_routing_to_buffer(**dict(kwargs, topk_ids=mine, tp_size=2, ep_size=2,
                                      tp_group=LocalGroup(shards)))

    rows = d.step({0: (0, 5), 1: (0, 2)}, encoder={0, 1}, finished={0, 1}, group_hook=sharded)
    np.testing.assert_array_equal(sink.items["exp_13:0:0:0"].ids,
                                  expected_record({p: rows[(0, p)] for p in range(5)}, 5))
    np.testing.assert_array_equal(sink.items["exp_14:0:0:0"].ids,
                                  expected_record({p: rows[(1, p)] for p in range(2)}, 2))
    assert d.managers[1].binding.errors == 0 and d.managers[0].stats()["bad_expert_ids"] == 0


def test_speculative_keeps_accepted_positions_and_trims_at_eos(seed):
    geometry = CaptureGeometry(max_num_seqs=4, max_model_len=64, num_moe_layers=2, top_k=2,
                               num_experts=8, block_size=4, total_block_num=32,
                               num_speculative_tokens=3)
    d, sink = make(seed, geometry=geometry)
    d.set_blocks(0, [0, 1, 2])
    d.set_blocks(1, [3, 4, 5])
    for slot, user in ((0, "exp_15:0:0:0"), (1, "exp_16:0:0:0")):
        d.manager.register_request(batch_id=slot, request_id=rid(user))
    eos = paddle.to_tensor(np.array([[0]], dtype=np.int64))

    def spec(accept, tokens, step_idx, max_dec):
        return {"accept_num": paddle.to_tensor(np.array(accept, np.int32)),
                "accept_tokens": paddle.to_tensor(np.array(tokens, np.int64)),
                "eos_token_id": eos,
                "step_idx": paddle.to_tensor(np.array(step_idx, np.int64).reshape(-1, 1)),
                "max_dec_len": paddle.to_tensor(np.array(max_dec, np.int64).reshape(-1, 1))}

    no = [-1] * 4
    rows = d.step({0: (0, 5), 1: (0, 5)}, encoder={0, 1},
                  extra=spec([1, 1, 0, 0], [[7] + no[:3], [7] + no[:3], no, no], [0, 0, 0, 0], [50, 5, 0, 0]))
    # decode: 1 + 3 drafts each; slot 0 accepts 3 (2 drafts + bonus), slot 1 accepts 2
    rows.update(d.step({0: (5, 4), 1: (5, 4)},
                       extra=spec([3, 2, 0, 0], [[5, 6, 4, -1], [3, 2, -1, -1], no, no],
                                  [1, 1, 0, 0], [50, 5, 0, 0])))
    assert d.manager.counters["tokens_offloaded"] == 10 + 5
    # slot 0: 4 drafts, all accepted (4 outputs), EOS is the 2nd of them; slot 1 hits max_dec_len
    rows.update(d.step({0: (8, 4), 1: (7, 4)},
                       extra=spec([4, 4, 0, 0], [[9, 0, 9, 9], [1, 1, 1, 1], no, no],
                                  [4, 3, 0, 0], [50, 5, 0, 0]), finished={0}))
    record0 = sink.items["exp_15:0:0:0"]
    assert record0.num_tokens == 8 + 2                # positions 8, 9 kept: EOS was output #2
    np.testing.assert_array_equal(record0.ids, expected_record({p: rows[(0, p)] for p in range(10)}, 10))
    record1 = sink.items["exp_16:0:0:0"]
    assert record1.num_tokens == 7 + 2                # two outputs left under max_dec_len=5
    np.testing.assert_array_equal(record1.ids, expected_record({p: rows[(1, p)] for p in range(9)}, 9))


def test_clear_all_request_forgets_everything(seed):
    d, sink = make(seed)
    d.set_blocks(0, [0])
    d.manager.register_request(batch_id=0, request_id=rid("exp_17:0:0:0"))
    d.step({0: (0, 3)}, encoder={0})
    assert (d.manager.host_cache.array != d.manager.fill_value).any()
    d.manager.clear_all_request()
    assert d.manager.routing_batch_to_request == {}
    d.manager.register_request(batch_id=0, request_id=rid("exp_18:0:0:0"))   # the slot is free again
    assert d.manager.counters["re_registered"] == 0
    assert (d.manager.host_cache.array == d.manager.fill_value).all()
    assert (d.manager.get_routing_table().numpy() == d.manager.fill_value).all()


def test_suspend_env_skips_writes(seed, monkeypatch):
    d, sink = make(seed)
    monkeypatch.setenv("FD_SUSPEND_ROUTING_REPLAY", "1")
    d.manager.update_suspend_routing_replay()
    d.set_blocks(0, [0])
    d.manager.register_request(batch_id=0, request_id=rid("exp_18:0:0:0"))
    d.step({0: (0, 3)}, encoder={0}, finished={0})
    assert sink.items == {} and d.manager.counters["suspended_skips"] == 1


def test_uint16_ids_survive(seed):
    geometry = CaptureGeometry(max_num_seqs=2, max_model_len=16, num_moe_layers=2, top_k=3,
                               num_experts=40000, block_size=4, total_block_num=8)
    d, sink = make(seed, geometry=geometry)
    assert d.manager.routing_dtype == np.uint16
    d.set_blocks(0, [2, 3])
    d.manager.register_request(batch_id=0, request_id=rid("exp_19:0:0:0"))
    rows = d.step({0: (0, 7)}, encoder={0}, finished={0})
    record = sink.items["exp_19:0:0:0"]
    assert record.ids.dtype == np.uint16 and record.ids.max() > 256
    np.testing.assert_array_equal(record.ids, expected_record({p: rows[(0, p)] for p in range(7)}, 7))


def test_noop_twin_has_the_managers_interface():
    public = {name for name, _ in inspect.getmembers(RoutingReplayManager, inspect.isfunction)
              if not name.startswith("_")}
    noop = NoopRoutingReplayManager()
    missing = {name for name in public if not callable(getattr(noop, name, None))}
    assert missing <= {"split_request_id"}, missing
    assert noop.get_routing_table() is None
    for name in public - {"split_request_id"}:
        theirs = inspect.signature(getattr(RoutingReplayManager, name)).parameters
        ours = inspect.signature(getattr(NoopRoutingReplayManager, name)).parameters
        assert list(theirs) == list(ours), name


def test_untracked_tokens_before_a_request_shift_its_step_rows(seed):
    """Token-major buffer: a slot the manager does not track still takes rows of the step,
    so a tracked request's rows start after them (cu_seqlens_q), not at row 0."""
    d, sink = make(seed)
    d.set_blocks(1, [6, 2])
    d.set_blocks(3, [4])
    d.manager.register_request(batch_id=1, request_id=rid("exp_20:0:0:0"))
    d.manager.register_request(batch_id=3, request_id=rid("exp_21:0:0:0"))
    rows = d.step({0: (5, 3), 1: (0, 6), 2: (9, 1), 3: (0, 2)}, encoder={0, 1, 3}, finished={1, 3})
    np.testing.assert_array_equal(sink.items["exp_20:0:0:0"].ids,
                                  expected_record({p: rows[(1, p)] for p in range(6)}, 6))
    np.testing.assert_array_equal(sink.items["exp_21:0:0:0"].ids,
                                  expected_record({p: rows[(3, p)] for p in range(2)}, 2))
    assert d.manager.counters["tokens_offloaded"] == 8


def test_a_layer_that_records_nothing_marks_its_rows_of_the_step_unknown(seed, caplog):
    """The step buffer is reused: a layer whose hook never ran this step would leave the
    previous step's rows behind.  The device call counters catch it (read once per step):
    that layer's row of the step's token is stored as unknown, the others as recorded."""
    d, sink = make(seed)
    d.set_blocks(0, [1, 2])
    d.manager.register_request(batch_id=0, request_id=rid("exp_22:0:0:0"))
    rows = d.step({0: (0, 4)}, encoder={0})

    def skip_layer_1(manager, kwargs):
        if kwargs["layer_idx"] != 1:
            save_routing_to_buffer(**kwargs)

    with caplog.at_level(logging.ERROR):
        rows.update(d.step({0: (4, 1)}, finished={0}, group_hook=skip_layer_1))
    record = sink.items["exp_22:0:0:0"]
    expected = expected_record({p: rows[(0, p)] for p in range(5)}, 5)
    expected[1, 4] = 255
    np.testing.assert_array_equal(record.ids, expected)
    assert record.metadata["missing_tokens"] == 1
    assert d.manager.stats()["missing_layer_steps"] == 1
    assert "MoE layers [1] recorded nothing" in caplog.text


def test_more_tokens_than_the_step_buffer_holds_is_a_counted_mismatch(seed):
    geometry = CaptureGeometry(max_num_seqs=4, max_model_len=64, num_moe_layers=3, top_k=2,
                               num_experts=8, block_size=4, total_block_num=32, max_num_batched_tokens=6)
    d, sink = make(seed, geometry=geometry)
    d.set_blocks(0, [1, 2])
    d.manager.register_request(batch_id=0, request_id=rid("exp_23:0:0:0"))
    d.step({0: (0, 7)}, encoder={0}, finished={0})
    assert sink.items == {}
    assert d.manager.binding.mismatches == 3 and d.manager.stats()["hook_errors"] == 3
    assert d.manager.stats()["records_failed"] == 1


def test_capture_device_memory_is_the_step_buffer(seed):
    geometry = CaptureGeometry(max_num_seqs=256, max_model_len=32768, num_moe_layers=3, top_k=8,
                               num_experts=64, block_size=64, total_block_num=4,
                               max_num_batched_tokens=512)
    d, _ = make(seed, geometry=geometry)
    buffer = d.manager.get_routing_table()
    assert list(buffer.shape) == [512, 3, 8] and buffer.dtype == paddle.uint8
    stats = d.manager.stats()
    assert stats["capture_device_bytes"] == 512 * 3 * 8 + 8 * 4
    assert stats["step_buffer_rows"] == 512
    derived = CaptureGeometry(max_num_seqs=8, max_model_len=100, num_moe_layers=1, top_k=1, num_experts=4,
                              block_size=4, total_block_num=4, num_speculative_tokens=15)
    assert derived.step_tokens == 128               # every sequence decoding 1 + 15 drafts
