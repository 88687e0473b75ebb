"""``only_last_turn``: which keys a finished turn retires, decided with the store alone.

When the put that completes turn t of ``{base}:{t}:{s}`` is durable, the turn is
*retired*:

* the previous turn's keys are deleted — exactly ``{base}:{t-1}:{s}`` and its per-layer
  keys ``{base}:{t-1}:{s}_{0..n-1}``, as FastDeploy does, never a prefix: bases may
  contain ``:`` and another rollout's base may extend this one (``job`` and ``job:0:0``);
* if a *later* turn of the same base and segment is already stored, turn t arrived late
  (turns finished out of order, or another writer stored the later one while this one
  was spilled): turn t's own keys are deleted again, so a late put never resurrects it.

The later-turn check lists ``{base}:`` (boundary-safe, one bucket of the prefix index)
after the put, so it needs nothing but the store interface and works across writers that
share a store.  Accepted race window: between a late put and its retirement the stale
turn is readable for one store round trip.  No interleaving of two writers leaves it
behind: if the late writer lists before the other writer's put of t+1, that writer's
retirement of t+1 (after its put) deletes turn t; otherwise the late writer sees t+1.
A later turn counts once complete: its fused key, or all ``n`` per-layer keys.

Partial records (``capture.partial_every_tokens``): a turn's keys include its partial record
``{base}:{t}:{s}_partial``, so retiring turn t-1 deletes its partial too (a turn that was
aborted left only that), and a superseded turn t loses its own.  With ``partials`` the
retirement also deletes turn t's own partial once turn t's final record is durable — the
final supersedes it — whether or not ``only_last_turn`` is on.  Partial keys are never a
later turn (they are not rollout ids).
"""

from __future__ import annotations

from dataclasses import dataclass

from fd_routing_replay.errors import InvalidRolloutId
from fd_routing_replay.keys import (
    MAX_KEY_BYTES,
    PARTIAL_SUFFIX,
    RolloutId,
    parse_rollout_id,
    previous_turn,
    split_layer_key,
)
from fd_routing_replay.store.base import RoutingStore

__all__ = ["Retirement", "later_turn", "partial_keys", "retire_turn", "turn_keys"]


def turn_keys(rollout_id: str, layer_count: int) -> list[str]:
    """Every key one turn may be stored under: fused, and per layer ``_{0..n-1}``."""
    return [rollout_id, *(f"{rollout_id}_{layer}" for layer in range(layer_count))]


def partial_keys(rollout_id: str) -> list[str]:
    """The partial record's key of a turn, ``[{rollout_id}_partial]`` (``[]`` for a rollout id
    too long to have one: :func:`~fd_routing_replay.keys.partial_key`)."""
    key = rollout_id + PARTIAL_SUFFIX
    return [key] if len(key.encode("utf-8")) <= MAX_KEY_BYTES else []


def later_turn(store: RoutingStore, rollout: RolloutId, layer_count: int) -> int | None:
    """The newest complete turn > ``rollout.turn`` of the same base and segment, or None."""
    layers_by_turn: dict[int, set[int]] = {}
    for key in store.list(f"{rollout.base}:"):
        try:
            other, layer = split_layer_key(key)
        except InvalidRolloutId:
            continue
        if other.base != rollout.base or other.segment != rollout.segment or \
                other.turn <= rollout.turn:
            continue
        layers = layers_by_turn.setdefault(other.turn, set())
        layers.add(-1 if layer is None else layer)
    complete = [turn for turn, layers in layers_by_turn.items()
                if -1 in layers or (layer_count and layers >= set(range(layer_count)))]
    return max(complete, default=None)


@dataclass(frozen=True)
class Retirement:
    """What retiring one turn did."""

    previous_deleted: int  # keys of turn t-1 (its partial included) that existed and were deleted
    superseded_by: int | None  # the later turn found, when turn t itself was deleted
    own_deleted: int  # keys of turn t deleted because a later turn was stored
    partial_deleted: int = 0  # turn t's own partial record, superseded by its final (``partials``)


def retire_turn(store: RoutingStore, rollout_id: str, layer_count: int, *,
                only_last_turn: bool = True, partials: bool = False) -> Retirement:
    """Retire turn t of ``rollout_id`` once its put is durable (see the module docstring):
    ``only_last_turn`` deletes turn t-1's keys (and turn t's when a later turn is stored),
    ``partials`` turn t's own partial record.

    Store errors propagate (the writer retries the whole retirement; both deletes and the
    listing are idempotent).  InvalidRolloutId when ``rollout_id`` breaks the grammar.
    """
    rollout = parse_rollout_id(rollout_id)
    own_partial = partial_keys(rollout.text) if partials else []
    if not only_last_turn:
        return Retirement(0, None, 0, store.delete(own_partial) if own_partial else 0)
    previous = previous_turn(rollout)
    later = later_turn(store, rollout, layer_count)
    own_deleted = store.delete(turn_keys(rollout.text, layer_count) + partial_keys(rollout.text)) \
        if later is not None else 0
    previous_deleted = store.delete(turn_keys(previous.text, layer_count)
                                    + partial_keys(previous.text)) if previous is not None else 0
    partial_deleted = store.delete(own_partial) if own_partial and later is None else 0
    return Retirement(previous_deleted, later, own_deleted, partial_deleted)
