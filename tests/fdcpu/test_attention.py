"""Paged attention on FastDeploy's KV cache layout against hand-worked cases."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import paddle
import pytest

from tests.fdcpu.attention import paged_attention, step_layout


def _meta(this_time, decoded, tables):
    cu = np.concatenate([[0], np.cumsum(this_time)]).astype(np.int32)
    return SimpleNamespace(cu_seqlens_q=paddle.to_tensor(cu), seq_lens_this_time=paddle.to_tensor(
        np.asarray(this_time, np.int32)), seq_lens_decoder=paddle.to_tensor(np.asarray(decoded, np.int32)),
        block_tables=paddle.to_tensor(np.asarray(tables, np.int32)))


def _f(values):
    return paddle.to_tensor(np.asarray(values, dtype=np.float32))


def test_prefill_then_decode_write_the_cache_by_block_table_and_attend_causally():
    key_cache = paddle.zeros([4, 1, 2, 2])          # [blocks, kv_heads, block_size, head_dim]
    value_cache = paddle.zeros([4, 1, 2, 2])
    tables = [[2, 0, -1]]
    # prefill of 3 tokens with zero queries: uniform attention -> running means of the values
    layout = step_layout(_meta([3], [0], tables), 3)
    v = [[[1, 0]], [[0, 1]], [[2, 2]]]
    out = paged_attention(_f([[[0, 0]]] * 3), _f([[[1, 0]], [[0, 0]], [[0, 0]]]), _f(v), key_cache,
                          value_cache, layout, 2, 1.0)
    np.testing.assert_allclose(out.numpy(), [[1, 0], [0.5, 0.5], [1, 1]], rtol=1e-6, atol=1e-6)
    # positions 0, 1 in block 2 (offsets 0, 1), position 2 in block 0 (offset 0)
    assert value_cache.numpy()[2, 0].tolist() == [[1, 0], [0, 1]]
    assert value_cache.numpy()[0, 0].tolist() == [[2, 2], [0, 0]]
    # decode at position 3 (block 0, offset 1); query [ln 3, 0] scores key 0 at ln 3, the others 0
    layout = step_layout(_meta([1], [3], tables), 1)
    out = paged_attention(_f([[[math.log(3), 0]]]), _f([[[0, 0]]]), _f([[[0, 6]]]), key_cache, value_cache,
                          layout, 2, 1.0)
    np.testing.assert_allclose(out.numpy(), [[(3 * 1 + 0 + 2 + 0) / 6, (0 + 1 + 2 + 6) / 6]], rtol=1e-6, atol=1e-6)
    assert value_cache.numpy()[0, 0].tolist() == [[2, 2], [0, 6]]


def test_grouped_query_heads_share_their_kv_head_and_sequences_stay_apart():
    key_cache, value_cache = paddle.zeros([4, 1, 2, 1]), paddle.zeros([4, 1, 2, 1])
    # two sequences in one step: seq 0 one token (block 1), seq 1 two tokens (block 3)
    layout = step_layout(_meta([1, 2], [0, 0], [[1, -1], [3, -1]]), 3)
    out = paged_attention(paddle.zeros([3, 2, 1]), paddle.zeros([3, 1, 1]), _f([[[5]], [[1]], [[3]]]),
                          key_cache, value_cache, layout, 2, 1.0)
    np.testing.assert_allclose(out.numpy(), [[5, 5], [1, 1], [2, 2]], rtol=1e-6, atol=1e-6)


def test_padding_tokens_of_an_overlapped_launch_are_not_written():
    key_cache, value_cache = paddle.zeros([2, 1, 2, 1]), paddle.zeros([2, 1, 2, 1])
    layout = step_layout(_meta([1], [0], [[1, -1]]), 3)             # one real token, two padding
    assert layout.batch.tolist() == [0, -1, -1]
    out = paged_attention(paddle.zeros([3, 1, 1]), paddle.zeros([3, 1, 1]), _f([[[7]], [[9]], [[9]]]),
                          key_cache, value_cache, layout, 2, 1.0)
    assert out.numpy().ravel().tolist() == [7, 0, 0]
    assert value_cache.numpy().ravel().tolist() == [0, 0, 7, 0]


def test_a_position_without_a_block_is_an_error():
    layout = step_layout(_meta([1], [2], [[1, -1]]), 1)
    with pytest.raises(ValueError, match="position 2 has no KV block"):
        paged_attention(paddle.zeros([1, 1, 1]), paddle.zeros([1, 1, 1]), paddle.zeros([1, 1, 1]),
                        paddle.zeros([2, 1, 2, 1]), paddle.zeros([2, 1, 2, 1]), layout, 2, 1.0)
