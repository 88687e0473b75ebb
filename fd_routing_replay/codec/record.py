"""The routing record itself: what one finished request's routing is, whatever the format.

:class:`RoutingRecord` (``ids[layer, token, k]`` plus what the ids mean), the allowed id
dtypes, the layer map rules, the optional :class:`Provenance` and the expert-range scan;
:class:`RecordFormat` names the ways a record is laid out in a store.  Byte formats live
in the sibling modules.

Provenance is four optional rr-v1 header fields a trainer can check before replaying a
record (docs/record-format.md#provenance):

* ``nd`` — the model's total decoder-layer count (dense, MoE; MTP/draft layers not
  counted), so a trainer can lay rows out over all layers (SGLang's ``[T, L_all, K]``)
  without guessing from the layer map;
* ``wv`` — the weights version the rollout was generated with (a string the RL loop sets,
  e.g. the training step), so stale routing is caught;
* ``th`` — :func:`tokens_digest` of the token ids of the positions the rows cover, so a
  trainer verifies that routes and tokens belong together (:meth:`Provenance.check_tokens`);
* ``sg`` — segment start offsets (token positions) for a rollout made of several segments
  (e.g. agent turns with tool output between them), first 0, strictly increasing.

Records without them read as before (every field None).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fd_routing_replay.codec.checksum import xxh3_64
from fd_routing_replay.errors import RecordError

__all__ = [
    "DTYPES", "MAX_DIM", "MAX_LAYER_INDEX", "MAX_WEIGHTS_VERSION", "TOKEN_CONVENTIONS",
    "TOKEN_FORWARDED", "Provenance", "RecordFormat", "RoutingRecord", "as_layer_tuple",
    "check_expert_range", "check_layer_map", "dtype_name", "is_int", "layer_map_problem",
    "routing_dtype", "tokens_digest",
]


class RecordFormat(enum.StrEnum):
    """How a record is laid out in the store: the one vocabulary of ``capture.record_format``,
    the writer, the sinks and the reader."""

    RR_V1 = "rr-v1"
    """The self-describing record (:mod:`fd_routing_replay.codec.rr_v1`)."""
    FASTDEPLOY_RAW = "fastdeploy-raw"
    """FastDeploy's raw padded bytes of ``[L, max_model_len, K]`` (compatibility)."""


MAX_DIM = 2**32 - 1
"""Largest value of any of L, T, K."""
MAX_LAYER_INDEX = 2**16 - 1
"""Largest global decoder-layer index a layer map may name."""
TOKEN_FORWARDED = "forwarded"
"""Token convention: row t is the routing of position t, one row per forwarded position
(prompt + generated - 1 rows; the last sampled token is never fed back)."""
TOKEN_CONVENTIONS = (TOKEN_FORWARDED,)

DTYPES: dict[str, np.dtype] = {
    "uint8": np.dtype("u1"),
    "uint16": np.dtype("<u2"),
    "uint32": np.dtype("<u4"),
}
"""The allowed id dtypes by name (little-endian), smallest first."""
_DTYPE_BY_STR = {dt.str: name for name, dt in DTYPES.items()}


def routing_dtype(num_experts: int) -> np.dtype:
    """Smallest allowed dtype holding ``num_experts`` ids plus the fill value."""
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise RecordError(f"num_experts must be a positive int, got {num_experts!r}")
    for dt in DTYPES.values():
        if num_experts <= np.iinfo(dt).max:
            return dt
    raise RecordError(f"num_experts {num_experts} does not fit uint32 with a fill value")


def dtype_name(dtype: np.dtype) -> str | None:
    """The :data:`DTYPES` name of ``dtype``, or None when it is not an allowed id dtype."""
    return _DTYPE_BY_STR.get(dtype.str)


def is_int(value: object) -> bool:
    """A plain int (bool excluded), as the formats store them."""
    return isinstance(value, int) and not isinstance(value, bool)


def layer_map_problem(layers: Sequence[int], num_layers: int) -> str | None:
    """What is wrong with a layer map of ``num_layers`` rows (plain ints), or None."""
    if len(layers) != num_layers:
        return f"has {len(layers)} entries for {num_layers} layers (one per row of [L, T, K])"
    previous = -1
    for position, layer in enumerate(layers):
        if not is_int(layer) or not 0 <= layer <= MAX_LAYER_INDEX:
            return f"entry {position} is {layer!r}, not an int in [0, {MAX_LAYER_INDEX}]"
        if layer <= previous:
            return f"must be strictly increasing, but entry {position} ({layer}) follows {previous}"
        previous = layer
    return None


def as_layer_tuple(layers: object) -> tuple[Any, ...] | None:
    """``layers`` as a tuple (numpy integers become ints), or None if it is no sequence."""
    if not isinstance(layers, (Sequence, np.ndarray)) or isinstance(layers, (str, bytes)):
        return None
    return tuple(int(layer) if isinstance(layer, np.integer) else layer for layer in layers)


def check_layer_map(layers: object, num_layers: int, *, what: str = "layers") -> tuple[int, ...]:
    """``layers`` as a tuple of ints, checked as the layer map of ``num_layers`` rows.

    One int per row, strictly increasing, each in [0, :data:`MAX_LAYER_INDEX`]; numpy
    integers are accepted.  RecordError starting with ``what`` otherwise.
    """
    as_tuple = as_layer_tuple(layers)
    if as_tuple is None:
        raise RecordError(f"{what} must be a sequence of ints, got {type(layers).__name__}")
    problem = layer_map_problem(as_tuple, num_layers)
    if problem:
        raise RecordError(f"{what} {problem}")
    return as_tuple


# ------------------------------------------------------------------ provenance

MAX_WEIGHTS_VERSION = 256
"""Longest weights version (characters)."""
_MAX_LAYERS = 2**16
_MAX_SEGMENTS = 2**16


def tokens_digest(token_ids: Any) -> int:
    """xxh3-64 of ``token_ids`` as little-endian int64, the value of the ``th`` field.

    Hash exactly the tokens at the positions the rows cover: with the ``forwarded``
    convention, the first ``num_tokens`` ids of prompt + response.
    """
    ids = np.asarray(token_ids)
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise RecordError(f"token ids must be a 1-D integer sequence, got shape {ids.shape} "
                          f"of {ids.dtype}")
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) > np.iinfo(np.int64).max):
        raise RecordError("token ids must be non-negative and fit int64")
    return xxh3_64(np.ascontiguousarray(ids, dtype="<i8"))


@dataclass(frozen=True)
class Provenance:
    """The optional provenance fields of one record (None = not recorded)."""

    num_decoder_layers: int | None = None
    weights_version: str | None = None
    tokens_hash: int | None = None
    segments: tuple[int, ...] | None = None

    def problem(self, num_tokens: int, layer_map: Sequence[int]) -> str | None:
        """What is wrong with these fields for a record of ``num_tokens`` rows and
        ``layer_map``, or None."""
        nd = self.num_decoder_layers
        if nd is not None:
            if not is_int(nd) or not 1 <= nd <= _MAX_LAYERS:
                return f"num_decoder_layers must be an int in [1, {_MAX_LAYERS}], got {nd!r}"
            if layer_map and max(layer_map) >= nd:
                return (f"num_decoder_layers {nd} is not above the layer map's last layer "
                        f"{max(layer_map)}")
        wv = self.weights_version
        if wv is not None and (not isinstance(wv, str) or not wv or len(wv) > MAX_WEIGHTS_VERSION):
            return f"weights_version must be a str of 1..{MAX_WEIGHTS_VERSION} characters, got {wv!r}"
        th = self.tokens_hash
        if th is not None and (not is_int(th) or not 0 <= th < 2**64):
            return f"tokens_hash must be an int in [0, 2**64), got {th!r}"
        sg = self.segments
        if sg is not None:
            if not isinstance(sg, (tuple, list)) or not all(is_int(s) for s in sg):
                return f"segments must be a sequence of ints, got {sg!r}"
            if len(sg) > _MAX_SEGMENTS:
                return f"segments has {len(sg)} entries, more than {_MAX_SEGMENTS}"
            if sg and (sg[0] != 0 or any(b <= a for a, b in zip(sg, sg[1:], strict=False))
                       or sg[-1] >= max(num_tokens, 1)):
                return (f"segments must start at 0, increase strictly and stay below the "
                        f"{num_tokens} tokens, got {list(sg)}")
        return None

    def to_header(self) -> dict[str, Any]:
        """The header entries for the fields that are set."""
        out: dict[str, Any] = {}
        for key, value in (("nd", self.num_decoder_layers), ("wv", self.weights_version),
                           ("th", self.tokens_hash)):
            if value is not None:
                out[key] = value
        if self.segments is not None:
            out["sg"] = list(self.segments)
        return out

    @classmethod
    def from_header(cls, header: dict[str, Any], num_tokens: int,
                    layer_map: Sequence[int]) -> Provenance:
        """The fields of a decoded header; a malformed one raises RecordError naming it."""
        segments = header.get("sg")
        provenance = cls(header.get("nd"), header.get("wv"), header.get("th"),
                         tuple(segments) if isinstance(segments, list) else segments)
        problem = provenance.problem(num_tokens, layer_map)
        if problem:
            raise RecordError(f"bad rr-v1 provenance field: {problem}")
        return provenance

    def check_tokens(self, token_ids: Any, num_tokens: int) -> None:
        """Raise RecordError unless the first ``num_tokens`` of ``token_ids`` (prompt +
        response) are the tokens the record's rows belong to; a no-op without a hash."""
        if self.tokens_hash is None:
            return
        ids = np.asarray(token_ids)
        if ids.ndim != 1 or ids.shape[0] < num_tokens:
            raise RecordError(f"the record covers {num_tokens} positions but "
                              f"{ids.shape[0] if ids.ndim == 1 else ids.shape} token ids were given")
        if tokens_digest(ids[:num_tokens]) != self.tokens_hash:
            raise RecordError("the routes do not belong to these tokens (tokens hash mismatch): "
                              "the record was written for another prompt or response")


# ------------------------------------------------------------------ the record


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
        layers = as_layer_tuple(self.layers)
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
        name = dtype_name(ids.dtype)
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
        if not is_int(ne) or ne < 1:
            raise RecordError(f"record {rid!r}: num_experts must be a positive int, got {ne!r}")
        if ne > max_value:
            raise RecordError(
                f"record {rid!r}: num_experts {ne} plus a fill value do not fit {name} "
                f"(at most {max_value} experts); use {routing_dtype(ne)}"
            )
        fill = self.fill_value
        if not is_int(fill) or not ne <= fill <= max_value:
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
