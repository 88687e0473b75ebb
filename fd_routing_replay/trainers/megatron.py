"""Megatron-Core ``RouterReplay``: one ``[tokens, K]`` int64 tensor per MoE router.

What Megatron-Core (0.16, ``megatron/core/transformer/moe/``) does with replay data — the
contract this adapter builds for (file:line in megatron-core 0.16.1):

* ``TopKRouter`` creates one ``RouterReplay`` per MoE layer when
  ``config.moe_enable_routing_replay`` is set (router.py:205-207); the instances sit in
  ``RouterReplay.global_router_replay_instances`` in build order, i.e. ascending decoder
  layer on this pipeline rank (router_replay.py:26, 87).
* ``RouterReplay.set_replay_data(list)`` hands tensor ``i`` to instance ``i`` and refuses a
  list of another length (router_replay.py:29-42); ``set_target_indices`` also queues it
  for the backward recompute (router_replay.py:89-92).
* ``TopKRouter.routing`` flattens logits ``[s, b, E]`` with ``view(-1, E)`` (router.py:559-560),
  so row ``i * b + j`` is position ``i`` of sequence ``j`` (sequence-major); under THD
  packing ``b == 1`` and rows are the packed tokens in order.
* In ``REPLAY_FORWARD`` / ``REPLAY_BACKWARD`` the top-k is not computed: the router takes
  the given indices and gathers its scores at them, ``scores.gather(1, top_indices)``
  (router_replay.py:146-159, reached from moe_utils.py:699-707).  There is no mask: an
  index of -1 (what NeMo-RL style "-1 = no route" lists hold) or the record's fill value
  fails the gather (out of range).  So positions without routes — padding, the last
  token of each sequence (never forwarded at rollout), unrouted positions — get distinct
  in-range placeholder experts ``0..K-1`` and :attr:`MegatronReplay.mask` says which
  entries are real; those positions are padding or masked out of the loss anyway.

Token layouts: ``"thd"`` (sequence packing; each sequence padded to ``pad_to_multiple``,
as Megatron/verl pad to ``tp * cp * 2``) and ``"sbhd"`` (a padded ``[b, s]`` batch, sent to
the router as ``[s, b]``).  Context parallelism keeps each rank's chunks
(:func:`~fd_routing_replay.trainers.parallel.context_parallel_indices`, per sequence for
THD, along ``s`` for SBHD) and sequence parallelism its contiguous ``1/tp`` of the rows.
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
from fd_routing_replay.trainers.parallel import context_parallel_indices, sequence_parallel_slice

__all__ = ["LAYOUTS", "MegatronReplay", "build_megatron_replay"]

LAYOUTS = ("thd", "sbhd")


@dataclass
class MegatronReplay:
    """Replay data for one micro-batch on one rank.

    ``topk[i]`` is the int64 ``[tokens, K]`` id array for the rank's ``i``-th MoE router
    (decoder layer ``layers[i]``); ``mask[i, t]`` is True where ``topk[i][t]`` is a recorded
    route, False where it is a placeholder.  ``cu_seqlens`` (THD) are the packed sequence
    boundaries before the CP/SP split, padding included, as Megatron's
    ``PackedSeqParams.cu_seqlens_q_padded``.
    """

    topk: list[np.ndarray]
    mask: np.ndarray
    layers: tuple[int, ...]
    layout: str
    cu_seqlens: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.mask.shape[1])

    @property
    def token_mask(self) -> np.ndarray:
        """``[tokens]``: True where every router replays a recorded route."""
        return self.mask.all(axis=0) if self.mask.shape[0] else \
            np.zeros(self.mask.shape[1], dtype=bool)

    def to_torch(self, device: Any = None) -> list[Any]:
        """The ``topk`` arrays as int64 torch tensors (what ``set_replay_data`` takes)."""
        torch = lazy_torch()
        return [torch.from_numpy(ids).to(device) if device is not None else torch.from_numpy(ids)
                for ids in self.topk]

    def install(self, device: Any = None, *, action: str = "replay_forward",
                routers: Sequence[Any] | None = None) -> None:
        """Give the tensors to Megatron-Core's ``RouterReplay`` instances and set them to
        ``action`` (``"replay_forward"``; ``"replay_backward"`` for recompute).

        By default all instances of the process (``RouterReplay.set_replay_data``: the rank
        must hold exactly ``len(topk)`` replaying routers).  With virtual pipeline stages a
        micro-batch runs one model chunk: pass that chunk's ``RouterReplay`` instances as
        ``routers`` (built from ``moe_layers`` of that chunk only).
        """
        from megatron.core.transformer.moe.router_replay import (
            RouterReplay,
            RouterReplayAction,
        )

        tensors = self.to_torch(device)
        if routers is None:
            RouterReplay.set_replay_data(tensors)
            RouterReplay.set_global_router_replay_action(RouterReplayAction(action))
            return
        routers = list(routers)
        if len(routers) != len(tensors):
            raise ValueError(f"{len(tensors)} replay tensors (layers {list(self.layers)}) for "
                             f"{len(routers)} routers")
        for router, ids in zip(routers, tensors, strict=True):
            router.set_target_indices(ids)
            router.set_router_replay_action(RouterReplayAction(action))


def _sequence_routes(record: RoutingRecord | None, layers: Sequence[int], length: int,
                     top_k: int, num_experts: int, expert_group: str | None) -> tuple[np.ndarray, np.ndarray]:
    """``[R, length, K]`` ids and ``[R, length]`` mask of one sequence (placeholders past
    the record's rows, everywhere for a missing record)."""
    if record is None:
        ids = np.empty((len(layers), length, top_k), dtype=np.int64)
        ids[...] = placeholder_ids(top_k, num_experts)
        return ids, np.zeros((len(layers), length), dtype=bool)
    return routes(record, layers, length=length, expert_group=expert_group)


def build_megatron_replay(
    records: Sequence[RoutingRecord | None],
    moe_layers: Sequence[int],
    *,
    layout: str = "thd",
    seq_lens: Sequence[int] | None = None,
    pad_to_multiple: int = 1,
    max_seq_len: int | None = None,
    cp_size: int = 1,
    cp_rank: int = 0,
    tp_size: int = 1,
    tp_rank: int = 0,
    sequence_parallel: bool = False,
    top_k: int | None = None,
    num_experts: int | None = None,
    expert_group: str | None = None,
) -> MegatronReplay:
    """Replay data for a micro-batch of ``records`` (one per sequence, in batch order).

    ``moe_layers``: the global decoder-layer index (0-based, the record's layer map) of
    each MoE router on this rank, in build order — e.g.
    ``rank_moe_layers(record, pipeline_layer_ranges(...))``.  ``seq_lens[i]``: tokens of
    sequence ``i`` in the trainer's input (default: the record's forwarded positions + 1,
    i.e. prompt + generated); a record longer than that is cut, a shorter one leaves
    placeholders.  A None record is a sequence without routes (all placeholders; its
    ``seq_lens`` entry is required).  ``top_k``/``num_experts`` are needed only when no
    record is given.  ``expert_group``: for records with expert groups (ERNIE-4.5-VL's text
    and image experts, docs/record-format.md), the group whose routers this replay feeds --
    its ids counted from 0, only its tokens' positions valid; such records are refused
    without it.  See the module docstring for layouts and parallel splits.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if pad_to_multiple < 1:
        raise ValueError(f"pad_to_multiple must be >= 1, got {pad_to_multiple}")
    records = list(records)
    shape = check_compatible(records)
    if shape is None:
        if top_k is None or num_experts is None:
            raise ValueError("no record in the batch: give top_k and num_experts")
        shape = (int(top_k), int(num_experts))
    k, experts = shape
    if expert_group is not None:
        experts = experts_of(next(r for r in records if r is not None), expert_group) \
            if any(r is not None for r in records) else experts
    if seq_lens is None:
        if any(r is None for r in records):
            raise ValueError("a sequence without a record needs its length: give seq_lens")
        seq_lens = [routed_length(r) + 1 for r in records]  # type: ignore[arg-type]
    seq_lens = [int(n) for n in seq_lens]
    if len(seq_lens) != len(records):
        raise ValueError(f"{len(seq_lens)} seq_lens for {len(records)} records")
    if any(n < 0 for n in seq_lens):
        raise ValueError(f"seq_lens must be >= 0, got {seq_lens}")
    layers = tuple(int(layer) for layer in moe_layers)
    cp_parts = 2 * cp_size if cp_size > 1 else 1

    if layout == "thd":
        id_parts, mask_parts, bounds = [], [], [0]
        for record, length in zip(records, seq_lens, strict=True):
            padded = -(-length // pad_to_multiple) * pad_to_multiple
            if padded % cp_parts:
                raise ValueError(f"padded sequence length {padded} is not divisible by "
                                 f"2 x cp_size = {cp_parts}: use pad_to_multiple = "
                                 f"{cp_parts} x tp_size")
            ids, mask = _sequence_routes(record, layers, padded, k, experts, expert_group)
            if length < padded:
                mask[:, length:] = False
            keep = context_parallel_indices(padded, cp_size, cp_rank)
            id_parts.append(ids[:, keep])
            mask_parts.append(mask[:, keep])
            bounds.append(bounds[-1] + padded)
        ids = np.concatenate(id_parts, axis=1) if id_parts else \
            np.empty((len(layers), 0, k), dtype=np.int64)
        mask = np.concatenate(mask_parts, axis=1) if mask_parts else \
            np.zeros((len(layers), 0), dtype=bool)
        cu_seqlens = np.asarray(bounds, dtype=np.int32)
    else:
        longest = max(seq_lens, default=0)
        width = longest if max_seq_len is None else int(max_seq_len)
        if width < longest:
            raise ValueError(f"max_seq_len {width} is shorter than the longest sequence "
                             f"({longest} tokens)")
        width = -(-width // pad_to_multiple) * pad_to_multiple
        batch = len(records)
        grid = np.empty((len(layers), batch, width, k), dtype=np.int64)
        grid_mask = np.zeros((len(layers), batch, width), dtype=bool)
        for j, (record, length) in enumerate(zip(records, seq_lens, strict=True)):
            seq_ids, seq_mask = _sequence_routes(record, layers, width, k, experts, expert_group)
            seq_mask[:, length:] = False
            grid[:, j], grid_mask[:, j] = seq_ids, seq_mask
        keep = context_parallel_indices(width, cp_size, cp_rank)
        grid, grid_mask = grid[:, :, keep], grid_mask[:, :, keep]
        # [R, b, s, K] -> [R, s, b, K] -> [R, s*b, K]: Megatron's sequence-major flattening.
        ids = np.ascontiguousarray(grid.transpose(0, 2, 1, 3)).reshape(len(layers), -1, k)
        mask = np.ascontiguousarray(grid_mask.transpose(0, 2, 1)).reshape(len(layers), -1)
        cu_seqlens = None

    ids[~mask] = placeholder_ids(k, experts)  # cut-off and padded positions alike
    if sequence_parallel and tp_size > 1:
        share = sequence_parallel_slice(ids.shape[1], tp_size, tp_rank)
        ids, mask = ids[:, share], mask[:, share]
    topk = [np.ascontiguousarray(ids[row]) for row in range(len(layers))]
    return MegatronReplay(topk=topk, mask=np.ascontiguousarray(mask), layers=layers,
                          layout=layout, cu_seqlens=cu_seqlens)
