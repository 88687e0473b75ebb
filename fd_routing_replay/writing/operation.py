"""One write operation, described once for every place it travels.

An :class:`Operation` is what the engine side builds at submit time, what crosses the
pipe to the writer (:meth:`Operation.to_wire` / :meth:`Operation.from_wire`), what the
engine-side spill queue and the worker hold, and what a journal or dead-letter sidecar
describes (:meth:`Operation.sidecar` / :meth:`Operation.from_sidecar`).  Keeping it in one
dataclass means a new field or a new check cannot reach one path and miss another.

:meth:`Operation.for_put` is where a put is checked before anything is queued: the record
and key rules (:func:`~fd_routing_replay.writing.validation.validate_put`) and the size of
the rr-v1 header it will be encoded with, so a record the writer could never encode is
refused on the caller's thread instead of failing later in the writer.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, fields, replace
from typing import Any

import msgpack
import numpy as np
import xxhash

from fd_routing_replay.codec import (
    MAX_HEADER_BYTES,
    TOKEN_FORWARDED,
    RoutingRecord,
    encode_record_parts,
    pack_layer_map,  # the codec's own packing: the size must be the encoder's
)
from fd_routing_replay.codec import (
    PREFIX_BYTES as _PREFIX_BYTES,
)
from fd_routing_replay.errors import RecordError
from fd_routing_replay.provenance import Provenance
from fd_routing_replay.writing.prefix import TurnPrefix
from fd_routing_replay.writing.validation import validate_put

__all__ = ["KINDS", "SIDECAR_VERSION", "Operation", "check_header_size", "check_sidecar",
           "encoded_header_bound"]

KINDS = ("put", "delete", "delete_prefix", "retire")
"""``retire`` is the follow-up of a final put under ``only_last_turn`` (writing.turns)."""
SIDECAR_VERSION = 1
_HEADER_LENGTH_AT = slice(6, 10)  # rr-v1: magic (4), version (2), header length (4)
_EMPTY_CHECKSUM = xxhash.xxh3_64_intdigest(b"")
# Generous sizes for _quick_header_bound: the default layer map ({"s", "n"}), the default
# producer (version, host name cut to 64 characters, pid) and every other field with its key.
_LAYER_MAP_BYTES = 32
_PRODUCER_BYTES = 400
_OTHER_FIELDS_BYTES = 320


def _packed_uint_size(value: int) -> int:
    """Bytes msgpack uses for the non-negative int ``value``."""
    if value < 128:
        return 1
    if value < 2**8:
        return 2
    if value < 2**16:
        return 3
    if value < 2**32:
        return 5
    return 9


def encoded_header_bound(record: RoutingRecord) -> int:
    """Size of the msgpack header ``record`` will be encoded with, without reading its ids.

    Encodes a payload-less copy (``[L, 0, K]``) through the codec itself, then accounts for
    what depends on the payload or on the encoding process: the token count, the payload
    length, the checksum (counted at its widest) and, when the record has no ``producer``,
    the encoding process's pid (counted at its widest).  Never below the true size, at most
    12 bytes above it.  RecordError when even the payload-less header is over the limit.
    """
    ids = record.ids
    layers, tokens, top_k = (int(d) for d in ids.shape)
    # The stand-in leaves the layer map out (validating it again would cost more than all
    # the rest); its packed size is accounted for below, with the codec's own packing.
    # Segments are checked against the token count, which the stand-in lacks: counted apart.
    segments = record.provenance.segments
    stand_in = RoutingRecord(record.rollout_id, np.empty((layers, 0, top_k), ids.dtype),
                             record.num_experts, record.fill_value, record.metadata,
                             created=0.0, producer=record.producer,
                             token_convention=record.token_convention,
                             provenance=replace(record.provenance, segments=None))
    head, _ = encode_record_parts(stand_in)
    length = int.from_bytes(head[_HEADER_LENGTH_AT], "little")
    header = msgpack.unpackb(head[_PREFIX_BYTES:_PREFIX_BYTES + length], raw=False)
    layer_map = len(msgpack.packb(pack_layer_map(record.layer_map))) if record.layers \
        is not None else len(msgpack.packb(header["lm"]))
    bound = (length - len(msgpack.packb(header["lm"])) + layer_map
             + _packed_uint_size(tokens) - 1 + _packed_uint_size(ids.nbytes) - 1
             + 9 - _packed_uint_size(_EMPTY_CHECKSUM))
    if record.producer is None:  # filled in by the process that encodes, maybe another pid
        bound += 5 - _packed_uint_size(os.getpid())
    if segments is not None:
        bound += len(msgpack.packb("sg")) + len(msgpack.packb(list(segments)))
    return bound


def _quick_header_bound(record: RoutingRecord, metadata_bytes: int) -> int:
    """A cheap upper bound of the header size (no encoding), generous by a few hundred
    bytes; the exact :func:`encoded_header_bound` runs only when this one is too big."""
    layer_map = _LAYER_MAP_BYTES if record.layers is None else 5 + 3 * int(record.ids.shape[0])
    producer = _PRODUCER_BYTES if record.producer is None else \
        len(msgpack.packb(record.producer, use_bin_type=True))
    provenance = record.provenance.to_header()
    return (metadata_bytes + len(record.rollout_id.encode("utf-8")) + 3 + layer_map + producer
            + _OTHER_FIELDS_BYTES + (len(msgpack.packb(provenance, use_bin_type=True))
                                     if provenance else 0))


def check_header_size(key: str, record: RoutingRecord, metadata_bytes: int) -> None:
    """RecordError naming the key, rollout id and sizes when ``record``'s rr-v1 header
    would exceed :data:`~fd_routing_replay.codec.MAX_HEADER_BYTES`."""
    if _quick_header_bound(record, metadata_bytes) <= MAX_HEADER_BYTES:
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


@dataclass(eq=False)
class Operation:
    """A put, delete, prefix delete or turn retirement, with everything needed to apply it.

    For a put, the ids are not part of it: they sit in the ring at ``offset`` (``nbytes``
    long) or, on the engine-side spill path, in ``ids`` (a copy owned by the operation).
    ``layer_count`` is the number of per-layer keys of the rollout (the record's layers):
    the retirement of a turn deletes ``{rollout_id}`` and ``{rollout_id}_{0..n-1}``.
    """

    kind: str
    seq: int = 0
    sub: int = 0
    key: str = ""
    rollout_id: str = ""
    targets: list[str] = field(default_factory=list)  # keys or prefixes (deletes)
    final: bool = False
    fmt: str = "rr-v1"
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
    # -- put: where the ids are --
    offset: int = -1
    nbytes: int = 0
    ids: np.ndarray | None = field(default=None, repr=False, metadata={"local": True})

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
        if prefix is not None:
            if key != rollout_id or fmt != "rr-v1":
                raise RecordError(f"cannot queue {key!r} with a prefix: prefix omission needs "
                                  f"fused rr-v1 records (key = rollout id), got format {fmt!r}")
            prefix.check(key)
        ids = record.ids
        if key == rollout_id:
            layer_count = int(ids.shape[0])
        else:
            layer = int(key.rpartition("_")[2])
            declared = record.metadata.get("num_layers")
            layer_count = max(layer + 1, declared if isinstance(declared, int)
                              and not isinstance(declared, bool) else 0)
        return cls("put", key=key, rollout_id=rollout_id, final=final, fmt=fmt,
                   layer_count=layer_count, dtype=ids.dtype.str, shape=[int(d) for d in ids.shape],
                   num_experts=record.num_experts, fill_value=int(record.fill_value),
                   metadata=dict(record.metadata),
                   layers=None if record.layers is None else list(record.layer_map),
                   token_convention=record.token_convention,
                   created=time.time() if record.created is None else record.created,
                   producer=record.producer, provenance=record.provenance.to_header(),
                   nbytes=ids.nbytes,
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
        if kind not in ("delete", "delete_prefix"):
            raise ValueError(f"not a delete kind: {kind!r}")
        return cls(kind, targets=list(targets))

    def retirement(self) -> Operation:
        """The ``only_last_turn`` follow-up of this final put (same seq, ``sub`` 1)."""
        return Operation("retire", seq=self.seq, sub=1, rollout_id=self.rollout_id,
                         layer_count=self.layer_count)

    # -- the record -----------------------------------------------------------------------
    def record(self, ids: np.ndarray | None = None) -> RoutingRecord:
        """The put's record around ``ids`` (default: the operation's own copy)."""
        ids = self.ids if ids is None else ids
        if ids is None:
            raise RecordError(f"put of {self.key!r} has no ids (neither in the ring nor copied)")
        return RoutingRecord(self.rollout_id, ids, self.num_experts, self.fill_value,
                             self.metadata, created=self.created, producer=self.producer,
                             layers=self.layers, token_convention=self.token_convention,
                             provenance=Provenance.from_header(self.provenance, int(ids.shape[1]),
                                                               self.layers or range(ids.shape[0])))

    def ring_view(self, ring: np.ndarray) -> np.ndarray:
        """The put's ids inside ``ring`` (a uint8 array), without a copy."""
        return ring[self.offset:self.offset + self.nbytes].view(np.dtype(self.dtype)).reshape(
            self.shape)

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
        out: dict[str, Any] = {"v": SIDECAR_VERSION, "op": self.kind, "seq": self.seq,
                               "sub": self.sub, "spilled_at": time.time(), "reason": reason}
        if self.kind == "put":
            out.update(key=self.key, rollout_id=self.rollout_id, final=self.final,
                       format=self.fmt, layer_count=self.layer_count)
            if self.prefix_key:       # the .rr holds only the tail: say what it continues
                out["prefix"] = [self.prefix_key, self.prefix_tokens, self.prefix_hash]
        elif self.kind == "retire":
            out.update(rollout_id=self.rollout_id, layer_count=self.layer_count)
        else:
            out["keys" if self.kind == "delete" else "prefixes"] = list(self.targets)
        return out

    @classmethod
    def from_sidecar(cls, seq: int, sub: int, sidecar: dict[str, Any]) -> Operation:
        """The operation a (checked) sidecar describes."""
        kind = sidecar["op"]
        layer_count = sidecar.get("layer_count", 0)
        layer_count = layer_count if isinstance(layer_count, int) and layer_count >= 0 else 0
        if kind == "put":
            prefix = sidecar.get("prefix") or ["", 0, 0]
            return cls(kind, seq, sub, key=sidecar["key"], rollout_id=sidecar["rollout_id"],
                       final=bool(sidecar.get("final", False)),
                       fmt=str(sidecar.get("format", "rr-v1")), layer_count=layer_count,
                       prefix_key=prefix[0], prefix_tokens=prefix[1], prefix_hash=prefix[2])
        if kind == "retire":
            return cls(kind, seq, sub, rollout_id=sidecar["rollout_id"], layer_count=layer_count)
        targets = list(sidecar["keys" if kind == "delete" else "prefixes"])
        if kind == "delete_prefix" and sub > 0:
            # Written by a version that deleted the previous turn by prefix, which also hit
            # other rollouts whose base extends this one: retire exactly that key instead.
            kind = "delete"
        return cls(kind, seq, sub, targets=targets)


def check_sidecar(op: Any, where: str) -> dict[str, Any]:
    """Validate a sidecar's shape; RecordError naming the problem."""
    if not isinstance(op, dict):
        raise RecordError(f"{where}: sidecar must be a JSON object, got {type(op).__name__}")
    kind = op.get("op")
    if kind not in KINDS:
        raise RecordError(f"{where}: sidecar field 'op' must be one of {KINDS}, got {kind!r}")
    if kind in ("put", "retire"):
        names = ("key", "rollout_id") if kind == "put" else ("rollout_id",)
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
        name = "keys" if kind == "delete" else "prefixes"
        values = op.get(name)
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise RecordError(f"{where}: {kind} sidecar needs a list of str {name!r}")
    return op
