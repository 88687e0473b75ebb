"""Where a finished request's gathered rows become records and reach the sink.

Both generations' finishing paths end here: the table-API manager
(:class:`~fd_routing_replay.capture.manager.RoutingReplayManager`) and FastDeploy 2.6's
engine side (:class:`~fd_routing_replay.capture.finisher.SlotRecordFinisher`) gather a
request's rows on the engine's thread (they must, before its KV slots are reused) and
hand them to :meth:`RecordOutlet.submit`; building the record(s), counting rows without
routing, stamping provenance and the sink's ``put`` (encode + store write, or the hand-off
to the background writer) run on the outlet's
:class:`~fd_routing_replay.capture.handoff.FinishingThread`, in submission order.
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import replace
from typing import Any

import numpy as np

from fd_routing_replay.capture.assembly import AssembledRecord, RecordAssembler, report_gaps
from fd_routing_replay.capture.handoff import FinishingThread, flush_after
from fd_routing_replay.codec.provenance import Provenance, tokens_digest

__all__ = ["RecordOutlet"]

logger = logging.getLogger(__name__)


class RecordOutlet:
    """Gathered rows -> records -> ``sink.put``, off the engine's thread.

    ``counters`` is the owner's counter table: ``records_submitted``, ``records_failed``
    and ``records_incomplete`` change here, on either thread, through :meth:`count`.
    ``provenance``: stamped on every record (the assembler's own otherwise).
    ``inline=True`` builds and puts on the caller's thread.
    """

    def __init__(self, assembler: RecordAssembler, sink: Any, counters: dict[str, Any], *,
                 provenance: Provenance | None = None, name: str = "fdrr-finish",
                 inline: bool = False) -> None:
        self.assembler = assembler
        self.sink = sink
        self.counters = counters
        self.provenance = provenance
        self.finishing = FinishingThread(name=name, inline=inline)
        self._lock = threading.Lock()

    def count(self, key: str, amount: int = 1) -> None:
        """Change a counter the engine's and the finishing thread both change."""
        with self._lock:
            self.counters[key] += amount

    def build(self, rollout_id: str, request_id: str | None, ids: np.ndarray, *,
              tokens: np.ndarray | None = None) -> AssembledRecord:
        """The record(s) of gathered ``ids``; ``tokens`` (the forwarded token ids) stamp
        their hash into the provenance.  Gaps are counted and logged."""
        assembled = report_gaps(self.assembler.build(rollout_id, ids, request_id=request_id), self.count)
        provenance = self.provenance
        if tokens is not None:
            provenance = replace(provenance or self.assembler.provenance, tokens_hash=tokens_digest(tokens))
        if provenance is not None:
            assembled.items[:] = [(key, replace(record, provenance=provenance))
                                  for key, record in assembled.items]
        return assembled

    def submit(self, rollout_id: str, request_id: str | None, ids: np.ndarray, *,
               tokens: np.ndarray | None = None, prefix: Any = None) -> None:
        """Build and put the record(s) of ``ids`` (owned by the outlet from now on) on the
        finishing thread; ``prefix``: the stored previous turn they continue
        (:meth:`~fd_routing_replay.capture.sink.WriterSink.durable_prefix`)."""
        self.finishing.submit(functools.partial(self._deliver, rollout_id, request_id, ids, tokens, prefix),
                              ids.nbytes)

    def _deliver(self, rollout_id: str, request_id: str | None, ids: np.ndarray,
                 tokens: np.ndarray | None, prefix: Any) -> None:
        try:
            assembled = self.build(rollout_id, request_id, ids, tokens=tokens)
            for key, record in assembled.items:
                if prefix is None:
                    self.sink.put(key, record)
                else:
                    self.sink.put(key, record, prefix=prefix)
            self.count("records_submitted")
        except Exception as exc:
            self.count("records_failed")
            logger.error("routing replay: could not assemble or submit the record of rollout %s "
                         "(request %s): %r", rollout_id, request_id, exc)

    # ------------------------------------------------------------------ lifecycle
    def wait_finished(self, timeout: float | None = None) -> bool:
        """Wait until every submitted request's records reached the sink."""
        return self.finishing.flush(timeout)

    def flush(self, timeout: float | None = None) -> bool:
        """:meth:`wait_finished`, then the sink's own flush (durable)."""
        return flush_after(self.finishing.flush, self.sink, timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Hand on what is in hand and stop the finishing thread (the sink stays open)."""
        return self.finishing.close(timeout)

    def stats(self) -> dict[str, Any]:
        return self.finishing.stats()
