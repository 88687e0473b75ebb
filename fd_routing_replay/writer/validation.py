"""Checks run on the caller's thread before anything is queued (cheap: no array scan).

A submission that fails here raises ``RecordError`` or ``InvalidRolloutId`` naming the
bad value, and the writer's state is untouched.  A partial record (a running request's
routing so far) goes under ``{rollout_id}_partial`` and only there: its metadata says
``partial: true``, it never completes a turn, and a final key refuses a partial record.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgpack

from fd_routing_replay.codec import RoutingRecord
from fd_routing_replay.errors import InvalidRolloutId, RecordError
from fd_routing_replay.keys import check_key, parse_rollout_id, split_partial_key

__all__ = ["as_list", "check_partial", "completes_turn", "is_partial_put", "key_layer",
           "turn_layer_count", "validate_put"]


def as_list(values: Iterable[str] | str, what: str) -> list[str]:
    """One str or an iterable of str, as a list; TypeError naming ``what`` otherwise."""
    if isinstance(values, str):
        return [values]
    try:
        return list(values)
    except TypeError:
        raise TypeError(f"{what} must be a str or an iterable of str, got "
                        f"{type(values).__name__}") from None


def key_layer(key: str, rollout_id: str) -> int | None:
    """The layer ``key`` stores of record ``rollout_id``: None for the fused key (the
    rollout id itself), ``n`` for the per-layer key ``{rollout_id}_{n}``;
    InvalidRolloutId for any other key."""
    if key == rollout_id:
        return None
    suffix = key[len(rollout_id) + 1:] if key.startswith(rollout_id + "_") else ""
    if not (suffix.isascii() and suffix.isdigit()):
        raise InvalidRolloutId(
            f"store key {key!r} does not belong to record {rollout_id!r}: expected "
            f"{rollout_id!r} (fused) or '{rollout_id}_{{layer}}' (per layer)")
    return int(suffix)


def is_partial_put(key: str, record: RoutingRecord) -> bool:
    """True when ``key`` is the partial key of ``record``'s rollout (``{rollout_id}_partial``)."""
    partial = split_partial_key(key)
    return partial is not None and partial.text == record.rollout_id


def check_partial(key: str, record: RoutingRecord, final: bool | None = None) -> bool:
    """True for a partial record under its partial key, False for anything else but a
    partial record elsewhere or another record under a partial key (RecordError): a
    record marked ``partial: true`` goes under ``{rollout_id}_partial`` and only it does,
    never with ``final=True`` (the rule of both sinks)."""
    rollout_id = record.rollout_id
    marked = record.metadata.get("partial", False) is True
    if is_partial_put(key, record):
        if not marked or final:
            raise RecordError(f"record {rollout_id!r} under partial key {key!r}: "
                              + ("a partial record never completes a turn (final=True)" if marked
                                 else "only a record whose metadata says partial: true goes there"))
        return True
    if marked:
        raise RecordError(f"record {rollout_id!r} is marked partial (metadata partial: true) "
                          f"but is put under {key!r}; its key is '{rollout_id}_partial'")
    return False


def completes_turn(key: str, record: RoutingRecord) -> bool:
    """True when the put of ``record`` under ``key`` completes its rollout's turn, the one
    rule ``only_last_turn`` retires turns by (the background writer and the inline
    ``StoreSink`` alike): a fused key, or the per-layer key of the last layer
    (``record.metadata["num_layers"] - 1``); never a partial record's key.  InvalidRolloutId
    for a key of another record.
    """
    if is_partial_put(key, record):
        return False
    layer = key_layer(key, record.rollout_id)
    if layer is None:
        return True
    layers = record.metadata.get("num_layers")
    return isinstance(layers, int) and layer == layers - 1


def turn_layer_count(key: str, record: RoutingRecord) -> int:
    """How many per-layer keys ``{rollout_id}_{n}`` the retirement of this record's turn
    considers: the record's layers for a fused key; for a per-layer key, at least this
    layer + 1, or ``record.metadata["num_layers"]`` when that says more; 0 for a partial."""
    if is_partial_put(key, record):
        return 0
    layer = key_layer(key, record.rollout_id)
    if layer is None:
        return int(record.ids.shape[0])
    declared = record.metadata.get("num_layers")
    return max(layer + 1, declared if isinstance(declared, int)
               and not isinstance(declared, bool) else 0)


def validate_put(key: str, record: RoutingRecord,
                 final: bool | None) -> tuple[str, bool, int]:
    """Validate a put; return ``(rollout_id, final, bytes of the packed metadata)``.

    The record must pass ``RoutingRecord.validate()`` (dtype, shape, expert count, fill),
    its rollout id must follow ``{base}:{turn}:{segment}``, ``key`` must be that id
    (fused) or ``{rollout_id}_{layer}`` (per layer), and the metadata must pack as
    msgpack.  ``final`` defaults to True for a fused key; for a per-layer key it is True
    when ``record.metadata["num_layers"]`` says this is the last layer.  A partial record
    (``metadata["partial"]`` true) goes under ``{rollout_id}_partial``, never with
    ``final=True``; nothing else goes there.
    """
    if not isinstance(record, RoutingRecord):
        raise RecordError(f"submit_put needs a RoutingRecord, got {type(record).__name__}")
    record.validate()
    rollout_id = record.rollout_id
    parse_rollout_id(rollout_id)
    check_key(key)
    if not check_partial(key, record, final):
        key_layer(key, rollout_id)
    final = completes_turn(key, record) if final is None else final
    try:
        metadata_bytes = len(msgpack.packb(record.metadata, use_bin_type=True))
    except (TypeError, ValueError, OverflowError) as exc:
        raise RecordError(f"record {rollout_id!r}: metadata cannot be packed as msgpack "
                          f"(use str, int, float, bool, None, lists and dicts): {exc}") from exc
    return rollout_id, bool(final), metadata_bytes
