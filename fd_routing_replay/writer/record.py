"""What a put stores and what it retires: the record, built once, and ``only_last_turn``.

**The record built once.**  A put reaches the writer as a small description (an
:class:`~fd_routing_replay.writer.operation.Operation`) and its ids in the ring.  The engine
hands over *rows*: the ``[layers, tokens, top_k]`` routing of a finished (or, for a partial
record, running) request, gathered straight into the ring, with what only the engine knows.
:func:`build_record` turns that into the record(s) to store, in one place for every path -- the
writer's worker, the journal replay, and FastDeploy's ``response`` mode, which needs the encoded
record on the engine's thread: ``num_tokens`` and ``request_id`` in the metadata and
``missing_tokens`` (tokens with the fill value in some layer: routing lost during capture) when
there are any; the stored previous turn's rows prepended (:func:`complete_record`, multi-turn
prefix omission); padding to ``pad_to`` positions (FastDeploy's ``max_model_len`` layout); one
record per layer under ``{rollout_id}_{layer}`` (FastDeploy's non-fused layout).  A record a user
submits whole is stored as given.  :func:`encode_for_store` is the one rule for how a record is
encoded for the store.

**only_last_turn.**  When the put that completes turn t of ``{base}:{t}:{s}`` is durable, the
turn is *retired* (:func:`retire_turn`): the previous turn's keys are deleted -- exactly
``{base}:{t-1}:{s}`` and its per-layer keys, as FastDeploy does, never a prefix: bases may
contain ``:`` and another rollout's base may extend this one -- and if a *later* turn of the same
base and segment is already stored, turn t arrived late and its own keys are deleted again, so
a late put never resurrects it.  The later-turn check lists ``{base}:`` after the put, so it
needs nothing but the store interface and works across writers that share a store (accepted
race window: between a late put and its retirement the stale turn is readable for one store
round trip).  Partial records: a turn's keys include its partial record, and with ``partials``
the retirement also deletes turn t's own partial once its final is durable.

**Durable turns.**  :class:`DurableTurns` is the writer's memory of each rollout's latest stored
turn, from which :meth:`RoutingWriter.durable_prefix
<fd_routing_replay.writer.client.RoutingWriter.durable_prefix>` offers turn ``t − 1`` as the
prefix of turn ``t``.  An offer the store no longer honours costs the turn its record, so an
entry never outlives the record it names: remembered when the store acknowledges a fused rr-v1
put with a tokens hash; forgotten when the store acknowledges an operation that removed it (a
delete naming it, a prefix delete selecting it, a retirement of its turn or the next); not
offered while such an operation, or another put of the rollout, is pending.  Deletes made by
someone else are not seen here; the worker's check of the prefix it reads back turns those
into dead letters with the reason, never into a wrong record.
"""

from __future__ import annotations

import ctypes
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

import numpy as np

from fd_routing_replay.codec import RecordFormat, RoutingRecord, encode_record_parts
from fd_routing_replay.codec.setcodec import SetEncodingError
from fd_routing_replay.core.native import CLibrary, c_library
from fd_routing_replay.errors import InvalidRolloutId, OpsError, RecordError
from fd_routing_replay.keys import (
    MAX_KEY_BYTES,
    PARTIAL_SUFFIX,
    RolloutId,
    layer_key,
    parse_rollout_id,
    prefix_matches,
    previous_turn,
    split_layer_key,
)
from fd_routing_replay.store.base import RoutingStore
from fd_routing_replay.writer.operation import Operation, OperationKind, TurnPrefix

__all__ = ["DURABLE_TURNS", "DurableTurn", "DurableTurns", "Retirement", "build_record",
           "complete_record", "count_unrouted", "encode_for_store", "later_turn", "partial_keys",
           "retire_turn", "turn_keys"]


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
    # The per-record counts describe the whole record, as on the full path.
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


@lru_cache(maxsize=1)
def _declared_count(loaded: CLibrary) -> Any:
    """The C library's ``fdrr_count_unrouted`` (custom_ops/unrouted.cc), declared once."""
    count = loaded.handle["fdrr_count_unrouted"]
    count.restype = ctypes.c_int64
    count.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 4 + [ctypes.c_uint64]
    return count


def count_unrouted(ids: np.ndarray, fill_value: int) -> int:
    """Tokens of a ``[layers, tokens, top_k]`` array with ``fill_value`` (no routing) in
    some layer: routing that was lost during capture.  One pass of the C library at memory
    speed (GIL released); OpsError naming why when the library did not load."""
    if ids.ndim != 3 or ids.shape[1] == 0:
        return 0
    loaded = c_library()
    if loaded.handle is None:
        raise OpsError(f"counting the unrouted tokens of a record needs the compiled C library: {loaded.reason}")
    ids = np.ascontiguousarray(ids)
    count = _declared_count(loaded)(ids.ctypes.data, *ids.shape, ids.itemsize, int(fill_value))
    if count < 0:
        raise RecordError(f"cannot count the unrouted tokens of {ids.dtype} {ids.shape} ids with fill "
                          f"{fill_value} ({count})")
    return int(count)


def build_record(op: Any, raw: RoutingRecord, previous: RoutingRecord | None = None
                 ) -> list[tuple[str, RoutingRecord]]:
    """The ``(key, record)`` pairs a put stores (see the module docstring).

    ``op`` is the put's :class:`~fd_routing_replay.writer.operation.Operation` (what to
    build: ``rows``, ``prefix``, ``pad_to``, ``per_layer``); ``raw`` the record as submitted
    (``op.record(ids)`` around the ring's ids, or read back from the journal), whose ids stay
    the caller's until the put is done; ``previous`` the stored record ``op.prefix``
    continues (read by the caller).  RecordError when the rows cannot make the record (a
    previous turn that is not the one the engine meant).
    """
    record = raw
    if op.rows:
        metadata = dict(raw.metadata, num_tokens=raw.num_tokens)
        missing = count_unrouted(raw.ids, raw.fill_value)
        if missing:
            metadata["missing_tokens"] = missing
        record = replace(raw, metadata=metadata)
    prefix = op.prefix
    if prefix is not None:
        if previous is None:
            raise RecordError(f"record of {op.key!r} was handed over without its first "
                              f"{prefix.num_tokens} positions, but the previous turn "
                              f"{prefix.rollout_id!r} is no longer stored")
        record = complete_record(previous, record, prefix)
    if op.pad_to and record.num_tokens < op.pad_to:
        padded = np.full((record.num_layers, op.pad_to, record.top_k), record.fill_value,
                         record.dtype)
        padded[:, :record.num_tokens] = record.ids
        record = replace(record, ids=padded)
    if not op.per_layer:
        return [(op.key, record)]
    layer_map = record.layer_map
    num_layers = record.num_layers
    return [(layer_key(record.rollout_id, layer),
             replace(record, ids=np.ascontiguousarray(record.ids[layer:layer + 1]),
                     metadata=dict(record.metadata, layer=layer, num_layers=num_layers),
                     layers=(layer_map[layer],)))
            for layer in range(num_layers)]


def encode_for_store(record: RoutingRecord, *, encoding: str, record_format: str,
                     converts: bool,
                     on_fallback: Callable[[SetEncodingError], None]) -> tuple[bytes, memoryview]:
    """The rr-v1 parts (header, payload) of ``record`` in ``encoding``.

    The encoding applies to rr-v1 records for a store that keeps records as they are; a
    store that ``converts`` records (FastDeploy's layouts) decodes them anyway, so it gets
    them plain.  A record the set encoding cannot hold (a row that is not top_k distinct
    expert ids or all fill value, or ranks wider than the codec's ``MAX_RANK_BITS`` = 128,
    e.g. E = 256, k = 32) is encoded plain after ``on_fallback(exc)``.
    """
    if encoding != "plain" and record_format == RecordFormat.RR_V1 and not converts:
        try:
            return encode_record_parts(record, encoding=encoding)
        except SetEncodingError as exc:
            on_fallback(exc)
    return encode_record_parts(record)


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
