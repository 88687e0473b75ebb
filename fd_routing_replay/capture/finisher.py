"""A finished request's records, assembled from a host slot cache through its block table.

This is the engine side of the step-buffer arrangement (FastDeploy 2.6), free of
FastDeploy: the worker scatters each step's rows into a slot cache by KV slot; when a
request finishes, :class:`SlotRecordFinisher` maps its positions to slots through the
block table, assembles its record(s), stamps the provenance (tokens hash) and hands
them to the sink -- only the rows after the stored previous turn when multi-turn prefix
omission applies -- or, with no sink (FastDeploy's ``response`` mode), returns the
encoded record.  With partial records on, :meth:`SlotRecordFinisher.progress` stores a
running request's routing so far every ``partial_every_tokens`` forwarded positions
(:mod:`fd_routing_replay.capture.partial`).  :class:`~fd_routing_replay.integrations.fastdeploy.engine.EngineRoutingAssembler`
wraps it for FastDeploy; the harness drives it directly.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from fd_routing_replay.capture.assembly import RecordAssembler
from fd_routing_replay.capture.outlet import RecordOutlet
from fd_routing_replay.capture.partial import PartialRecords
from fd_routing_replay.capture.positions import request_slots
from fd_routing_replay.codec import encode_record
from fd_routing_replay.codec.provenance import Provenance, tokens_digest
from fd_routing_replay.codec.record import RecordFormat
from fd_routing_replay.errors import InvalidRolloutId
from fd_routing_replay.keys import parse_request_id, parse_rollout_id

__all__ = ["SlotRecordFinisher", "prefix_omission_applies"]

logger = logging.getLogger(__name__)

COUNTERS = ("records_submitted", "records_returned", "records_failed", "records_incomplete",
            "invalid_request_ids", "prefix_omitted", "prefix_fallbacks")


def prefix_omission_applies(capture: Any, assembler: RecordAssembler, sink: Any) -> bool:
    """Whether ``capture.prefix_omission`` can take effect: fused rr-v1 records, no padding
    to ``max_model_len`` and a store to read the previous turn from (logs why not)."""
    applies = bool(capture.prefix_omission and sink is not None and capture.fused
                   and assembler.pad_to is None and capture.record_format == RecordFormat.RR_V1)
    if capture.prefix_omission and not applies:
        logger.warning("fd-routing-replay: capture.prefix_omission is off: it needs fused rr-v1 "
                       "records, no padding to max_model_len and a store (not response mode)")
    return applies


class SlotRecordFinisher:
    """Finished requests -> records (see the module docstring).

    ``sink`` None: :meth:`finish` returns the encoded record instead of storing it.
    ``partial_every_tokens`` > 0 (with a sink): :meth:`progress` writes partial records.
    """

    def __init__(self, assembler: RecordAssembler, sink: Any, *, block_size: int,
                 provenance: Provenance | None = None, prefix_omission: bool = False,
                 partial_every_tokens: int = 0) -> None:
        self.assembler = assembler
        self.sink = sink
        self.block_size = int(block_size)
        self.provenance = provenance or Provenance()
        self.prefix_omission = bool(prefix_omission and sink is not None)
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        # records are built and handed to the sink off the caller's (token processor's) thread
        self.outlet = RecordOutlet(assembler, sink, self.counters, provenance=self.provenance,
                                   name="fdrr-finish-engine")
        self.partials = PartialRecords(partial_every_tokens, self.outlet) \
            if partial_every_tokens > 0 and sink is not None else None

    def finish(self, request_id: str, block_table: Any, num_tokens: int,
               token_ids: Any = None) -> np.ndarray | None:
        """Assemble a finished request's ``num_tokens`` positions; store them, or return
        the encoded record when there is no sink.

        ``token_ids`` (prompt + output) put the hash of the ``num_tokens`` forwarded ones
        in the record's provenance.  Never raises: a request whose routing cannot be
        assembled is counted and logged.
        """
        if self.partials is not None:
            self.partials.forget(request_id)      # the final supersedes its partials
        try:
            rollout_id = parse_request_id(request_id).text
        except InvalidRolloutId as exc:
            self.counters["invalid_request_ids"] += 1
            logger.error("routing replay: request %r carries no valid rollout id, its routing will "
                         "not be stored: %s", request_id, exc)
            return None
        try:
            prefix = self._omittable_prefix(rollout_id, token_ids, num_tokens)
            ids = self.assembler.gather_request(np.asarray(block_table, dtype=np.int64), num_tokens,
                                                self.block_size, start=0 if prefix is None else prefix.num_tokens)
            tokens = None
            if token_ids is not None and len(token_ids) >= num_tokens:
                tokens = np.asarray(token_ids[:num_tokens], dtype=np.int64)   # a snapshot
            if self.sink is None:      # response mode: the caller needs the record now
                (_, record), = self.outlet.build(rollout_id, request_id, ids, tokens=tokens).items
                self.outlet.count("records_returned")
                return np.frombuffer(encode_record(record), dtype=np.uint8)
        except Exception as exc:
            self.outlet.count("records_failed")
            logger.error("routing replay: could not assemble or submit the record of rollout %s "
                         "(request %s): %r", rollout_id, request_id, exc)
            return None
        self.outlet.submit(rollout_id, request_id, ids, tokens=tokens, prefix=prefix)
        return None

    def progress(self, request_id: str, block_table: Any, num_tokens: int, token_ids: Any = None) -> bool:
        """A running request has forwarded ``num_tokens`` positions (their rows are in the
        slot cache): when that is ``partial_every_tokens`` more than its last partial record,
        gather them now and store them as its partial record (built on the finishing thread,
        in order with the finals).  ``token_ids`` (at least ``num_tokens`` of prompt +
        output) hash into the provenance.  True when a partial was handed on.  Never raises.
        """
        partials = self.partials
        if partials is None or not partials.due(request_id, num_tokens):
            return False
        try:
            rollout_id = parse_request_id(request_id).text
        except InvalidRolloutId:                  # its final is refused (and counted) at finish
            partials.skip(request_id, num_tokens)
            return False
        try:
            slots = request_slots(np.asarray(block_table, dtype=np.int64), num_tokens, self.block_size)
            ids = self.assembler.gather(slots)
            tokens = None
            if token_ids is not None and len(token_ids) >= num_tokens:
                tokens = np.asarray(token_ids[:num_tokens], dtype=np.int64)
        except Exception as exc:
            partials.skip(request_id, num_tokens)
            partials.failed(rollout_id, request_id, exc)
            return False
        partials.submit(rollout_id, request_id, ids, tokens=tokens)
        return True

    def wait_finished(self, timeout: float | None = None) -> bool:
        """Wait until every finished request's records were handed to the sink."""
        return self.outlet.wait_finished(timeout)

    def flush(self, timeout: float | None = None) -> bool:
        """:meth:`wait_finished`, then flush the sink (durable)."""
        return self.outlet.flush(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Hand on what is in hand, then stop the finishing thread (the sink stays open)."""
        self.outlet.close(timeout)

    def _omittable_prefix(self, rollout_id: str, token_ids: Any, num_tokens: int) -> Any:
        """The stored previous turn this request may hand over only its new rows after
        (prefix omission), or None: a full hand-off."""
        if not self.prefix_omission or parse_rollout_id(rollout_id).turn == 0:
            return None
        prefix = self.sink.durable_prefix(rollout_id)
        if (prefix is None or token_ids is None or not prefix.num_tokens <= num_tokens
                or len(token_ids) < prefix.num_tokens
                or tokens_digest(np.asarray(token_ids[:prefix.num_tokens], dtype=np.int64))
                != prefix.tokens_hash):
            self.counters["prefix_fallbacks"] += 1
            return None
        self.counters["prefix_omitted"] += 1
        return prefix

