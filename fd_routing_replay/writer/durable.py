"""The writer's memory of each rollout's latest stored turn, for prefix omission.

:meth:`RoutingWriter.durable_prefix <fd_routing_replay.writer.client.RoutingWriter.durable_prefix>`
offers the engine turn ``t − 1``'s stored record as the prefix of turn ``t``; the engine
then hands over only the new rows, and the writer's worker reads the prefix back.  An
offer the store no longer honours costs the turn its record (dead-lettered until someone
replays it), so an entry must never outlive the record it names.  This writer's own
operations are what can remove one, and :class:`DurableTurns` follows them:

* remembered when the store acknowledges a fused rr-v1 put with a tokens hash;
* forgotten when the store acknowledges an operation that removed it, submitted after the
  put it came from: a ``delete`` naming it, a ``delete_prefix`` whose prefix selects it,
  a retirement (``only_last_turn`` or :meth:`submit_retire`) of the next turn (deletes
  turn ``t − 1``) or of its own turn when a later turn was already stored (superseded).
  A delete that was dead-lettered is forgotten all the same: not offering is always safe.
* **not offered while such an operation is pending** (submitted, not acknowledged): the
  engine's tail would reach the worker after the delete and be dead-lettered.  Pending
  means a delete or prefix delete that selects it, a retirement of its turn or of the
  next, or an unfinished put of its own rollout id (its ``only_last_turn`` retirement may
  still find a later turn and delete it; a partial record's put retires nothing and does
  not count).  The engine hands such a turn over whole.

Deletes made by someone else (another writer on the same store, ``fd-rr rm``, retention)
are not seen here; the worker's check of the prefix it reads back turns those into dead
letters with the reason, never into a wrong record.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from fd_routing_replay.codec import RecordFormat
from fd_routing_replay.errors import InvalidRolloutId
from fd_routing_replay.keys import RolloutId, parse_rollout_id, prefix_matches, previous_turn
from fd_routing_replay.writer.operation import Operation, OperationKind
from fd_routing_replay.writer.record import TurnPrefix

__all__ = ["DURABLE_TURNS", "DurableTurn", "DurableTurns"]

DURABLE_TURNS = 65536
"""Rollouts whose latest stored turn the writer remembers for prefix omission."""


@dataclass(frozen=True)
class DurableTurn:
    """One stored turn: its rollout id, token count, tokens hash and the put's sequence."""

    rollout_id: str
    turn: int
    num_tokens: int
    tokens_hash: int
    seq: int


def _slot(rollout: RolloutId) -> tuple[str, int]:
    return rollout.base, rollout.segment


def _previous_id(rollout_id: str) -> str | None:
    previous = previous_turn(rollout_id)
    return None if previous is None else previous.text


class DurableTurns:
    """(base, segment) → the latest turn this writer stored; LRU-bounded, not thread-safe
    (the ledger's caller holds the writer's lock)."""

    def __init__(self, limit: int = DURABLE_TURNS) -> None:
        self.limit = limit
        self._turns: OrderedDict[tuple[str, int], DurableTurn] = OrderedDict()
        self._retiring: set[int] = set()  # puts stored whose retirement is not done yet

    def __len__(self) -> int:
        return len(self._turns)

    def get(self, rollout_id: str) -> DurableTurn | None:
        """The entry of ``rollout_id``'s base and segment, whatever its turn."""
        return self._turns.get(_slot(parse_rollout_id(rollout_id)))

    # -- acknowledgements -------------------------------------------------------------------
    def stored(self, op: Operation, *, retiring: bool = False) -> None:
        """The store acknowledged put ``op``; ``retiring``: its ``only_last_turn``
        retirement follows (its "done" comes after that)."""
        if op.kind != OperationKind.PUT:
            return
        if retiring:
            self._retiring.add(op.seq)
        tokens_hash = op.provenance.get("th")
        if op.fmt != RecordFormat.RR_V1 or tokens_hash is None or op.key != op.rollout_id:
            return
        rollout = parse_rollout_id(op.rollout_id)
        slot = _slot(rollout)
        known = self._turns.get(slot)
        if known is not None and known.turn > rollout.turn:
            return                                   # a later turn is already stored
        tokens = int(op.shape[1]) + (op.prefix_tokens if op.prefix_key else 0)
        self._turns[slot] = DurableTurn(op.rollout_id, rollout.turn, tokens, int(tokens_hash),
                                        op.seq)
        self._turns.move_to_end(slot)
        while len(self._turns) > self.limit:
            self._turns.popitem(last=False)

    def finished(self, op: Operation) -> None:
        """``op`` is done (applied or dead-lettered): forget what it removed."""
        if op.kind == OperationKind.DELETE:
            for key in op.targets:
                self._forget(key, op.seq)
        elif op.kind == OperationKind.DELETE_PREFIX:
            stale = [turn.rollout_id for turn in self._turns.values()
                     if turn.seq < op.seq and any(prefix_matches(turn.rollout_id, prefix)
                                                  for prefix in op.targets)]
            for rollout_id in stale:
                self._forget(rollout_id, op.seq)
        elif op.kind == OperationKind.RETIRE or (op.kind == OperationKind.PUT
                                                 and op.seq in self._retiring):
            self._retiring.discard(op.seq)
            previous = _previous_id(op.rollout_id)
            if previous is not None:
                self._forget(previous, op.seq)

    def superseded(self, op: Operation) -> None:
        """The retirement of ``op``'s turn deleted that turn again (a later one is stored)."""
        self._forget(op.rollout_id, op.seq + 1)

    def _forget(self, rollout_id: str, before_seq: int) -> None:
        """Drop the entry naming ``rollout_id`` if its put came before ``before_seq``."""
        try:
            slot = _slot(parse_rollout_id(rollout_id))
        except InvalidRolloutId:
            return                                   # a per-layer key: never an entry
        known = self._turns.get(slot)
        if known is not None and known.rollout_id == rollout_id and known.seq < before_seq:
            del self._turns[slot]

    # -- the offer ----------------------------------------------------------------------------
    def prefix(self, rollout_id: str, pending: Iterable[Operation]) -> TurnPrefix | None:
        """The :class:`TurnPrefix` ``rollout_id`` may continue: its previous turn, stored,
        with no ``pending`` (unacknowledged) operation that may remove it or put
        ``rollout_id`` itself; None otherwise (see the module docstring)."""
        rollout = parse_rollout_id(rollout_id)
        known = self._turns.get(_slot(rollout))
        if known is None or known.turn != rollout.turn - 1:
            return None
        stored = known.rollout_id
        for op in pending:
            if op.partial:
                continue                             # a partial record removes nothing
            if op.kind == OperationKind.PUT and op.rollout_id in (rollout_id, stored):
                return None
            if op.kind == OperationKind.REPLAY and op.label in (rollout_id, stored):
                return None                          # a journaled put of an earlier writer
            if op.kind == OperationKind.DELETE and stored in op.targets:
                return None
            if op.kind == OperationKind.DELETE_PREFIX and any(
                    prefix_matches(stored, prefix) for prefix in op.targets):
                return None
            if op.kind == OperationKind.RETIRE and stored in (
                    op.rollout_id, _previous_id(op.rollout_id)):
                return None
        return TurnPrefix(stored, known.num_tokens, known.tokens_hash)
