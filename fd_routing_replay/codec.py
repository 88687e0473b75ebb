"""Routing record format ``rr-v1`` and the ``fastdeploy-raw`` compatibility format.

One finished request becomes one self-describing record: a small msgpack header that says
what the payload is (rollout id, dtype, shape, fill value, checksum, ...) followed by the
raw ``[layers, tokens, top_k]`` array.  The payload never goes through msgpack (that would
cost an extra copy) and nothing is pickled.  Decoding is zero-copy: the returned array is
a read-only view on the caller's buffer.

Byte layout (all integers little-endian)::

    offset  size  field
    0       4     magic  b"\\x89R3R"
    4       2     format version, uint16 (1)
    6       4     header length H, uint32 (bytes of msgpack that follow)
    10      H     msgpack map (the header, short keys; see HEADER_FIELDS)
    10+H    pad   zero bytes up to the next multiple of 64 (payload alignment)
    P       N     payload: ids in C order, little-endian, N = L*T*K*itemsize (codec
                  "raw", the plain encoding), or the set encoding (codec "set",
                  fd_routing_replay.setcodec): one bit-packed rank per token-layer

``docs/record-format.md`` documents every field, the checksum and the versioning rules.
"""

from __future__ import annotations

import math
import os
import socket
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import msgpack
import numpy as np
import xxhash

from fd_routing_replay import __version__
from fd_routing_replay.errors import RecordError
from fd_routing_replay.provenance import Provenance
from fd_routing_replay.setcodec import SetEncodingError, decode_sets, encode_sets, payload_nbytes

__all__ = [
    "CHECKSUM_ALGORITHM", "ENCODINGS", "FORMAT_NAME", "FORMAT_VERSION", "HEADER_FIELDS", "MAGIC",
    "MAX_HEADER_BYTES", "MAX_LAYER_INDEX", "PAYLOAD_ALIGNMENT", "TOKEN_CONVENTIONS",
    "TOKEN_FORWARDED", "RoutingRecord", "check_expert_range", "check_layer_map",
    "decode_fastdeploy_raw", "decode_record", "encode_fastdeploy_raw", "encode_record",
    "encode_record_parts", "read_header", "routing_dtype",
]

MAGIC = b"\x89R3R"
"""First four bytes of every rr-v1 record: a non-ASCII, non-UTF-8 lead byte, then "R3R"."""
FORMAT_NAME = "rr-v1"
FORMAT_VERSION = 1
PAYLOAD_ALIGNMENT = 64
"""The payload starts at a multiple of this offset (cache line, SIMD and DMA friendly)."""
MAX_HEADER_BYTES = 64 * 1024
"""Largest msgpack header accepted on encode and decode (bounds work on corrupt input)."""
MAX_DIM = 2**32 - 1
"""Largest value of any of L, T, K."""
CHECKSUM_ALGORITHM = "xxh3_64"
LAYOUT = "LTK"
CODEC = "raw"
ENCODINGS: dict[str, str] = {"plain": CODEC, "set": "set"}
"""Payload encoding (``capture.encoding``) → the header's ``co`` value.  ``set`` keeps each
token-layer's top-k as a set (order not kept; decoded ascending): docs/record-format.md."""
_ENCODING_BY_CODEC = {codec: name for name, codec in ENCODINGS.items()}
MAX_LAYER_INDEX = 2**16 - 1
"""Largest global decoder-layer index a layer map may name."""
TOKEN_FORWARDED = "forwarded"
"""Token convention: row t is the routing of position t, one row per forwarded position
(prompt + generated - 1 rows; the last sampled token is never fed back)."""
TOKEN_CONVENTIONS = (TOKEN_FORWARDED,)

_PREFIX = struct.Struct("<4sHI")
PREFIX_BYTES = _PREFIX.size  # 10

_DTYPES: dict[str, np.dtype] = {
    "uint8": np.dtype("u1"),
    "uint16": np.dtype("<u2"),
    "uint32": np.dtype("<u4"),
}
_DTYPE_BY_STR = {dt.str: name for name, dt in _DTYPES.items()}

HEADER_FIELDS: dict[str, str] = {
    "id": "rollout_id",
    "dt": "dtype",
    "sh": "shape",
    "lo": "layout",
    "ne": "num_experts",
    "k": "top_k",
    "fv": "fill_value",
    "co": "codec",
    "ca": "checksum_algorithm",
    "cs": "checksum",
    "pl": "payload_length",
    "ct": "created",
    "pr": "producer",
    "md": "metadata",
    "lm": "layer_map",
    "tc": "token_convention",
    "nd": "num_decoder_layers",
    "wv": "weights_version",
    "th": "tokens_hash",
    "sg": "segments",
}
"""Short msgpack key → meaning.  ``ct``, ``pr``, ``md``, ``lm``, ``tc`` and the provenance
fields ``nd``, ``wv``, ``th``, ``sg`` (:mod:`fd_routing_replay.provenance`) are optional
on decode (``lm`` defaults to ``range(L)``, ``tc`` to ``"forwarded"``, the others to None)."""
_PROVENANCE_FIELDS = ("nd", "wv", "th", "sg")


def routing_dtype(num_experts: int) -> np.dtype:
    """Smallest allowed dtype holding ``num_experts`` ids plus the fill value."""
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise RecordError(f"num_experts must be a positive int, got {num_experts!r}")
    for dt in _DTYPES.values():
        if num_experts <= np.iinfo(dt).max:
            return dt
    raise RecordError(f"num_experts {num_experts} does not fit uint32 with a fill value")


def _dtype_name(dtype: np.dtype) -> str | None:
    return _DTYPE_BY_STR.get(dtype.str)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _layer_map_problem(layers: Sequence[int], num_layers: int) -> str | None:
    """What is wrong with a layer map of ``num_layers`` rows (plain ints), or None."""
    if len(layers) != num_layers:
        return f"has {len(layers)} entries for {num_layers} layers (one per row of [L, T, K])"
    previous = -1
    for position, layer in enumerate(layers):
        if not _is_int(layer) or not 0 <= layer <= MAX_LAYER_INDEX:
            return f"entry {position} is {layer!r}, not an int in [0, {MAX_LAYER_INDEX}]"
        if layer <= previous:
            return f"must be strictly increasing, but entry {position} ({layer}) follows {previous}"
        previous = layer
    return None


def _as_layer_tuple(layers: object) -> tuple[Any, ...] | None:
    """``layers`` as a tuple (numpy integers become ints), or None if it is no sequence."""
    if not isinstance(layers, (Sequence, np.ndarray)) or isinstance(layers, (str, bytes)):
        return None
    return tuple(int(layer) if isinstance(layer, np.integer) else layer for layer in layers)


def check_layer_map(layers: object, num_layers: int, *, what: str = "layers") -> tuple[int, ...]:
    """``layers`` as a tuple of ints, checked as the layer map of ``num_layers`` rows.

    One int per row, strictly increasing, each in [0, :data:`MAX_LAYER_INDEX`]; numpy
    integers are accepted.  RecordError starting with ``what`` otherwise.
    """
    as_tuple = _as_layer_tuple(layers)
    if as_tuple is None:
        raise RecordError(f"{what} must be a sequence of ints, got {type(layers).__name__}")
    problem = _layer_map_problem(as_tuple, num_layers)
    if problem:
        raise RecordError(f"{what} {problem}")
    return as_tuple


def pack_layer_map(layers: tuple[int, ...]) -> dict[str, int] | list[int]:
    """Compact form: ``{"s": start, "n": count}`` (+ ``"d": step`` when not 1) for an
    evenly spaced map, else the explicit list."""
    if not layers:
        return []
    step = layers[1] - layers[0] if len(layers) > 1 else 1
    if any(b - a != step for a, b in zip(layers, layers[1:], strict=False)):
        return list(layers)
    packed = {"s": layers[0], "n": len(layers)}
    if step != 1:
        packed["d"] = step
    return packed


@dataclass(eq=False)
class RoutingRecord:
    """The routing of one rollout: ``ids[layer, token, k]`` are expert ids.

    Values ``< num_experts`` are expert ids; ``== fill_value`` means "no routing" for that
    slot.  ``fill_value=None`` becomes the dtype's maximum.  ``created`` (unix time) and
    ``producer`` (package version, host, pid) are filled in at encode time when None and
    restored by decode.  ``layers`` is the layer map: for each row of ``ids`` the global
    decoder-layer index it came from (DeepSeek-V3's first MoE layer is decoder layer 3);
    None means ``range(L)``, and a decoded record always has it as a tuple.
    ``token_convention`` says which positions the rows are (:data:`TOKEN_FORWARDED`).
    """

    rollout_id: str
    ids: np.ndarray
    num_experts: int
    fill_value: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    created: float | None = None
    producer: dict[str, Any] | None = None
    layers: Sequence[int] | None = None
    token_convention: str = TOKEN_FORWARDED
    provenance: Provenance = field(default_factory=Provenance)

    def __post_init__(self) -> None:
        if self.fill_value is None and isinstance(self.ids, np.ndarray) and self.ids.dtype.kind == "u":
            self.fill_value = int(np.iinfo(self.ids.dtype).max)

    @property
    def layer_map(self) -> tuple[int, ...]:
        """The global decoder-layer index of each row: ``layers``, or ``range(L)`` when unset."""
        if self.layers is None:
            return tuple(range(self.num_layers))
        layers = _as_layer_tuple(self.layers)
        if layers is None:
            raise RecordError(f"record {self.rollout_id!r}: layers must be a sequence of ints, "
                              f"got {type(self.layers).__name__}")
        return layers

    @property
    def num_layers(self) -> int:
        return int(self.ids.shape[0])

    @property
    def num_decoder_layers(self) -> int | None:
        """The model's total decoder-layer count, when the producer recorded it."""
        return self.provenance.num_decoder_layers

    @property
    def weights_version(self) -> str | None:
        return self.provenance.weights_version

    @property
    def tokens_hash(self) -> int | None:
        return self.provenance.tokens_hash

    @property
    def segments(self) -> tuple[int, ...] | None:
        return self.provenance.segments

    def check_tokens(self, token_ids: Any) -> None:
        """RecordError unless ``token_ids`` (prompt + response) are the tokens these routes
        belong to (their first ``num_tokens`` hash to ``tokens_hash``); a no-op for a
        record written without the hash."""
        self.provenance.check_tokens(token_ids, self.num_tokens)

    @property
    def num_tokens(self) -> int:
        return int(self.ids.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.ids.shape[2])

    @property
    def dtype(self) -> np.dtype:
        return self.ids.dtype

    def validate(self) -> None:
        """Raise RecordError unless the record can be encoded as rr-v1.

        Checks: rollout id is a non-empty str; ``ids`` is a 3-D C-contiguous
        uint8/uint16/uint32 little-endian array with dims ≤ 2**32-1; ``num_experts`` ≥ 1
        and ``num_experts + 1`` values fit the dtype; the fill value fits the dtype and
        is not a valid expert id; metadata is a dict with str keys; ``layers`` has one
        strictly increasing int in [0, 2**16) per layer; the token convention is known.
        Does not scan the ids (see :func:`check_expert_range`).
        """
        rid = self.rollout_id
        if not isinstance(rid, str) or not rid:
            raise RecordError(f"rollout_id must be a non-empty str, got {rid!r}")
        try:
            rid.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise RecordError(f"rollout_id {rid!r} is not valid Unicode") from exc
        ids = self.ids
        if not isinstance(ids, np.ndarray):
            raise RecordError(f"record {rid!r}: ids must be a numpy array, got {type(ids).__name__}")
        name = _dtype_name(ids.dtype)
        if name is None:
            hint = ""
            if ids.dtype.kind == "u" and ids.dtype.byteorder == ">":
                hint = " (big-endian: convert with ids.astype(ids.dtype.newbyteorder('<')))"
            raise RecordError(
                f"record {rid!r}: ids dtype {ids.dtype} ({ids.dtype.str}) is not allowed; "
                f"use uint8, uint16 or uint32 little-endian{hint}"
            )
        if ids.ndim != 3:
            raise RecordError(f"record {rid!r}: ids must be 3-D [layers, tokens, top_k], got shape {ids.shape}")
        if not ids.flags.c_contiguous:
            raise RecordError(f"record {rid!r}: ids must be C-contiguous (use np.ascontiguousarray)")
        if any(dim > MAX_DIM for dim in ids.shape):
            raise RecordError(f"record {rid!r}: shape {ids.shape} has a dimension above {MAX_DIM}")
        max_value = int(np.iinfo(ids.dtype).max)
        ne = self.num_experts
        if not _is_int(ne) or ne < 1:
            raise RecordError(f"record {rid!r}: num_experts must be a positive int, got {ne!r}")
        if ne > max_value:
            raise RecordError(
                f"record {rid!r}: num_experts {ne} plus a fill value do not fit {name} "
                f"(at most {max_value} experts); use {routing_dtype(ne)}"
            )
        fill = self.fill_value
        if not _is_int(fill) or not ne <= fill <= max_value:
            raise RecordError(
                f"record {rid!r}: fill_value {fill!r} must be an int in [num_experts={ne}, "
                f"{max_value}] (fits {name} and is not a valid expert id)"
            )
        if not isinstance(self.metadata, dict) or not all(isinstance(k, str) for k in self.metadata):
            raise RecordError(f"record {rid!r}: metadata must be a dict with str keys")
        if self.created is not None and (
            not isinstance(self.created, (int, float))
            or isinstance(self.created, bool)
            or not math.isfinite(self.created)
        ):
            raise RecordError(f"record {rid!r}: created must be a finite unix time, got {self.created!r}")
        if self.producer is not None and not isinstance(self.producer, dict):
            raise RecordError(f"record {rid!r}: producer must be a dict, got {self.producer!r}")
        if self.layers is None and ids.shape[0] > MAX_LAYER_INDEX + 1:
            raise RecordError(f"record {rid!r}: {ids.shape[0]} layers exceed the layer map's "
                              f"limit of {MAX_LAYER_INDEX + 1}")
        if self.layers is not None:
            check_layer_map(self.layers, ids.shape[0], what=f"record {rid!r}: layers")
        if self.token_convention not in TOKEN_CONVENTIONS:
            raise RecordError(f"record {rid!r}: token_convention {self.token_convention!r} is "
                              f"not one of {TOKEN_CONVENTIONS}")
        if not isinstance(self.provenance, Provenance):
            raise RecordError(f"record {rid!r}: provenance must be a Provenance, got "
                              f"{type(self.provenance).__name__}")
        problem = self.provenance.problem(int(ids.shape[1]), self.layer_map)
        if problem:
            raise RecordError(f"record {rid!r}: {problem}")


@lru_cache(maxsize=1)
def _host() -> str:
    return socket.gethostname()[:64]


def _producer() -> dict[str, Any]:
    return {"v": __version__, "h": _host(), "p": os.getpid()}


def _align(offset: int) -> int:
    return -(-offset // PAYLOAD_ALIGNMENT) * PAYLOAD_ALIGNMENT


def encode_record_parts(record: RoutingRecord, *, encoding: str = "plain") -> tuple[bytes, memoryview]:
    """Encode ``record`` as (header bytes incl. magic and padding, payload view).

    ``plain``: the payload is a read-only view on ``record.ids`` — nothing is copied, the
    payload is only hashed — so a store that writes parts (``put_parts``, ``writev``) moves
    the ids exactly once.  ``set``: the payload is a new buffer of one bit-packed rank per
    token-layer (SetEncodingError, a RecordError, when a row is neither ``top_k`` distinct
    expert ids nor all fill value).  ``header + bytes(payload)`` equals :func:`encode_record`.
    """
    if encoding not in ENCODINGS:
        raise RecordError(f"unknown encoding {encoding!r}; known: {', '.join(ENCODINGS)}")
    record.validate()
    ids = record.ids
    if encoding == "set":
        payload = memoryview(encode_sets(ids, record.num_experts, record.fill_value)).toreadonly()
    else:
        payload = memoryview(ids.reshape(-1).view(np.uint8)).toreadonly()
    header: dict[str, Any] = {
        "id": record.rollout_id,
        "dt": _dtype_name(ids.dtype),
        "sh": [int(d) for d in ids.shape],
        "lo": LAYOUT,
        "ne": record.num_experts,
        "k": int(ids.shape[2]),
        "fv": record.fill_value,
        "co": ENCODINGS[encoding],
        "ca": CHECKSUM_ALGORITHM,
        "cs": xxhash.xxh3_64_intdigest(payload),
        "pl": payload.nbytes,
        "ct": float(record.created) if record.created is not None else time.time(),
        "pr": record.producer if record.producer is not None else _producer(),
        "lm": pack_layer_map(record.layer_map),
        "tc": record.token_convention,
    }
    header.update(record.provenance.to_header())
    if record.metadata:
        header["md"] = record.metadata
    try:
        packed = msgpack.packb(header, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise RecordError(
            f"record {record.rollout_id!r}: metadata/producer cannot be packed as msgpack "
            f"(use str, int, float, bool, None, bytes, lists and str-keyed dicts): {exc}"
        ) from exc
    if len(packed) > MAX_HEADER_BYTES:
        raise RecordError(
            f"record {record.rollout_id!r}: header is {len(packed)} bytes, more than "
            f"{MAX_HEADER_BYTES}; keep metadata small"
        )
    end = PREFIX_BYTES + len(packed)
    head = b"".join(
        (_PREFIX.pack(MAGIC, FORMAT_VERSION, len(packed)), packed, bytes(_align(end) - end))
    )
    return head, payload


def encode_record(record: RoutingRecord, *, encoding: str = "plain") -> bytes:
    """Encode ``record`` into one contiguous ``bytes`` object (one copy of the payload).

    ``bytes.join`` sizes the result once and copies header and payload into it, which is
    cheaper than filling a zero-initialised bytearray (no zeroing pass).  ``encoding`` as
    in :func:`encode_record_parts`.
    """
    head, payload = encode_record_parts(record, encoding=encoding)
    return b"".join((head, payload))


def _byte_view(buffer: object, what: str = "record") -> memoryview:
    try:
        view = memoryview(buffer)  # type: ignore[arg-type]
    except TypeError as exc:
        raise RecordError(f"{what}: expected a bytes-like buffer, got {type(buffer).__name__}") from exc
    if not view.c_contiguous:
        raise RecordError(f"{what}: buffer is not contiguous")
    if view.ndim != 1 or view.format != "B":
        try:
            view = view.cast("B")
        except TypeError as exc:
            raise RecordError(f"{what}: buffer of format {view.format!r} cannot be read as bytes") from exc
    return view


def _bad(field_key: str, problem: str) -> RecordError:
    return RecordError(f"bad rr-v1 header field {field_key!r} ({HEADER_FIELDS[field_key]}): {problem}")


def _require(header: dict, key: str) -> Any:
    if key not in header:
        raise RecordError(f"rr-v1 header lacks required field {key!r} ({HEADER_FIELDS[key]})")
    return header[key]


def _int_field(header: dict, key: str, low: int, high: int) -> int:
    value = _require(header, key)
    if not _is_int(value):
        raise _bad(key, f"expected an int, got {type(value).__name__} {value!r}")
    if not low <= value <= high:
        raise _bad(key, f"{value} is outside [{low}, {high}]")
    return value


def _parse(buffer: object, require_payload: bool) -> tuple[dict[str, Any], memoryview]:
    """Validate prefix and header; return the normalized header (long names) and the view."""
    view = _byte_view(buffer)
    size = view.nbytes
    if size < PREFIX_BYTES:
        raise RecordError(
            f"truncated record: {size} bytes, but an rr-v1 record starts with "
            f"{PREFIX_BYTES} bytes of magic, version and header length"
        )
    magic, version, header_len = _PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        raise RecordError(
            f"bad magic {bytes(magic)!r} (expected {MAGIC!r}): not an rr-v1 record "
            "(a fastdeploy-raw value is read with decode_fastdeploy_raw)"
        )
    if version != FORMAT_VERSION:
        raise RecordError(
            f"unsupported rr-v1 format version {version} (this reader knows version "
            f"{FORMAT_VERSION}); upgrade fd-routing-replay to read it"
        )
    if header_len > MAX_HEADER_BYTES:
        raise RecordError(f"header length {header_len} exceeds the limit of {MAX_HEADER_BYTES} bytes")
    end = PREFIX_BYTES + header_len
    if end > size:
        raise RecordError(
            f"truncated record: header length {header_len} needs {end} bytes, buffer has {size}"
        )
    try:
        header = msgpack.unpackb(view[PREFIX_BYTES:end], raw=False)
    except Exception as exc:  # any parse failure of untrusted bytes is a bad record
        raise RecordError(f"header is not valid msgpack: {type(exc).__name__}: {exc}") from exc
    if not isinstance(header, dict):
        raise RecordError(f"header must be a msgpack map, got {type(header).__name__}")

    rollout_id = _require(header, "id")
    if not isinstance(rollout_id, str) or not rollout_id:
        raise _bad("id", f"expected a non-empty str, got {rollout_id!r}")
    dtype_name = _require(header, "dt")
    if not isinstance(dtype_name, str) or dtype_name not in _DTYPES:
        raise _bad("dt", f"{dtype_name!r} is not one of {sorted(_DTYPES)}")
    dtype = _DTYPES[dtype_name]
    max_value = int(np.iinfo(dtype).max)
    shape = _require(header, "sh")
    if not isinstance(shape, list) or len(shape) != 3:
        raise _bad("sh", f"expected [layers, tokens, top_k], got {shape!r}")
    for dim in shape:
        if not _is_int(dim) or not 0 <= dim <= MAX_DIM:
            raise _bad("sh", f"dimensions must be ints in [0, {MAX_DIM}], got {shape!r}")
    layout = _require(header, "lo")
    if layout != LAYOUT:
        raise _bad("lo", f"unsupported layout {layout!r} (this reader knows {LAYOUT!r})")
    num_experts = _int_field(header, "ne", 1, max_value)
    top_k = _int_field(header, "k", 0, MAX_DIM)
    if top_k != shape[2]:
        raise _bad("k", f"top_k {top_k} disagrees with shape {shape}")
    fill_value = _int_field(header, "fv", num_experts, max_value)
    codec = _require(header, "co")
    if codec not in _ENCODING_BY_CODEC:
        known = ", ".join(f"{c!r} ({name})" for name, c in ENCODINGS.items())
        raise _bad("co", f"unknown encoding {codec!r} (this reader knows {known}); a newer "
                         "fd-routing-replay may know it: upgrade to read it")
    algorithm = _require(header, "ca")
    if algorithm != CHECKSUM_ALGORITHM:
        raise _bad("ca", f"unsupported checksum algorithm {algorithm!r} (this reader knows {CHECKSUM_ALGORITHM!r})")
    checksum = _int_field(header, "cs", 0, 2**64 - 1)
    if codec == CODEC:
        expected_len = shape[0] * shape[1] * shape[2] * dtype.itemsize
    else:
        try:
            expected_len = payload_nbytes(shape[0] * shape[1], num_experts, top_k)
        except SetEncodingError as exc:
            raise _bad("co", str(exc)) from exc
    payload_len = _require(header, "pl")
    if not _is_int(payload_len) or payload_len != expected_len:
        raise _bad("pl", f"{payload_len!r} disagrees with shape {shape} of {dtype_name} in "
                         f"encoding {_ENCODING_BY_CODEC[codec]!r} ({expected_len} bytes)")
    created = header.get("ct")
    if created is not None and (not isinstance(created, (int, float)) or isinstance(created, bool)):
        raise _bad("ct", f"expected a unix time, got {created!r}")
    producer = header.get("pr")
    if producer is not None and not isinstance(producer, dict):
        raise _bad("pr", f"expected a map, got {producer!r}")
    metadata = header.get("md", {})
    if not isinstance(metadata, dict):
        raise _bad("md", f"expected a map, got {metadata!r}")
    layer_map = _unpack_layer_map(header.get("lm"), shape[0])
    token_convention = header.get("tc", TOKEN_FORWARDED)
    if token_convention not in TOKEN_CONVENTIONS:
        raise _bad("tc", f"unknown token convention {token_convention!r} (this reader knows "
                         f"{', '.join(repr(c) for c in TOKEN_CONVENTIONS)})")
    Provenance.from_header(header, shape[1], layer_map)  # validates nd, wv, th, sg

    payload_offset = _align(end)
    padding = view[end : min(payload_offset, size)]
    if padding.nbytes and any(padding):
        raise RecordError(f"non-zero padding between header and payload (bytes {end}..{payload_offset})")
    if require_payload:
        total = payload_offset + payload_len
        if size < total:
            raise RecordError(
                f"truncated record {rollout_id!r}: {size} bytes, header promises {total} "
                f"({payload_len} payload bytes at offset {payload_offset})"
            )
        if size > total:
            raise RecordError(f"record {rollout_id!r}: {size - total} unexpected bytes after the payload")
    return (
        {
            "format": FORMAT_NAME,
            "version": version,
            "header_length": header_len,
            "payload_offset": payload_offset,
            "rollout_id": rollout_id,
            "dtype": dtype_name,
            "shape": list(shape),
            "layout": layout,
            "num_experts": num_experts,
            "top_k": top_k,
            "fill_value": fill_value,
            "codec": codec,
            "encoding": _ENCODING_BY_CODEC[codec],
            "checksum_algorithm": algorithm,
            "checksum": checksum,
            "payload_length": payload_len,
            "created": created,
            "producer": producer,
            "metadata": metadata,
            "layer_map": layer_map,
            "token_convention": token_convention,
            **{HEADER_FIELDS[key]: header[key] for key in _PROVENANCE_FIELDS if key in header},
        },
        view,
    )


def _unpack_layer_map(value: Any, num_layers: int) -> list[int]:
    """Validate an ``lm`` value; absent (records written before it existed) = range(L)."""
    if value is None:
        if num_layers > MAX_LAYER_INDEX + 1:
            raise _bad("sh", f"{num_layers} layers exceed the layer map's limit of "
                             f"{MAX_LAYER_INDEX + 1}")
        return list(range(num_layers))
    if isinstance(value, dict):
        unknown = sorted(str(key) for key in value if key not in ("s", "n", "d"))
        if unknown:
            raise _bad("lm", f"unknown keys {unknown} in the range form (expected s, n, d)")
        start, count, step = value.get("s"), value.get("n"), value.get("d", 1)
        for name, number, low, high in (("s", start, 0, MAX_LAYER_INDEX),
                                        ("n", count, 0, MAX_LAYER_INDEX + 1),
                                        ("d", step, 1, MAX_LAYER_INDEX)):
            if not _is_int(number) or not low <= number <= high:
                raise _bad("lm", f"range field {name!r} must be an int in [{low}, {high}], "
                                 f"got {number!r}")
        if count != num_layers:
            raise _bad("lm", f"range of {count} layers disagrees with shape's {num_layers}")
        if count and start + (count - 1) * step > MAX_LAYER_INDEX:
            raise _bad("lm", f"range s={start}, n={count}, d={step} goes past layer "
                             f"{MAX_LAYER_INDEX}")
        return list(range(start, start + count * step, step))
    if not isinstance(value, list):
        raise _bad("lm", f"expected a list of layer indices or a range map, got {value!r}")
    problem = _layer_map_problem(value, num_layers)
    if problem:
        raise _bad("lm", problem)
    return value


def header_provenance(header: dict[str, Any]) -> Provenance:
    """The provenance fields of a header from :func:`read_header` (already validated)."""
    segments = header.get("segments")
    return Provenance(header.get("num_decoder_layers"), header.get("weights_version"),
                      header.get("tokens_hash"), None if segments is None else tuple(segments))


def read_header(buffer: bytes | bytearray | memoryview, *, require_payload: bool = True) -> dict[str, Any]:
    """Validate and return an rr-v1 header with long field names (no checksum pass).

    Adds ``format``, ``version``, ``header_length`` and ``payload_offset``.  With
    ``require_payload=False`` the buffer may stop after the header (e.g. the first 4 KiB
    of a file), for listing tools.
    """
    header, _ = _parse(buffer, require_payload)
    return header


def decode_record(
    buffer: bytes | bytearray | memoryview, *, verify: bool = True, check_range: bool = False
) -> RoutingRecord:
    """Decode an rr-v1 record; ``ids`` is a read-only zero-copy view on ``buffer``.

    ``verify`` checks the payload checksum (one xxh3 pass); ``check_range`` also scans the
    ids for values ≥ num_experts other than the fill value.  Every malformation raises
    RecordError naming the problem.  Keep ``buffer`` alive and unmodified while the ids
    are in use (they share its memory).  A ``set``-encoded record is decoded into a new
    read-only array instead, each token-layer's ids ascending.
    """
    header, view = _parse(buffer, require_payload=True)
    offset, length = header["payload_offset"], header["payload_length"]
    if verify:
        actual = xxhash.xxh3_64_intdigest(view[offset : offset + length])
        if actual != header["checksum"]:
            raise RecordError(
                f"checksum mismatch in record {header['rollout_id']!r}: header says "
                f"{header['checksum']:#018x}, payload hashes to {actual:#018x} (corrupt payload)"
            )
    dtype = _DTYPES[header["dtype"]]
    shape = tuple(header["shape"])
    if header["codec"] == CODEC:
        ids = np.frombuffer(view, dtype=dtype, count=math.prod(shape), offset=offset).reshape(shape)
    else:
        try:
            ids = decode_sets(view[offset : offset + length], shape, header["num_experts"],
                              header["fill_value"], dtype)
        except RecordError as exc:
            raise RecordError(f"record {header['rollout_id']!r}: {exc}") from exc
    ids.flags.writeable = False
    record = RoutingRecord(
        rollout_id=header["rollout_id"],
        ids=ids,
        num_experts=header["num_experts"],
        fill_value=header["fill_value"],
        metadata=header["metadata"],
        created=header["created"],
        producer=header["producer"],
        layers=tuple(header["layer_map"]),
        token_convention=header["token_convention"],
        provenance=header_provenance(header),
    )
    if check_range:
        check_expert_range(record)
    return record


_RANGE_CHUNK = 1 << 20


def check_expert_range(record: RoutingRecord) -> None:
    """Raise RecordError if any id is ≥ num_experts and not the fill value.

    One ``max`` pass; only when that exceeds the expert range (padded records) a chunked
    scan locates the first offender, so memory stays bounded.
    """
    ids = record.ids
    if ids.size == 0:
        return
    num_experts = record.num_experts
    fill = record.fill_value if record.fill_value is not None else int(np.iinfo(ids.dtype).max)
    if int(ids.max()) < num_experts:
        return
    flat = ids.reshape(-1)
    for start in range(0, flat.size, _RANGE_CHUNK):
        chunk = flat[start : start + _RANGE_CHUNK]
        bad = (chunk >= num_experts) & (chunk != fill)
        if bad.any():
            index = start + int(np.argmax(bad))
            layer, token, k = (int(i) for i in np.unravel_index(index, ids.shape))
            raise RecordError(
                f"record {record.rollout_id!r}: expert id {int(flat[index])} at [layer {layer}, "
                f"token {token}, k {k}] is ≥ num_experts {num_experts} and is not the fill "
                f"value {fill}"
            )


def _compat_dtype(dtype: object) -> np.dtype:
    try:
        dt = np.dtype(dtype)  # type: ignore[call-overload]
    except (TypeError, ValueError) as exc:
        raise RecordError(f"fastdeploy-raw: {dtype!r} is not a dtype") from exc
    if dt.kind != "u" or dt.itemsize not in (1, 2, 4):
        raise RecordError(f"fastdeploy-raw: dtype {dt} is not uint8, uint16 or uint32")
    return dt.newbyteorder("<")


def _compat_fill(fill_value: int | None, dtype: np.dtype) -> int:
    max_value = int(np.iinfo(dtype).max)
    if fill_value is None:
        return max_value
    if not _is_int(fill_value) or not 0 <= fill_value <= max_value:
        raise RecordError(f"fastdeploy-raw: fill_value {fill_value!r} does not fit {dtype}")
    return fill_value


def encode_fastdeploy_raw(ids: np.ndarray, max_model_len: int, fill_value: int | None = None) -> bytes:
    """Write ``ids`` the way FastDeploy ≥ 2.4 stores routing today: raw bytes only.

    ``ids`` is ``[layers, tokens, top_k]`` (fused) or ``[tokens, top_k]`` (one layer);
    tokens are padded to ``max_model_len`` with ``fill_value`` (default: the dtype's
    maximum, FastDeploy's ``-1``), little-endian, C order.  The reader must know shape
    and dtype from elsewhere.  The ids are copied once (one ``bytes.join`` of each
    layer's rows and a shared padding block).
    """
    if not isinstance(ids, np.ndarray) or ids.ndim not in (2, 3):
        raise RecordError("fastdeploy-raw: ids must be a 2-D [tokens, top_k] or 3-D [layers, tokens, top_k] array")
    dtype = _compat_dtype(ids.dtype)
    fill = _compat_fill(fill_value, dtype)
    if not _is_int(max_model_len) or max_model_len < 0:
        raise RecordError(f"fastdeploy-raw: max_model_len must be a non-negative int, got {max_model_len!r}")
    tokens = ids.shape[-2]
    if tokens > max_model_len:
        raise RecordError(f"fastdeploy-raw: {tokens} tokens do not fit max_model_len {max_model_len}")
    num_layers = ids.shape[0] if ids.ndim == 3 else 1
    layers = np.ascontiguousarray(ids, dtype=dtype).reshape(num_layers, tokens, ids.shape[-1])
    padding = np.full((max_model_len - tokens, ids.shape[-1]), fill, dtype=dtype).tobytes()
    parts: list[Any] = []
    for layer in layers:
        parts.append(memoryview(layer.reshape(-1).view(np.uint8)))
        parts.append(padding)
    return b"".join(parts)


def decode_fastdeploy_raw(
    buffer: bytes | bytearray | memoryview,
    num_layers: int,
    max_model_len: int,
    top_k: int,
    dtype: object,
    *,
    trim: bool = True,
    fill_value: int | None = None,
) -> np.ndarray:
    """Read a fastdeploy-raw value as a read-only ``[num_layers, max_model_len, top_k]`` view.

    A per-layer value is read with ``num_layers=1``.  With ``trim`` the trailing tokens
    whose every slot holds the fill value are dropped; the result is then a view that is
    not C-contiguous when ``num_layers > 1`` (``np.ascontiguousarray`` before building a
    RoutingRecord).  A wrong byte count raises RecordError naming both sizes.
    """
    view = _byte_view(buffer, "fastdeploy-raw value")
    dt = _compat_dtype(dtype)
    fill = _compat_fill(fill_value, dt)
    for name, value in (("num_layers", num_layers), ("max_model_len", max_model_len), ("top_k", top_k)):
        if not _is_int(value) or not 0 <= value <= MAX_DIM:
            raise RecordError(f"fastdeploy-raw: {name} must be an int in [0, {MAX_DIM}], got {value!r}")
    count = num_layers * max_model_len * top_k
    if view.nbytes != count * dt.itemsize:
        hint = " (it starts with the rr-v1 magic: use decode_record)" if bytes(view[:4]) == MAGIC else ""
        raise RecordError(
            f"fastdeploy-raw value has {view.nbytes} bytes, but [{num_layers}, {max_model_len}, "
            f"{top_k}] {dt} needs {count * dt.itemsize}; check layers, max_model_len, top_k and dtype{hint}"
        )
    ids = np.frombuffer(view, dtype=dt, count=count).reshape(num_layers, max_model_len, top_k)
    ids.flags.writeable = False
    if not trim or ids.size == 0:
        return ids
    used = np.zeros(max_model_len, dtype=bool)
    for layer in ids:
        used |= (layer != fill).any(axis=1)
    nonzero = np.flatnonzero(used)
    tokens = int(nonzero[-1]) + 1 if nonzero.size else 0
    return ids[:, :tokens, :]
