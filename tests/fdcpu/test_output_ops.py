"""The System V message-queue hand-off between the worker's save_output and the engine's get_output."""

from __future__ import annotations

import socket

import numpy as np
import paddle
import pytest

from tests.fdcpu import output_ops


@pytest.fixture
def queue_id(monkeypatch):
    with socket.socket() as sock:                 # a free port: the rig's queue ids are ports
        sock.bind(("127.0.0.1", 0))
        qid = sock.getsockname()[1]
    monkeypatch.setenv("INFERENCE_MSG_QUEUE_ID", str(qid))
    output_ops._queues.pop(qid, None)
    yield qid
    output_ops.remove_queue(qid)


def test_tokens_cross_the_queue_with_the_stop_flag_and_preempted_slots(queue_id):
    out = paddle.full([output_ops.MAX_BSZ + 2, 1], 2, dtype="int64")
    output_ops.save_output(paddle.to_tensor([[11], [12], [-1]], dtype="int64"), paddle.to_tensor([True]),
                           paddle.to_tensor([[0], [1], [0]], dtype="int32"), 0, False)
    output_ops.save_output(paddle.to_tensor([[5]], dtype="int64"), paddle.to_tensor([False]), None, 0, False)
    output_ops.get_output(out, 0, True)
    # mtext[0] = +1 (running), bsz 3, tokens; slot 1 preempted -> PREEMPTED_TOKEN_ID
    assert out.numpy()[:5, 0].tolist() == [1, 3, 11, -9, -1]
    output_ops.get_output(out, 0, True)
    assert out.numpy()[:3, 0].tolist() == [-1, 1, 5]               # no running sequence: -1
    output_ops.get_output(out, 0, False)                             # empty, non-blocking
    assert out.numpy()[:2, 0].tolist() == [-2, 0]
    assert output_ops.remove_queue(queue_id) is True
    assert output_ops.remove_queue(queue_id) is False


def test_only_rank_zero_sends_and_keys_keep_sixteen_bits_of_the_id(queue_id):
    output_ops.save_output(paddle.to_tensor([[1]], dtype="int64"), paddle.to_tensor([True]), None, 1, False)
    out = paddle.full([output_ops.MAX_BSZ + 2, 1], 2, dtype="int64")
    output_ops.get_output(out, 0, False)
    assert out.numpy()[:2, 0].tolist() == [-2, 0]
    assert output_ops.queue_key(0x1234) & 0xFFFF == 0x1234
    assert output_ops.queue_key(0x1234) != output_ops.queue_key(0x1235)
    assert np.int32(output_ops.queue_key(0x11234)) == np.int32(output_ops.queue_key(0x1234))
