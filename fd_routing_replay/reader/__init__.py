"""Trainer-side API: fetch a rollout's routing as ``[layers, tokens, top_k]`` arrays.

Records are validated (format, checksum, expert-id range, and that the record belongs
to the rollout asked for) before they are handed out.  Two stored formats are read:
rr-v1 records (either payload encoding: ``plain``, or ``set``, whose rows come back with
their ids ascending) and FastDeploy's ``.pdtensor`` files (``fastdeploy-raw``, parsed
without unpickling, padding trimmed).  A rollout stored per layer (``{rollout_id}_{layer}``) is
assembled into one ``[layers, tokens, top_k]`` record.  Conversions to Paddle, Torch and
Megatron's per-layer replay list live here too; none of those frameworks is imported
unless its helper is called.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fd_routing_replay.codec.fastdeploy_raw import decode_fastdeploy_raw
from fd_routing_replay.codec.header import MAGIC
from fd_routing_replay.codec.pdtensor import looks_like_pdtensor, record_from_pdtensor, trim_padding
from fd_routing_replay.codec.record import (
    RecordFormat,
    RoutingRecord,
    check_expert_range,
    check_layer_map,
)
from fd_routing_replay.codec.rr_v1 import decode_record, read_header
from fd_routing_replay.codec.verification import warn_once
from fd_routing_replay.errors import InvalidRolloutId, RecordError
from fd_routing_replay.keys import check_key, parse_rollout_id, split_layer_key
from fd_routing_replay.store import RoutingStore, open_store


@dataclass(frozen=True)
class RawGeometry:
    """What a header-less FastDeploy raw value (its P2PStore keys) does not say about itself.

    ``num_layers`` is needed for fused values (a per-layer value is one layer); ``dtype``
    is FastDeploy's routing dtype (uint8 / uint16 / uint32); ``num_experts`` enables the
    expert-range check (default: every id below the fill is accepted); ``layers`` is the
    layer map of the rows.  max_model_len follows from the value's size.
    """

    top_k: int
    dtype: str
    num_layers: int | None = None
    num_experts: int | None = None
    layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("top_k", "num_layers", "num_experts"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"raw geometry: {name} must be a positive int, got {value!r}")
        if self.dtype not in ("uint8", "uint16", "uint32"):
            raise ValueError(f"raw geometry: dtype must be uint8, uint16 or uint32, got {self.dtype!r}")

    @classmethod
    def parse(cls, text: str) -> RawGeometry:
        """``"top_k=8,dtype=uint16[,num_layers=27][,num_experts=256]"`` (the CLI's form)."""
        fields_: dict[str, Any] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, value = part.partition("=")
            if not sep or name not in ("top_k", "dtype", "num_layers", "num_experts"):
                raise ValueError(f"raw geometry {text!r}: expected top_k=K,dtype=D[,num_layers=L]"
                                 f"[,num_experts=E], got {part!r}")
            fields_[name] = value if name == "dtype" else _positive(value, name)
        if "top_k" not in fields_ or "dtype" not in fields_:
            raise ValueError(f"raw geometry {text!r}: top_k and dtype are required")
        return cls(**fields_)


def _positive(text: str, name: str) -> int:
    if not text.isascii() or not text.isdigit():
        raise ValueError(f"raw geometry: {name} must be a positive decimal int, got {text!r}")
    return int(text)


def _record_from_raw(buffer: Any, key: str, raw: RawGeometry, trim: bool) -> tuple[RoutingRecord, dict]:
    rollout, layer = split_layer_key(key)
    num_layers = 1 if layer is not None else raw.num_layers
    if num_layers is None:
        raise RecordError(f"value of key {key!r} is a fused FastDeploy raw value: its layer count is "
                          "not stored; give the raw geometry's num_layers")
    itemsize = np.dtype(raw.dtype).itemsize
    row = num_layers * raw.top_k * itemsize
    nbytes = memoryview(buffer).nbytes
    if nbytes % row:
        raise RecordError(f"value of key {key!r} has {nbytes} bytes, not a multiple of {num_layers} "
                          f"layers x top_k {raw.top_k} x {raw.dtype}; check the raw geometry")
    ids = decode_fastdeploy_raw(buffer, num_layers, nbytes // row, raw.top_k, raw.dtype, trim=trim)
    ids = np.ascontiguousarray(ids)
    ids.flags.writeable = False
    fill = int(np.iinfo(ids.dtype).max)
    layers = raw.layers if layer is None else ((raw.layers[layer],) if raw.layers else (layer,))
    fmt = RecordFormat.FASTDEPLOY_RAW.value
    metadata: dict[str, Any] = {"format": fmt, "num_tokens": int(ids.shape[1]),
                                "max_model_len": nbytes // row}
    if layer is not None:
        metadata["layer"] = layer
    record = RoutingRecord(rollout.text, ids, raw.num_experts or fill, fill, metadata, layers=layers)
    header = {"format": fmt, "rollout_id": rollout.text, "dtype": raw.dtype,
              "shape": list(ids.shape), "layout": "fused" if layer is None else "per-layer",
              "max_model_len": nbytes // row, "num_tokens": int(ids.shape[1])}
    return record, header


@dataclass
class StoredRecord:
    """A record as a store held it: the decoded record, a header naming its ``format``
    (``rr-v1`` or ``fastdeploy-raw``), the bytes read and the keys they came from."""

    record: RoutingRecord
    header: dict[str, Any]
    nbytes: int
    keys: list[str] = field(default_factory=list)

    @property
    def format(self) -> str:
        return str(self.header.get("format", ""))


def decode_stored(buffer: Any, key: str, *, verify: bool = True,
                  trim: bool = True, raw: RawGeometry | None = None) -> StoredRecord:
    """Decode the value stored under ``key``, whichever format it is in.

    rr-v1 records are recognised by their magic; FastDeploy ``.pdtensor`` files by their
    pickle header (parsed, never unpickled; ``trim`` drops the padding).  The rollout id
    and layer of a ``.pdtensor`` come from ``key``.  With ``raw``, anything else is read as
    a header-less FastDeploy raw value (its P2PStore keys); without it, RecordError.
    """
    view = memoryview(buffer)
    if bytes(view[:len(MAGIC)]) == MAGIC:
        record = decode_record(buffer, verify=verify)
        return StoredRecord(record, read_header(buffer).as_dict(), view.nbytes, [key])
    if looks_like_pdtensor(view):
        rollout, layer = split_layer_key(key)
        record, header = record_from_pdtensor(buffer, rollout.text, layer=layer, trim=trim,
                                              source=f"value of key {key!r}")
        return StoredRecord(record, header, view.nbytes, [key])
    if raw is not None:
        record, header = _record_from_raw(buffer, key, raw, trim)
        return StoredRecord(record, header, view.nbytes, [key])
    raise RecordError(
        f"value of key {key!r} is neither an rr-v1 record (magic {MAGIC!r}) nor a FastDeploy "
        f".pdtensor file (first bytes {bytes(view[:8])!r}); a raw fastdeploy-raw value has no "
        "header: give the reader its raw geometry (RoutingReader(raw_geometry=...), "
        "fd-rr --raw-geometry top_k=K,dtype=D,num_layers=L)")


def read_stored(store: RoutingStore, key: str, *, verify: bool = True,
                num_layers: int | None = None, raw: RawGeometry | None = None) -> StoredRecord | None:
    """The value under ``key``, or — for a rollout id stored per layer — its layers
    assembled; None when nothing is stored, when layer 0 is not (yet), or, with
    ``num_layers``, until every layer is."""
    buffer = store.get(key)
    if buffer is not None:
        return decode_stored(buffer, key, verify=verify, raw=raw)
    try:
        parse_rollout_id(key)
    except InvalidRolloutId:
        return None
    if not store.exists(f"{key}_0"):  # one cheap probe before listing (polling readers)
        return None
    layer_keys = _layer_keys(store, key)
    if not layer_keys:
        return None
    layers = sorted(layer_keys)
    expected = num_layers if num_layers is not None else layers[-1] + 1
    missing = sorted(set(range(expected)) - set(layers))
    if layers[-1] >= expected:
        raise RecordError(f"rollout {key!r} has layer {layers[-1]} stored, but num_layers is "
                          f"{expected}")
    if missing:
        if num_layers is not None:
            return None  # not every layer is written yet
        raise RecordError(f"rollout {key!r} is stored per layer but layers {missing} of "
                          f"0..{expected - 1} are missing (pass num_layers to wait for them)")
    parts = []
    for layer in layers:
        buffer = store.get(layer_keys[layer])
        if buffer is None:
            return None  # deleted while we read
        parts.append(decode_stored(buffer, layer_keys[layer], verify=verify, trim=False, raw=raw))
    return _assemble(key, parts)


def _layer_keys(store: RoutingStore, rollout_id: str) -> dict[int, str]:
    found = {}
    for key in store.list(rollout_id):
        try:
            rollout, layer = split_layer_key(key)
        except InvalidRolloutId:
            continue
        if layer is not None and rollout.text == rollout_id:
            found[layer] = key
    return found


def _assemble(rollout_id: str, parts: list[StoredRecord]) -> StoredRecord:
    """Stack per-layer records ``[1, T, K]`` into one ``[layers, T, K]`` record."""
    first = parts[0]
    for layer, part in enumerate(parts):
        record, where = part.record, f"rollout {rollout_id!r}, key {part.keys[0]!r}"
        if part.format != first.format:
            raise RecordError(f"{where}: format {part.format} differs from layer 0's "
                              f"{first.format}")
        if record.rollout_id != rollout_id:
            raise RecordError(f"{where}: the record belongs to rollout {record.rollout_id!r}")
        if record.num_layers != 1 or record.ids.shape[1:] != first.record.ids.shape[1:] \
                or record.dtype != first.record.dtype \
                or record.fill_value != first.record.fill_value:
            raise RecordError(
                f"{where}: layer {layer} is {list(record.ids.shape)} {record.dtype} fill "
                f"{record.fill_value}, layer 0 is {list(first.record.ids.shape)} "
                f"{first.record.dtype} fill {first.record.fill_value}; layers must agree")
    ids = np.concatenate([part.record.ids for part in parts], axis=0)
    metadata = {k: v for k, v in first.record.metadata.items() if k != "layer"}
    metadata["num_layers"] = len(parts)
    if first.format == RecordFormat.FASTDEPLOY_RAW:
        ids = np.ascontiguousarray(trim_padding(ids))
        metadata["num_tokens"] = int(ids.shape[1])
    ids.flags.writeable = False
    record = RoutingRecord(rollout_id, ids, first.record.num_experts, first.record.fill_value,
                           metadata, first.record.created, first.record.producer,
                           layers=_assembled_layer_map(rollout_id, parts),
                           token_convention=first.record.token_convention)
    header = {k: v for k, v in first.header.items() if k not in ("layer", "checksum")}
    header.update(rollout_id=rollout_id, layout="per-layer", layers=len(parts),
                  shape=list(ids.shape))
    if first.format == RecordFormat.FASTDEPLOY_RAW:
        header["num_tokens"] = int(ids.shape[1])
    return StoredRecord(record, header, sum(p.nbytes for p in parts),
                        [k for p in parts for k in p.keys])


def _assembled_layer_map(rollout_id: str, parts: list[StoredRecord]) -> tuple[int, ...] | None:
    """The layers' own maps joined; None (``range(L)``) when no part has one of its own
    (FastDeploy files, rr-v1 records written before layer maps: each maps to row 0)."""
    maps = [part.record.layer_map for part in parts]
    if all(layer_map == (0,) for layer_map in maps):
        return None
    joined = tuple(index for layer_map in maps for index in layer_map)
    return check_layer_map(joined, len(parts), what=f"rollout {rollout_id!r}: the layers' map")


class RoutingReader:
    """Reads records by rollout id from a store (or anything :func:`open_store` takes).

    ``num_layers``, when given, is the model's MoE layer count: a rollout stored per layer
    is returned only once all of its layers exist (so :meth:`wait` waits for them).
    ``raw_geometry`` reads FastDeploy's header-less raw values (:class:`RawGeometry`).
    """

    def __init__(self, store_or_config: Any, *, namespace: str | None = None,
                 verify: bool = True, num_layers: int | None = None,
                 raw_geometry: RawGeometry | None = None) -> None:
        if num_layers is not None and (isinstance(num_layers, bool)
                                       or not isinstance(num_layers, int) or num_layers < 1):
            raise ValueError(f"num_layers must be a positive int or None, got {num_layers!r}")
        if isinstance(store_or_config, RoutingStore):
            self.store = store_or_config
            self._owns_store = False
        else:
            self.store = open_store(store_or_config, namespace)
            self._owns_store = True
        self.verify = verify
        self.num_layers = num_layers
        self.raw_geometry = raw_geometry

    def get(self, rollout_id: str) -> RoutingRecord | None:
        """The record of ``rollout_id``, or None when it has not been stored (yet)."""
        parse_rollout_id(rollout_id)
        try:
            stored = read_stored(self.store, rollout_id, verify=self.verify,
                                 num_layers=self.num_layers, raw=self.raw_geometry)
        except RecordError as exc:
            raise RecordError(f"record of rollout {rollout_id!r}: {exc}") from exc
        return None if stored is None else self._checked(rollout_id, stored.record)

    def get_slice(self, rollout_id: str, *, layers: Iterable[int] | None = None,
                  tokens: slice | None = None) -> RoutingRecord | None:
        """Only decoder ``layers`` (global indices, the record's layer map; default all)
        and positions ``tokens`` (a slice) of the record, or None when not stored.

        Where the store reads byte ranges only the header and those bytes are fetched
        (the local store), or the chunks holding them (Redis: ``store.redis.chunk_bytes``,
        1 MiB by default), all of one version of the record (one replaced meanwhile is
        read again); elsewhere the record is read whole and sliced
        (:mod:`fd_routing_replay.reader.sliced`).  A ranged read checks the header, the
        record's length and the ids, but not the payload checksum.  RecordError for a
        corrupt, truncated or overlong record.
        """
        from fd_routing_replay.reader.sliced import read_slice, slice_record

        parse_rollout_id(rollout_id)
        try:
            ranged = read_slice(self.store, rollout_id, layers=layers, tokens=tokens)
        except RecordError as exc:
            raise RecordError(f"record of rollout {rollout_id!r}: {exc}") from exc
        if ranged is not None:
            return self._checked(rollout_id, ranged[0])
        record = self.get(rollout_id)
        return None if record is None else slice_record(record, layers=layers, tokens=tokens)

    def get_many(self, rollout_ids: Iterable[str]) -> dict[str, RoutingRecord | None]:
        """Records of several rollouts, in the order given; missing ones map to None.

        Where the store fetches several values in one round trip (Redis's ``get_many``)
        they are fetched together; a rollout stored per layer is then read on its own."""
        wanted = list(dict.fromkeys(rollout_ids))
        for rollout_id in wanted:
            parse_rollout_id(rollout_id)
        get_many = getattr(self.store, "get_many", None)
        if get_many is None:
            return {rid: self.get(rid) for rid in wanted}
        out: dict[str, RoutingRecord | None] = {}
        for rollout_id, value in zip(wanted, get_many(wanted), strict=True):
            if value is None:                      # absent, or stored per layer
                out[rollout_id] = self.get(rollout_id)
                continue
            try:
                stored = decode_stored(value, rollout_id, verify=self.verify, raw=self.raw_geometry)
            except RecordError as exc:
                raise RecordError(f"record of rollout {rollout_id!r}: {exc}") from exc
            out[rollout_id] = self._checked(rollout_id, stored.record)
        return out

    def list_rollouts(self, prefix: str | None = None) -> list[str]:
        """Sorted rollout ids stored under the boundary-safe ``prefix`` (a rollout stored
        per layer is listed once, by its rollout id)."""
        found = set()
        for key in self.store.list(prefix):
            try:
                found.add(split_layer_key(key)[0].text)
            except InvalidRolloutId:
                continue                          # not a routing key: not ours to list
        return sorted(found)

    def latest_turn(self, base: str, segment: int = 0) -> int | None:
        """The highest turn stored for ``{base}:{turn}:{segment}``, or None when none is
        (with ``only_last_turn`` the only one kept: the record to train on)."""
        turns = []
        for rollout_id in self.list_rollouts(base):
            parsed = parse_rollout_id(rollout_id)
            if parsed.base == base and parsed.segment == segment:
                turns.append(parsed.turn)
        return max(turns, default=None)

    def get_partial(self, rollout_id: str) -> RoutingRecord | None:
        """The latest partial record of a running rollout (``capture.partial_every_tokens``):
        its first ``num_tokens`` positions, a prefix of the final record; None when none is
        stored (too early, or finished: :mod:`fd_routing_replay.reader.partials`)."""
        from fd_routing_replay.reader.partials import read_partial

        parse_rollout_id(rollout_id)
        record = read_partial(self.store, rollout_id, verify=self.verify)
        return None if record is None else self._checked(rollout_id, record)

    def list_partials(self, prefix: str | None = None) -> list[str]:
        """Sorted rollout ids with a partial record under the boundary-safe ``prefix``."""
        from fd_routing_replay.reader.partials import partial_rollouts

        return partial_rollouts(self.store, prefix)

    def get_layer(self, rollout_id: str, layer: int) -> RoutingRecord | None:
        """A per-layer record (FastDeploy's non-fused mode stores ``{id}_{layer}``)."""
        parse_rollout_id(rollout_id)
        key = check_key(f"{rollout_id}_{layer}")
        buffer = self.store.get(key)
        if buffer is None:
            return None
        try:
            stored = decode_stored(buffer, key, verify=self.verify, raw=self.raw_geometry)
        except RecordError as exc:
            raise RecordError(f"record of rollout {rollout_id!r}: {exc}") from exc
        return self._checked(rollout_id, stored.record)

    def resolve(self, reference: Any, timeout: float = 30.0, poll_interval: float = 0.05) -> RoutingRecord:
        """The record a reference from a FastDeploy response names, once the writer stored it
        (waits up to ``timeout`` s); RecordError naming the key when it stays missing or
        differs from the reference (:func:`fd_routing_replay.reader.references.resolve_reference`)."""
        from fd_routing_replay.reader.references import resolve_reference

        record = resolve_reference(self.store, reference, timeout=timeout, poll_interval=poll_interval)
        return self._checked(record.rollout_id, record)

    def wait(self, rollout_id: str, timeout: float, poll_interval: float = 0.05) -> RoutingRecord:
        """Poll until the record exists; ``TimeoutError`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            record = self.get(rollout_id)
            if record is not None:
                return record
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"no routing record for rollout {rollout_id!r} in {self.store.describe()} "
                    f"after {timeout:g} s")
            time.sleep(min(poll_interval, remaining))

    def wait_many(self, rollout_ids: Iterable[str], timeout: float,
                  poll_interval: float = 0.05) -> dict[str, RoutingRecord]:
        """Poll until every record exists (each fetched once, as it appears), in the order
        given; ``TimeoutError`` naming the missing ones after ``timeout`` seconds."""
        wanted = list(dict.fromkeys(rollout_ids))
        for rollout_id in wanted:
            parse_rollout_id(rollout_id)
        found: dict[str, RoutingRecord] = {}
        deadline = time.monotonic() + timeout
        while True:
            for rollout_id in wanted:
                if rollout_id not in found:
                    record = self.get(rollout_id)
                    if record is not None:
                        found[rollout_id] = record
            missing = [rid for rid in wanted if rid not in found]
            if not missing:
                return {rid: found[rid] for rid in wanted}
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
                raise TimeoutError(f"{len(missing)} of {len(wanted)} routing records not in "
                                   f"{self.store.describe()} after {timeout:g} s: {shown}")
            time.sleep(min(poll_interval, remaining))

    def close(self) -> None:
        if self._owns_store:
            self.store.close()

    def __enter__(self) -> RoutingReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _checked(rollout_id: str, record: RoutingRecord) -> RoutingRecord:
        if record.rollout_id != rollout_id:
            raise RecordError(
                f"record stored under {rollout_id!r} belongs to rollout "
                f"{record.rollout_id!r}; the store is inconsistent (run fd-rr fsck)")
        check_expert_range(record)
        warn_once(record)            # a verification record (capture.verify): adapters refuse it
        return record


def pad_to(ids: np.ndarray, length: int, fill_value: int | None = None) -> np.ndarray:
    """Pad ``[L, T, K]`` ids along tokens to ``length`` with the fill (default: dtype max)."""
    layers, tokens, top_k = ids.shape
    if length < tokens:
        raise ValueError(f"pad_to: length {length} is shorter than the record's {tokens} tokens")
    fill = np.iinfo(ids.dtype).max if fill_value is None else fill_value
    out = np.full((layers, length, top_k), fill, dtype=ids.dtype)
    out[:, :tokens] = ids
    return out


def to_paddle(ids: np.ndarray, dtype: str = "int64") -> Any:
    """A Paddle tensor of ``ids`` (int64 by default, what routers index with)."""
    import paddle

    return paddle.to_tensor(np.ascontiguousarray(ids, dtype=dtype))


def to_torch(ids: np.ndarray, dtype: str = "int64") -> Any:
    """A Torch tensor of ``ids``; needs torch installed (extra ``torch``)."""
    try:
        import torch
    except ImportError as exc:
        raise ImportError("to_torch needs torch: pip install 'fd-routing-replay[torch]'") from exc
    return torch.from_numpy(np.ascontiguousarray(ids, dtype=dtype))


def to_replay_list(record: RoutingRecord, *, fill_as: int = -1,
                   dtype: str = "int64") -> list[np.ndarray]:
    """Per-layer ``[T, K]`` arrays for NeMo-RL-style ``set_replay_data``.

    "No routing" entries become ``fill_as`` (-1: NeMo-RL falls back to the live router).
    Upstream Megatron-Core's ``RouterReplay`` has no such fallback (an index of -1 fails
    its gather): use :func:`fd_routing_replay.trainers.build_megatron_replay`, which packs
    several records, never emits -1 and returns a replay mask.
    """
    ids = record.ids.astype(dtype)
    ids[record.ids == record.fill_value] = fill_as
    return [ids[layer] for layer in range(ids.shape[0])]
