"""What every trainer adapter needs from a record: routes, validity, layer rows.

A record is ``ids[layer_row, position, k]`` (docs/record-format.md): one row per MoE layer
(the layer map names its global decoder-layer index), one column per *forwarded* position
(prompt + generated - 1: the last sampled token is never fed back, so it has no route),
and the fill value where a position has no routing.  Trainers want int64 expert ids with
no fill value in them (Megatron gathers router scores at the ids: -1 or the fill would
index out of range), plus a mask saying which positions carry recorded routes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from fd_routing_replay.codec import TOKEN_FORWARDED, RoutingRecord
from fd_routing_replay.codec.groups import expert_groups, group_named
from fd_routing_replay.codec.verification import refuse_for_training

__all__ = ["check_compatible", "check_convention", "experts_of", "layer_rows", "lazy_torch",
           "placeholder_ids", "routed_length", "routes"]


def routed_length(record: RoutingRecord) -> int:
    """Forwarded positions the record covers: ``metadata["num_tokens"]`` for a record
    padded to ``max_model_len`` (capture.pad_to_max_model_len, fastdeploy-raw), else T."""
    stated = record.metadata.get("num_tokens") if isinstance(record.metadata, dict) else None
    total = record.num_tokens
    if isinstance(stated, int) and not isinstance(stated, bool) and 0 <= stated <= total:
        return stated
    return total


def layer_rows(record: RoutingRecord, layers: Iterable[int] | None) -> list[int]:
    """Row indices of ``record.ids`` for the global decoder layers ``layers`` (in that
    order); all rows when None.  ValueError naming the layers the record lacks."""
    layer_map = record.layer_map
    if layers is None:
        return list(range(len(layer_map)))
    wanted = [int(layer) for layer in layers]
    position = {layer: row for row, layer in enumerate(layer_map)}
    missing = [layer for layer in wanted if layer not in position]
    if missing:
        raise ValueError(
            f"record {record.rollout_id!r} has no routing for decoder layer(s) {missing}: its "
            f"layer map is {list(layer_map)} (MoE layers only; dense layers have no router)")
    return [position[layer] for layer in wanted]


def placeholder_ids(top_k: int, num_experts: int) -> np.ndarray:
    """The ids given to positions without routes: experts ``0..K-1``, distinct and in
    range, so a router that gathers scores at them (Megatron) and a dispatcher that sends
    the token to them both work.  Such positions are masked out (padding, the last token)."""
    if top_k > num_experts:
        raise ValueError(f"top_k {top_k} exceeds num_experts {num_experts}")
    return np.arange(top_k, dtype=np.int64)


def check_convention(record: RoutingRecord) -> None:
    """ValueError unless the record's rows are forwarded positions (the only token
    convention the adapters lay out; a future one must not be silently misaligned).
    RecordError for a verification record (``capture.verify``): its ids are a test
    pattern, never routes to replay."""
    refuse_for_training(record)
    if record.token_convention != TOKEN_FORWARDED:
        raise ValueError(f"record {record.rollout_id!r}: token convention "
                         f"{record.token_convention!r} is not {TOKEN_FORWARDED!r}, the only "
                         "one these adapters lay out")


def experts_of(record: RoutingRecord, expert_group: str | None) -> int:
    """The expert count a router replaying ``record`` has: the record's, or with
    ``expert_group`` that group's (:func:`routes`)."""
    return record.num_experts if expert_group is None else group_named(record, expert_group).count


def routes(record: RoutingRecord, layers: Sequence[int] | None = None, *,
           length: int | None = None, expert_group: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, valid)``: int64 ``[L', T', K]`` routes of the chosen decoder layers and the
    bool ``[L', T']`` mask of positions with recorded routes.

    ``T'`` is :func:`routed_length` (or ``length``, cut or extended with unrouted
    positions).  A position counts as routed in a layer only if all K slots hold expert
    ids; elsewhere the ids are :func:`placeholder_ids`, never the fill value or -1.

    A record with expert groups (docs/record-format.md, "Expert groups": ERNIE-4.5-VL's
    text and image experts in one id space) is read one group at a time: ``expert_group``
    names it, its ids come back counted from 0 and only the positions routed to it are
    valid (each group's router replays its own tokens).  Without ``expert_group`` such a
    record is refused, naming its groups; a record without groups refuses ``expert_group``.
    """
    check_convention(record)
    groups = expert_groups(record)
    if groups and expert_group is None:
        raise ValueError(f"record {record.rollout_id!r} routes its tokens through the expert groups "
                         f"{[g.name for g in groups]} (one id space, docs/record-format.md 'Expert groups'): "
                         "read it with expert_group= one of them, for the router of that group")
    group = group_named(record, expert_group) if expert_group is not None else None
    rows = layer_rows(record, layers)
    available = routed_length(record)
    count = available if length is None else int(length)
    if count < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    top_k = record.top_k
    placeholder = placeholder_ids(top_k, record.num_experts if group is None else group.count)
    out = np.empty((len(rows), count, top_k), dtype=np.int64)
    out[...] = placeholder
    valid = np.zeros((len(rows), count), dtype=bool)
    take = min(count, available)
    if rows and take:
        source = record.ids[rows, :take] if rows != list(range(record.num_layers)) \
            else record.ids[:, :take]
        routed = (source != record.fill_value).all(axis=2)
        ids = source.astype(np.int64)
        if group is not None:
            routed &= group.holds(ids)
            ids -= group.first
        ids[~routed] = placeholder
        out[:, :take] = ids
        valid[:, :take] = routed
    return out, valid


def check_compatible(records: Sequence[RoutingRecord | None]) -> tuple[int, int] | None:
    """``(top_k, num_experts)`` shared by all records (None entries skipped), or None
    when there is no record; ValueError naming the first that differs."""
    first = next((r for r in records if r is not None), None)
    if first is None:
        return None
    for record in records:
        if record is None:
            continue
        if record.top_k != first.top_k or record.num_experts != first.num_experts:
            raise ValueError(
                f"records disagree: {record.rollout_id!r} has top_k {record.top_k}, "
                f"{record.num_experts} experts; {first.rollout_id!r} has top_k {first.top_k}, "
                f"{first.num_experts} experts")
    return first.top_k, first.num_experts


def lazy_torch() -> Any:
    """``torch``, imported on first use (no adapter needs it for numpy output)."""
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - exercised only without torch
        raise ImportError("torch tensors need torch: pip install 'fd-routing-replay[torch]'") \
            from exc
    return torch


def host_array(value: Any, dtype: Any = None) -> np.ndarray:
    """``value`` as a host NumPy array: a torch tensor detached and copied to the CPU,
    anything else through ``np.asarray``."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        value = value.detach().cpu().numpy()
    return np.asarray(value, dtype=dtype)
