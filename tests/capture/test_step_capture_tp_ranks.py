"""TP ranks above 0 of FastDeploy 2.6: they save nothing, yet their counters reach the engine.

FastDeploy calls ``prepare_pending_save`` on TP rank 0 only (pre_and_post_process.py:342 in
2.6) and ``flush_pending_save`` on every rank (gpu_model_runner.py:2328-2329).  The
multi-process contract test (tests/fastdeploy_contract/test_parallel.py) runs it with two
real ranks and the engine's shared slot cache.
"""

from __future__ import annotations

import numpy as np

from fd_routing_replay.capture.device import save_routing_to_buffer_v2
from fd_routing_replay.capture.fd26 import StepRoutingCapturer
from fd_routing_replay.capture.slots import STAT_FIELDS
from fdrr_dev.harness.paddle_runtime import paddle


class PublishingHost:
    """The engine's slot cache as a worker sees it: rows, and one counters row per TP rank."""

    num_slots = 64

    def __init__(self) -> None:
        self.published: list[tuple[int, dict]] = []
        self.writes = 0

    def publish_values(self, rank, values):
        self.published.append((rank, dict(zip(STAT_FIELDS, values, strict=True))))

    def write(self, *args):
        self.writes += 1


def make(tp_rank: int) -> tuple[StepRoutingCapturer, PublishingHost]:
    host = PublishingHost()
    capturer = StepRoutingCapturer(max_batched_tokens=8, num_moe_layers=2, top_k=4, num_experts=16,
                                   tp_rank=tp_rank, attach_host=lambda: host)
    return capturer, host


def step(capturer, rng, num_tokens=3):
    for layer in range(2):
        topk = paddle.to_tensor(rng.integers(0, 16, (num_tokens, 4)))
        save_routing_to_buffer_v2(device_routing_buffer=capturer.get_device_routing_buffer(),
                                  topk_ids=topk, layer_idx=layer, tp_size=2, ep_size=1, tp_group=None,
                                  total_token_num=num_tokens)
    capturer.flush_pending_save()       # no prepare_pending_save: this rank is not TP rank 0


def test_a_tp_rank_above_zero_publishes_its_hook_counters_every_step(seed):
    rng = np.random.default_rng(seed)
    capturer, host = make(tp_rank=1)
    step(capturer, rng)
    step(capturer, rng)
    assert [rank for rank, _ in host.published] == [1, 1]
    assert host.published[-1][1]["hook_calls"] == 4
    assert host.published[-1][1]["steps"] == 0 and host.writes == 0     # it saves nothing
    capturer.close()


def test_tp_rank_zero_publishes_only_with_the_steps_it_saves(seed):
    rng = np.random.default_rng(seed)
    capturer, host = make(tp_rank=0)
    step(capturer, rng)
    assert host.published == []          # nothing was queued: rank 0 publishes after a save
    capturer.close()
