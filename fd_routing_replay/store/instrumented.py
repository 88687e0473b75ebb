"""Timing and counting for any store, in one wrapper applied once.

Backends stay free of metrics code; :class:`InstrumentedStore` wraps every method of the
:class:`RoutingStore` interface (a test checks that none is missed) and records calls,
errors, bytes and latency per operation.  With ``prometheus_client`` and a registry it
also exports them.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from fd_routing_replay.store.base import Buffer, RoutingStore

OPERATIONS = ("put", "put_parts", "get", "exists", "delete", "delete_prefix", "list", "clear")
_LATENCY_WINDOW = 10_000


class StoreMetrics:
    """Per-operation counters and a window of recent latencies (seconds)."""

    def __init__(self, registry: Any | None = None, prefix: str = "fd_rr_store") -> None:
        self._lock = threading.Lock()
        self.calls = dict.fromkeys(OPERATIONS, 0)
        self.errors = dict.fromkeys(OPERATIONS, 0)
        self.bytes_written = 0
        self.bytes_read = 0
        self._latency: dict[str, deque[float]] = {
            op: deque(maxlen=_LATENCY_WINDOW) for op in OPERATIONS}
        self._prom = None
        if registry is not None:
            from prometheus_client import Counter, Histogram

            self._prom = {
                "seconds": Histogram(f"{prefix}_operation_seconds", "Store call latency",
                                     ["op"], registry=registry,
                                     buckets=(1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1,
                                              0.5, 1, 5)),
                "errors": Counter(f"{prefix}_errors", "Store calls that raised", ["op"],
                                  registry=registry),
                "bytes": Counter(f"{prefix}_bytes", "Bytes moved", ["direction"],
                                 registry=registry),
            }

    def observe(self, op: str, seconds: float, failed: bool) -> None:
        with self._lock:
            self.calls[op] += 1
            self._latency[op].append(seconds)
            if failed:
                self.errors[op] += 1
        if self._prom is not None:
            self._prom["seconds"].labels(op).observe(seconds)
            if failed:
                self._prom["errors"].labels(op).inc()

    def add_bytes(self, written: int = 0, read: int = 0) -> None:
        with self._lock:
            self.bytes_written += written
            self.bytes_read += read
        if self._prom is not None:
            if written:
                self._prom["bytes"].labels("written").inc(written)
            if read:
                self._prom["bytes"].labels("read").inc(read)

    def latency_quantiles(self, op: str, quantiles: Sequence[float] = (0.5, 0.99)) -> list[float]:
        """Quantiles (seconds) over the recent window; NaN when the op was never called."""
        with self._lock:
            window = np.fromiter(self._latency[op], dtype=np.float64)
        if window.size == 0:
            return [float("nan")] * len(quantiles)
        return [float(q) for q in np.quantile(window, quantiles)]

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"calls": dict(self.calls), "errors": dict(self.errors),
                    "bytes_written": self.bytes_written, "bytes_read": self.bytes_read}


class InstrumentedStore(RoutingStore):
    """Delegates to ``inner`` and records metrics for every call."""

    def __init__(self, inner: RoutingStore, metrics: StoreMetrics | None = None) -> None:
        super().__init__(inner.namespace)
        self.inner = inner
        self.scheme = inner.scheme  # type: ignore[misc]
        self.metrics = metrics or StoreMetrics()

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

    def supports_list_namespaces(self) -> bool:
        return self.inner.supports_list_namespaces()

    def list_namespaces(self) -> list[str]:
        return self.inner.list_namespaces()
