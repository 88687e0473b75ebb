"""Routes in the token order a Hugging Face MoE router sees: ``[layers, tokens, K]`` per batch.

Every supported router flattens its input with ``reshape(-1, hidden)``
(families.py), so token row ``b * S + s`` is position ``s`` of batch row ``b``:

* **packed** (varlen: one row ``[1, N]`` of concatenated sequences, told apart by
  ``position_ids`` restarting at 0 or by ``cu_seqlens``): the records' routes one after
  another (:func:`packed_routes`);
* **padded** (``[B, S]`` with an ``attention_mask``, left or right padding): record ``b``'s
  routes at the positions where row ``b``'s mask is 1, in order (:func:`padded_routes`).

A rank's share under context parallelism (per-sequence chunks,
:func:`~fd_routing_replay.trainers.parallel.context_parallel_indices`) or sequence
parallelism (a contiguous slice, Ulysses or Megatron style,
:func:`~fd_routing_replay.trainers.parallel.sequence_parallel_slice`) is cut with the
existing helpers; :meth:`HFRoutes.take` keeps any other set of token rows.

Positions without a recorded route — padding, the last token of each sequence (never
forwarded at rollout), unrouted positions, sequences without a record — are False in
``valid``; the replay keeps the live router's choice there.  NumPy only.
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
    host_array,
    placeholder_ids,
    routed_length,
)
from fd_routing_replay.trainers._common import routes as record_routes
from fd_routing_replay.trainers.parallel import context_parallel_indices, sequence_parallel_slice

__all__ = ["HFRoutes", "as_routes", "packed_routes", "padded_routes", "routes_for_model",
           "seq_lens_from_cu_seqlens", "seq_lens_from_position_ids"]


@dataclass(frozen=True)
class HFRoutes:
    """Recorded top-k for one forward pass: ``ids[row, token, k]`` (int64) for the MoE layer
    ``layers[row]`` (global decoder-layer index, as a record's layer map), ``valid[row, token]``
    True where ``ids`` is a recorded route (elsewhere the live router decides)."""

    ids: np.ndarray
    valid: np.ndarray
    layers: tuple[int, ...]
    num_experts: int | None = None

    def __post_init__(self) -> None:
        if self.ids.ndim != 3 or self.valid.shape != self.ids.shape[:2]:
            raise ValueError(f"ids must be [layers, tokens, K] and valid [layers, tokens]; got "
                             f"{self.ids.shape} and {self.valid.shape}")
        if len(self.layers) != self.ids.shape[0]:
            raise ValueError(f"{self.ids.shape[0]} rows of routes for {len(self.layers)} layers "
                             f"{list(self.layers)}")

    @property
    def num_tokens(self) -> int:
        return int(self.ids.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.ids.shape[2])

    def take(self, positions: np.ndarray | Sequence[int] | slice) -> HFRoutes:
        """The routes of the given token rows only (a rank's CP/SP share), in that order."""
        index = positions if isinstance(positions, slice) else \
            np.asarray(positions, dtype=np.int64).reshape(-1)
        return HFRoutes(np.ascontiguousarray(self.ids[:, index]),
                        np.ascontiguousarray(self.valid[:, index]), self.layers, self.num_experts)


def _layer_map(records: Sequence[RoutingRecord | None],
               layers: Sequence[int] | None) -> tuple[int, ...]:
    """The layers to lay out: ``layers`` or the records' shared layer map."""
    if layers is not None:
        return tuple(int(layer) for layer in layers)
    maps = {tuple(r.layer_map) for r in records if r is not None}
    if len(maps) > 1:
        raise ValueError(f"records of one batch have different layer maps {sorted(maps)}: "
                         "pass layers=")
    if not maps:
        raise ValueError("no record in the batch: pass layers= (the model's MoE layers)")
    return maps.pop()


def _sequence(record: RoutingRecord | None, layers: tuple[int, ...], length: int, top_k: int,
              num_experts: int, exact_length: bool, expert_group: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``[R, length, K]`` ids and ``[R, length]`` validity of one sequence of ``length``
    tokens.  A record holds ``tokens - 1`` rows (the last token is never forwarded at
    rollout); any other count is refused unless ``exact_length`` is False, which cuts a
    longer record and leaves the end of a shorter one unrouted."""
    if record is None:
        ids = np.empty((len(layers), length, top_k), dtype=np.int64)
        ids[...] = placeholder_ids(top_k, num_experts)
        return ids, np.zeros((len(layers), length), dtype=bool)
    routed = routed_length(record)
    if exact_length and routed != length - 1:
        raise ValueError(
            f"record {record.rollout_id!r} has {routed} routed positions but its sequence in "
            f"the batch has {length} tokens, so {max(length - 1, 0)} are expected (a record "
            "holds tokens - 1 rows: the last token is never forwarded); a record of another "
            "sequence would misroute it. Pass exact_length=False to cut a longer record "
            "(a truncated response) or leave the end of a shorter one unrouted")
    return record_routes(record, layers, length=length, expert_group=expert_group)


def _shape(records: Sequence[RoutingRecord | None], top_k: int | None,
           num_experts: int | None, expert_group: str | None = None) -> tuple[int, int]:
    shape = check_compatible(records)
    if shape is not None:
        if expert_group is not None:            # the group's router has the group's experts
            return shape[0], experts_of(next(r for r in records if r is not None), expert_group)
        return shape
    if top_k is None or num_experts is None:
        raise ValueError("no record in the batch: give top_k and num_experts")
    return int(top_k), int(num_experts)


def seq_lens_from_position_ids(position_ids: Any) -> list[int]:
    """Sequence lengths of a packed row from its ``position_ids`` (each sequence restarts at 0),
    as transformers' packed-sequence detection reads them."""
    flat = host_array(position_ids).reshape(-1)
    if flat.size == 0:
        return []
    starts = np.flatnonzero(flat == 0)
    if starts.size == 0 or starts[0] != 0:
        raise ValueError("position_ids of a packed row must start each sequence at 0")
    return np.diff(np.append(starts, flat.size)).astype(int).tolist()


def seq_lens_from_cu_seqlens(cu_seqlens: Any) -> list[int]:
    """Sequence lengths from cumulative boundaries ``[0, n0, n0 + n1, ...]``."""
    bounds = host_array(cu_seqlens, np.int64).reshape(-1)
    lengths = np.diff(bounds)
    if (bounds.size and bounds[0] != 0) or (lengths < 0).any():
        raise ValueError(f"cu_seqlens must start at 0 and not decrease, got {bounds.tolist()}")
    return lengths.astype(int).tolist()




def packed_routes(records: Sequence[RoutingRecord | None], *,
                  seq_lens: Sequence[int] | None = None, position_ids: Any = None,
                  cu_seqlens: Any = None, num_tokens: int | None = None,
                  layers: Sequence[int] | None = None, cp_size: int = 1, cp_rank: int = 0,
                  load_balanced: bool = True, sp_size: int = 1, sp_rank: int = 0,
                  top_k: int | None = None, num_experts: int | None = None,
                  exact_length: bool = True, expert_group: str | None = None) -> HFRoutes:
    """Routes of a packed row: sequence ``i`` (record ``records[i]``) takes ``seq_lens[i]``
    tokens (from ``position_ids`` or ``cu_seqlens`` if given; default: the record's forwarded
    positions + 1).  ``num_tokens`` pads the row's end (e.g. to a multiple of the SP size).
    A record must route exactly its sequence's ``tokens - 1`` positions;
    ``exact_length=False`` cuts a longer one and leaves the end of a shorter one unrouted.

    Context parallelism keeps rank ``cp_rank``'s chunks of each sequence; sequence
    parallelism then the ``sp_rank``-th contiguous share of the row.  ``expert_group``: one
    group of records with expert groups (ERNIE-4.5-VL; :mod:`.groups` replays them).
    """
    records = list(records)
    given = [name for name, value in (("seq_lens", seq_lens), ("position_ids", position_ids),
                                      ("cu_seqlens", cu_seqlens)) if value is not None]
    if len(given) > 1:
        raise ValueError(f"give one of seq_lens, position_ids, cu_seqlens; got {given}")
    if position_ids is not None:
        seq_lens = seq_lens_from_position_ids(position_ids)
    elif cu_seqlens is not None:
        seq_lens = seq_lens_from_cu_seqlens(cu_seqlens)
    elif seq_lens is None:
        if any(r is None for r in records):
            raise ValueError("a sequence without a record needs its length: give seq_lens")
        seq_lens = [routed_length(r) + 1 for r in records]  # type: ignore[arg-type]
    lengths = [int(n) for n in seq_lens]
    if len(lengths) != len(records):
        raise ValueError(f"the packed row has {len(lengths)} sequences but {len(records)} "
                         "records were given")
    k, experts = _shape(records, top_k, num_experts, expert_group)
    row_layers = _layer_map(records, layers)
    id_parts = [np.empty((len(row_layers), 0, k), dtype=np.int64)]
    valid_parts = [np.zeros((len(row_layers), 0), dtype=bool)]
    for record, length in zip(records, lengths, strict=True):
        ids, valid = _sequence(record, row_layers, length, k, experts, exact_length, expert_group)
        keep = context_parallel_indices(length, cp_size, cp_rank, load_balanced=load_balanced)
        id_parts.append(ids[:, keep])
        valid_parts.append(valid[:, keep])
    ids, valid = np.concatenate(id_parts, axis=1), np.concatenate(valid_parts, axis=1)
    if num_tokens is not None:
        ids, valid = _pad_end(ids, valid, int(num_tokens), k, experts)
    routes = HFRoutes(ids, valid, row_layers, experts)
    if sp_size > 1:
        routes = routes.take(sequence_parallel_slice(routes.num_tokens, sp_size, sp_rank))
    return routes


def _pad_end(ids: np.ndarray, valid: np.ndarray, total: int, top_k: int,
             num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    if total < ids.shape[1]:
        raise ValueError(f"num_tokens {total} is shorter than the packed sequences "
                         f"({ids.shape[1]} tokens)")
    extra = total - ids.shape[1]
    pad_ids = np.empty((ids.shape[0], extra, top_k), dtype=np.int64)
    pad_ids[...] = placeholder_ids(top_k, num_experts)
    return (np.concatenate([ids, pad_ids], axis=1),
            np.concatenate([valid, np.zeros((ids.shape[0], extra), dtype=bool)], axis=1))


def padded_routes(records: Sequence[RoutingRecord | None], attention_mask: Any, *,
                  layers: Sequence[int] | None = None, sp_size: int = 1, sp_rank: int = 0,
                  top_k: int | None = None, num_experts: int | None = None,
                  exact_length: bool = True, expert_group: str | None = None) -> HFRoutes:
    """Routes of a padded ``[B, S]`` batch: record ``b``'s routes at the positions where
    ``attention_mask[b]`` is nonzero (left or right padding alike), in order; padding is
    not valid.  Sequence parallelism (Ulysses: each rank holds ``S / sp_size`` contiguous
    positions of every row) keeps rank ``sp_rank``'s columns.  A record must route exactly
    its row's ``tokens - 1`` positions (``exact_length``, as :func:`packed_routes`)."""
    records = list(records)
    mask = host_array(attention_mask) != 0
    if mask.ndim != 2:
        raise ValueError(f"attention_mask must be [batch, seq], got shape {mask.shape}")
    if mask.shape[0] != len(records):
        raise ValueError(f"the batch has {mask.shape[0]} rows but {len(records)} records "
                         "were given")
    k, experts = _shape(records, top_k, num_experts, expert_group)
    row_layers = _layer_map(records, layers)
    batch, width = mask.shape
    ids = np.empty((len(row_layers), batch, width, k), dtype=np.int64)
    ids[...] = placeholder_ids(k, experts)
    valid = np.zeros((len(row_layers), batch, width), dtype=bool)
    for b, record in enumerate(records):
        where = np.flatnonzero(mask[b])
        seq_ids, seq_valid = _sequence(record, row_layers, where.size, k, experts,
                                       exact_length, expert_group)
        ids[:, b, where], valid[:, b, where] = seq_ids, seq_valid
    if sp_size > 1:
        share = sequence_parallel_slice(width, sp_size, sp_rank)
        ids, valid = ids[:, :, share], valid[:, :, share]
    rows = len(row_layers)
    return HFRoutes(np.ascontiguousarray(ids).reshape(rows, -1, k),
                    np.ascontiguousarray(valid).reshape(rows, -1), row_layers, experts)


def as_routes(routes: HFRoutes | RoutingRecord | Any, layers: Sequence[int] | None = None, *,
              model_layers: Sequence[int] | None = None) -> HFRoutes:
    """:class:`HFRoutes` from what a trainer holds: HFRoutes as they are; one record (a
    batch of one unpadded sequence, :func:`packed_routes`); or a ``[layers, tokens, K]``
    array (numpy or torch) of expert ids, where a negative id or an unsigned dtype's maximum
    (a record's fill value) marks "no route".  An array's rows are the decoder ``layers``
    (default: ``model_layers``, the model's MoE layers in order)."""
    if isinstance(routes, HFRoutes):
        return routes
    if isinstance(routes, RoutingRecord):
        return packed_routes([routes], layers=layers)
    array = host_array(routes)
    if array.ndim != 3 or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"routes must be HFRoutes, a RoutingRecord or an integer "
                         f"[layers, tokens, K] array; got {array.dtype} {array.shape}")
    unrouted = array < 0
    if np.issubdtype(array.dtype, np.unsignedinteger):
        unrouted = array == np.iinfo(array.dtype).max
    valid = ~unrouted.any(axis=2)
    ids = array.astype(np.int64)
    ids[~valid] = np.arange(array.shape[2], dtype=np.int64)
    if layers is None and model_layers is not None and len(model_layers) == array.shape[0]:
        layers = model_layers  # else range(L): the replay then names both layer counts
    row_layers = tuple(int(x) for x in layers) if layers is not None else \
        tuple(range(array.shape[0]))
    if len(row_layers) != array.shape[0]:
        raise ValueError(f"the routes array has {array.shape[0]} layer rows but "
                         f"{len(row_layers)} layers {list(row_layers)} were named")
    return HFRoutes(ids, valid, row_layers)


def routes_for_model(routes: HFRoutes | RoutingRecord | Any, layers: Sequence[int] | None,
                     gates: Sequence[tuple[int, int, int]], *, unit: str, units: str) -> HFRoutes:
    """:func:`as_routes`, checked against a model whose MoE layers' routing is ``gates``:
    one ``(decoder layer, top_k, experts)`` per MoE layer in order (``unit`` / ``units``
    name them in errors: "router" / "MoE blocks", "gate" / "MoE gates").  The layer map,
    top-k and expert count must be the model's and every recorded id one of its experts."""
    model_layers = tuple(layer for layer, _, _ in gates)
    routes = as_routes(routes, layers, model_layers=model_layers)
    if routes.layers != model_layers:
        raise ValueError(
            f"the routes cover {len(routes.layers)} MoE layers (decoder layers "
            f"{list(routes.layers)}) but the model has {len(model_layers)} {units} "
            f"(decoder layers {list(model_layers)}); a record's layer map must list the "
            "model's MoE layers (moe_layers(model))")
    for row, (layer, top_k, experts) in enumerate(gates):
        if routes.top_k != top_k:
            raise ValueError(f"the routes have top_k {routes.top_k} but the {unit} of "
                             f"decoder layer {layer} picks top_k {top_k}")
        if routes.num_experts is not None and routes.num_experts != experts:
            raise ValueError(f"the routes were recorded with {routes.num_experts} experts "
                             f"but the {unit} of decoder layer {layer} has {experts}: "
                             "not this model's routing")
        chosen = routes.ids[row][routes.valid[row]]
        if chosen.size and (chosen.min() < 0 or chosen.max() >= experts):
            raise ValueError(f"decoder layer {layer}: recorded expert ids "
                             f"{int(chosen.min())}..{int(chosen.max())} are outside the "
                             f"{unit}'s {experts} experts")
    return routes
