"""The MoE stand-ins against hand-worked cases: routing, the expert-sorted permutation, the
per-expert FFN and the weighted reduce."""

from __future__ import annotations

import math

import numpy as np
import paddle
import pytest

from tests.fdcpu import moe_ops


def _silu(v: float) -> float:
    return v / (1.0 + math.exp(-v))


def _dispatch(x, gates, k=2, bias=None):
    return moe_ops.moe_expert_dispatch(paddle.to_tensor(np.asarray(x, dtype=np.float32)),
                                       paddle.to_tensor(np.asarray(gates, dtype=np.float32)),
                                       None if bias is None else paddle.to_tensor(np.asarray(bias, np.float32)),
                                       None, k, False, "w16a16", topk_only_mode=False)


def test_dispatch_routes_by_softmax_rank_and_sorts_pairs_by_expert():
    x = [[1.0, 10.0], [2.0, 20.0], [3.0, 30.0]]
    gates = [[0.0, 2.0, 1.0, -1.0],        # experts 1, 2
             [3.0, 3.0, 0.0, 0.0],          # a tie: 0 before 1
             [0.0, 0.0, 0.0, 5.0]]          # 3, then the lowest of the tied 0, 1, 2
    permuted, prefix, where, weights, ids, sorted_experts, _, biggest = _dispatch(x, gates)
    assert ids.numpy().tolist() == [[1, 2], [0, 1], [3, 0]]
    assert ids.dtype == paddle.int32
    e = [math.exp(v) for v in (0.0, 2.0, 1.0, -1.0)]
    assert weights.numpy()[0].tolist() == pytest.approx([e[1] / sum(e), e[2] / sum(e)])
    # pairs (token, j) by expert: e0: (1,0) (2,1); e1: (0,0) (1,1); e2: (0,1); e3: (2,0)
    assert sorted_experts.numpy().tolist() == [0, 0, 1, 1, 2, 3]
    assert permuted.numpy()[:, 0].tolist() == [2.0, 3.0, 1.0, 2.0, 1.0, 3.0]
    assert prefix.numpy().tolist() == [2, 4, 5, 6]
    assert where.numpy().tolist() == [[2, 0, 5], [4, 3, 1]]          # [k, tokens]
    assert biggest.numpy().tolist() == [2]


def test_dispatch_selects_with_the_correction_bias_but_weighs_without_it():
    _, _, _, weights, ids, _, _, _ = _dispatch([[1.0]], [[1.0, 0.0, 0.0]], k=1, bias=[0.0, 0.0, 1.0])
    e = [math.exp(v) for v in (1.0, 0.0, 0.0)]
    # softmax [0.576, 0.212, 0.212] + bias -> expert 2 wins; its weight is its softmax 0.212
    assert ids.numpy().tolist() == [[2]]
    np.testing.assert_allclose(weights.numpy(), [[e[2] / sum(e)]], rtol=1e-6)


def test_dispatch_refuses_quantized_and_grouped_paths():
    with pytest.raises(NotImplementedError, match="quant='w4a8'"):
        moe_ops.moe_expert_dispatch(paddle.ones([1, 2]), paddle.ones([1, 2]), None, None, 1, False, "w4a8")


def test_ffn_runs_each_experts_rows_through_its_weights():
    # hidden 2, intermediate 1: up_gate[e] = [[a_e, 0], [0, 1]] -> (a_e * x0, x1); SwiGLU silu(a_e x0) * x1;
    # down[e] = [[1, -1]]
    a = [1.0, -0.5]
    up_gate = np.array([[[a[e], 0.0], [0.0, 1.0]] for e in range(2)], dtype=np.float32)
    down = np.array([[[1.0, -1.0]]] * 2, dtype=np.float32)
    rows = np.array([[1.0, 2.0], [0.5, 1.0], [2.0, -1.0]], dtype=np.float32)    # expert 0 gets 2 rows
    out = moe_ops.moe_expert_ffn(paddle.to_tensor(rows), paddle.to_tensor([2, 3], dtype="int64"),
                                 paddle.to_tensor(up_gate), paddle.to_tensor(down), paddle.zeros([1]),
                                 None, None, None, None, None, None, "w16a16", False, -1, 128, "swiglu").numpy()
    expected = [_silu(1.0) * 2.0, _silu(0.5) * 1.0, _silu(-1.0) * -1.0]
    assert out[:, 0].tolist() == pytest.approx(expected, rel=1e-6)
    assert out[:, 1].tolist() == pytest.approx([-v for v in expected], rel=1e-6)


def test_reduce_weighs_each_tokens_expert_rows_back_in_token_order():
    ffn = paddle.to_tensor(np.array([[1.0], [2.0], [4.0], [8.0]], dtype=np.float32))
    where = paddle.to_tensor(np.array([[2, 1], [0, 3]], dtype=np.int32))          # [k, tokens]
    weights = paddle.to_tensor(np.array([[0.3, 0.1], [0.1, 0.3]], dtype=np.float32))
    ids = paddle.to_tensor(np.array([[0, 1], [1, 0]], dtype=np.int32))
    normed = moe_ops.moe_expert_reduce(ffn, weights, where, ids, None, True, 1.0).numpy()
    # token 0: rows 2 and 0 with 0.75 / 0.25 -> 3.25; token 1: rows 1 and 3 with 0.25 / 0.75 -> 6.5
    assert normed.ravel().tolist() == pytest.approx([3.25, 6.5])
    raw = moe_ops.moe_expert_reduce(ffn, weights, where, ids, None, False, 2.0).numpy()
    assert raw.ravel().tolist() == pytest.approx([2 * (0.3 * 4 + 0.1 * 1), 2 * (0.1 * 2 + 0.3 * 8)])
