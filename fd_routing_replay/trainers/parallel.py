"""Which part of a record one trainer rank needs: its layers (PP) and its tokens (CP/SP).

* **Pipeline parallel**: a rank builds a contiguous range of decoder layers (with virtual
  pipeline stages, several ranges).  The record's layer map says which decoder layer each
  row belongs to, so a rank keeps the rows whose layer falls in its ranges
  (:func:`pipeline_layer_ranges`, :func:`rank_moe_layers`, :func:`slice_layers`).
  The split follows Megatron-Core's rule (``get_transformer_layer_offset`` /
  ``get_num_layers_to_build``): equal stages, optionally a different count on the first
  and last stage; with ``vp_size`` chunk ``v`` of rank ``r`` starts at
  ``v * L / vp + r * L / (vp * pp)``.
* **Context parallel**: with load balancing (Megatron's ``get_batch_on_this_cp_rank`` and
  Transformer Engine's THD partitioning) a sequence is cut into ``2 * cp`` equal chunks
  and rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r`` (:func:`context_parallel_indices`).
* **Sequence parallel** (tensor parallel with SP): the router sees a contiguous ``1/tp``
  of the flattened tokens (:func:`sequence_parallel_slice`).

Expert parallelism needs no slicing: every EP rank routes all of its tokens with the full
router, so it needs the same ``[tokens, K]`` ids as without EP.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from fd_routing_replay.codec import RoutingRecord

__all__ = ["context_parallel_indices", "pipeline_layer_ranges", "rank_moe_layers",
           "sequence_parallel_slice", "shard_tokens", "slice_layers"]


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _rank(name: str, rank: int, size: int) -> int:
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < size:
        raise ValueError(f"{name} must be an int in [0, {size}), got {rank!r}")
    return int(rank)


def pipeline_layer_ranges(num_layers: int, pp_size: int, pp_rank: int, *,
                          vp_size: int | None = None, first_stage_layers: int | None = None,
                          last_stage_layers: int | None = None) -> list[range]:
    """The decoder layers (0-based, global) pipeline rank ``pp_rank`` builds, one range per
    model chunk (one without virtual pipeline stages), as Megatron-Core splits them."""
    num_layers = _positive("num_layers", num_layers)
    pp_size = _positive("pp_size", pp_size)
    pp_rank = _rank("pp_rank", pp_rank, pp_size)
    uneven = first_stage_layers is not None or last_stage_layers is not None
    if vp_size is not None and pp_size > 1:
        vp_size = _positive("vp_size", vp_size)
        if uneven:
            raise ValueError("uneven first/last pipeline stages with virtual pipeline stages: "
                             "pass each rank's layer ranges yourself")
        if num_layers % (pp_size * vp_size):
            raise ValueError(f"num_layers {num_layers} is not divisible by pp_size {pp_size} x "
                             f"vp_size {vp_size}")
        chunk = num_layers // (pp_size * vp_size)
        return [range(v * num_layers // vp_size + pp_rank * chunk,
                      v * num_layers // vp_size + (pp_rank + 1) * chunk) for v in range(vp_size)]
    if not uneven:
        if num_layers % pp_size:
            raise ValueError(f"num_layers {num_layers} is not divisible by pp_size {pp_size}; "
                             "give first_stage_layers / last_stage_layers")
        per = num_layers // pp_size
        return [range(pp_rank * per, (pp_rank + 1) * per)]
    counts: list[int | None] = [None] * pp_size
    if first_stage_layers is not None:
        counts[0] = int(first_stage_layers)
    if last_stage_layers is not None:
        counts[-1] = int(last_stage_layers)
    fixed = sum(c for c in counts if c is not None)
    middle = sum(1 for c in counts if c is None)
    rest = num_layers - fixed
    if rest < 0 or (middle and rest % middle) or (not middle and rest):
        raise ValueError(f"{num_layers} layers cannot be split over {pp_size} stages with "
                         f"first={first_stage_layers}, last={last_stage_layers}")
    per = rest // middle if middle else 0
    sizes = [per if c is None else c for c in counts]
    start = sum(sizes[:pp_rank])
    return [range(start, start + sizes[pp_rank])]


def rank_moe_layers(layer_map: Sequence[int] | RoutingRecord,
                    ranges: Iterable[range]) -> tuple[int, ...]:
    """The MoE decoder layers (those in ``layer_map``, a record's or a model's) inside
    ``ranges``, ascending: the order in which the rank's routers are built."""
    layers = layer_map.layer_map if isinstance(layer_map, RoutingRecord) else layer_map
    spans = list(ranges)
    return tuple(sorted(int(layer) for layer in layers if any(layer in span for span in spans)))


def slice_layers(record: RoutingRecord, layers: Iterable[int] | Iterable[range]) -> RoutingRecord:
    """A record with only the rows of the given decoder layers (or of the decoder layers
    inside the given ranges) that the record has; rows keep their layer map entries.
    Contiguous rows are a view, others a copy."""
    items = list(layers)
    if items and all(isinstance(item, range) for item in items):
        wanted = set(rank_moe_layers(record, items))
    else:
        wanted = {int(layer) for layer in items}  # type: ignore[arg-type]
    rows = [row for row, layer in enumerate(record.layer_map) if layer in wanted]
    if rows and rows == list(range(rows[0], rows[-1] + 1)):
        ids = record.ids[rows[0]:rows[-1] + 1]
    else:
        ids = np.ascontiguousarray(record.ids[rows]) if rows else \
            np.empty((0,) + record.ids.shape[1:], record.ids.dtype)
    return RoutingRecord(record.rollout_id, ids, record.num_experts, record.fill_value,
                         dict(record.metadata), record.created, record.producer,
                         layers=tuple(record.layer_map[row] for row in rows),
                         token_convention=record.token_convention)


def context_parallel_indices(seq_len: int, cp_size: int, cp_rank: int, *,
                             load_balanced: bool = True) -> np.ndarray:
    """Positions of a ``seq_len``-token sequence that context-parallel rank ``cp_rank``
    holds: chunks ``r`` and ``2*cp-1-r`` of ``2*cp`` (load balanced, Megatron's causal
    split), or the ``r``-th of ``cp`` contiguous chunks."""
    cp_size = _positive("cp_size", cp_size)
    cp_rank = _rank("cp_rank", cp_rank, cp_size)
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 0:
        raise ValueError(f"seq_len must be a non-negative int, got {seq_len!r}")
    if cp_size == 1:
        return np.arange(seq_len, dtype=np.int64)
    parts = 2 * cp_size if load_balanced else cp_size
    if seq_len % parts:
        raise ValueError(f"seq_len {seq_len} is not divisible by {parts} (context parallel size "
                         f"{cp_size}{', load balanced' if load_balanced else ''}); pad sequences "
                         f"to a multiple of {parts}")
    chunk = seq_len // parts
    if not load_balanced:
        return np.arange(cp_rank * chunk, (cp_rank + 1) * chunk, dtype=np.int64)
    second = parts - 1 - cp_rank
    return np.concatenate([np.arange(cp_rank * chunk, (cp_rank + 1) * chunk),
                           np.arange(second * chunk, (second + 1) * chunk)]).astype(np.int64)


def sequence_parallel_slice(num_tokens: int, tp_size: int, tp_rank: int) -> slice:
    """The contiguous share of ``num_tokens`` flattened tokens that tensor-parallel rank
    ``tp_rank`` routes under sequence parallelism (Megatron's scatter along dim 0)."""
    tp_size = _positive("tp_size", tp_size)
    tp_rank = _rank("tp_rank", tp_rank, tp_size)
    if num_tokens % tp_size:
        raise ValueError(f"{num_tokens} tokens are not divisible by tensor parallel size "
                         f"{tp_size} (sequence parallel); pad to a multiple of {tp_size}")
    share = num_tokens // tp_size
    return slice(tp_rank * share, (tp_rank + 1) * share)


def shard_tokens(record: RoutingRecord, positions: np.ndarray | Sequence[int]) -> RoutingRecord:
    """A record of the given positions only (e.g. :func:`context_parallel_indices`).
    Positions past the record's rows (the last, never-forwarded token; padding) get the
    fill value, as any position without routing."""
    index = np.asarray(positions, dtype=np.int64).reshape(-1)
    if index.size and index.min() < 0:
        raise ValueError(f"positions must be >= 0, got {int(index.min())}")
    ids = np.full((record.num_layers, index.size, record.top_k), record.fill_value,
                  dtype=record.ids.dtype)
    inside = index < record.num_tokens
    ids[:, inside] = record.ids[:, index[inside]]
    metadata = {k: v for k, v in record.metadata.items() if k != "num_tokens"}
    return RoutingRecord(record.rollout_id, ids, record.num_experts, record.fill_value,
                         metadata, record.created, record.producer, layers=record.layer_map,
                         token_convention=record.token_convention)
