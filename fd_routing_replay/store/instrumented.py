"""Timing and counting for any store, in one wrapper applied once.

Backends stay free of metrics code; :class:`InstrumentedStore` wraps every method of the
:class:`RoutingStore` interface (a test checks that none is missed) and records calls,
errors, bytes and latency per operation in a :class:`StoreMetrics`.  ``open_store`` wraps
every store it opens (``instrument=False`` or ``store.metrics: false`` to opt out) with the
:class:`StoreMetrics` shared by its namespace and backend in ``prometheus_client``'s default
registry (:func:`fd_routing_replay.metrics.store_metrics_for`); the writer ships its
worker's snapshot to its own registry.  Both render through
:func:`fd_routing_replay.metrics.render_store`.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from fd_routing_replay.metrics import STORE_LATENCY_BUCKETS
from fd_routing_replay.store.base import Buffer, RoutingStore

OPERATIONS = ("put", "put_parts", "get", "exists", "delete", "delete_prefix", "list", "clear",
              "read_ranges", "get_many")
"""Timed calls: the RoutingStore interface plus the optional ``read_ranges`` and
``get_many`` capabilities."""
_LATENCY_WINDOW = 10_000


class StoreMetrics:
    """Per-operation calls, errors, latency histogram (Prometheus buckets) and a window of
    recent latencies (seconds) for percentiles; plain numbers, exported by a collector."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls = dict.fromkeys(OPERATIONS, 0)
        self.errors = dict.fromkeys(OPERATIONS, 0)
        self.seconds = dict.fromkeys(OPERATIONS, 0.0)
        self.buckets = {op: [0] * len(STORE_LATENCY_BUCKETS) for op in OPERATIONS}
        self.bytes_written = 0
        self.bytes_read = 0
        self._latency: dict[str, deque[float]] = {
            op: deque(maxlen=_LATENCY_WINDOW) for op in OPERATIONS}

    def observe(self, op: str, seconds: float, failed: bool) -> None:
        slot = bisect.bisect_left(STORE_LATENCY_BUCKETS, seconds)
        with self._lock:
            self.calls[op] += 1
            self.seconds[op] += seconds
            if slot < len(STORE_LATENCY_BUCKETS):
                self.buckets[op][slot] += 1
            self._latency[op].append(seconds)
            if failed:
                self.errors[op] += 1

    def add_bytes(self, written: int = 0, read: int = 0) -> None:
        with self._lock:
            self.bytes_written += written
            self.bytes_read += read

    def latency_quantiles(self, op: str, quantiles: Sequence[float] = (0.5, 0.99)) -> list[float]:
        """Quantiles (seconds) over the recent window; NaN when the op was never called."""
        with self._lock:
            window = np.fromiter(self._latency[op], dtype=np.float64)
        if window.size == 0:
            return [float("nan")] * len(quantiles)
        return [float(q) for q in np.quantile(window, quantiles)]

    def snapshot(self) -> dict[str, Any]:
        """Plain numbers (they cross the writer's process boundary as a msgpack message)."""
        with self._lock:
            return {"calls": dict(self.calls), "errors": dict(self.errors),
                    "seconds": dict(self.seconds),
                    "buckets": {op: list(counts) for op, counts in self.buckets.items()},
                    "bytes_written": self.bytes_written, "bytes_read": self.bytes_read}


class InstrumentedStore(RoutingStore):
    """Delegates to ``inner`` and records metrics for every call."""

    def __init__(self, inner: RoutingStore, metrics: StoreMetrics | None = None) -> None:
        super().__init__(inner.namespace)
        self.inner = inner
        self.scheme = inner.scheme  # type: ignore[misc]
        self.metrics = metrics or StoreMetrics()

    def __getattr__(self, name: str) -> Any:
        # Backend-specific capabilities (fsck's ``index``, the local store's ``root``, ...)
        # pass through untimed; the RoutingStore interface and ``read_ranges`` are counted.
        if name == "inner":
            raise AttributeError(name)
        value = getattr(self.inner, name)
        if name == "read_ranges":
            return self._read_ranges
        if name == "get_many":
            return self._get_many
        return value

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
