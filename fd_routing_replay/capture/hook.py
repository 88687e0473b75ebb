"""The MoE-layer hook: write one layer's ``topk_ids`` into the device routing table.

``save_routing_to_buffer`` has FastDeploy's signature and keyword names, so FastDeploy's
``FusedMoE.forward`` binds it unchanged (``functools.partial(save_routing_to_buffer,
routing_replay_table=..., ...)``) and every MoE backend calls it right after top-k with
``topk_ids=``.  The work is one ``record_routing_`` custom op per layer.

Tensor × expert parallelism: when ``tp_size > 1 and ep_size > 1`` FastDeploy routes each
TP rank's share of the tokens separately (``forward_split_allgather``), so a rank's
``topk_ids`` covers only its shard; the shards are all-gathered over the TP group first
(and the padding rows of the last shard dropped) so every rank's table holds the whole
step.  With TP alone the gate is replicated and every rank already sees all tokens.

Never raises: a failure is counted and logged, the layer's routing is marked lost for
the step's requests (they are reported, not written wrong), and the forward goes on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fd_routing_replay import ops

__all__ = ["TableBinding", "bind_table", "gather_topk_over_tp", "new_error_count",
           "save_routing_to_buffer", "unbind_table"]

logger = logging.getLogger(__name__)


@dataclass
class TableBinding:
    """What the hook knows about a table: expert count and whom to tell about errors."""

    num_experts: int
    error_count: Any = None
    on_error: Callable[[int, BaseException], None] | None = None
    errors: int = 0
    calls: int = 0
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


_BINDINGS: dict[int, TableBinding] = {}
_LOCK = threading.Lock()


def bind_table(table: Any, binding: TableBinding) -> None:
    """Register ``table`` (a manager's device table) with its binding."""
    with _LOCK:
        _BINDINGS[id(table)] = binding


def unbind_table(table: Any) -> None:
    with _LOCK:
        _BINDINGS.pop(id(table), None)


def new_error_count(place: Any = None) -> Any:
    """The int64 counter ``record_routing_`` adds out-of-range expert ids to."""
    import paddle

    return paddle.zeros([1], dtype="int64", device=place)


def _unbound_binding(table: Any) -> TableBinding:
    """A table no manager registered (FastDeploy's own, say): accept ids below the fill."""
    binding = TableBinding(num_experts=ops.fill_value(table.dtype),
                           error_count=new_error_count(table.place))
    bind_table(table, binding)
    return binding


def gather_topk_over_tp(topk_ids: Any, tp_size: int, tp_group: Any) -> Any:
    """All-gather every TP rank's ``[tokens_per_rank, K]`` shard, in rank order."""
    if hasattr(tp_group, "all_gather"):      # an in-process group (the harness)
        return tp_group.all_gather(topk_ids)
    import paddle

    gathered = paddle.zeros([topk_ids.shape[0] * tp_size, topk_ids.shape[1]], dtype=topk_ids.dtype)
    paddle.distributed.all_gather(gathered, topk_ids, tp_group)
    return gathered


def save_routing_to_buffer(
    routing_replay_table: Any,
    topk_ids: Any,
    batch_id_per_token: Any,
    seq_lens_decoder: Any,
    cu_seqlens_q: Any,
    layer_idx: int,
    tp_size: int = 1,
    ep_size: int = 1,
    tp_group: Any = None,
) -> None:
    """Record ``topk_ids`` of MoE layer ``layer_idx`` (FastDeploy's hook signature)."""
    if routing_replay_table is None or topk_ids is None or topk_ids.shape[0] == 0:
        return
    started = time.perf_counter()
    binding = _BINDINGS.get(id(routing_replay_table))
    try:
        if tp_size > 1 and ep_size > 1:
            topk_ids = gather_topk_over_tp(topk_ids, tp_size, tp_group)
        num_tokens = min(int(topk_ids.shape[0]), int(batch_id_per_token.shape[0]))
        if topk_ids.shape[0] != num_tokens:
            topk_ids = topk_ids[:num_tokens]           # padding rows of the last shard
        if batch_id_per_token.shape[0] != num_tokens:
            batch_id_per_token = batch_id_per_token[:num_tokens]
        if binding is None:
            binding = _unbound_binding(routing_replay_table)
        ops.record_routing(routing_replay_table, topk_ids, batch_id_per_token, cu_seqlens_q,
                           seq_lens_decoder, layer_idx, binding.error_count,
                           num_experts=binding.num_experts)
        binding.calls += 1
        binding.seconds += time.perf_counter() - started
    except Exception as exc:  # never stop the forward pass
        if binding is not None:
            binding.errors += 1
            if binding.on_error is not None:
                binding.on_error(layer_idx, exc)
        logger.error("routing replay: recording MoE layer %d failed; the routing of this "
                     "step's requests is marked lost: %r", layer_idx, exc)
