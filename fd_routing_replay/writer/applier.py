"""The writer's store side: one attempt at one operation, and the store it goes to.

:class:`StoreApplier` owns the writer generation's store connection (opened on first
use; failing to open is transient, so records wait in the journal until it opens) and
applies a put, delete, prefix delete or retirement once: the caller
(:class:`~fd_routing_replay.writer.worker.Worker`) decides about retries, the journal and
dead letters.  Puts are encoded here, in the writer, never on the engine's thread; a put
replayed from the journal is stored from its ``.rr`` file; a put of a tail (prefix
omission) is completed from the stored previous turn first.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from fd_routing_replay.codec import RecordFormat, RoutingRecord, decode_record, read_header
from fd_routing_replay.errors import RecordError, TransientStoreError
from fd_routing_replay.store.base import RoutingStore
from fd_routing_replay.store.instrumented import InstrumentedStore
from fd_routing_replay.store.metrics import StoreMetrics
from fd_routing_replay.writer.encoding import encode_for_store
from fd_routing_replay.writer.journal import Journal
from fd_routing_replay.writer.logs import RateLimitedLog
from fd_routing_replay.writer.operation import Operation, OperationKind
from fd_routing_replay.writer.prefix import complete_record
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

    def encoded(self, op: Operation) -> tuple[bytes, memoryview]:
        """The rr-v1 parts of a ring-backed put, encoded once for all its attempts."""
        if op.encoded is None:
            op.encoded = self.encode(op.view, op.fmt, op.label)
        return op.encoded

    def encode(self, record: RoutingRecord, fmt: str, label: str) -> tuple[bytes, memoryview]:
        """rr-v1 parts in the configured encoding — here, in the writer, never on the
        engine's thread (:func:`~fd_routing_replay.writer.encoding.encode_for_store`; a
        record the set encoding cannot hold is written plain, with a log line)."""
        def fallback(exc: Exception) -> None:
            self._error_log.log(logging.WARNING, "set-encoding",
                                "routing writer: %s is written with the plain encoding: %s",
                                label, exc)

        converts = self._store is not None and self._store.converts_records()
        return encode_for_store(record, encoding=self.settings.encoding, record_format=fmt,
                                converts=converts, on_fallback=fallback)

    def apply(self, op: Operation) -> tuple[int, float]:
        """One attempt at ``op``; returns (bytes written, seconds in the store call)."""
        store = self.store()
        if op.kind == OperationKind.RETIRE:
            start = time.perf_counter()
            op.retired = retire_turn(store, op.rollout_id, op.layer_count,
                                     partials=self.settings.partials)
            return 0, time.perf_counter() - start
        if op.kind == OperationKind.PUT and op.prefix_key:
            return self._apply_tail(op, store)
        if op.kind == OperationKind.PUT:
            # A store that converts records itself (FastDeploy's local layout) takes rr-v1.
            whole = op.fmt == RecordFormat.RR_V1 or store.converts_records()
            if op.entry is not None:
                data = self.journal.read_record(op.entry)
                record = decode_record(data, verify=True)
                parts = [data] if whole else [record.ids.reshape(-1).view(np.uint8)]
                if (whole and op.fmt == RecordFormat.RR_V1 and self.settings.encoding != "plain"
                        and read_header(data).encoding == "plain"):  # spilled by the engine
                    parts = list(self.encode(record, op.fmt, op.label))
            else:
                head, payload = self.encoded(op)
                parts = [head, payload] if whole else [payload]
            start = time.perf_counter()
            store.put_parts(op.key, parts)
            return sum(memoryview(p).nbytes for p in parts), time.perf_counter() - start
        start = time.perf_counter()
        if op.kind == OperationKind.DELETE:
            store.delete(op.targets)
        else:
            store.delete_prefix(op.targets)
        return 0, time.perf_counter() - start

    def _apply_tail(self, op: Operation, store: RoutingStore) -> tuple[int, float]:
        """A put whose ids continue the stored previous turn (prefix omission): read that
        record back, check it is the one the engine meant, store the whole record.  A
        store error while reading is transient (retried); a prefix that is missing or
        not the expected one is a RecordError (dead letter, nothing written wrong)."""
        prefix = op.prefix
        tail = (decode_record(self.journal.read_record(op.entry), verify=True)
                if op.entry is not None else op.view)
        start = time.perf_counter()
        data = store.get(prefix.rollout_id)
        if data is None:
            raise RecordError(f"record of {op.key!r} was handed over without its first "
                              f"{prefix.num_tokens} positions, but the previous turn "
                              f"{prefix.rollout_id!r} is no longer stored")
        full = complete_record(decode_record(data, verify=True), tail, prefix)
        parts = list(self.encode(full, op.fmt, op.label))
        store.put_parts(op.key, parts)
        return sum(memoryview(p).nbytes for p in parts), time.perf_counter() - start
