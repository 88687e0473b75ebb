"""verl: ``routed_experts [bs, prompt_length + response_length, L, K]``, aligned to input_ids.

verl builds its batch with each prompt **left**-padded to ``rollout.prompt_length`` and
each response **right**-padded to ``rollout.response_length``; ``input_ids`` and
``attention_mask`` are the concatenation (``verl/experimental/agent_loop/agent_loop.py``,
``_run_agent_loop``).  Its agent loop places the engine's ``routed_experts`` ``[T, L, K]``
into a zero tensor of ``[1, total_length, L, K]`` starting at the first real prompt token
(``start_pos = padded prompt length - prompt length``), rows past the total cut off.  The
Megatron actor then hands that ``[bs, max_seq_len, layer_num, topk]`` tensor with the
attention mask to ``set_router_replay_data`` (``verl/utils/megatron/router_replay_utils.py``),
which drops the padding by the mask (``preprocess_packed_seqs``), scatters the packed
tokens over the sequence-parallel ranks and gives router ``i`` of a pipeline stage layer
``i + offset`` (``offset`` = the stage's first decoder layer), cast to int64.

So the layer axis is indexed by decoder layer.  For an all-MoE model (Qwen3-MoE,
Mixtral) that is the record's rows as they are (``num_layers=None``); for a model with
dense layers (DeepSeek-V3: layers 0-2 dense) pass ``num_layers`` to get every decoder
layer, dense ones zero (they have no router), which is what an engine capturing into a
``num_hidden_layers`` buffer returns (see :mod:`.slime`).

Positions without routes — the padding, the last response token (never forwarded at
rollout, the record's token convention), unrouted positions, a missing record — carry the
distinct placeholder experts ``0..K-1`` (:func:`~fd_routing_replay.trainers._common.placeholder_ids`,
as the Megatron adapter gives them), not verl's zeros: the last response token is inside
the attention mask, so it reaches a router, and verl's replay (``router_replay_patch.py``)
gathers the scores at the ids and scatters them into the routing map — ``[0, 0, …]``
would send the token to one expert with one of its K weights.
:attr:`VerlRoutedExperts.routed_mask` says which positions carry recorded routes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fd_routing_replay.codec import RoutingRecord
from fd_routing_replay.trainers._common import (
    check_compatible,
    lazy_torch,
    placeholder_ids,
    routed_length,
    routes,
)

__all__ = ["VerlRoutedExperts", "to_verl_routed_experts"]


@dataclass
class VerlRoutedExperts:
    """``routed_experts [bs, P + R, L, K]`` (verl's ``batch["routed_experts"]``) and
    ``routed_mask [bs, P + R]``: True where the position carries a recorded route."""

    routed_experts: np.ndarray
    routed_mask: np.ndarray
    layers: tuple[int, ...]

    def to_torch(self) -> Any:
        """``routed_experts`` as a torch tensor (verl's batch holds torch tensors)."""
        return lazy_torch().from_numpy(self.routed_experts)


def _layer_axis(records: Sequence[RoutingRecord | None], num_layers: int | None
                ) -> tuple[tuple[int, ...], list[int] | None]:
    """The decoder layers of the output's layer axis and, with ``num_layers``, where each
    MoE layer of the record lands on it."""
    first = next(r for r in records if r is not None)
    moe = tuple(first.layer_map)
    for record in records:
        if record is not None and tuple(record.layer_map) != moe:
            raise ValueError(f"records disagree on the layer map: {record.rollout_id!r} has "
                             f"{list(record.layer_map)}, {first.rollout_id!r} has {list(moe)}")
    if num_layers is None:
        return moe, None
    if moe and max(moe) >= num_layers:
        raise ValueError(f"num_layers {num_layers} is too small for MoE layer {max(moe)}")
    return tuple(range(num_layers)), list(moe)


def to_verl_routed_experts(
    records: Sequence[RoutingRecord | None],
    prompt_lengths: Sequence[int],
    *,
    max_prompt_length: int,
    max_response_length: int,
    num_layers: int | None = None,
    dtype: str | np.dtype = "int32",
) -> VerlRoutedExperts:
    """verl's ``routed_experts`` for a batch: record ``i`` belongs to sample ``i`` whose
    prompt has ``prompt_lengths[i]`` tokens.  Its row ``t`` (position ``t`` of prompt +
    response) lands at column ``max_prompt_length - prompt_lengths[i] + t``.  Every
    other position (and every position of a None record) holds the placeholder experts
    ``0..K-1`` on the MoE layers, unrouted in ``routed_mask``; dense layers hold 0."""
    records = list(records)
    if len(prompt_lengths) != len(records):
        raise ValueError(f"{len(prompt_lengths)} prompt lengths for {len(records)} records")
    total = int(max_prompt_length) + int(max_response_length)
    shape = check_compatible(records)
    if shape is None:
        raise ValueError("no record in the batch: nothing to lay out (verl skips "
                         "routed_experts when the engine returns none)")
    top_k, num_experts = shape
    axis, moe_slots = _layer_axis(records, num_layers)
    out = np.zeros((len(records), total, len(axis), top_k), dtype=np.dtype(dtype))
    placeholder = placeholder_ids(top_k, num_experts).astype(out.dtype)
    if moe_slots is None:
        out[...] = placeholder
    else:
        out[:, :, moe_slots] = placeholder
    mask = np.zeros((len(records), total), dtype=bool)
    for i, (record, prompt) in enumerate(zip(records, prompt_lengths, strict=True)):
        prompt = int(prompt)
        if not 0 <= prompt <= max_prompt_length:
            raise ValueError(f"sample {i}: prompt of {prompt} tokens does not fit "
                             f"max_prompt_length {max_prompt_length}")
        if record is None:
            continue
        start = max_prompt_length - prompt
        count = min(routed_length(record), total - start)
        ids, valid = routes(record, length=count)        # placeholders where not valid
        routed = valid.all(axis=0) if valid.shape[0] else np.zeros(count, dtype=bool)
        placed = ids.transpose(1, 0, 2)                  # [count, L, K]
        if moe_slots is None:
            out[i, start:start + count] = placed
        else:
            out[i, start:start + count][:, moe_slots] = placed
        mask[i, start:start + count] = routed
    return VerlRoutedExperts(out, mask, axis)
