"""Trainer-side adapters: a record in the shape each trainer consumes (docs/trainer.md) —
Megatron-Core's ``RouterReplay``, verl's and slime's layouts — the slices a parallel rank
needs, and routing-mismatch metrics.  NumPy only; torch is imported where a torch tensor is
asked for, Megatron-Core only when its replay is installed.
"""

from fd_routing_replay.trainers._common import placeholder_ids, routed_length, routes
from fd_routing_replay.trainers.compare import (
    RoutingMismatchGauges,
    compare_routing,
    logprob_mismatch,
    replay_topk,
)
from fd_routing_replay.trainers.megatron import MegatronReplay, build_megatron_replay
from fd_routing_replay.trainers.parallel import (
    context_parallel_indices,
    pipeline_layer_ranges,
    rank_moe_layers,
    sequence_parallel_slice,
    shard_tokens,
    slice_layers,
)
from fd_routing_replay.trainers.slime import (
    sglang_routed_experts_b64,
    to_sglang_routed_experts,
    unrouted_positions,
)
from fd_routing_replay.trainers.verl import VerlRoutedExperts, to_verl_routed_experts

__all__ = [
    "MegatronReplay", "RoutingMismatchGauges", "VerlRoutedExperts", "build_megatron_replay",
    "compare_routing", "context_parallel_indices", "logprob_mismatch", "pipeline_layer_ranges",
    "placeholder_ids", "rank_moe_layers", "replay_topk", "routed_length", "routes",
    "sequence_parallel_slice",
    "sglang_routed_experts_b64", "shard_tokens", "slice_layers", "to_sglang_routed_experts",
    "to_verl_routed_experts", "unrouted_positions",
]
