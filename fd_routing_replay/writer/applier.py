"""The writer's store side: one attempt at one operation, and the store it goes to.

:class:`StoreApplier` owns the writer generation's store connection (opened on first
use; failing to open is transient, so records wait in the journal until it opens) and
applies a put, delete, prefix delete or retirement once: the caller
(:class:`~fd_routing_replay.writer.worker.Worker`) decides about retries, the journal and
dead letters.  Puts are built (:func:`~fd_routing_replay.writer.record.build_record`) and
encoded here, in the writer, never on the engine's thread; a put replayed from the journal
is built from its ``.rr`` file (the record as submitted); a put of a tail (prefix omission)
is completed from the stored previous turn first.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from fd_routing_replay.codec import RecordFormat, RoutingRecord, decode_record, encode_record_parts
from fd_routing_replay.errors import TransientStoreError
from fd_routing_replay.store.base import RoutingStore
from fd_routing_replay.store.instrumented import InstrumentedStore
from fd_routing_replay.store.metrics import StoreMetrics
from fd_routing_replay.writer.journal import Journal
from fd_routing_replay.writer.logs import RateLimitedLog
from fd_routing_replay.writer.operation import Operation, OperationKind
from fd_routing_replay.writer.record import build_record, encode_for_store
from fd_routing_replay.writer.settings import WorkerSettings
from fd_routing_replay.writer.turns import retire_turn

__all__ = ["StoreApplier"]

log = logging.getLogger("fd_routing_replay.writer")


class StoreApplier:
    """Applies operations to the store of one writer generation (see the module docstring).

    ``store`` injects an already open store (tests); otherwise ``settings.store`` is
    opened on first use.  ``store_metrics`` counts the store calls for the engine side.
    """

    def __init__(self, settings: WorkerSettings, journal: Journal, *,
                 store: RoutingStore | None = None) -> None:
        self.settings = settings
        self.journal = journal
        self.store_metrics = StoreMetrics()
        self._store: RoutingStore | None = (
            InstrumentedStore(store, self.store_metrics) if store is not None else None)
        self._clear_pending = settings.clear_on_start
        self._open_error: str | None = None
        self._error_log = RateLimitedLog(log)
        self.incomplete = 0    # records built with tokens lacking routing, not yet reported

    def close(self) -> None:
        """Close the store if it was opened; never raises (it must not mask the real exit)."""
        if self._store is not None:
            try:
                self._store.close()
            except Exception:  # noqa: BLE001 - closing must not mask the real exit
                pass

    def store(self) -> RoutingStore:
        """The store, opened on first use; any failure to open is transient (spill)."""
        if self._store is None:
            from fd_routing_replay.store import open_store

            try:
                opened = open_store(self.settings.store, instrument=False)
                if self.settings.record_ttl_s > 0 and opened.supports_expiry():
                    opened.expire_records_after(self.settings.record_ttl_s)
                self._store = InstrumentedStore(opened, self.store_metrics)
            except Exception as exc:  # noqa: BLE001 - fixable later; never dead-letter for it
                message = f"cannot open the store: {type(exc).__name__}: {exc}"
                if message != self._open_error:
                    log.error("routing writer: %s; records are kept in %s until it opens",
                              message, self.journal.directory)
                    self._open_error = message
                raise TransientStoreError(message) from exc
            self._open_error = None
        if self._clear_pending:
            try:
                removed = self._store.clear()
            except Exception as exc:  # noqa: BLE001 - not the operation's fault: retry
                raise TransientStoreError(f"clear_on_start failed: {exc}") from exc
            self._clear_pending = False
            log.warning("routing writer: clear_on_start removed %d records from namespace %s",
                        removed, self._store.namespace)
        return self._store

    def raw(self, op: Operation) -> RoutingRecord:
        """The record as submitted: around the ring's ids, or read back from the journal."""
        if op.entry is not None:
            return decode_record(self.journal.read_record(op.entry), verify=True)
        return op.view if op.view is not None else op.record()

    def raw_parts(self, op: Operation) -> list[memoryview | bytes]:
        """The rr-v1 parts of the record as submitted, for the journal or a dead letter (the
        record is built again when it is replayed)."""
        return list(encode_record_parts(self.raw(op)))

    def encoded(self, op: Operation, store: RoutingStore) -> list[tuple[str, list[Any]]]:
        """``(key, parts)`` of every record the put stores, built (:func:`build_record`) and
        encoded once for all its attempts; the stored previous turn a tail continues is
        read from ``store`` (a store error there is transient; a previous turn that is gone
        or not the one the engine meant is a RecordError: dead letter, nothing written wrong)."""
        if op.encoded is None:
            previous = None
            if op.prefix_key:
                data = store.get(op.prefix_key)
                previous = None if data is None else decode_record(data, verify=True)
            records = build_record(op, self.raw(op), previous)
            whole = op.fmt == RecordFormat.RR_V1 or store.converts_records()
            out = []
            for key, record in records:
                if whole:
                    out.append((key, list(self.encode(record, op.fmt, op.label, store))))
                else:            # FastDeploy's raw bytes (already padded by the build)
                    out.append((key, [record.ids.reshape(-1).view(np.uint8)]))
            missing = records[0][1].metadata.get("missing_tokens") if op.rows else None
            if missing:
                self.incomplete += 1
                log.warning("routing replay: rollout %s has %d of %d tokens without routing "
                            "(stored with the fill value)", op.rollout_id, missing,
                            records[0][1].metadata.get("num_tokens", records[0][1].num_tokens))
            op.encoded = out
        return op.encoded

    def encode(self, record: RoutingRecord, fmt: str, label: str,
               store: RoutingStore | None = None) -> tuple[bytes, memoryview]:
        """rr-v1 parts in the configured encoding — here, in the writer, never on the
        engine's thread (:func:`~fd_routing_replay.writer.record.encode_for_store`; a
        record the set encoding cannot hold is written plain, with a log line)."""
        def fallback(exc: Exception) -> None:
            self._error_log.log(logging.WARNING, "set-encoding",
                                "routing writer: %s is written with the plain encoding: %s",
                                label, exc)

        converts = store is not None and store.converts_records()
        return encode_for_store(record, encoding=self.settings.encoding, record_format=fmt,
                                converts=converts, on_fallback=fallback)

    def apply(self, op: Operation) -> tuple[int, float]:
        """One attempt at ``op``; returns (bytes written, seconds in the store calls)."""
        store = self.store()
        start = time.perf_counter()
        if op.kind == OperationKind.RETIRE:
            op.retired = retire_turn(store, op.rollout_id, op.layer_count,
                                     partials=self.settings.partials)
            return 0, time.perf_counter() - start
        if op.kind == OperationKind.PUT:
            encoded = self.encoded(op, store)
            start = time.perf_counter()
            for key, parts in encoded:
                store.put_parts(key, parts)
            return (sum(memoryview(p).nbytes for _, parts in encoded for p in parts),
                    time.perf_counter() - start)
        if op.kind == OperationKind.DELETE:
            store.delete(op.targets)
        else:
            store.delete_prefix(op.targets)
        return 0, time.perf_counter() - start
