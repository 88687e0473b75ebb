"""Tensor and expert parallelism simulated by ranks in one process.

The runner keeps one manager (or step capturer) per TP rank, each with its own table or
device buffer, all fed by the same forward.  With EP > 1 each rank's hook sees only its
token shard of ``topk_ids`` and must all-gather over the TP group first; a
:class:`LocalGroup` stands in for that process group.  The hooks built here are what
every MoE layer calls right after top-k.

With a :class:`ProcessRank` the ranks are real processes instead
(:mod:`fdrr_dev.harness.tp_ranks`): this process holds only its own rank's
buffer, routes only its own token shard under TP x EP, and the hook all-gathers over a
real ``paddle.distributed`` group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fd_routing_replay.capture.device import (
    binding_of,
    save_routing_to_buffer,
    save_routing_to_buffer_v2,
)
from fdrr_dev.harness.paddle_runtime import paddle

__all__ = ["LocalGroup", "ProcessRank", "fan_out", "sent_shards", "step_hook", "table_hook", "tp_shards"]

Hook = Callable[..., None]


class LocalGroup:
    """Stand-in for a TP process group whose ranks run in this process.

    ``all_gather`` returns the concatenation of every rank's shard — what
    ``paddle.distributed.all_gather`` leaves in its output tensor.
    """

    def __init__(self, shards: Sequence[Any]) -> None:
        self.shards = list(shards)

    def all_gather(self, tensor: Any) -> Any:
        return paddle.concat(self.shards, axis=0)


@dataclass(frozen=True)
class ProcessRank:
    """This process is TP rank ``rank`` of a real process group ``group`` (a
    ``paddle.distributed`` group of ``tp`` ranks); the runner then holds one manager."""

    group: Any
    rank: int


def table_hook(tables: list[Any], share_inputs: dict[str, Any], tp: int, ep: int,
               process_rank: ProcessRank | None = None) -> Hook:
    """FastDeploy 2.5: ``save_routing_to_buffer`` into every rank's routing table."""
    si = share_inputs

    def hook(*, layer_idx: int, topk_ids: Any) -> None:
        fan_out(save_routing_to_buffer, "routing_replay_table", tables, topk_ids, tp, ep,
                batch_id_per_token=si["batch_id_per_token"], seq_lens_decoder=si["seq_lens_decoder"],
                cu_seqlens_q=si["cu_seqlens_q"], layer_idx=layer_idx, tp_size=tp, ep_size=ep,
                process_rank=process_rank)

    return hook


def step_hook(buffers: list[Any], share_inputs: dict[str, Any], tp: int, ep: int,
              num_tokens: int, process_rank: ProcessRank | None = None) -> Hook:
    """moe.py:747-759: ``save_routing_to_buffer_v2`` bound per MoE layer."""
    si = share_inputs

    def hook(*, layer_idx: int, topk_ids: Any) -> None:
        fan_out(save_routing_to_buffer_v2, "device_routing_buffer", buffers, topk_ids, tp, ep,
                layer_idx=layer_idx, tp_size=tp, ep_size=ep, total_token_num=num_tokens,
                position_ids=si["position_ids_buffer"], debug_mode=False, process_rank=process_rank)

    return hook


def fan_out(save: Any, target: str, targets: list[Any], topk_ids: Any, tp: int, ep: int,
            process_rank: ProcessRank | None = None, **common: Any) -> None:
    """Call the hook once per rank's buffer: with TP x EP each rank routed only its token
    shard and the hook gathers over the TP group first.  With ``process_rank`` only this
    process's rank is called, with its own shard and the real group."""
    if process_rank is not None:
        (buffer,) = targets
        shard = tp_shards(topk_ids, tp)[process_rank.rank] if tp > 1 and ep > 1 else topk_ids
        save(**{target: buffer}, topk_ids=shard, tp_group=process_rank.group, **common)
    elif tp > 1 and ep > 1:
        shards = tp_shards(topk_ids, tp)
        group = LocalGroup(sent_shards(targets, shards, common))
        for rank, buffer in enumerate(targets):
            save(**{target: buffer}, topk_ids=shards[rank], tp_group=group, **common)
    else:
        for buffer in targets:
            save(**{target: buffer}, topk_ids=topk_ids, tp_group=None, **common)


def sent_shards(targets: list[Any], shards: list[Any], common: dict[str, Any]) -> list[Any]:
    """What each in-process rank's hook hands the all-gather: its shard, or in verification
    mode (``capture.verify``) the known values its hook puts in the shard's place (the same
    call the hook makes, so a real group would carry the same tensors)."""
    sent = []
    for buffer, shard in zip(targets, shards, strict=True):
        verify = getattr(binding_of(buffer), "verify", None)
        if verify is None:
            sent.append(shard)
            continue
        positions = common.get("position_ids")
        if positions is None:
            positions = verify.table_positions(common["batch_id_per_token"], common["seq_lens_decoder"],
                                               common["cu_seqlens_q"])
        sent.append(verify.shard(shard, verify.current_row(), positions, sharded=True))
    return sent


def tp_shards(topk_ids: Any, tp: int) -> list[Any]:
    """Each TP rank's token shard of ``topk_ids`` (the last padded with zeros)."""
    per_rank = -(-topk_ids.shape[0] // tp)
    padded = paddle.concat([topk_ids, paddle.zeros(
        [per_rank * tp - topk_ids.shape[0], topk_ids.shape[1]], dtype=topk_ids.dtype)])
    return [padded[r * per_rank:(r + 1) * per_rank] for r in range(tp)]
