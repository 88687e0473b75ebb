"""Where a step's tokens sit, against FastDeploy's per-sequence loops: the oracle's NumPy
planning (tests/capture/step_oracle.py) and the compiled ledger's plan (the manager's
``get_token_positions`` + ``compute_slot_mapping``)."""

from __future__ import annotations

import numpy as np
import pytest

from fd_routing_replay.capture.fd25 import CaptureGeometry, RoutingReplayManager
from tests.capture.step_oracle import compute_slot_mapping, token_positions


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


def test_empty_step():
    got = token_positions(np.zeros(4, np.int32), np.zeros(4, np.int32))
    assert len(got.batch_ids) == 0 and len(got.active) == 0


@pytest.mark.parametrize("trial", range(5))
def test_slot_mapping_matches_reference(seed, trial):
    rng = np.random.default_rng([seed, trial, 1])
    n, width, block_size = 8, 6, int(rng.choice([1, 4, 16]))
    table = rng.integers(-1, 50, (n, width)).astype(np.int32)
    batch = rng.integers(0, n, 200).astype(np.int64)
    pos = rng.integers(0, width * block_size + 8, 200).astype(np.int64)   # some past the table
    expected = reference_slots(table, batch, pos, block_size)
    np.testing.assert_array_equal(compute_slot_mapping(table, batch, pos, block_size), expected)


def reference_rows(this_time, batch, pos, decoder):
    """Row of each token in the token-major step buffer: its index among all the step's tokens."""
    cu = np.concatenate(([0], np.cumsum(np.maximum(this_time, 0))))
    return np.array([cu[b] + p - decoder[b] for b, p in zip(batch, pos, strict=True)], dtype=np.int64)


@pytest.mark.parametrize("trial", range(5))
@pytest.mark.parametrize("block_dtype", [np.int32, np.int64])
def test_the_ledgers_plan_matches_the_per_sequence_loops(seed, trial, block_dtype):
    """One bound call: positions, step-buffer rows and KV slots of the tracked tokens."""
    from fdrr_dev.harness.paddle_runtime import paddle

    rng = np.random.default_rng([seed, trial, 2])
    n, block_size = int(rng.integers(1, 12)), int(rng.choice([1, 4, 16]))
    width = int(rng.integers(1, 8))
    table = rng.integers(-1, 40, (n, width)).astype(block_dtype)
    geometry = CaptureGeometry(max_num_seqs=n, max_model_len=4096, num_moe_layers=2, top_k=2, num_experts=8,
                               block_size=block_size, total_block_num=40)
    manager = RoutingReplayManager(geometry, block_table=paddle.to_tensor(table))
    registered = rng.random(n) < 0.8
    for b in np.flatnonzero(registered):
        manager.register_request(batch_id=int(b), request_id=f"chatcmpl-exp_{b}:0:0:0-x")
    decoder = rng.integers(0, width * block_size + 4, n).astype(np.int32)
    this_time = np.where(rng.random(n) < 0.3, 0, rng.integers(1, 9, n)).astype(np.int32)
    planned = manager.get_token_positions(paddle.to_tensor(decoder.reshape(-1, 1)),
                                          paddle.to_tensor(this_time.reshape(-1, 1)))
    batch, pos = reference_positions(decoder, this_time, registered)
    np.testing.assert_array_equal(planned.batch_ids, batch)
    np.testing.assert_array_equal(planned.positions, pos)
    np.testing.assert_array_equal(planned.rows, reference_rows(this_time, batch, pos, decoder))
    np.testing.assert_array_equal(manager.compute_slot_mapping(planned),
                                  reference_slots(table, batch, pos, block_size))
    assert planned.num_step_tokens == int(this_time.sum())
    manager.close()
