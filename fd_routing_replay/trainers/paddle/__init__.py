"""Routing replay into PaddleFormers MoE models (Paddle trainers): ``with
replay_routing(model, routes):`` makes every MoE gate select the recorded experts, with
routing weights computed from the live scores by the gate's own code, so its gradient is
kept.  Routes are laid out per batch (packed or padded, a rank's CP/SP share) as for the
Hugging Face adapter.  Paddle is imported only when a replay runs.  docs/trainer.md,
"PaddleFormers (Paddle trainers)".
"""

from fd_routing_replay.trainers.hf.routes import (
    HFRoutes,
    as_routes,
    packed_routes,
    padded_routes,
    seq_lens_from_cu_seqlens,
    seq_lens_from_position_ids,
)
from fd_routing_replay.trainers.paddle.families import (
    PADDLE_FAMILIES,
    TESTED_PADDLEFORMERS,
    PaddleFamily,
    paddle_family_of,
)
from fd_routing_replay.trainers.paddle.patch import (
    PaddleGate,
    PaddleRoutingReplay,
    moe_gates,
    moe_layers,
    replay_routing,
)
from fd_routing_replay.trainers.paddle.routes import TOKEN_ORDERS, sequence_parallel_routes

__all__ = [
    "PADDLE_FAMILIES", "TESTED_PADDLEFORMERS", "TOKEN_ORDERS", "HFRoutes", "PaddleFamily",
    "PaddleGate", "PaddleRoutingReplay", "as_routes", "moe_gates", "moe_layers",
    "packed_routes", "padded_routes", "paddle_family_of", "replay_routing",
    "seq_lens_from_cu_seqlens", "seq_lens_from_position_ids", "sequence_parallel_routes",
]
