"""The sampling stand-ins against hand-worked cases."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from tests.fdcpu import sampling_ops


def col(values, dtype):
    return paddle.to_tensor(np.asarray(values).reshape(-1, 1), dtype=dtype)


def _penalty(logits, history, prompt_len, step, *, alpha=1.0, beta=0.0, gamma=0.0, temperature=1.0,
             min_len=0, bad=(-1,)):
    out = paddle.to_tensor(np.asarray([logits], dtype=np.float32))
    result = sampling_ops.get_token_penalty_multi_scores(
        paddle.to_tensor(np.asarray([history]), dtype="int64"), out, col([alpha], "float32"),
        col([beta], "float32"), col([gamma], "float32"), col([temperature], "float32"),
        paddle.to_tensor(np.asarray([bad]), dtype="int64"), paddle.to_tensor([len(bad)], dtype="int64"),
        col([prompt_len], "int64"), col([step], "int64"), col([min_len], "int64"),
        col([2], "int64"))
    assert result is out                     # in place, returned as the op's output
    return out.numpy()[0].tolist()


def test_penalties_follow_the_kernels_order():
    # vocab 5; prompt = [1, 4]; generated = [4, 3, 3]; -1 = unused history slots
    history = [1, 4, 4, 3, 3, -1, -1]
    got = _penalty([1.0, -2.0, 3.0, 0.5, 2.0], history, prompt_len=2, step=3, alpha=2.0, beta=0.5,
                   gamma=0.25, temperature=0.5)
    # token 1: prompt only -> -2 * 2 = -4;  token 3: generated twice -> 0.5 / 2 - 2 * 0.5 - 0.25 = -1.0
    # token 4: prompt and generated once -> 2 / 2 - 0.5 - 0.25 = 0.25; then every logit / 0.5
    assert got == pytest.approx([2.0, -8.0, 6.0, -2.0, 0.5])


def test_temperature_one_and_no_penalty_leave_logits_alone_but_bad_words_and_min_length_apply():
    got = _penalty([1.0, 2.0, 3.0, 4.0], [1, 2, -1], prompt_len=1, step=0, min_len=1, bad=(3, 9))
    assert got == [1.0, 2.0, -1e10, -1e10]                   # eos 2 below min length; 3 banned; 9 ignored
    got = _penalty([1.0, 2.0, 3.0, 4.0], [1, 2, -1], prompt_len=1, step=1, min_len=1)
    assert got == [1.0, 2.0, 3.0, 4.0]


def _sample(probs, top_p, seeds):
    probs = paddle.to_tensor(np.asarray(probs, dtype=np.float32))
    scores, ids = sampling_ops.top_p_sampling(probs, col(top_p, "float32"), topp_seed=col(seeds, "int64"))
    return ids.numpy().ravel().tolist(), scores.numpy().ravel().tolist()


def test_top_p_zero_is_greedy_and_ties_take_the_lower_id():
    ids, scores = _sample([[0.1, 0.4, 0.4, 0.1], [0.7, 0.1, 0.1, 0.1]], [0.0, 0.0], [3, 4])
    assert ids == [1, 0]
    assert scores == pytest.approx([0.4, 0.7])


def test_top_p_samples_inside_the_nucleus_deterministically_per_seed():
    probs = [[0.05, 0.5, 0.15, 0.3]] * 64
    ids, _ = _sample(probs, [0.7] * 64, list(range(64)))
    # order 1 (0.5), 3 (0.3) ...: u * 0.7 < 0.5 -> token 1, else token 3; never 2 or 0
    assert set(ids) == {1, 3}
    assert _sample(probs, [0.7] * 64, list(range(64)))[0] == ids
    draws = [np.random.default_rng(seed).random() * 0.7 for seed in range(64)]
    assert ids == [1 if d < 0.5 else 3 for d in draws]


def test_top_p_refuses_what_it_does_not_stand_in():
    with pytest.raises(NotImplementedError, match="threshold"):
        sampling_ops.top_p_sampling(paddle.ones([1, 2]), col([0.5], "float32"), threshold=col([0.1], "float32"))


def test_min_p_and_top_k_renorm():
    probs = paddle.to_tensor(np.array([[0.5, 0.3, 0.15, 0.05]], dtype=np.float32))
    kept = sampling_ops.min_p_sampling(probs, col([0.4], "float32")).numpy()[0]
    assert kept.tolist() == pytest.approx([0.5, 0.3, 0.0, 0.0])            # below 0.4 * 0.5 = 0.2
    renorm = sampling_ops.top_k_renorm_probs(probs, col([2], "int64")).numpy()[0]
    assert renorm.tolist() == pytest.approx([0.625, 0.375, 0.0, 0.0])
    assert sampling_ops.top_k_renorm_probs(probs, col([0], "int64")).numpy()[0].tolist() == \
        pytest.approx([0.5, 0.3, 0.15, 0.05])
