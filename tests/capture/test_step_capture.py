"""StepRoutingCapturer (FastDeploy 2.6's interface) over the token-major step buffer."""

from __future__ import annotations

import numpy as np

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


def test_a_missing_layer_invalidates_the_steps_slots(seed):
    rng = np.random.default_rng(seed)
    capturer, host = make()
    forward(capturer, rng, 2)
    capturer.prepare_pending_save(2, slot_mapping([1, 2]))
    capturer.flush_pending_save()
    forward(capturer, rng, 2, layers=(0, 2))             # layer 1 keeps the previous step's rows
    capturer.prepare_pending_save(2, slot_mapping([1, 2]))
    capturer.flush_pending_save()
    assert (host.read(np.array([1, 2])) == 255).all()
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


def test_the_compiled_flush_matches_the_numpy_path_on_random_steps(seed):
    """Twin capturers, one forced onto the NumPy flush: same host cache and counters after
    every step (invalid and repeated slots, int32 and int64 slot mappings, steps where a
    layer recorded nothing, steps whose hook failed)."""
    from fd_routing_replay import ops

    if ops.bound_backend() is None:
        import pytest

        pytest.skip("the compiled ops library is not loaded (FD_RR_OPS=reference)")
    rng = np.random.default_rng(seed)
    (fast, fast_host), (ref, ref_host) = make(), make()
    ref._flush_args = (None, ref_host)                   # the NumPy path
    keys = ("steps", "tokens_offloaded", "invalid_slots", "damaged_steps", "missing_layer_steps", "errors")
    for step in range(80):
        n = int(rng.integers(1, 9))
        slots = rng.integers(-3, SLOTS + 3, n)
        dtype = np.int32 if step % 2 else np.int64
        layers = [layer for layer in range(LAYERS) if rng.random() > 0.05]
        hook_fails = rng.random() < 0.05
        draw_seed = int(rng.integers(2**31))
        for capturer in (fast, ref):
            forward(capturer, np.random.default_rng(draw_seed), n, layers=layers)
            if hook_fails:
                capturer._on_hook_error(0, RuntimeError("planted"))
            padded = np.full(8, -1, dtype)
            padded[:n] = slots
            capturer.prepare_pending_save(n, paddle.to_tensor(padded))
            capturer.flush_pending_save()
        np.testing.assert_array_equal(fast_host.array, ref_host.array)
        assert {k: fast.counters[k] for k in keys} == {k: ref.counters[k] for k in keys}
    assert fast._flush_args[0] is not None
    assert fast.counters["tokens_offloaded"] > 0 and fast.counters["damaged_steps"] > 0


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
