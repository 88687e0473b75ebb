"""Timing and counting for any store, in one wrapper applied once.

Backends stay free of metrics code; :class:`InstrumentedStore` wraps every method of the
:class:`RoutingStore` interface (a test checks that none is missed) and records calls,
errors, bytes and latency per operation in a :class:`StoreMetrics`.  ``open_store`` wraps
every store it opens (``instrument=False`` or ``store.metrics: false`` to opt out) with the
:class:`StoreMetrics` shared by its namespace and backend in ``prometheus_client``'s default
registry (:func:`fd_routing_replay.store.metrics.store_metrics_for`); the writer ships its
worker's snapshot to its own registry.  Both render through
:func:`fd_routing_replay.store.metrics.render_store`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

from fd_routing_replay.store.base import Buffer, RoutingStore
from fd_routing_replay.store.metrics import StoreMetrics


class TimedRanges:
    """An ``open_ranges`` view whose reads are timed and counted as ``read_ranges``."""

    def __init__(self, view: Any, timed: Any, metrics: StoreMetrics) -> None:
        self.view = view
        self.size = view.size
        self._timed = timed
        self._metrics = metrics

    def read(self, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        parts = self._timed("read_ranges", self.view.read, ranges)
        self._metrics.add_bytes(read=sum(len(part) for part in parts))
        return parts

    def unchanged(self) -> bool:
        return self.view.unchanged()

    def close(self) -> None:
        self.view.close()

    def __enter__(self) -> TimedRanges:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class InstrumentedStore(RoutingStore):
    """Delegates to ``inner`` and records metrics for every call."""

    def __init__(self, inner: RoutingStore, metrics: StoreMetrics | None = None) -> None:
        super().__init__(inner.namespace)
        self.inner = inner
        self.scheme = inner.scheme  # type: ignore[misc]
        self.metrics = metrics or StoreMetrics()

    def __getattr__(self, name: str) -> Any:
        # Backend-specific capabilities (fsck's ``index``, the local store's ``root``, ...)
        # pass through untimed; the RoutingStore interface, ``read_ranges`` and the reads of an
        # ``open_ranges`` view are counted.
        if name == "inner":
            raise AttributeError(name)
        value = getattr(self.inner, name)
        if name == "read_ranges":
            return self._read_ranges
        if name == "get_many":
            return self._get_many
        if name == "open_ranges":
            return self._open_ranges
        return value

    def _open_ranges(self, key: str) -> TimedRanges | None:
        view = self._timed("read_ranges", self.inner.open_ranges, key)  # type: ignore[attr-defined]
        return None if view is None else TimedRanges(view, self._timed, self.metrics)

    def _get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        values = self._timed("get_many", self.inner.get_many, keys)  # type: ignore[attr-defined]
        self.metrics.add_bytes(read=sum(memoryview(v).nbytes for v in values if v is not None))
        return values

    def _read_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes] | None:
        parts = self._timed("read_ranges", self.inner.read_ranges, key, ranges)  # type: ignore[attr-defined]
        if parts is not None:
            self.metrics.add_bytes(read=sum(len(part) for part in parts))
        return parts

    def _timed(self, op: str, fn: Any, *args: Any) -> Any:
        start = time.perf_counter()
        failed = True
        try:
            result = fn(*args)
            failed = False
            return result
        finally:
            self.metrics.observe(op, time.perf_counter() - start, failed)

    def put(self, key: str, value: Buffer) -> None:
        self._timed("put", self.inner.put, key, value)
        self.metrics.add_bytes(written=memoryview(value).nbytes)

    def put_parts(self, key: str, parts: Sequence[Buffer]) -> None:
        self._timed("put_parts", self.inner.put_parts, key, parts)
        self.metrics.add_bytes(written=sum(memoryview(p).nbytes for p in parts))

    def get(self, key: str) -> bytes | memoryview | None:
        value = self._timed("get", self.inner.get, key)
        if value is not None:
            self.metrics.add_bytes(read=memoryview(value).nbytes)
        return value

    def exists(self, key: str) -> bool:
        return self._timed("exists", self.inner.exists, key)

    def delete(self, keys: Iterable[str]) -> int:
        return self._timed("delete", self.inner.delete, keys)

    def delete_prefix(self, prefixes: Iterable[str]) -> dict[str, int]:
        return self._timed("delete_prefix", self.inner.delete_prefix, prefixes)

    def list(self, prefix: str | None = None) -> list[str]:
        return self._timed("list", self.inner.list, prefix)

    def clear(self) -> int:
        return self._timed("clear", self.inner.clear)

    def close(self) -> None:
        self.inner.close()

    def describe(self) -> str:
        return self.inner.describe()

    def supports_fsync(self) -> bool:
        return self.inner.supports_fsync()

    def supports_cross_process(self) -> bool:
        return self.inner.supports_cross_process()

    def converts_records(self) -> bool:
        return self.inner.converts_records()

    def supports_expiry(self) -> bool:
        return self.inner.supports_expiry()

    def expire_records_after(self, ttl_s: float) -> None:
        self.inner.expire_records_after(ttl_s)

    def supports_list_namespaces(self) -> bool:
        return self.inner.supports_list_namespaces()

    def list_namespaces(self) -> list[str]:
        return self.inner.list_namespaces()
