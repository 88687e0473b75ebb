"""Routing replay into Hugging Face ``transformers`` MoE models (plain FSDP trainers):
``with replay_routing(model, routes):`` makes every MoE router use the recorded experts,
with routing weights recomputed by the live router so its gradient is kept.  Routes are
laid out per batch (packed or padded, a rank's CP/SP share) from records.  docs/trainer.md,
"Hugging Face transformers".
"""

from fd_routing_replay.trainers.hf.families import (
    FAMILIES,
    MIN_TRANSFORMERS,
    TESTED_TRANSFORMERS,
    Family,
    family_of,
)
from fd_routing_replay.trainers.hf.groups import GroupedRoutingReplay, replay_grouped_routing
from fd_routing_replay.trainers.hf.patch import (
    MoERouter,
    RoutingReplay,
    check_transformers,
    moe_layers,
    moe_routers,
    replay_routing,
)
from fd_routing_replay.trainers.hf.routes import (
    HFRoutes,
    as_routes,
    packed_routes,
    padded_routes,
    seq_lens_from_cu_seqlens,
    seq_lens_from_position_ids,
)

__all__ = [
    "FAMILIES", "MIN_TRANSFORMERS", "TESTED_TRANSFORMERS", "Family", "GroupedRoutingReplay", "HFRoutes",
    "MoERouter", "RoutingReplay", "as_routes", "check_transformers", "family_of", "moe_layers", "moe_routers",
    "packed_routes", "padded_routes", "replay_grouped_routing", "replay_routing", "seq_lens_from_cu_seqlens",
    "seq_lens_from_position_ids",
]
