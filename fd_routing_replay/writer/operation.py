"""One write operation, described once for every place it travels, and the rules a put must follow.

An :class:`Operation` is what the engine side builds at submit time, what crosses the pipe to
the writer (:meth:`Operation.to_wire`, packed by :func:`pack`), what the engine side's ledger
and spill queue and the worker hold, and what a journal or dead-letter sidecar describes
(:meth:`Operation.sidecar` / :meth:`Operation.from_sidecar`, :func:`check_sidecar`: the one
parser of sidecars, for the writer and ``fd-rr dead-letters``).  Keeping it in one dataclass
means a new field or check cannot reach one path and miss another.  Its last fields are one
process's bookkeeping while the operation is in flight (its ring range, its journal entry, its
attempts); they are ``local``: never on the wire, never in a sidecar.

A put is either a record a user submits whole (:meth:`Operation.for_put`: checked here on the
caller's thread -- the record and key rules, :func:`validate_put`, and the size of the rr-v1
header it will be encoded with, so a record the writer could never encode is refused before
anything is queued), or an engine's rows (:meth:`Operation.for_rows`), from which the writer
builds the record.  A :class:`TurnPrefix` says the rows continue a stored previous turn
(multi-turn prefix omission).  A partial record (a running request's routing so far) goes under
``{rollout_id}_partial`` and only there; it never completes a turn.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from fd_routing_replay.codec import (
    MAX_HEADER_BYTES,
    TOKEN_FORWARDED,
    RoutingRecord,
)
from fd_routing_replay.codec.record import Provenance, RecordFormat
from fd_routing_replay.codec.rr_v1 import encoded_header_bound, quick_header_bound
from fd_routing_replay.errors import InvalidRolloutId, RecordError
from fd_routing_replay.keys import check_key, parse_rollout_id, partial_key, split_partial_key

__all__ = ["JOURNALED_KINDS", "Operation", "OperationKind", "OperationState", "SIDECAR_VERSION",
           "TurnPrefix", "as_list", "check_header_size", "check_partial", "check_sidecar",
           "completes_turn", "encoded_header_bound", "is_partial_put", "key_layer", "pack",
           "turn_layer_count", "unpack", "validate_put"]


if TYPE_CHECKING:
    from fd_routing_replay.writer.journal import JournalEntry
    from fd_routing_replay.writer.record import Retirement
    from fd_routing_replay.writer.ring import Block


@dataclass(frozen=True)
class TurnPrefix:
    """The stored record a tail continues: its rollout id, token count and tokens hash.

    Multi-turn prefix omission: turn ``t`` of an agentic rollout re-sends the whole
    conversation, so its record repeats every row of turn ``t − 1``'s.  When turn ``t −
    1``'s record is durable and its tokens are the first tokens of turn ``t`` (their hashes
    match), the engine hands over only positions ``[n_prev, T)`` with this prefix; the
    writer reads turn ``t − 1``'s record back, checks it and prepends its rows
    (:func:`complete_record`), so the store still holds one whole record per turn.  Which
    stored turn the writer offers is :mod:`fd_routing_replay.writer.record`'s.
    """

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


def pack(message: list[Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(data: bytes) -> list[Any]:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


class OperationKind(enum.StrEnum):
    """What an operation does (the ``op`` of its journal sidecar)."""

    PUT = "put"
    DELETE = "delete"
    """Exact store keys."""
    DELETE_PREFIX = "delete_prefix"
    """Boundary-safe prefixes."""
    RETIRE = "retire"
    """The follow-up of a final put under ``only_last_turn``
    (:mod:`fd_routing_replay.writer.record`)."""
    REPLAY = "replay"
    """Engine side only: a journal entry an earlier writer left, found at start (the
    writer replays it from its sidecar, which names its real kind)."""


JOURNALED_KINDS = (OperationKind.PUT, OperationKind.DELETE, OperationKind.DELETE_PREFIX,
                   OperationKind.RETIRE)
"""The kinds a journal or dead-letter sidecar may name."""


class OperationState(enum.StrEnum):
    """Where an unfinished operation is, as the engine side's ledger sees it."""

    SENT = "sent"
    """Its message went to the writer; a put's ids sit in a ring range."""
    SPILLING = "spilling"
    """The engine side is writing it to the journal."""
    JOURNAL = "journal"
    """In the journal (its ring range is free); the writer replays it from disk."""


SIDECAR_VERSION = 1


def check_header_size(key: str, record: RoutingRecord, metadata_bytes: int) -> None:
    """RecordError naming the key, rollout id and sizes when ``record``'s rr-v1 header
    would exceed :data:`~fd_routing_replay.codec.MAX_HEADER_BYTES`."""
    if quick_header_bound(record, metadata_bytes) <= MAX_HEADER_BYTES:
        return
    where = f"cannot queue {key!r} (rollout {record.rollout_id!r})"
    try:
        bound = encoded_header_bound(record)
    except RecordError as exc:
        raise RecordError(f"{where}: {exc}") from exc
    if bound > MAX_HEADER_BYTES:
        raise RecordError(
            f"{where}: its rr-v1 header would be {bound} bytes, more than the limit of "
            f"{MAX_HEADER_BYTES} (metadata packs to {metadata_bytes} bytes); keep metadata "
            f"small")


def _local(default: Any) -> Any:
    """A field of one process's bookkeeping: not sent, not journaled, not compared."""
    return field(default=default, repr=False, compare=False, metadata={"local": True})


@dataclass(eq=False)
class Operation:
    """A put, delete, prefix delete or turn retirement, with everything needed to apply it.

    For a put, the ids are not part of it: they sit in the ring at ``offset`` (``nbytes``
    long) or, on the engine-side spill path, in ``ids`` (a copy owned by the operation).
    ``layer_count`` is the number of per-layer keys of the rollout (the record's layers):
    the retirement of a turn deletes ``{rollout_id}`` and ``{rollout_id}_{0..n-1}``.
    """

    kind: OperationKind
    seq: int = 0
    sub: int = 0
    key: str = ""
    rollout_id: str = ""
    targets: list[str] = field(default_factory=list)  # keys or prefixes (deletes)
    final: bool = False
    fmt: str = RecordFormat.RR_V1.value
    layer_count: int = 0
    # -- put: what the record around the ids is --
    dtype: str = ""
    shape: list[int] = field(default_factory=list)
    num_experts: int = 0
    fill_value: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
    layers: list[int] | None = None
    token_convention: str = TOKEN_FORWARDED
    created: float | None = None
    producer: dict[str, Any] | None = None
    provenance: dict[str, Any] = field(default_factory=dict)  # its rr-v1 header entries
    # -- put of a tail (multi-turn prefix omission): the stored record it continues --
    prefix_key: str = ""
    prefix_tokens: int = 0
    prefix_hash: int = 0
    # -- put of an engine's rows: the writer builds the record (writer/record.py) --
    rows: bool = False
    pad_to: int = 0  # pad the tokens to this many positions (FastDeploy's max_model_len layout)
    per_layer: bool = False  # one record per layer under {rollout_id}_{layer}
    # -- put: where the ids are --
    offset: int = -1
    nbytes: int = 0
    # -- in flight, engine side (the ledger and the spill queue) --
    ids: np.ndarray | None = _local(None)  # spill path: the put's own copy of the ids
    block: Block | None = _local(None)  # the ring range of the ids, until done or journaled
    state: OperationState = _local(OperationState.SENT)
    # -- in flight, writer side (the worker) --
    view: RoutingRecord | None = _local(None)  # a ring-backed put's record (ids on the ring)
    entry: JournalEntry | None = _local(None)  # set once it is in the journal
    parent_entry: JournalEntry | None = _local(None)  # a follow-up removes its put's entry too
    attempts: int = _local(0)
    encoded: tuple[bytes, memoryview] | None = _local(None)  # encoded once for all attempts
    done: bool = _local(False)
    retired: Retirement | None = _local(None)  # what a ``retire`` did

    def __post_init__(self) -> None:
        self.kind = OperationKind(self.kind)  # ValueError for a kind nobody knows

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def for_put(cls, key: str, record: RoutingRecord, *, final: bool | None,
                fmt: str, prefix: TurnPrefix | None = None) -> Operation:
        """Validate a put and describe it; RecordError / InvalidRolloutId when refused.

        Checks the record, the key and the rr-v1 header size (:func:`check_header_size`):
        every record the writer may have to encode (for the store, the journal or the dead
        letters) is checked here, before it is queued.  ``created`` is set now when unset,
        so the record says when it was submitted, not when the writer encoded it.
        """
        rollout_id, final, metadata_bytes = validate_put(key, record, final)
        check_header_size(key, record, metadata_bytes)
        if fmt != RecordFormat.RR_V1 and split_partial_key(key) is not None:
            raise RecordError(f"cannot queue partial record {key!r}: partial records are rr-v1 "
                              f"(their header marks them partial), this writer writes {fmt!r}")
        if prefix is not None:
            if key != rollout_id or fmt != RecordFormat.RR_V1:
                raise RecordError(f"cannot queue {key!r} with a prefix: prefix omission needs "
                                  f"fused rr-v1 records (key = rollout id), got format {fmt!r}")
            prefix.check(key)
        op = cls(OperationKind.PUT, key=key, rollout_id=rollout_id, final=final, fmt=fmt,
                 layer_count=turn_layer_count(key, record),
                 **({} if prefix is None else {"prefix_key": prefix.rollout_id,
                                               "prefix_tokens": prefix.num_tokens,
                                               "prefix_hash": prefix.tokens_hash}))
        return op.around(record)

    def around(self, record: RoutingRecord) -> Operation:
        """This put with ``record``'s description (ids shape and dtype, geometry, metadata,
        provenance): a submitted record, or the ``.rr`` file a journal or dead-letter
        sidecar goes with (for an engine's rows, the rows as the ring held them)."""
        ids = record.ids
        self.dtype, self.shape, self.nbytes = ids.dtype.str, [int(d) for d in ids.shape], ids.nbytes
        self.num_experts, self.fill_value = record.num_experts, int(record.fill_value)
        self.metadata = dict(record.metadata)
        self.layers = None if record.layers is None else list(record.layer_map)
        self.token_convention, self.producer = record.token_convention, record.producer
        self.created = time.time() if record.created is None else record.created
        self.provenance = record.provenance.to_header()
        return self

    @classmethod
    def for_rows(cls, rollout_id: str, *, shape: tuple[int, int, int], dtype: np.dtype,
                 num_experts: int, fill_value: int, layers: tuple[int, ...], fmt: str,
                 metadata: dict[str, Any], provenance: dict[str, Any], partial: bool = False,
                 per_layer: bool = False, pad_to: int = 0,
                 prefix: TurnPrefix | None = None) -> Operation:
        """The put of an engine's rows ``[layers, tokens, top_k]`` of ``rollout_id`` (a
        rollout id the engine parsed at registration), from which the writer builds the
        record (:func:`~fd_routing_replay.writer.record.build_record`).

        ``partial``: the routing so far of a running request, stored under
        ``{rollout_id}_partial`` (fused rr-v1, never final); ``per_layer``: FastDeploy's
        non-fused layout; ``pad_to``: FastDeploy's ``max_model_len`` padding; ``prefix``:
        the rows continue that stored previous turn.  ``provenance``: its rr-v1 header
        entries.  Checks only what the engine side cannot get wrong by construction is
        left out: the geometry is the capture's own.
        """
        num_layers, num_tokens, top_k = (int(d) for d in shape)
        if len(layers) != num_layers:
            raise RecordError(f"rows of {rollout_id!r}: a layer map of {len(layers)} layers for "
                              f"{num_layers} rows")
        if (partial or prefix is not None) and (per_layer or pad_to or fmt != RecordFormat.RR_V1):
            raise RecordError(f"rows of {rollout_id!r}: partial records and prefix omission "
                              f"need fused, unpadded rr-v1 records")
        if prefix is not None:
            prefix.check(rollout_id)
        if partial:
            metadata = dict(metadata, partial=True)
        dtype = np.dtype(dtype)
        return cls(OperationKind.PUT, key=partial_key(rollout_id) if partial else rollout_id,
                   rollout_id=rollout_id, final=not partial, fmt=str(fmt),
                   layer_count=0 if partial else num_layers, dtype=dtype.str,
                   shape=[num_layers, num_tokens, top_k], num_experts=int(num_experts),
                   fill_value=int(fill_value), metadata=metadata, layers=list(layers),
                   created=time.time(), provenance=provenance,
                   nbytes=num_layers * num_tokens * top_k * dtype.itemsize, rows=True,
                   pad_to=int(pad_to), per_layer=bool(per_layer),
                   **({} if prefix is None else {"prefix_key": prefix.rollout_id,
                                                 "prefix_tokens": prefix.num_tokens,
                                                 "prefix_hash": prefix.tokens_hash}))

    @property
    def prefix(self) -> TurnPrefix | None:
        """The stored record this put's ids continue (prefix omission), or None."""
        if not self.prefix_key:
            return None
        return TurnPrefix(self.prefix_key, self.prefix_tokens, self.prefix_hash)

    @classmethod
    def for_delete(cls, kind: str, targets: list[str]) -> Operation:
        """A user delete (``delete``: exact keys) or prefix delete (``delete_prefix``)."""
        if kind not in (OperationKind.DELETE, OperationKind.DELETE_PREFIX):
            raise ValueError(f"not a delete kind: {kind!r}")
        return cls(kind, targets=list(targets))

    def retirement(self) -> Operation:
        """The ``only_last_turn`` follow-up of this final put (same seq, ``sub`` 1)."""
        return Operation(OperationKind.RETIRE, seq=self.seq, sub=1, rollout_id=self.rollout_id,
                         layer_count=self.layer_count)

    # -- the record -----------------------------------------------------------------------
    def record(self, ids: np.ndarray | None = None) -> RoutingRecord:
        """The put's record around ``ids`` (default: the operation's own copy)."""
        ids = self.ids if ids is None else ids
        if ids is None:
            raise RecordError(f"put of {self.key!r} has no ids (neither in the ring nor copied)")
        return RoutingRecord(self.rollout_id, ids, self.num_experts, self.fill_value,
                             dict(self.metadata), created=self.created, producer=self.producer,
                             layers=self.layers, token_convention=self.token_convention,
                             provenance=Provenance.from_header(self.provenance, int(ids.shape[1]),
                                                               self.layers or range(ids.shape[0])))

    def ring_view(self, ring: np.ndarray) -> np.ndarray:
        """The put's ids inside ``ring`` (a uint8 array), without a copy."""
        return ring[self.offset:self.offset + self.nbytes].view(np.dtype(self.dtype)).reshape(
            self.shape)

    @property
    def partial(self) -> bool:
        """A put of a partial record (``{rollout_id}_partial``): it retires nothing."""
        return self.kind == OperationKind.PUT and split_partial_key(self.key) is not None

    @property
    def label(self) -> str:
        """What to name in a log line: the key, the first targets, or the rollout id."""
        return self.key or ",".join(self.targets[:3]) or self.rollout_id

    # -- the pipe -------------------------------------------------------------------------
    def to_wire(self) -> list[Any]:
        """The operation as a msgpack-able list (field order; ``ids`` stays behind)."""
        return [getattr(self, f.name) for f in fields(self) if not f.metadata.get("local")]

    @classmethod
    def from_wire(cls, values: list[Any]) -> Operation:
        names = [f.name for f in fields(cls) if not f.metadata.get("local")]
        if len(values) != len(names):
            raise ValueError(f"operation message has {len(values)} fields, expected "
                             f"{len(names)}: the engine and the writer run different versions")
        return cls(**dict(zip(names, values, strict=True)))

    # -- journal and dead-letter sidecars ----------------------------------------------------
    def sidecar(self, reason: str) -> dict[str, Any]:
        """The JSON sidecar of this operation (the record itself goes in ``NAME.rr``)."""
        out: dict[str, Any] = {"v": SIDECAR_VERSION, "op": self.kind.value, "seq": self.seq,
                               "sub": self.sub, "spilled_at": time.time(), "reason": reason}
        if self.kind == OperationKind.PUT:
            out.update(key=self.key, rollout_id=self.rollout_id, final=self.final,
                       format=self.fmt, layer_count=self.layer_count)
            if self.prefix_key:       # the .rr holds only the tail: say what it continues
                out["prefix"] = [self.prefix_key, self.prefix_tokens, self.prefix_hash]
            if self.rows:             # the .rr holds the engine's rows: the record is built
                out.update(rows=True, pad_to=self.pad_to, per_layer=self.per_layer)
        elif self.kind == OperationKind.RETIRE:
            out.update(rollout_id=self.rollout_id, layer_count=self.layer_count)
        else:
            out["keys" if self.kind == OperationKind.DELETE else "prefixes"] = list(self.targets)
        return out

    @classmethod
    def from_sidecar(cls, seq: int, sub: int, sidecar: dict[str, Any]) -> Operation:
        """The operation a (checked) sidecar describes."""
        kind = OperationKind(sidecar["op"])
        layer_count = sidecar.get("layer_count", 0)
        layer_count = layer_count if isinstance(layer_count, int) and layer_count >= 0 else 0
        if kind == OperationKind.PUT:
            prefix = sidecar.get("prefix") or ["", 0, 0]
            pad_to = sidecar.get("pad_to", 0)
            return cls(kind, seq, sub, key=sidecar["key"], rollout_id=sidecar["rollout_id"],
                       final=bool(sidecar.get("final", False)),
                       fmt=str(sidecar.get("format", RecordFormat.RR_V1.value)), layer_count=layer_count,
                       prefix_key=prefix[0], prefix_tokens=prefix[1], prefix_hash=prefix[2],
                       rows=sidecar.get("rows") is True, per_layer=sidecar.get("per_layer") is True,
                       pad_to=pad_to if isinstance(pad_to, int) and not isinstance(pad_to, bool)
                       and pad_to > 0 else 0)
        if kind == OperationKind.RETIRE:
            return cls(kind, seq, sub, rollout_id=sidecar["rollout_id"], layer_count=layer_count)
        targets = list(sidecar["keys" if kind == OperationKind.DELETE else "prefixes"])
        if kind == OperationKind.DELETE_PREFIX and sub > 0:
            # Written by a version that deleted the previous turn by prefix, which also hit
            # other rollouts whose base extends this one: retire exactly that key instead.
            kind = OperationKind.DELETE
        return cls(kind, seq, sub, targets=targets)


def check_sidecar(op: Any, where: str) -> dict[str, Any]:
    """Validate a sidecar's shape; RecordError naming the problem."""
    if not isinstance(op, dict):
        raise RecordError(f"{where}: sidecar must be a JSON object, got {type(op).__name__}")
    kind = op.get("op")
    if kind not in JOURNALED_KINDS:
        raise RecordError(f"{where}: sidecar field 'op' must be one of "
                          f"{tuple(k.value for k in JOURNALED_KINDS)}, got {kind!r}")
    if kind in (OperationKind.PUT, OperationKind.RETIRE):
        names = ("key", "rollout_id") if kind == OperationKind.PUT else ("rollout_id",)
        for name in names:
            if not isinstance(op.get(name), str):
                raise RecordError(f"{where}: {kind} sidecar needs a str {name!r}, got "
                                  f"{op.get(name)!r}")
        prefix = op.get("prefix")
        if prefix is not None and not (
                isinstance(prefix, list) and len(prefix) == 3 and isinstance(prefix[0], str)
                and all(isinstance(v, int) and not isinstance(v, bool) for v in prefix[1:])):
            raise RecordError(f"{where}: sidecar field 'prefix' must be [rollout_id, "
                              f"num_tokens, tokens_hash], got {prefix!r}")
    else:
        name = "keys" if kind == OperationKind.DELETE else "prefixes"
        values = op.get(name)
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise RecordError(f"{where}: {kind} sidecar needs a list of str {name!r}")
    return op


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
    rule ``only_last_turn`` retires turns by (every writer mode alike): a fused key, or the per-layer key of the last layer
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
