"""Random routing records for the trainer-adapter tests (numpy reference data)."""

from __future__ import annotations

import numpy as np

from fd_routing_replay.codec import RoutingRecord


def random_ids(gen: np.random.Generator, layers: int, tokens: int, top_k: int,
               num_experts: int) -> np.ndarray:
    """``[layers, tokens, top_k]`` distinct expert ids per (layer, token), uint8."""
    scores = gen.random((layers, tokens, num_experts))
    return np.argsort(scores, axis=2)[..., :top_k].astype(np.uint8)


def make_record(gen: np.random.Generator, rollout_id: str = "exp_a:0:0", *, tokens: int = 7,
                layers: tuple[int, ...] = (1, 2, 3), top_k: int = 2, num_experts: int = 8,
                unrouted: tuple[int, ...] = (), pad_to: int | None = None) -> RoutingRecord:
    """A record over decoder ``layers`` with ``tokens`` forwarded positions; positions in
    ``unrouted`` hold the fill value; ``pad_to`` pads like capture.pad_to_max_model_len."""
    ids = random_ids(gen, len(layers), tokens, top_k, num_experts)
    fill = 255
    for position in unrouted:
        ids[:, position] = fill
    metadata = {"num_tokens": tokens}
    if pad_to is not None:
        padded = np.full((len(layers), pad_to, top_k), fill, dtype=np.uint8)
        padded[:, :tokens] = ids
        ids = padded
    return RoutingRecord(rollout_id, np.ascontiguousarray(ids), num_experts, fill, metadata,
                         layers=layers)
