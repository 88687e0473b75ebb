"""verl: ``routed_experts [bs, prompt_length + response_length, L, K]`` int16, aligned to input_ids.

Checked against verl 0.9.1 (the release ``tests/trainers/test_verl*.py`` run).  verl builds
its batch with each prompt **left**-padded to ``rollout.prompt_length`` and each response
**right**-padded to ``rollout.response_length``; ``input_ids`` and ``attention_mask`` are
the concatenation.  Its agent loop (``verl/experimental/agent_loop/agent_loop.py``,
``_agent_loop_postprocess``) casts the rollout engine's ``routed_experts [T, L, K]`` to
**int16** and places it into a zero tensor ``[1, total_length, L, K]`` starting at the
first real prompt token (``start_pos = padded prompt length - prompt length``).

The trainer reads it on the engine's nested-tensor path: ``left_right_2_no_padding``
(``verl/workers/utils/padding.py``) keeps the positions the attention mask attends, as a
jagged tensor with ``input_ids``'s offsets.  Then

* **Megatron** engine, ``router_replay.mode=R3``: ``align_r3_router_replay_data`` and
  ``build_r3_replay_mask`` (``verl/utils/megatron/router_replay_utils.py``) replay every
  position but the last of each sample, which keeps its native routing;
  ``set_router_replay_data`` gives router ``i`` the slot of its decoder layer when the
  layer axis has exactly ``num_layers`` slots, and otherwise the slot of its MoE ordinal
  (counted with ``moe_layer_freq``).
* **VeOmni** engine: targets go to the routers in the order they fire; a layer axis with
  another count than the routers that fire is refused
  (``verl/workers/engine/veomni/transformer_impl.py:942``).  A row whose top-k holds a
  duplicate (the all-zero rows verl leaves where nothing was recorded) is routed natively
  (``verl/utils/veomni/router_replay.py``, ``on_router_forward``).

So the layer axis here is the record's **MoE layers** (one slot per router), the layout
both engines read.  A decoder-layer axis (``num_layers=``, dense layers 0) only works on
the Megatron engine, and only when it has exactly the model's ``num_layers`` slots: it is
refused unless ``engine="megatron"`` says so, and always for ``engine="veomni"``.

Positions without routes — the padding, the last response token (never forwarded at
rollout, the record's token convention), unrouted positions, a missing record — get what
the engine that reads them does best with:

* **VeOmni** (and ``engine=None``): **0** in every slot, as verl's agent loop leaves rows it
  has no route for.  VeOmni routes any row whose top-k holds a duplicate natively
  (``verl/utils/veomni/router_replay.py:244-267``, ``on_router_forward``), so these
  positions get the live router's choice.
* **Megatron** (``engine="megatron"``): the distinct placeholder experts ``0..K-1``, as the
  Megatron-Core and slime adapters.  verl's Megatron R3 replays every row but each
  sample's last (``build_r3_replay_mask``, ``verl/utils/megatron/router_replay_utils.py:
  380-396``; ``RouterReplay.get_replay_topk``, ``router_replay_patch.py:109-136``), and a
  row of zeros there collapses to expert 0 alone at a fraction of its weight (the scatter
  of duplicate ids into the routing map, ``router_replay_patch.py:232-242``), where the
  placeholders give a well-formed top-k.  Nothing in verl's Megatron engine can route an
  unrouted row inside a sample live: ``routed_mask`` says which positions those are (its
  ``set_router_replay_data(..., replay_mask=)``, router_replay_utils.py:434-460, routes
  the rows a mask leaves out natively, for a trainer that builds the mask itself).

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
    experts_of,
    lazy_torch,
    placeholder_ids,
    routed_length,
    routes,
)

__all__ = ["VERL_DTYPE", "VERL_ENGINES", "VerlRoutedExperts", "to_verl_routed_experts",
           "to_verl_token_routes"]

VERL_DTYPE = "int16"
"""The dtype of verl's ``routed_experts`` (its agent loop casts the engine's routes to it)."""

VERL_ENGINES = ("megatron", "veomni")
"""verl's training engines that replay routes (``actor_rollout_ref.actor.strategy``)."""


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


def _layer_axis(records: Sequence[RoutingRecord | None], num_layers: int | None,
                engine: str | None) -> tuple[tuple[int, ...], list[int] | None]:
    """The decoder layers of the output's layer axis and, with ``num_layers``, where each
    MoE layer of the record lands on it."""
    if engine is not None and engine not in VERL_ENGINES:
        raise ValueError(f"engine must be one of {VERL_ENGINES} or None, got {engine!r}")
    first = next(r for r in records if r is not None)
    moe = tuple(first.layer_map)
    for record in records:
        if record is not None and tuple(record.layer_map) != moe:
            raise ValueError(f"records disagree on the layer map: {record.rollout_id!r} has "
                             f"{list(record.layer_map)}, {first.rollout_id!r} has {list(moe)}")
    if num_layers is None or moe == tuple(range(num_layers)):
        return moe, None
    if moe and max(moe) >= num_layers:
        raise ValueError(f"num_layers {num_layers} is too small for MoE layer {max(moe)}")
    dense = sorted(set(range(num_layers)) - set(moe))
    if engine == "veomni":
        raise ValueError(
            f"num_layers={num_layers} gives verl's VeOmni engine {num_layers} layer slots but "
            f"only {len(moe)} routers fire (MoE layers {list(moe)}; dense {dense}): it matches "
            "slots to routers by fire order and refuses the difference "
            "(verl/workers/engine/veomni/transformer_impl.py:942). Drop num_layers: one slot "
            "per MoE layer is what VeOmni replays")
    if engine is None:
        raise ValueError(
            f"num_layers={num_layers} adds slots for dense layers {dense}, a layout only verl's "
            "Megatron engine reads (by decoder layer, when the axis has exactly the model's "
            "num_layers slots); its VeOmni engine refuses it. Drop num_layers (one slot per "
            "MoE layer works on both engines) or pass engine='megatron'")
    return tuple(range(num_layers)), list(moe)


def _check_dtype(dtype: np.dtype, num_experts: int) -> None:
    if dtype.kind not in "iu" or np.iinfo(dtype).max < num_experts - 1:
        raise ValueError(f"dtype {dtype} cannot hold expert ids up to {num_experts - 1}")


def to_verl_routed_experts(
    records: Sequence[RoutingRecord | None],
    prompt_lengths: Sequence[int],
    *,
    max_prompt_length: int,
    max_response_length: int,
    num_layers: int | None = None,
    engine: str | None = None,
    dtype: str | np.dtype = VERL_DTYPE,
    expert_group: str | None = None,
) -> VerlRoutedExperts:
    """verl's ``routed_experts`` for a batch: record ``i`` belongs to sample ``i`` whose
    prompt has ``prompt_lengths[i]`` tokens.  Its row ``t`` (position ``t`` of prompt +
    response) lands at column ``max_prompt_length - prompt_lengths[i] + t``; rows past
    ``max_prompt_length + max_response_length`` are cut off, as verl's agent loop does.
    Every position without a recorded route (and every position of a None record) is 0
    in every slot, which VeOmni routes natively; with ``engine="megatron"`` it holds the
    placeholder experts ``0..K-1`` on every MoE slot instead (verl's Megatron R3 replays
    it).  The layer axis is the records' MoE layers; ``num_layers`` (with
    ``engine="megatron"`` only) makes it every decoder layer, dense ones 0.
    ``expert_group``: for records with expert groups (ERNIE-4.5-VL), the group to lay out
    (its ids from 0; the other groups' tokens unrouted); such records are refused without it."""
    records = list(records)
    if len(prompt_lengths) != len(records):
        raise ValueError(f"{len(prompt_lengths)} prompt lengths for {len(records)} records")
    total = int(max_prompt_length) + int(max_response_length)
    shape = check_compatible(records)
    if shape is None:
        raise ValueError("no record in the batch: nothing to lay out (verl skips "
                         "routed_experts when the engine returns none)")
    top_k, num_experts = shape
    if expert_group is not None:
        num_experts = experts_of(next(r for r in records if r is not None), expert_group)
    axis, moe_slots = _layer_axis(records, num_layers, engine)
    out = np.zeros((len(records), total, len(axis), top_k), dtype=np.dtype(dtype))
    _check_dtype(out.dtype, num_experts)
    unrouted = placeholder_ids(top_k, num_experts) if engine == "megatron" else \
        np.zeros(top_k, dtype=np.int64)                    # VeOmni: a duplicate, routed live
    slots = slice(None) if moe_slots is None else moe_slots
    if engine == "megatron":
        out[:, :, slots] = unrouted
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
        ids, valid = routes(record, length=count, expert_group=expert_group)   # [L, count, K], [L, count]
        ids[~valid] = unrouted
        placed = ids.transpose(1, 0, 2)                    # [count, L, K]
        if moe_slots is None:
            out[i, start:start + count] = placed
        else:
            out[i, start:start + count][:, moe_slots] = placed
        mask[i, start:start + count] = valid.all(axis=0) if valid.shape[0] else False
    return VerlRoutedExperts(out, mask, axis)


def to_verl_token_routes(record: RoutingRecord, *, num_tokens: int | None = None,
                         num_layers: int | None = None, engine: str | None = None) -> np.ndarray:
    """``[T, L, K]`` int16 routes from the first prompt token on: what a verl rollout
    server returns as ``TokenOutput.routed_experts`` and an agent loop passes on as
    ``AgentLoopOutput.routed_experts``, which verl's agent loop then places into the
    batch (:func:`to_verl_routed_experts` gives the same tensor).  ``T`` is the record's
    routed positions, or ``num_tokens`` (cut, or extended with unrouted rows); unrouted
    positions are 0 (``engine="megatron"``: the placeholders ``0..K-1``)."""
    rows = routed_length(record) if num_tokens is None else int(num_tokens)
    if rows < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    out = to_verl_routed_experts([record], [0], max_prompt_length=0, max_response_length=rows,
                                 num_layers=num_layers, engine=engine)
    return out.routed_experts[0]
