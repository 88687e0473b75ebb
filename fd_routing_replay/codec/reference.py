"""A reference to a stored record (``rr-ref``): what a response carries instead of the record.

In FastDeploy 2.6's ``response`` mode with ``response.routes: reference`` the engine writes
the record to the configured store and the response carries this small JSON object
instead of the record itself (as vLLM's Mooncake work returns object keys).  It names the
record (store key and namespace) and pins its content: the checksum and length of the
record's payload, which are the rr-v1 header's ``cs`` and ``pl`` of the plain-encoded
record, plus its shape and dtype.  A reader compares them with the stored record's header
before it decodes (and the decode checks the payload against ``cs``), so a record that
is missing, replaced or damaged is refused instead of replayed
(:func:`fd_routing_replay.reader.references.resolve_reference`).

``docs/record-format.md`` ("References") documents the fields.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fd_routing_replay.codec.header import CHECKSUM_ALGORITHM, RecordHeader
from fd_routing_replay.codec.record import DTYPES
from fd_routing_replay.errors import InvalidRolloutId, RecordError
from fd_routing_replay.keys import check_key, check_namespace

__all__ = ["REFERENCE_FORMAT", "REFERENCE_VERSION", "RecordReference", "looks_like_reference",
           "parse_reference", "reference_for_header"]

#: The ``format`` field of every reference.
REFERENCE_FORMAT = "rr-ref"
#: The reference version this package writes and reads.
REFERENCE_VERSION = 1
#: Longest reference text accepted (a real one is about 300 bytes).
MAX_REFERENCE_BYTES = 4096


@dataclass(frozen=True)
class RecordReference:
    """Where a record is stored and what it must hold (see the module docstring).

    ``key`` is the store key (the rollout id of a fused record), ``namespace`` the store
    namespace it is under; ``checksum`` (XXH3-64) and ``size`` (bytes) are those of the
    record's payload in the plain encoding, ``shape`` is ``[L, T, K]``; ``store`` says
    which store the engine wrote to, without secrets (for messages only: a reader reads
    the store it was opened on).
    """

    key: str
    namespace: str
    checksum: int
    size: int
    shape: tuple[int, int, int]
    dtype: str
    store: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The JSON-able form (``checksum`` as 16 hex digits: JSON numbers lose bits above 2^53)."""
        return {"format": REFERENCE_FORMAT, "version": REFERENCE_VERSION, "key": self.key,
                "namespace": self.namespace, "store": self.store,
                "checksum_algorithm": CHECKSUM_ALGORITHM, "checksum": f"{self.checksum:016x}",
                "size": self.size, "shape": list(self.shape), "dtype": self.dtype}

    def to_json(self) -> str:
        """Compact JSON text of :meth:`to_dict`."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    def mismatch(self, header: RecordHeader) -> str | None:
        """What in a stored record's header differs from this reference, or None."""
        problems = []
        if header.rollout_id != self.key:
            problems.append(f"rollout id {header.rollout_id!r} (expected {self.key!r})")
        if header.encoding != "plain":
            problems.append(f"encoding {header.encoding!r} (expected 'plain')")
        if header.checksum != self.checksum:
            problems.append(f"checksum {header.checksum:016x} (expected {self.checksum:016x})")
        if header.payload_length != self.size:
            problems.append(f"size {header.payload_length} bytes (expected {self.size})")
        if tuple(header.shape) != self.shape:
            problems.append(f"shape {list(header.shape)} (expected {list(self.shape)})")
        if header.dtype != self.dtype:
            problems.append(f"dtype {header.dtype} (expected {self.dtype})")
        return ", ".join(problems) or None


def reference_for_header(header: RecordHeader, *, namespace: str, store: str = "") -> RecordReference:
    """The reference to a plain-encoded record with this header, stored under its rollout
    id in ``namespace``."""
    if header.encoding != "plain":
        raise RecordError(f"record {header.rollout_id!r}: a reference pins a plain-encoded payload, "
                          f"this one is {header.encoding!r}")
    return RecordReference(key=header.rollout_id, namespace=namespace, checksum=header.checksum,
                           size=header.payload_length, shape=tuple(header.shape), dtype=header.dtype,
                           store=store)


def looks_like_reference(buffer: bytes | bytearray | memoryview) -> bool:
    """True when ``buffer`` starts like a reference's JSON text (an rr-v1 record never does)."""
    return bytes(memoryview(buffer)[:1]) == b"{"


def _field(data: Mapping[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    if name not in data:
        raise RecordError(f"routing reference lacks field {name!r}")
    value = data[name]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise RecordError(f"routing reference field {name!r}: unexpected value {value!r}")
    return value


def _checksum(data: Mapping[str, Any]) -> int:
    algorithm = data.get("checksum_algorithm", CHECKSUM_ALGORITHM)
    if algorithm != CHECKSUM_ALGORITHM:
        raise RecordError(f"routing reference: unsupported checksum algorithm {algorithm!r} "
                          f"(this reader knows {CHECKSUM_ALGORITHM!r})")
    text = _field(data, "checksum", str)
    if len(text) != 16 or any(c not in "0123456789abcdef" for c in text):
        raise RecordError(f"routing reference field 'checksum': expected 16 lowercase hex digits, "
                          f"got {text!r}")
    return int(text, 16)


def _shape(data: Mapping[str, Any]) -> tuple[int, int, int]:
    shape = _field(data, "shape", list)
    if len(shape) != 3 or any(isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < 2**32
                              for d in shape):
        raise RecordError(f"routing reference field 'shape': expected [layers, tokens, top_k], got {shape!r}")
    return int(shape[0]), int(shape[1]), int(shape[2])


def _from_mapping(data: Mapping[str, Any]) -> RecordReference:
    if data.get("format") != REFERENCE_FORMAT:
        raise RecordError(f"not a routing reference: format is {data.get('format')!r}, "
                          f"expected {REFERENCE_FORMAT!r}")
    version = data.get("version")
    if version != REFERENCE_VERSION:
        raise RecordError(f"unsupported routing reference version {version!r} (this reader knows "
                          f"version {REFERENCE_VERSION})")
    try:
        key = check_key(_field(data, "key", str))
        namespace = check_namespace(_field(data, "namespace", str))
    except InvalidRolloutId as exc:
        raise RecordError(f"routing reference: {exc}") from exc
    dtype = _field(data, "dtype", str)
    if dtype not in DTYPES:
        raise RecordError(f"routing reference field 'dtype': {dtype!r} is not one of {', '.join(DTYPES)}")
    size = _field(data, "size", int)
    shape = _shape(data)
    expected = shape[0] * shape[1] * shape[2] * DTYPES[dtype].itemsize
    if size != expected:
        raise RecordError(f"routing reference: size {size} does not match shape {list(shape)} of "
                          f"{dtype} ({expected} bytes)")
    store = data.get("store", "")
    return RecordReference(key=key, namespace=namespace, checksum=_checksum(data), size=size,
                           shape=shape, dtype=dtype, store=store if isinstance(store, str) else "")


def parse_reference(value: RecordReference | Mapping[str, Any] | str | bytes) -> RecordReference:
    """A reference from its dict, its JSON text (str or bytes) or itself.

    Strict: RecordError naming the field for anything malformed (unknown fields are
    ignored, as in record headers, so a newer writer's additions do not break readers).
    """
    if isinstance(value, RecordReference):
        return value
    if isinstance(value, (bytes, bytearray, memoryview, str)):
        text = bytes(value) if not isinstance(value, str) else value.encode("utf-8", "replace")
        if len(text) > MAX_REFERENCE_BYTES:
            raise RecordError(f"routing reference is {len(text)} bytes, more than {MAX_REFERENCE_BYTES}")
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise RecordError(f"routing reference is not JSON: {exc}") from None
    if not isinstance(value, Mapping):
        raise RecordError(f"routing reference must be a JSON object, got {type(value).__name__}")
    return _from_mapping(value)
