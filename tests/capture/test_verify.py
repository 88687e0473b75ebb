"""Verification mode's function and the hook's verification step.

The code is held up against an independent reference: every K-subset of [0, E) listed by
``itertools.combinations`` in colex order, the ``code``-th of which must be what ``encode``
returns.  The hook's device computation is held up against the NumPy ``encode``; the TP x
EP placement check against shards gathered in order and out of order.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from fd_routing_replay.capture.device import (
    HookVerifier,
    enable_verification,
    save_routing_to_buffer,
    save_routing_to_buffer_v2,
)
from fd_routing_replay.capture.fd26 import StepRoutingCapturer
from fd_routing_replay.capture.slots import HostSlotCache
from fd_routing_replay.codec.verification import MIN_PERIOD, VerificationCode
from fd_routing_replay.errors import ConfigError
from fdrr_dev.harness.paddle_runtime import paddle
from fdrr_dev.harness.parallel import LocalGroup, tp_shards


def colex_subsets(num_experts: int, top_k: int) -> list[tuple[int, ...]]:
    """Every K-subset of [0, E), in colex order (ordered by the largest, then the next ...)."""
    return sorted(itertools.combinations(range(num_experts), top_k), key=lambda s: s[::-1])


@pytest.mark.parametrize("num_experts,top_k", [(8, 1), (8, 2), (9, 3), (16, 4), (12, 6)])
def test_encode_is_the_code_th_subset_and_decode_inverts_it(seed, num_experts, top_k):
    rng = np.random.default_rng(seed)
    subsets = colex_subsets(num_experts, top_k)
    ranks = int(rng.integers(1, 3))
    code = VerificationCode(num_experts, top_k, num_layers=1, ranks=ranks)
    assert code.period == len(subsets) // (2 * ranks)
    positions = rng.integers(0, 10 * code.period, 200)
    symbols = rng.integers(0, 2 * ranks, 200)
    ids = code.encode(positions, 0, symbols)
    assert ids.shape == (200, top_k)
    for row, p, s in zip(ids, positions, symbols, strict=True):
        assert tuple(sorted(row)) == subsets[(p % code.period) * 2 * ranks + s]
    decoded = code.decode(rng.permuted(ids, axis=1))      # order inside the top-k carries nothing
    assert decoded.valid.all()
    np.testing.assert_array_equal(decoded.position, positions % code.period)
    np.testing.assert_array_equal(decoded.symbol, symbols)


def test_rows_are_distinct_in_range_and_tell_every_place_apart(seed):
    rng = np.random.default_rng(seed)
    while True:          # ~1 draw in 220 is a model the code refuses (tested below): redraw
        num_experts, top_k, layers, ranks = int(rng.integers(16, 300)), int(rng.integers(2, 9)), \
            int(rng.integers(1, 60)), int(rng.integers(1, 5))
        if math.comb(num_experts, top_k) // (layers * 2 * ranks) >= MIN_PERIOD:
            break
    code = VerificationCode(num_experts, top_k, layers, ranks)
    assert code.period == min(math.comb(num_experts, top_k), 2**62) // (layers * 2 * ranks)
    positions = np.arange(min(code.period, 512))
    grid = code.encode(positions[:, None, None], np.arange(layers)[None, :, None],
                       np.arange(2 * ranks)[None, None, :])
    assert ((grid >= 0) & (grid < num_experts)).all()
    assert (np.diff(np.sort(grid, axis=-1), axis=-1) > 0).all()           # distinct ids
    sets = {tuple(sorted(row)) for row in grid.reshape(-1, top_k)}
    assert len(sets) == grid.size // top_k                                 # one set per place
    decoded = code.decode(grid)
    assert decoded.valid.all()
    np.testing.assert_array_equal(decoded.layer, np.broadcast_to(np.arange(layers)[None, :, None], decoded.layer.shape))


def test_decode_rejects_what_no_hook_wrote():
    code = VerificationCode(16, 4, 3, 1)
    rows = np.array([[0, 0, 1, 2],            # repeated id
                     [1, 2, 3, 16],           # out of range
                     [255, 255, 255, 255],    # the fill
                     [12, 13, 14, 15]])       # the last code: beyond P * L * S
    assert not code.decode(rows).valid.any()


def test_a_model_too_small_to_tell_positions_apart_is_refused():
    with pytest.raises(ConfigError, match=r"C\(4, 2\) = 6 expert sets"):
        VerificationCode(4, 2, num_layers=2, ranks=1)
    with pytest.raises(ConfigError, match="top_k 5 exceeds num_experts 4"):
        VerificationCode(4, 5, 1)


# ---------------------------------------------------------------------------- the hook
LAYERS, TOP_K, EXPERTS = 3, 4, 16


def capturer(rank=0, tp=1, layer_rows=None):
    host = HostSlotCache(64, LAYERS, TOP_K, np.uint8, 255)
    made = StepRoutingCapturer(max_batched_tokens=16, num_moe_layers=LAYERS, top_k=TOP_K, num_experts=EXPERTS,
                               tp_rank=rank, attach_host=lambda: host, layer_rows=layer_rows)
    verifier = enable_verification(made, num_experts=EXPERTS, top_k=TOP_K, layer_map=(1, 2, 3), tp_size=tp)
    return made, host, verifier


def test_the_v2_hook_records_f_instead_of_the_routing(seed):
    rng = np.random.default_rng(seed)
    made, host, verifier = capturer()
    n = 7
    positions = np.sort(rng.choice(400, n, replace=False)).astype(np.int64)
    for layer in range(LAYERS):
        routed = rng.integers(0, EXPERTS, (n, TOP_K))
        save_routing_to_buffer_v2(device_routing_buffer=made.get_device_routing_buffer(),
                                  topk_ids=paddle.to_tensor(routed), layer_idx=layer, tp_size=1, ep_size=1,
                                  tp_group=None, total_token_num=n,
                                  position_ids=paddle.to_tensor(np.concatenate([positions, [0, 0]])))
    slots = rng.permutation(64)[:n]
    made.prepare_pending_save(n, paddle.to_tensor(slots.astype(np.int64)))
    made.flush_pending_save()
    rows = host.read(slots)                                        # [n, L, K]
    expected = verifier.code.encode(positions[:, None], np.arange(LAYERS)[None, :], 0)
    np.testing.assert_array_equal(np.sort(rows, -1), np.sort(expected, -1))
    assert made.stats()["hook_errors"] == 0


def layers_recorded(made, verifier, layer_indices):
    """Call the v2 hook once per MoE layer with these ``layer_idx`` (in the model's order);
    the MoE row each stored row's value names, per row."""
    positions = paddle.to_tensor(np.arange(4, dtype=np.int64))
    for layer_idx in layer_indices:
        save_routing_to_buffer_v2(device_routing_buffer=made.get_device_routing_buffer(),
                                  topk_ids=paddle.zeros([4, TOP_K], dtype="int64"), layer_idx=layer_idx,
                                  tp_size=1, ep_size=1, tp_group=None, total_token_num=4, position_ids=positions)
    made.prepare_pending_save(4, paddle.to_tensor(np.arange(4, dtype=np.int64)))
    made.flush_pending_save()
    return verifier.code.decode(host_of(made).read(np.arange(4))).layer[0]


def host_of(made):
    return made.host_cache


def test_the_layer_comes_from_the_call_order_not_the_recorders_rows(seed):
    """A recorder whose layer map puts FastDeploy layers 0 and 1 in each other's rows stores
    layer 0's value (MoE row 0 of the code) in row 1: the check sees the swap."""
    made, _, verifier = capturer(layer_rows=(1, 0, 2))
    np.testing.assert_array_equal(layers_recorded(made, verifier, range(LAYERS)), [1, 0, 2])


def test_a_call_site_passing_another_layers_index_is_caught(seed):
    """The call site passes layer_idx 1 for the first MoE layer and 0 for the second: each
    layer's known values land in the other's row (the value names the call, not layer_idx)."""
    made, _, verifier = capturer()
    np.testing.assert_array_equal(layers_recorded(made, verifier, [1, 0, 2]), [1, 0, 2])
    again, _, verifier = capturer()
    np.testing.assert_array_equal(layers_recorded(again, verifier, range(LAYERS)), [0, 1, 2])
    assert verifier.calls == LAYERS and verifier.current_row() == 0


def test_the_table_hook_takes_fastdeploy_25s_placement(seed):
    rng = np.random.default_rng(seed)
    lens_decoder = np.array([0, 17, 0, 5], dtype=np.int32)
    this_time = np.array([3, 1, 0, 2], dtype=np.int32)
    batch = np.repeat(np.arange(4), this_time).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum(this_time)]).astype(np.int32)
    expected = np.concatenate([d + np.arange(n) for d, n in zip(lens_decoder, this_time, strict=True)])
    got = HookVerifier.table_positions(paddle.to_tensor(batch), paddle.to_tensor(lens_decoder.reshape(-1, 1)),
                                       paddle.to_tensor(cu)).numpy()
    np.testing.assert_array_equal(got, expected)
    made, host, verifier = capturer()
    for layer in range(LAYERS):
        save_routing_to_buffer(routing_replay_table=made.get_device_routing_buffer(),
                               topk_ids=paddle.to_tensor(rng.integers(0, EXPERTS, (6, TOP_K))),
                               batch_id_per_token=paddle.to_tensor(batch),
                               seq_lens_decoder=paddle.to_tensor(lens_decoder.reshape(-1, 1)),
                               cu_seqlens_q=paddle.to_tensor(cu), layer_idx=layer)
    rows = made.get_device_routing_buffer().numpy()[:6, 2]
    np.testing.assert_array_equal(np.sort(rows, -1), np.sort(verifier.code.encode(expected, 2, 0), -1))


@pytest.mark.parametrize("order", ["in order", "rank 1 first"])
def test_tp_x_ep_each_rank_sends_its_shard_and_placement_is_checked(seed, order):
    """Two ranks in one process: each computes its shard's values from its own rows'
    positions; after the gather a row in the wrong share is flagged with R + its owner."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 12))
    positions = paddle.to_tensor(rng.integers(0, 500, 16).astype(np.int64))
    routed = paddle.to_tensor(rng.integers(0, EXPERTS, (n, TOP_K)))
    ranks = [capturer(rank=r, tp=2) for r in range(2)]
    shards = tp_shards(routed, 2)
    sent = [v.shard(shard, v.current_row(), positions, sharded=True)
            for (_, _, v), shard in zip(ranks, shards, strict=True)]
    group = LocalGroup(sent if order == "in order" else sent[::-1])
    for (made, _, _), shard in zip(ranks, shards, strict=True):
        save_routing_to_buffer_v2(device_routing_buffer=made.get_device_routing_buffer(), topk_ids=shard,
                                  layer_idx=1, tp_size=2, ep_size=2, tp_group=group, total_token_num=n,
                                  position_ids=positions)
    code = ranks[0][2].code
    c = int(shards[0].shape[0])
    owner = np.arange(n) // c
    rows = ranks[0][0].get_device_routing_buffer().numpy()[:n, 1]          # layer_idx 1: row 1
    decoded = code.decode(rows)
    np.testing.assert_array_equal(decoded.position, positions.numpy()[:n] % code.period)
    if order == "in order":
        np.testing.assert_array_equal(decoded.symbol, owner)
        assert ranks[0][2].misplaced_rows() == 0
    else:
        np.testing.assert_array_equal(decoded.symbol, owner + 2)      # every row in the wrong share
        assert ranks[0][2].misplaced_rows() == n


def test_missing_position_ids_cost_the_step_not_the_forward():
    made, host, _ = capturer()
    save_routing_to_buffer_v2(device_routing_buffer=made.get_device_routing_buffer(),
                              topk_ids=paddle.zeros([2, TOP_K], dtype="int64"), layer_idx=0, tp_size=1,
                              ep_size=1, tp_group=None, total_token_num=2, position_ids=None)
    assert made.stats()["hook_errors"] == 1
