"""The store calls' metric table: :class:`StoreMetrics` (calls, errors, latency, bytes per
operation), how a snapshot of it renders, and one shared instance per label set and registry."""

from __future__ import annotations

import bisect
import threading
import weakref
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from fd_routing_replay.metrics import LABELS, SnapshotCollector

__all__ = ["OPERATIONS", "STORE_LATENCY_BUCKETS", "STORE_PREFIX", "StoreMetrics", "StoreMetricsHub",
           "render_store", "store_metrics_for"]

STORE_PREFIX = "fd_rr_store"
STORE_LATENCY_BUCKETS = (1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)
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


def render_store(snapshot: Mapping[str, Any], labels: Mapping[str, str]) -> Iterator[Any]:
    """Families for a :meth:`StoreMetrics.snapshot` dict: per-operation latency histogram
    (its ``_count`` is the number of calls), errors and bytes moved."""
    from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

    names, values = list(labels), list(labels.values())
    seconds = HistogramMetricFamily(f"{STORE_PREFIX}_operation_seconds",
                                    "Store call latency by operation", labels=names + ["op"])
    errors = CounterMetricFamily(f"{STORE_PREFIX}_errors", "Store calls that raised, by operation",
                                 labels=names + ["op"])
    for op, calls in snapshot.get("calls", {}).items():
        counts = snapshot.get("buckets", {}).get(op)
        if counts is None:
            continue
        cumulative, buckets = 0, []
        for bound, count in zip(STORE_LATENCY_BUCKETS, counts, strict=True):
            cumulative += count
            buckets.append((repr(float(bound)), cumulative))
        buckets.append(("+Inf", calls))
        seconds.add_metric(values + [op], buckets, snapshot.get("seconds", {}).get(op, 0.0))
        errors.add_metric(values + [op], snapshot.get("errors", {}).get(op, 0))
    yield seconds
    yield errors
    for direction in ("written", "read"):
        family = CounterMetricFamily(f"{STORE_PREFIX}_{direction}_bytes",
                                     f"Bytes {direction} through the store", labels=names)
        family.add_metric(values, float(snapshot.get(f"bytes_{direction}", 0)))
        yield family


class StoreMetricsHub:
    """One :class:`~fd_routing_replay.store.instrumented.StoreMetrics` per label set in one
    registry: stores opened with the same namespace and backend add to the same counters,
    so they stay monotonic when a store is closed and another one opened."""

    def __init__(self, registry: Any) -> None:
        self._lock = threading.Lock()
        self._metrics: dict[tuple[str, ...], Any] = {}
        self._registry = registry

    def metrics_for(self, labels: Mapping[str, str]) -> Any:
        key = tuple(labels[name] for name in LABELS)
        with self._lock:
            metrics = self._metrics.get(key)
            if metrics is None:
                metrics = self._metrics[key] = StoreMetrics()
                self._registry.register(SnapshotCollector(metrics.snapshot, render_store, labels))
            return metrics


_hubs: weakref.WeakKeyDictionary[Any, StoreMetricsHub] = weakref.WeakKeyDictionary()
_hubs_lock = threading.Lock()


def store_metrics_for(labels: Mapping[str, str], registry: Any = None) -> Any:
    """The shared :class:`StoreMetrics` of ``labels`` in ``registry`` (default:
    ``prometheus_client.REGISTRY``), registered for export on first use."""
    if registry is None:
        from prometheus_client import REGISTRY as registry
    with _hubs_lock:
        hub = _hubs.get(registry)
        if hub is None:
            hub = _hubs[registry] = StoreMetricsHub(registry)
    return hub.metrics_for(labels)
