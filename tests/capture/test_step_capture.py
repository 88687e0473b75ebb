"""StepRoutingCapturer (FastDeploy 2.6's interface) over the token-major step buffer."""

from __future__ import annotations

import numpy as np
import pytest

from fd_routing_replay.capture.device import save_routing_to_buffer_v2
from fd_routing_replay.capture.fd26 import StepRoutingCapturer
from fd_routing_replay.capture.slots import HostSlotCache
from fdrr_dev.harness.paddle_runtime import paddle

LAYERS, TOP_K, EXPERTS, SLOTS = 3, 4, 16, 64


def make() -> tuple[StepRoutingCapturer, HostSlotCache]:
    host = HostSlotCache(SLOTS, LAYERS, TOP_K, np.uint8, 255)
    capturer = StepRoutingCapturer(max_batched_tokens=8, num_moe_layers=LAYERS, top_k=TOP_K,
                                   num_experts=EXPERTS, attach_host=lambda: host)
    return capturer, host


def forward(capturer, rng, num_tokens, layers=range(LAYERS)) -> np.ndarray:
    drawn = rng.integers(0, EXPERTS, (num_tokens, LAYERS, TOP_K))
    for layer in layers:
        save_routing_to_buffer_v2(device_routing_buffer=capturer.get_device_routing_buffer(),
                                  topk_ids=paddle.to_tensor(drawn[:, layer].copy()), layer_idx=layer,
                                  tp_size=1, ep_size=1, tp_group=None, total_token_num=num_tokens)
    return drawn


def slot_mapping(slots, width=8) -> paddle.Tensor:
    padded = np.full(width, -1, np.int64)
    padded[: len(slots)] = slots
    return paddle.to_tensor(padded)


def test_rows_land_in_their_kv_slots(seed):
    rng = np.random.default_rng(seed)
    capturer, host = make()
    drawn = forward(capturer, rng, 5)
    capturer.prepare_pending_save(5, slot_mapping([9, 3, 40, 41, 0]))
    capturer.flush_pending_save()
    np.testing.assert_array_equal(host.read(np.array([9, 3, 40, 41, 0])), drawn)
    drawn2 = forward(capturer, rng, 2)                  # next step reuses rows 0..1
    capturer.prepare_pending_save(2, slot_mapping([10, 11]))
    capturer.flush_pending_save()
    np.testing.assert_array_equal(host.read(np.array([10, 11])), drawn2)
    np.testing.assert_array_equal(host.read(np.array([40, 41])), drawn[2:4])
    stats = capturer.stats()
    assert stats["tokens_offloaded"] == 7 and stats["hook_calls"] == 2 * LAYERS
    assert stats["capture_device_bytes"] == 8 * LAYERS * TOP_K + 8 * (LAYERS + 1)


def test_invalid_slots_are_skipped_and_an_unflushed_step_is_not_lost(seed):
    rng = np.random.default_rng(seed)
    capturer, host = make()
    drawn = forward(capturer, rng, 3)
    capturer.prepare_pending_save(3, slot_mapping([5, -1, SLOTS + 2]))
    drawn2 = forward(capturer, rng, 1)
    capturer.prepare_pending_save(1, slot_mapping([6]))   # flushes the previous step first
    capturer.flush_pending_save()
    np.testing.assert_array_equal(host.read(np.array([5])), drawn[:1])
    np.testing.assert_array_equal(host.read(np.array([6])), drawn2)
    assert capturer.counters["invalid_slots"] == 2


def test_a_missing_layer_marks_only_its_rows_unknown(seed):
    """Layer 1 recorded nothing this step: its rows are the previous step's (stale), so its
    rows of the step's slots get the fill; layers 0 and 2 keep what they recorded."""
    rng = np.random.default_rng(seed)
    capturer, host = make()
    forward(capturer, rng, 2)
    capturer.prepare_pending_save(2, slot_mapping([1, 2]))
    capturer.flush_pending_save()
    drawn = forward(capturer, rng, 2, layers=(0, 2))     # layer 1 keeps the previous step's rows
    capturer.prepare_pending_save(2, slot_mapping([1, 2]))
    capturer.flush_pending_save()
    rows = host.read(np.array([1, 2]))
    assert (rows[:, 1] == 255).all()
    np.testing.assert_array_equal(rows[:, [0, 2]], drawn[:, [0, 2]])
    assert capturer.counters["missing_layer_steps"] == 1 and capturer.counters["damaged_steps"] == 1


def test_clear_refills_the_buffer(seed):
    rng = np.random.default_rng(seed)
    capturer, _ = make()
    forward(capturer, rng, 4)
    capturer.prepare_pending_save(4, slot_mapping([0, 1, 2, 3]))
    capturer.clear()
    assert (capturer.get_device_routing_buffer().numpy() == 255).all()
    capturer.flush_pending_save()                        # nothing queued any more
    assert capturer.counters["tokens_offloaded"] == 0


@pytest.mark.parametrize("columns", [None, (0, 2, 3)])
def test_the_flush_matches_a_numpy_model_on_random_steps(seed, columns):
    """The bound flush against the rule, step by step: valid slots get the step's rows (into
    their columns when the cache has more rows: FastDeploy's view), a layer that recorded
    nothing gets the fill in its rows, a step whose hook failed the fill in every layer,
    invalid slots are skipped and counted (int32 and int64 slot mappings, repeated slots)."""
    rng = np.random.default_rng(seed)
    rows_in_cache = LAYERS if columns is None else 4
    host = HostSlotCache(SLOTS, rows_in_cache, TOP_K, np.uint8, 255, layer_columns=columns)
    capturer = StepRoutingCapturer(max_batched_tokens=8, num_moe_layers=LAYERS, top_k=TOP_K,
                                   num_experts=EXPERTS, attach_host=lambda: host)
    expected = np.full((SLOTS, rows_in_cache, TOP_K), 255, np.uint8)
    cols = list(range(LAYERS)) if columns is None else list(columns)
    invalid = missing_steps = 0
    for step in range(80):
        n = int(rng.integers(1, 9))
        slots = rng.integers(-3, SLOTS + 3, n)
        layers = [layer for layer in range(LAYERS) if rng.random() > 0.05]
        hook_fails = rng.random() < 0.05
        drawn = forward(capturer, rng, n, layers=layers)
        if hook_fails:
            save_routing_to_buffer_v2(device_routing_buffer=capturer.get_device_routing_buffer(),  # a call that
                                      topk_ids=paddle.to_tensor(np.zeros((n, TOP_K + 1), np.int64)),  # fails:
                                      layer_idx=0, tp_size=1, ep_size=1, tp_group=None,  # wrong top-k
                                      total_token_num=n)
        padded = np.full(8, -1, np.int32 if step % 2 else np.int64)
        padded[:n] = slots
        capturer.prepare_pending_save(n, paddle.to_tensor(padded))
        capturer.flush_pending_save()
        missing_steps += len(layers) < LAYERS
        for i, slot in enumerate(slots.tolist()):        # the rule, one token at a time, in order
            if not 0 <= slot < SLOTS:
                invalid += 1
                continue
            for layer in range(LAYERS):
                known = not hook_fails and layer in layers
                expected[slot, cols[layer]] = drawn[i, layer] if known else 255
        np.testing.assert_array_equal(host.array, expected)
    assert capturer.counters["invalid_slots"] == invalid
    assert capturer.counters["missing_layer_steps"] == missing_steps > 0


def test_published_values_are_the_stats_fields_in_order(seed):
    from fd_routing_replay.capture.slots import STAT_FIELDS

    rng = np.random.default_rng(seed)
    capturer, _ = make()
    for step in range(3):
        forward(capturer, rng, 4, layers=range(LAYERS) if step != 1 else (0, 2))
        capturer.prepare_pending_save(4, slot_mapping([1, 2, SLOTS + 5, 7]))
        capturer.flush_pending_save()
    stats = capturer.stats()
    assert capturer.stat_values() == tuple(stats[key] for key in STAT_FIELDS)
    assert stats["hook_calls"] == 3 * LAYERS - 1 and stats["missing_layer_steps"] == 1
