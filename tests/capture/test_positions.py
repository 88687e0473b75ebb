"""Token positions and slot mapping against a per-sequence reference (FastDeploy's loop)."""

from __future__ import annotations

import numpy as np
import pytest

from fd_routing_replay.capture.positions import (
    StepPositions,
    compute_slot_mapping,
    token_positions,
)


def reference_positions(decoder, this_time, registered):
    """FastDeploy's get_token_positions loop, restricted to registered slots."""
    batch, pos = [], []
    for b in range(len(this_time)):
        if this_time[b] == 0 or not registered[b]:
            continue
        for i in range(this_time[b]):
            batch.append(b)
            pos.append(decoder[b] + i)
    return np.array(batch, dtype=np.int64), np.array(pos, dtype=np.int64)


def reference_slots(block_table, batch, pos, block_size):
    out = []
    for b, p in zip(batch, pos, strict=True):
        index = p // block_size
        if index >= block_table.shape[1] or block_table[b, index] < 0:
            out.append(-1)
        else:
            out.append(block_table[b, index] * block_size + p % block_size)
    return np.array(out, dtype=np.int64)


@pytest.mark.parametrize("trial", range(5))
def test_positions_match_reference(seed, trial):
    rng = np.random.default_rng([seed, trial])
    n = int(rng.integers(1, 40))
    decoder = rng.integers(0, 300, n).astype(np.int32)
    this_time = np.where(rng.random(n) < 0.3, 0, rng.integers(1, 20, n)).astype(np.int32)
    registered = rng.random(n) < 0.8
    got = token_positions(decoder.reshape(-1, 1), this_time.reshape(-1, 1), registered=registered)
    batch, pos = reference_positions(decoder, this_time, registered)
    np.testing.assert_array_equal(got.batch_ids, batch)
    np.testing.assert_array_equal(got.positions, pos)
    np.testing.assert_array_equal(got.relative, pos - decoder[batch])


def test_positions_accept_paddle_tensors_and_encoder():
    from fdrr_dev.harness.paddle_runtime import paddle

    decoder = paddle.to_tensor(np.array([[5], [0], [7]], dtype=np.int32))
    this_time = paddle.to_tensor(np.array([[1], [4], [0]], dtype=np.int32))
    encoder = paddle.to_tensor(np.array([[0], [4], [0]], dtype=np.int32))
    got = token_positions(decoder, this_time, seq_lens_encoder=encoder)
    np.testing.assert_array_equal(got.batch_ids, [0, 1, 1, 1, 1])
    np.testing.assert_array_equal(got.positions, [5, 0, 1, 2, 3])
    np.testing.assert_array_equal(got.is_prefill, [False, True])


def test_empty_step():
    got = token_positions(np.zeros(4, np.int32), np.zeros(4, np.int32))
    assert len(got) == 0 and len(got.active) == 0
    assert len(StepPositions.empty()) == 0


@pytest.mark.parametrize("trial", range(5))
def test_slot_mapping_matches_reference(seed, trial):
    rng = np.random.default_rng([seed, trial, 1])
    n, width, block_size = 8, 6, int(rng.choice([1, 4, 16]))
    table = rng.integers(-1, 50, (n, width)).astype(np.int32)
    batch = rng.integers(0, n, 200).astype(np.int64)
    pos = rng.integers(0, width * block_size + 8, 200).astype(np.int64)   # some past the table
    expected = reference_slots(table, batch, pos, block_size)
    np.testing.assert_array_equal(compute_slot_mapping(table, batch, pos, block_size), expected)

    from fdrr_dev.harness.paddle_runtime import paddle

    np.testing.assert_array_equal(
        compute_slot_mapping(paddle.to_tensor(table), batch, pos, block_size), expected)


def reference_rows(this_time, batch, pos, decoder):
    """Row of each token in the token-major step buffer: its index among all the step's tokens."""
    cu = np.concatenate(([0], np.cumsum(np.maximum(this_time, 0))))
    return np.array([cu[b] + p - decoder[b] for b, p in zip(batch, pos, strict=True)], dtype=np.int64)


@pytest.mark.parametrize("trial", range(6))
@pytest.mark.parametrize("block_dtype", [np.int32, np.int64])
def test_plan_positions_matches_the_references(seed, trial, block_dtype):
    """One pass (compiled plan): positions, step rows and KV slots of the tracked tokens."""
    from fd_routing_replay import ops
    from fd_routing_replay.capture.positions import plan_positions
    from fd_routing_replay.ops import reference as ref

    rng = np.random.default_rng([seed, trial, 2])
    n, width, block_size = int(rng.integers(1, 40)), 5, int(rng.choice([1, 4, 16]))
    decoder = rng.integers(0, width * block_size + 4, n).astype(np.int32)      # some past the table
    this_time = np.where(rng.random(n) < 0.3, 0, rng.integers(1, 20, n)).astype(np.int32)
    this_time[rng.random(n) < 0.1] = -1                                          # garbage counts as 0
    registered = rng.random(n) < 0.8
    table = rng.integers(-1, 50, (n, width)).astype(block_dtype)
    got = plan_positions(decoder.reshape(-1, 1), this_time.reshape(-1, 1), registered=registered,
                         block_table=table, block_size=block_size)
    batch, pos = reference_positions(decoder, np.maximum(this_time, 0), registered)
    np.testing.assert_array_equal(got.batch_ids, batch)
    np.testing.assert_array_equal(got.positions, pos)
    np.testing.assert_array_equal(got.rows, reference_rows(this_time, batch, pos, decoder))
    np.testing.assert_array_equal(got.slots, reference_slots(table, batch, pos, block_size))
    np.testing.assert_array_equal(got.active, np.flatnonzero((this_time > 0) & registered))
    assert got.num_step_tokens == int(np.maximum(this_time, 0).sum())
    numpy_plan = ref.plan_step_np(decoder.astype(np.int64), this_time.astype(np.int64), registered,
                                  table, block_size)
    for ours, theirs in zip(ops.plan_step(decoder, this_time, registered, table, block_size), numpy_plan,
                            strict=True):
        np.testing.assert_array_equal(ours, theirs)


def test_plan_positions_empty_step_and_no_table():
    from fd_routing_replay.capture.positions import plan_positions

    got = plan_positions(np.zeros(4, np.int32), np.zeros(4, np.int32))
    assert len(got) == 0 and got.num_step_tokens == 0 and got.slots is None
    got = plan_positions(np.array([3, 0]), np.array([2, 1]))
    np.testing.assert_array_equal(got.positions, [3, 4, 0])
    np.testing.assert_array_equal(got.rows, [0, 1, 2])


def test_scatter_rows_matches_numpy(seed):
    from fd_routing_replay import ops
    from fd_routing_replay.ops import reference as ref

    rng = np.random.default_rng(seed)
    for dtype in (np.uint8, np.uint16, np.uint32):
        cache = rng.integers(0, 200, (30, 3, 4)).astype(dtype)
        staging = rng.integers(0, 200, (10, 3, 4)).astype(dtype)
        slots = rng.integers(-2, 33, 12)                    # some negative, some past the cache
        rows = rng.integers(-1, 11, 12)                     # some past the staging
        expected = cache.copy()
        n_ref = ref.scatter_rows_np(expected, staging, slots, rows)
        assert ops.scatter_rows(cache, staging, slots, rows) == n_ref
        np.testing.assert_array_equal(cache, expected)
