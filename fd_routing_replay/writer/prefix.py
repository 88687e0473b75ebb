"""Multi-turn prefix omission: hand over only the rows a turn added.

Turn ``t`` of an agentic rollout re-sends the whole conversation, so its record repeats
every row of turn ``t − 1``'s.  When turn ``t − 1``'s record is durable (the writer has
stored it) and its tokens are the first tokens of turn ``t`` (their hashes match), the
engine assembles and hands over only positions ``[n_prev, T)`` with a
:class:`TurnPrefix`; the writer's worker reads turn ``t − 1``'s record back, checks it is
the one the engine meant (rollout id, token count, tokens hash, layer map, geometry),
prepends its rows and stores the complete record — so the store still holds one whole
record per turn, and ``only_last_turn`` retires turn ``t − 1`` only after that.

The prefix rows are the ones turn ``t − 1`` recorded: what a prefix-cache hit replays.
Which stored turn the writer offers, and when it stops offering one (a delete of it,
acknowledged or still pending), is :mod:`fd_routing_replay.writer.durable`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fd_routing_replay.codec import RoutingRecord
from fd_routing_replay.errors import RecordError
from fd_routing_replay.keys import parse_rollout_id

__all__ = ["TurnPrefix", "complete_record"]


@dataclass(frozen=True)
class TurnPrefix:
    """The stored record a tail continues: its rollout id, token count and tokens hash."""

    rollout_id: str
    num_tokens: int
    tokens_hash: int

    def check(self, key: str) -> None:
        """RecordError unless this can prefix the record of ``key`` (the same rollout's
        previous turn, same segment, with a token count and a hash)."""
        current = parse_rollout_id(key)
        previous = parse_rollout_id(self.rollout_id)
        if (previous.base, previous.segment, previous.turn + 1) != \
                (current.base, current.segment, current.turn):
            raise RecordError(f"prefix {self.rollout_id!r} is not the previous turn of {key!r}")
        if isinstance(self.num_tokens, bool) or not isinstance(self.num_tokens, int) \
                or self.num_tokens < 1:
            raise RecordError(f"prefix of {key!r}: num_tokens must be a positive int, got "
                              f"{self.num_tokens!r}")
        if isinstance(self.tokens_hash, bool) or not isinstance(self.tokens_hash, int) \
                or not 0 <= self.tokens_hash < 2**64:
            raise RecordError(f"prefix of {key!r}: tokens_hash must be a uint64, got "
                              f"{self.tokens_hash!r}")


def complete_record(previous: RoutingRecord, tail: RoutingRecord, prefix: TurnPrefix) -> RoutingRecord:
    """``tail`` with ``previous``'s rows prepended, after checking ``previous`` is the
    record ``prefix`` names and shares ``tail``'s geometry; RecordError otherwise."""
    where = f"record of {tail.rollout_id!r} (prefix {prefix.rollout_id!r})"
    problems = []
    if previous.rollout_id != prefix.rollout_id:
        problems.append(f"the stored prefix belongs to {previous.rollout_id!r}")
    if previous.num_tokens != prefix.num_tokens:
        problems.append(f"the stored prefix has {previous.num_tokens} tokens, the engine "
                        f"expected {prefix.num_tokens}")
    if previous.tokens_hash != prefix.tokens_hash:
        problems.append("the stored prefix's tokens hash differs from the engine's (other "
                        "tokens, or a record written without the hash)")
    for name in ("num_experts", "fill_value", "top_k", "dtype", "layer_map", "token_convention"):
        if getattr(previous, name) != getattr(tail, name):
            problems.append(f"{name} {getattr(previous, name)!r} ≠ {getattr(tail, name)!r}")
    if problems:
        raise RecordError(f"{where}: cannot prepend the previous turn: " + "; ".join(problems))
    ids = np.concatenate([previous.ids, tail.ids], axis=1)
    # The assembler's per-record counts describe the whole record, as on the full path.
    metadata = dict(tail.metadata)
    if "num_tokens" in metadata:
        metadata["num_tokens"] = int(ids.shape[1])
    missing = int(previous.metadata.get("missing_tokens", 0) or 0) + \
        int(tail.metadata.get("missing_tokens", 0) or 0)
    metadata.pop("missing_tokens", None)
    if missing:
        metadata["missing_tokens"] = missing
    return RoutingRecord(tail.rollout_id, np.ascontiguousarray(ids), tail.num_experts,
                         tail.fill_value, metadata, created=tail.created,
                         producer=tail.producer, layers=tail.layers,
                         token_convention=tail.token_convention, provenance=tail.provenance)
