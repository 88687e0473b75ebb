"""The record, built once: what a put's rows become in the store.

A put reaches the writer as a small description (an
:class:`~fd_routing_replay.writer.operation.Operation`) and its ids in the ring.  The
engine hands over *rows*: the ``[layers, tokens, top_k]`` routing of a finished (or, for a
partial record, running) request, gathered straight into the ring, with what only the
engine knows (rollout and request id, layer map, provenance, whether the rows continue a
stored previous turn).  :func:`build_record` turns that into the record(s) to store, in one
place for every path -- the writer's worker, the journal replay, and FastDeploy's
``response`` mode, which needs the encoded record on the engine's thread:

* ``num_tokens`` and ``request_id`` in the metadata, and ``missing_tokens`` (tokens with the
  fill value in some layer: routing that was lost) when there are any;
* multi-turn prefix omission: the stored previous turn's rows prepended
  (:func:`complete_record`, after checking it is the turn the engine meant);
* padding to ``pad_to`` positions (FastDeploy's ``max_model_len`` layout);
* FastDeploy's non-fused layout: one record per layer under ``{rollout_id}_{layer}``.

A record a user submits whole (:meth:`RoutingWriter.submit_put
<fd_routing_replay.writer.client.RoutingWriter.submit_put>`) is stored as given.
:func:`encode_for_store` is the one rule for how a record is encoded for the store.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

import numpy as np

from fd_routing_replay.codec import RecordFormat, RoutingRecord, encode_record_parts
from fd_routing_replay.codec.setcodec import SetEncodingError
from fd_routing_replay.core.native import CLibrary, c_library
from fd_routing_replay.errors import RecordError
from fd_routing_replay.keys import layer_key, parse_rollout_id

__all__ = ["TurnPrefix", "build_record", "complete_record", "count_unrouted", "encode_for_store"]


@dataclass(frozen=True)
class TurnPrefix:
    """The stored record a tail continues: its rollout id, token count and tokens hash.

    Multi-turn prefix omission: turn ``t`` of an agentic rollout re-sends the whole
    conversation, so its record repeats every row of turn ``t − 1``'s.  When turn ``t −
    1``'s record is durable and its tokens are the first tokens of turn ``t`` (their hashes
    match), the engine hands over only positions ``[n_prev, T)`` with this prefix; the
    writer reads turn ``t − 1``'s record back, checks it and prepends its rows
    (:func:`complete_record`), so the store still holds one whole record per turn.  Which
    stored turn the writer offers is :mod:`fd_routing_replay.writer.durable`'s.
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
    speed (GIL released); NumPy (~20x slower) only where the C library is absent."""
    if ids.ndim != 3 or ids.shape[1] == 0:
        return 0
    loaded = c_library()
    if loaded.handle is None:
        return int(np.count_nonzero((ids == fill_value).any(axis=(0, 2))))
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
