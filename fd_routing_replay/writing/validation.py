"""Checks run on the caller's thread before anything is queued (cheap: no array scan).

A submission that fails here raises ``RecordError`` or ``InvalidRolloutId`` naming the
bad value, and the writer's state is untouched.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgpack

from fd_routing_replay.codec import RoutingRecord
from fd_routing_replay.errors import InvalidRolloutId, RecordError
from fd_routing_replay.keys import check_key, parse_rollout_id

__all__ = ["as_list", "validate_put"]


def as_list(values: Iterable[str] | str, what: str) -> list[str]:
    """One str or an iterable of str, as a list; TypeError naming ``what`` otherwise."""
    if isinstance(values, str):
        return [values]
    try:
        return list(values)
    except TypeError:
        raise TypeError(f"{what} must be a str or an iterable of str, got "
                        f"{type(values).__name__}") from None


def validate_put(key: str, record: RoutingRecord,
                 final: bool | None) -> tuple[str, bool, int]:
    """Validate a put; return ``(rollout_id, final, bytes of the packed metadata)``.

    The record must pass ``RoutingRecord.validate()`` (dtype, shape, expert count, fill),
    its rollout id must follow ``{base}:{turn}:{segment}``, ``key`` must be that id
    (fused) or ``{rollout_id}_{layer}`` (per layer), and the metadata must pack as
    msgpack.  ``final`` defaults to True for a fused key; for a per-layer key it is True
    when ``record.metadata["num_layers"]`` says this is the last layer.
    """
    if not isinstance(record, RoutingRecord):
        raise RecordError(f"submit_put needs a RoutingRecord, got {type(record).__name__}")
    record.validate()
    rollout_id = record.rollout_id
    parse_rollout_id(rollout_id)
    check_key(key)
    if key == rollout_id:
        final = True if final is None else final
    else:
        suffix = key[len(rollout_id) + 1:] if key.startswith(rollout_id + "_") else ""
        if not (suffix.isascii() and suffix.isdigit()):
            raise InvalidRolloutId(
                f"store key {key!r} does not belong to record {rollout_id!r}: expected "
                f"{rollout_id!r} (fused) or '{rollout_id}_{{layer}}' (per layer)")
        if final is None:
            layers = record.metadata.get("num_layers")
            final = isinstance(layers, int) and int(suffix) == layers - 1
    try:
        metadata_bytes = len(msgpack.packb(record.metadata, use_bin_type=True))
    except (TypeError, ValueError, OverflowError) as exc:
        raise RecordError(f"record {rollout_id!r}: metadata cannot be packed as msgpack "
                          f"(use str, int, float, bool, None, lists and dicts): {exc}") from exc
    return rollout_id, bool(final), metadata_bytes
