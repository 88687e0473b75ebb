"""The sizes a capture allocates for: FastDeploy's ``FDConfig`` and the KV cache, read once."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fd_routing_replay.codec import routing_dtype
from fd_routing_replay.errors import OpsError

__all__ = ["CaptureGeometry"]


@dataclass(frozen=True)
class CaptureGeometry:
    """Sizes the manager allocates for (FastDeploy reads them from its FDConfig)."""

    max_num_seqs: int
    max_model_len: int
    num_moe_layers: int
    top_k: int
    num_experts: int
    block_size: int
    total_block_num: int
    num_shared_experts: int = 0
    num_speculative_tokens: int = 0
    layer_map: tuple[int, ...] = ()     # global decoder-layer index of each row; () = 0..L-1
    max_num_batched_tokens: int = 0     # step buffer rows; 0 = derived (see step_tokens)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_model_len", "num_moe_layers", "top_k", "num_experts",
                     "block_size", "total_block_num"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise OpsError(f"capture geometry: {name} must be a positive int, got {value!r}")
        if self.layer_map and len(self.layer_map) != self.num_moe_layers:
            raise OpsError(f"capture geometry: layer_map has {len(self.layer_map)} layers but "
                           f"num_moe_layers is {self.num_moe_layers}")

    @property
    def layers(self) -> tuple[int, ...]:
        """The layer map, defaulting to ``0 .. num_moe_layers - 1``."""
        return tuple(self.layer_map) or tuple(range(self.num_moe_layers))

    @property
    def step_tokens(self) -> int:
        """Rows of the step buffer: FastDeploy's ``max_num_batched_tokens`` when given,
        else the most a step can forward without it (one full prompt, or every sequence
        decoding with all its draft tokens)."""
        if self.max_num_batched_tokens > 0:
            return int(self.max_num_batched_tokens)
        return max(self.max_model_len, self.max_num_seqs * (1 + self.num_speculative_tokens))

    @property
    def dtype(self) -> np.dtype:
        """Narrowest dtype for the ids, as FastDeploy sizes it (routed + shared + fill)."""
        return routing_dtype(self.num_experts + self.num_shared_experts)
