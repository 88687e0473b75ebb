"""Prefetch: a running rollout's latest partial record, read while it still runs.

With ``capture.partial_every_tokens: N`` the engine stores a running request's routing so
far every ``N`` forwarded positions under ``{rollout_id}_partial``
(:func:`~fd_routing_replay.keys.partial_key`): an rr-v1 record of positions
``0 .. num_tokens-1`` whose metadata says ``partial: true``.  It is a prefix of the final
record: its ``num_tokens`` rows are the final record's first rows — unless the request was
preempted and recomputed in between, where a recomputed position whose gate was a near-tie
may have routed differently (the final holds the recomputed rows; the trainer replays the
final).  Once the final is durable the writer deletes the partial, so a reader that finds
none either came too early (fewer than ``N`` positions so far) or too late (read the final
with :meth:`~fd_routing_replay.reader.RoutingReader.get`).

A trainer prefetches with :meth:`~fd_routing_replay.reader.RoutingReader.get_partial`
while the rollout runs and, once the final is stored, fetches only the rest with a sliced
read (``get_slice(rollout_id, tokens=slice(partial.num_tokens, None))``).
"""

from __future__ import annotations

from fd_routing_replay.codec.record import RoutingRecord
from fd_routing_replay.codec.rr_v1 import decode_record
from fd_routing_replay.errors import RecordError
from fd_routing_replay.keys import partial_key, split_partial_key
from fd_routing_replay.store import RoutingStore

__all__ = ["partial_rollouts", "read_partial"]


def read_partial(store: RoutingStore, rollout_id: str, *, verify: bool = True) -> RoutingRecord | None:
    """The partial record of ``rollout_id``, or None when none is stored.

    RecordError when the value is not an rr-v1 partial record of that rollout (a corrupt
    record, another rollout's, or one not marked ``partial: true``).
    """
    key = partial_key(rollout_id)
    value = store.get(key)
    if value is None:
        return None
    try:
        record = decode_record(value, verify=verify)
    except RecordError as exc:
        raise RecordError(f"partial record {key!r}: {exc}") from exc
    if record.rollout_id != rollout_id:
        raise RecordError(f"partial record {key!r} belongs to rollout {record.rollout_id!r}; the "
                          "store is inconsistent (run fd-rr fsck)")
    if record.metadata.get("partial") is not True:
        raise RecordError(f"the record under {key!r} is not marked partial (metadata partial: true)")
    return record


def partial_rollouts(store: RoutingStore, prefix: str | None = None) -> list[str]:
    """Sorted rollout ids with a partial record under the boundary-safe ``prefix``:
    running rollouts, and aborted or crashed ones whose final record never came."""
    found = set()
    for key in store.list(prefix):
        rollout = split_partial_key(key)
        if rollout is not None:
            found.add(rollout.text)
    return sorted(found)
