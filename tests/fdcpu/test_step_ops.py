"""The state-machine stand-ins against hand-worked cases (expected values written out, not
recomputed): a wrong one hangs the live server rather than failing it."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from tests.fdcpu import step_ops


def t(values, dtype):
    return paddle.to_tensor(np.asarray(values), dtype=dtype)


def col(values, dtype):
    return paddle.to_tensor(np.asarray(values).reshape(-1, 1), dtype=dtype)


# ---------------------------------------------------------------- get_padding_offset
def test_padding_offset_packs_each_sequences_tokens_in_order():
    ids = t([[5, 6, 7, 0], [8, 0, 0, 0], [9, 10, 0, 0]], "int64")
    packed, batch, cu_q, cu_k = step_ops.get_padding_offset(ids, t([3, 0, 2], "int32"), None, None, 5)
    assert packed.numpy().tolist() == [5, 6, 7, 9, 10]
    assert batch.numpy().tolist() == [0, 0, 0, 2, 2]
    assert cu_q.numpy().tolist() == [0, 3, 3, 5] and cu_k.numpy().tolist() == [0, 3, 3, 5]
    assert packed.dtype == paddle.int64 and batch.dtype == paddle.int32 and cu_q.dtype == paddle.int32


def test_padding_offset_pads_an_overlapped_launch_and_refuses_a_short_count():
    ids = t([[5, 6, 0], [9, 0, 0]], "int64")
    packed, batch, cu_q, _ = step_ops.get_padding_offset(ids, t([1, 1], "int32"), None, None, 4)
    assert packed.numpy().tolist() == [5, 9, 0, 0]
    assert batch.numpy().tolist() == [0, 1, -1, -1]
    assert cu_q.numpy().tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="token_num_cpu=1 but seq_lens_this_time sums to 2"):
        step_ops.get_padding_offset(ids, t([1, 1], "int32"), None, None, 1)


def test_padding_offset_refuses_the_speculative_inputs_by_name():
    with pytest.raises(NotImplementedError, match="draft_tokens"):
        step_ops.get_padding_offset(t([[1]], "int64"), t([1], "int32"), t([[1]], "int64"), None, 1)


# ---------------------------------------------------------------- positions and slots
def test_positions_and_slots_follow_each_tokens_block_table_row():
    buffer_pos = paddle.full([6], 99, dtype="int64")
    buffer_slot = paddle.full([6], 99, dtype="int64")
    tables = t([[7, 8, 9, -1], [1, 2, 3, 4], [20, 21, -1, -1]], "int32")
    step_ops.get_position_ids_and_slot_mapping(
        t([0, 0, 0], "int32"), t([10, 0, 5], "int32"), t([1, 0, 3], "int32"), t([0, 2, 2, 2], "int32"),
        tables, buffer_pos[:4], buffer_slot[:4], 4)
    # position 10 of seq 0: block index 2 -> block 9, offset 2; positions 5..7 of seq 2: block 21
    assert buffer_pos.numpy().tolist() == [10, 5, 6, 7, 99, 99]
    assert buffer_slot.numpy().tolist() == [38, 85, 86, 87, 99, 99]


def test_slots_use_the_tokens_batch_id_not_the_loop_index():
    # the kernel reads block_tables[batch_id_per_token[t]]: a wrong batch id moves the slot
    pos, slot = paddle.zeros([1], dtype="int64"), paddle.zeros([1], dtype="int64")
    step_ops.get_position_ids_and_slot_mapping(
        t([1], "int32"), t([0], "int32"), t([1], "int32"), t([1], "int32"),
        t([[3], [5]], "int32"), pos, slot, 16)
    assert pos.numpy().tolist() == [0] and slot.numpy().tolist() == [80]


# ---------------------------------------------------------------- recover_decode_task
def test_recover_resumes_a_paused_sequence_once_its_next_block_exists():
    stop = col([True, True, False, True], "bool")
    this_time = t([0, 0, 1, 0], "int32")
    enc, dec = t([0, 0, 0, 0], "int32"), t([0, 0, 9, 0], "int32")
    step_dec = col([8, 8, 0, 8], "int32")
    blocked = t([True, True, False, True], "bool")
    tables = t([[1, 2, 3], [1, 2, -1], [4, 5, 6], [7, 8, 9]], "int32")
    step_ops.recover_decode_task(stop, this_time[:3], enc, dec, step_dec, tables, blocked, None, None, None, 4, 0)
    # seq 0: block_tables[0, 8 // 4] = 3 exists -> resumes at length 8; seq 1: still no block;
    # seq 2: not paused; seq 3 is beyond the step's 3 sequences
    assert blocked.numpy().tolist() == [False, True, False, True]
    assert this_time.numpy().tolist() == [1, 0, 1, 0]
    assert stop.numpy().ravel().tolist() == [False, True, False, True]
    assert dec.numpy().tolist() == [8, 0, 9, 0]


# ---------------------------------------------------------------- rebuild_padding
def test_rebuild_padding_takes_each_sequences_sampling_row():
    tmp = paddle.to_tensor(np.arange(12, dtype=np.float32).reshape(6, 2))      # row r = [2r, 2r+1]
    out = step_ops.rebuild_padding(tmp, t([0, 3, 3, 4, 6, 6], "int32"), t([3, 0, 1, 2, 0], "int32"),
                                   t([0, 5, 7, 4, 0], "int32"), t([3, 0, 0, 2, 0], "int32"))
    # seq 0: prefill of 3 -> row 2; seq 1: no tokens -> zeros; seq 2: decode -> row 3;
    # seq 3: chunk of 2 after 4 cached -> row 5; seq 4: no tokens -> zeros
    assert out.numpy().tolist() == [[4, 5], [0, 0], [6, 7], [10, 11], [0, 0]]


def test_rebuild_padding_skips_a_sequence_with_no_lengths():
    tmp = paddle.ones([1, 2], dtype="float32")
    out = step_ops.rebuild_padding(tmp, t([0, 1], "int32"), t([1], "int32"), t([0], "int32"), t([0], "int32"))
    assert out.numpy().tolist() == [[0, 0]]


# ---------------------------------------------------------------- set_value_by_flags_and_idx
def test_history_gets_the_token_fed_this_step_after_the_prompt():
    history = paddle.full([3, 12], -1, dtype="int64")
    ids = t([[40, 41, 42], [50, 51, 52], [60, 61, 62]], "int64")
    step_ops.set_value_by_flags_and_idx(history, ids, t([1, 2, 1], "int32"), t([0, 3, 0], "int32"),
                                        t([5, 4, 4], "int32"), col([3, 2, 4], "int64"), col([2, 3, 1], "int64"),
                                        col([False, False, True], "bool"))
    got = history.numpy()
    assert got[0].tolist() == [-1] * 5 + [40] + [-1] * 6          # decode: input_ids[0, 0] at 3 + 2
    assert got[1].tolist() == [-1] * 5 + [52] + [-1] * 6          # chunk: input_ids[1, 3 - 1] at 2 + 3
    assert (got[2] == -1).all()                                    # stopped


def test_history_is_left_alone_at_step_zero():
    history = paddle.full([1, 4], -1, dtype="int64")
    step_ops.set_value_by_flags_and_idx(history, t([[7, 8]], "int64"), t([2], "int32"), t([2], "int32"),
                                        t([0], "int32"), col([2], "int64"), col([0], "int64"),
                                        col([False], "bool"))
    assert history.numpy().tolist() == [[-1, -1, -1, -1]]


# ---------------------------------------------------------------- set_stop_value_multi_ends
def _stop_case(topk, stop, lens, steps, minimum, stop_seq=None):
    history = paddle.full([len(topk), 10], -1, dtype="int64")
    seqs, seq_lens = paddle.full([len(topk), 2, 3], -1, dtype="int64"), paddle.zeros([len(topk), 2], dtype="int32")
    if stop_seq is not None:
        row, seq, generated = stop_seq
        seqs[row, 0, : len(seq)] = paddle.to_tensor(seq, dtype="int64")
        seq_lens[row, 0] = len(seq)
        history[row, 2: 2 + len(generated)] = paddle.to_tensor(generated, dtype="int64")
    topk_t, stop_t, nexts = col(topk, "int64"), col(stop, "bool"), paddle.full([len(topk), 1], -9, dtype="int64")
    step_ops.set_stop_value_multi_ends(topk_t, stop_t, t(lens, "int32"), col([2, 3], "int64"), nexts, history,
                                       col([2] * len(topk), "int64"), col(steps, "int64"), seqs, seq_lens,
                                       col(minimum, "int64"), False)
    return topk_t.numpy().ravel().tolist(), stop_t.numpy().ravel().tolist(), nexts.numpy().ravel().tolist()


def test_stop_flags_for_end_ids_stopped_and_running_sequences():
    topk, stop, nexts = _stop_case(topk=[7, 3, 9, 4, 2], stop=[False, False, True, True, False],
                                   lens=[1, 1, 0, 1, 1], steps=[3, 5, 4, 4, 1], minimum=[1, 1, 1, 1, 3])
    assert topk == [7, 2, -1, 2, 2]          # 3 is an end id -> written as end_ids[0]
    assert stop == [False, True, True, True, False]
    # seq 2 stopped without tokens: next_tokens untouched; seq 4 below min_tokens keeps running
    assert nexts == [7, 2, -9, 2, 2]


def test_a_stop_sequence_at_the_tail_of_the_history_stops():
    # generated tokens at history[row, prompt(2) + j]: j = 0..2 -> [30, 11, 12]; step_idx 3
    topk, stop, nexts = _stop_case(topk=[5], stop=[False], lens=[1], steps=[3], minimum=[1],
                                   stop_seq=(0, [11, 12], [30, 11, 12]))
    assert (topk, stop, nexts) == ([2], [True], [2])
    topk, stop, _ = _stop_case(topk=[5], stop=[False], lens=[1], steps=[3], minimum=[1],
                               stop_seq=(0, [11, 13], [30, 11, 12]))
    assert (topk, stop) == ([5], [False])


# ---------------------------------------------------------------- update_inputs_v1
def _update(stop, this_time, enc, dec, prompts, sampled, nexts, tables, blocked=None, bsz=None):
    n = len(stop)
    bsz = bsz or n
    tensors = dict(stop=col(stop, "bool"), this_time=t(this_time, "int32"), enc=t(enc, "int32"),
                   dec=t(dec, "int32"), step_dec=paddle.zeros([n, 1], dtype="int32"),
                   prompts=col(prompts, "int64"), sampled=col(sampled, "int64"),
                   ids=paddle.zeros([n, 4], dtype="int64"), tables=t(tables, "int32"),
                   nexts=col(nexts, "int64"), blocked=t(blocked or [False] * n, "bool"),
                   not_need_stop=paddle.to_tensor([False]))
    step_ops.update_inputs_v1(tensors["stop"], tensors["not_need_stop"], tensors["this_time"][:bsz], tensors["enc"],
                              tensors["dec"], tensors["step_dec"], tensors["prompts"], tensors["sampled"],
                              tensors["ids"], tensors["tables"], tensors["nexts"], tensors["blocked"], 4)
    return {k: v.numpy().reshape(-1).tolist() if k != "ids" else v.numpy().tolist() for k, v in tensors.items()}


def test_update_inputs_moves_sequences_to_decode_stop_and_chunk():
    tables = [[1, 2, 3, -1], [4, 5, -1, -1], [6, 7, 8, 9], [1, 1, 1, 1], [2, 2, 2, 2]]
    got = _update(stop=[False, False, False, True, True], this_time=[1, 6, 4, 1, 0], enc=[0, 6, 4, 0, 0],
                  dec=[10, 0, 0, 12, 0], prompts=[5, 6, 10, 5, 3], sampled=[31, 32, 33, 34, 35],
                  nexts=[41, 42, 43, 44, 45], tables=tables, bsz=4)
    # seq 0 decodes (length 11, block_tables[0, 11 // 4] = 3), seq 1 finished its prompt of 6
    # (length 6, block 5), seq 2 has prompt left (chunked: stopped, token -1), seq 3 was
    # stopped (its token stays, 13 >= 5), seq 4 is beyond the step's 4 sequences
    assert got["dec"] == [11, 6, 0, 0, 0]
    assert got["this_time"] == [1, 1, 0, 0, 0]
    assert got["enc"] == [0, 0, 0, 0, 0]
    assert got["stop"] == [False, False, True, True, True]
    assert got["sampled"] == [31, 32, -1, 34, 35]
    assert [row[0] for row in got["ids"]] == [41, 42, 0, 0, 0]
    assert got["not_need_stop"] == [True]


def test_update_inputs_pauses_a_sequence_whose_next_block_is_missing():
    got = _update(stop=[False], this_time=[1], enc=[0], dec=[7], prompts=[3], sampled=[9], nexts=[9],
                  tables=[[5, 6, -1, -1]])
    # length 8 needs block_tables[0, 2] == -1: paused, its length kept in step_seq_lens_decoder
    assert got["blocked"] == [True] and got["stop"] == [True]
    assert got["step_dec"] == [8] and got["dec"] == [0] and got["this_time"] == [0]
    assert got["not_need_stop"] == [False]


def test_update_inputs_drops_the_token_of_a_stop_before_the_prompt_ends():
    got = _update(stop=[True], this_time=[2], enc=[2], dec=[0], prompts=[5], sampled=[9], nexts=[9],
                  tables=[[1, 2, 3, 4]])
    assert got["sampled"] == [-1] and got["this_time"] == [0] and got["not_need_stop"] == [False]


# ---------------------------------------------------------------- custom_numpy_to_tensor
def test_numpy_bytes_go_into_a_view_of_the_target():
    buffer = paddle.zeros([2, 4], dtype="int64")
    step_ops.custom_numpy_to_tensor(np.array([7, 8, 9], dtype=np.int64), buffer[1:2, :3])
    assert buffer.numpy().tolist() == [[0, 0, 0, 0], [7, 8, 9, 0]]
    with pytest.raises(ValueError, match="16 bytes into a tensor of 3"):
        step_ops.custom_numpy_to_tensor(np.array([7, 8], dtype=np.int64), buffer[1:2, :3])
