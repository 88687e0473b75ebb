"""The hand-off: a request's rows, from the host slot cache straight into the writer's ring.

When a request finishes (or, with partial records, while it runs) the engine's thread does
only what cannot wait -- its KV slots may be reused by the very next step: one compiled
gather of the request's rows through its block-table row, written directly into the
background writer's ring (:meth:`RoutingWriter.submit
<fd_routing_replay.writer.client.RoutingWriter.submit>`), with a small description of the
put (:meth:`Operation.for_rows <fd_routing_replay.writer.operation.Operation.for_rows>`:
rollout and request id, layer map, provenance, whether it continues a stored turn).  No
record object is built here: the writer builds it, once
(:func:`~fd_routing_replay.writer.record.build_record`).  The ring is the one bounded
queue between the engine and the store, and ``writer.full_policy`` its one full policy.

FastDeploy 2.6's ``response`` mode needs the encoded record in the call:
:meth:`Handoff.encoded` gathers into a new array and runs the same ``build_record`` on
this thread.

Multi-turn prefix omission (``capture.prefix_omission``): when the writer holds turn
``t − 1`` durable and its tokens start turn ``t`` (their hashes match), only positions
``[n_prev, T)`` are handed over; the writer prepends the stored rows.

Partial records (``capture.partial_every_tokens: N``): a running request's routing so
far is stored under ``{rollout_id}_partial`` whenever its forwarded positions have grown by
``N`` since its last one; the writer deletes it once the final record is durable.  A
request's progress is kept by request id, so it survives preemption: a recomputed request
writes its next partial only once it has forwarded ``N`` positions more than the stored one.

Never raises to the engine: a request whose routing cannot be handed over is counted
(``records_failed``, ``partials_failed``) and logged with its rollout id.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from fd_routing_replay import ops
from fd_routing_replay.capture.slots import HostSlotCache
from fd_routing_replay.codec import RecordFormat, check_layer_map, encode_record
from fd_routing_replay.codec.record import Provenance, tokens_digest
from fd_routing_replay.keys import parse_rollout_id
from fd_routing_replay.writer.operation import Operation
from fd_routing_replay.writer.record import build_record

__all__ = ["HANDOFF_COUNTERS", "TRACKED_REQUESTS", "Handoff", "gather_request", "records_pad_to"]

logger = logging.getLogger(__name__)

HANDOFF_COUNTERS = ("records_submitted", "records_returned", "records_failed", "prefix_omitted",
                    "prefix_fallbacks", "partials_submitted", "partials_failed")
"""The counters a :class:`Handoff` keeps in its owner's counter table."""

TRACKED_REQUESTS = 65536
"""Requests whose last partial record is remembered; an aborted request's entry is only
forgotten when this many newer requests have written partials."""


def records_pad_to(config: Any, max_model_len: int) -> int:
    """Positions records are padded to: ``max_model_len`` when ``capture.pad_to_max_model_len``
    asks for it, and always in FastDeploy's raw format; else 0 (no padding)."""
    capture = config.capture
    if capture.pad_to_max_model_len or capture.record_format == RecordFormat.FASTDEPLOY_RAW:
        return int(max_model_len)
    return 0


def gather_request(cache: HostSlotCache, block_row: Any, start: int, length: int, block_size: int,
                   out: np.ndarray | None = None) -> np.ndarray:
    """Rows of positions ``start .. length-1`` of one request as ``[L, length-start, K]``,
    through its block-table row (a host int array), into ``out`` when given: one compiled
    call (the library's ``pack_request``).  Raises naming the problem when a position has
    no KV block or maps outside the cache."""
    row = np.ascontiguousarray(block_row)
    if row.dtype.kind != "i" or row.ndim != 1:
        row = np.ascontiguousarray(row.reshape(-1), dtype=np.int64)
    pack = ops.request_packer()
    columns = cache.layer_columns
    if columns is None:
        return pack(cache.array, row, int(start), int(length), int(block_size), out)
    packed = pack(cache.array, row, int(start), int(length), int(block_size))[columns]
    if out is None:
        return np.ascontiguousarray(packed)
    out[...] = packed
    return out


class Handoff:
    """A request's rows → the writer's ring, or an encoded record (see the module docstring).

    ``cache`` is the host slot cache the rows are gathered from; ``writer`` the background
    :class:`~fd_routing_replay.writer.RoutingWriter` (None: nothing is stored, only
    :meth:`encoded` works -- FastDeploy's ``response`` mode with records in the body).
    ``layer_map``: global decoder-layer index of each of the cache's layers.  ``fused``
    False stores FastDeploy's per-layer keys; ``pad_to`` pads records to that many
    positions (FastDeploy's ``max_model_len`` layout).  ``metadata`` goes into every record
    (``request_id`` is added per request).  ``counters``: the owner's counter table, where
    :data:`HANDOFF_COUNTERS` change.
    """

    def __init__(self, cache: HostSlotCache, writer: Any, *, num_experts: int,
                 layer_map: Sequence[int], record_format: str = RecordFormat.RR_V1,
                 fused: bool = True, pad_to: int = 0, metadata: dict[str, Any] | None = None,
                 num_decoder_layers: int | None = None, weights_version: str | None = None,
                 prefix_omission: bool = False, partial_every_tokens: int = 0,
                 counters: dict[str, Any] | None = None) -> None:
        if isinstance(partial_every_tokens, bool) or not isinstance(partial_every_tokens, int) \
                or partial_every_tokens < 0:
            raise ValueError(f"capture.partial_every_tokens must be a non-negative int, got "
                             f"{partial_every_tokens!r}")
        self.cache = cache
        self.writer = writer
        self.num_experts = int(num_experts)
        self.layer_map = check_layer_map(layer_map, cache.num_layers, what="capture layer map")
        self.record_format = RecordFormat(record_format)
        self.fused = bool(fused)
        self.pad_to = int(pad_to or 0)
        self.metadata = dict(metadata or {})
        self.provenance = Provenance(num_decoder_layers=num_decoder_layers,
                                     weights_version=weights_version or None)
        can_omit = (writer is not None and self.fused and not self.pad_to
                    and self.record_format == RecordFormat.RR_V1)
        if prefix_omission and not can_omit:
            logger.warning("fd-routing-replay: capture.prefix_omission is off: it needs fused rr-v1 "
                           "records, no padding to max_model_len and a store (not response mode)")
        self.prefix_omission = bool(prefix_omission and can_omit)
        self.partial_every = int(partial_every_tokens) if writer is not None else 0
        self.progress: OrderedDict[str, int] = OrderedDict()  # request id -> tokens of its last partial
        self.counters = counters if counters is not None else {}
        for name in HANDOFF_COUNTERS:
            self.counters.setdefault(name, 0)

    # ------------------------------------------------------------------ finished requests
    def finish(self, rollout_id: str, request_id: str | None, block_row: Any, length: int,
               block_size: int, token_ids: Any = None) -> bool:
        """Hand a finished request's ``length`` forwarded positions to the writer.

        ``token_ids`` (at least ``length`` of prompt + output) put the hash of the forwarded
        ones in the record's provenance (and let a turn omit its stored prefix).  True when
        the writer took it; never raises.
        """
        self.forget(request_id)              # the final supersedes its partials
        try:
            tokens = self._token_array(token_ids, length)
            tokens_hash = None if tokens is None else tokens_digest(tokens)
            prefix = self._omittable_prefix(rollout_id, token_ids if tokens is None else tokens, length)
            start = 0 if prefix is None else prefix.num_tokens
            op = self._op(rollout_id, request_id, length - start, tokens_hash, prefix=prefix)
            if self.writer.submit(op, lambda out: gather_request(self.cache, block_row, start, length,
                                                                 block_size, out)):
                self.counters["records_submitted"] += 1
                return True
            self.counters["records_failed"] += 1      # dropped by the writer (logged there)
        except Exception as exc:
            self.counters["records_failed"] += 1
            logger.error("routing replay: could not hand over the routing of rollout %s "
                         "(request %s): %r", rollout_id, request_id, exc)
        return False

    def encoded(self, rollout_id: str, request_id: str | None, block_row: Any, length: int,
                block_size: int, token_ids: Any = None) -> bytes | None:
        """The encoded rr-v1 record of a finished request, built on this thread (FastDeploy's
        ``response`` mode); None (counted, logged) when it cannot be built."""
        try:
            op = self._op(rollout_id, request_id, length, self._tokens_hash(token_ids, length),
                          fused_rr_v1=True)
            ids = gather_request(self.cache, block_row, 0, length, block_size)
            (_, record), = build_record(op, op.record(ids))
            data = encode_record(record)
        except Exception as exc:
            self.counters["records_failed"] += 1
            logger.error("routing replay: could not build the record of rollout %s (request %s): "
                         "%r", rollout_id, request_id, exc)
            return None
        self.counters["records_returned"] += 1
        return data

    # ------------------------------------------------------------------ partial records
    def due(self, request_id: str, num_tokens: int) -> bool:
        """Whether a running request that forwarded ``num_tokens`` positions is due a
        partial record (always False while partial records are off)."""
        return bool(self.partial_every) and \
            num_tokens - self.progress.get(request_id, 0) >= self.partial_every

    def last_partial(self, request_id: str | None) -> int:
        """Positions in ``request_id``'s last partial record (0: none yet)."""
        return self.progress.get(request_id, 0) if request_id is not None else 0

    def partial(self, rollout_id: str | None, request_id: str, block_row: Any, num_tokens: int,
                block_size: int, token_ids: Any = None) -> bool:
        """Hand a running request's routing so far (``num_tokens`` positions, their rows in
        the cache) to the writer as its partial record.  ``rollout_id`` None: the request
        carries no valid rollout id (nothing is stored for it).  True when the writer took
        it; never raises."""
        self._skip(request_id, num_tokens)
        if rollout_id is None or not self.partial_every:
            return False
        try:
            op = self._op(rollout_id, request_id, num_tokens, self._tokens_hash(token_ids, num_tokens),
                          partial=True)
            if self.writer.submit(op, lambda out: gather_request(self.cache, block_row, 0, num_tokens,
                                                                 block_size, out)):
                self.counters["partials_submitted"] += 1
                return True
            self.counters["partials_failed"] += 1     # dropped by the writer (logged there)
        except Exception as exc:
            self.counters["partials_failed"] += 1
            logger.error("routing replay: could not write the partial record of rollout %s "
                         "(request %s): %r", rollout_id, request_id, exc)
        return False

    def forget(self, request_id: str | None) -> None:
        """The request finished: its final record supersedes the partials."""
        self.progress.pop(request_id, None)

    def clear(self) -> None:
        """RL weight update: every running request is dropped."""
        self.progress.clear()

    # ------------------------------------------------------------------ internals
    def _skip(self, request_id: str, num_tokens: int) -> None:
        self.progress[request_id] = int(num_tokens)
        self.progress.move_to_end(request_id)
        while len(self.progress) > TRACKED_REQUESTS:
            self.progress.popitem(last=False)

    def _op(self, rollout_id: str, request_id: str | None, num_tokens: int, tokens_hash: int | None, *,
            partial: bool = False, prefix: Any = None, fused_rr_v1: bool = False) -> Operation:
        metadata = self.metadata if request_id is None else dict(self.metadata, request_id=request_id)
        provenance = self.provenance.to_header()
        if tokens_hash is not None:
            provenance["th"] = tokens_hash
        cache = self.cache
        plain = partial or fused_rr_v1
        return Operation.for_rows(
            rollout_id, shape=(len(self.layer_map), int(num_tokens), int(cache.array.shape[2])),
            dtype=cache.dtype, num_experts=self.num_experts, fill_value=cache.fill_value,
            layers=self.layer_map, fmt=RecordFormat.RR_V1 if plain else self.record_format,
            metadata=metadata, provenance=provenance, partial=partial,
            per_layer=not (plain or self.fused), pad_to=0 if plain else self.pad_to, prefix=prefix)

    @staticmethod
    def _token_array(token_ids: Any, num_tokens: int) -> np.ndarray | None:
        """The first ``num_tokens`` token ids as int64, converted once per hand-off (the
        record's token hash and the prefix check read the same array); None when fewer."""
        if token_ids is None or len(token_ids) < num_tokens:
            return None
        return np.asarray(token_ids[:num_tokens], dtype=np.int64)

    def _tokens_hash(self, token_ids: Any, num_tokens: int) -> int | None:
        tokens = self._token_array(token_ids, num_tokens)
        return None if tokens is None else tokens_digest(tokens)

    def _omittable_prefix(self, rollout_id: str, token_ids: Any, num_tokens: int) -> Any:
        """The stored previous turn this request may hand over only its new rows after, or
        None: a full hand-off."""
        if not self.prefix_omission or parse_rollout_id(rollout_id).turn == 0:
            return None
        prefix = self.writer.durable_prefix(rollout_id)
        if (prefix is None or token_ids is None or not prefix.num_tokens <= num_tokens
                or len(token_ids) < prefix.num_tokens
                or tokens_digest(np.asarray(token_ids[:prefix.num_tokens], dtype=np.int64))
                != prefix.tokens_hash):
            self.counters["prefix_fallbacks"] += 1
            return None
        self.counters["prefix_omitted"] += 1
        return prefix
