"""The writer's numbers, kept once and shown twice: ``stats()`` and Prometheus.

Each writer owns a ``CollectorRegistry`` (two writers in one process never clash) and may
serve it over HTTP.  Counters are exported with the ``_total`` suffix Prometheus adds;
``stats()`` returns the same values under the short names listed in
:data:`COUNTERS` and :data:`GAUGES`, plus latency percentiles over a recent window.
Every family carries the labels of :data:`fd_routing_replay.metrics.LABELS`; the same
registry exports the writer's store calls and, when a capture manager hands its records to
this writer, the capture counters (:meth:`WriterMetrics.add_source`).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from fd_routing_replay.metrics import SnapshotCollector, labels_for
from fd_routing_replay.store.metrics import render_store

PREFIX = "fd_rr_writer"
_WINDOW = 10_000

COUNTERS: dict[str, str] = {
    "submitted": "Valid submissions: puts (dropped ones included) and deletes",
    "rejected": "Submissions refused by validation (bad record or key)",
    "written": "Puts acknowledged by the store",
    "written_bytes": "Bytes of records acknowledged by the store",
    "deleted": "Delete operations applied by the store",
    "retries": "Store calls repeated after a transient failure",
    "store_errors": "Store calls that failed",
    "spilled": "Operations moved to the journal (engine side or writer side)",
    "dropped": "Puts dropped: full_policy=drop, or neither memory nor the journal could take "
               "them (see dropped_journal_full)",
    "dropped_journal_full": "Puts dropped because the writer's memory was full and the journal "
                            "could not take them within block_timeout_s (also in dropped)",
    "dead_lettered": "Operations the store rejected permanently (kept in dead_letter_dir)",
    "restarts": "Writer processes/threads restarted after dying",
    "submit_waits": "Submits that had to wait for room (full_policy=block, or records waiting "
                    "for a slow or failing journal)",
    "superseded": "Puts of a turn stored after a later turn of the same rollout, deleted again "
                  "(only_last_turn)",
    "records_incomplete": "Records built from an engine's rows with tokens lacking routing (lost "
                          "during capture); stored, with the fill value there and the count in "
                          "their metadata's missing_tokens",
}
GAUGES: dict[str, str] = {
    "queue_bytes": "Payload bytes waiting in memory (ring and spill queue)",
    "pending_ops": "Submitted operations not yet finished (in memory or in the journal)",
    "journal_entries": "Operations waiting in the journal for the store",
    "blocked_submits": "Submits currently waiting for room (full_policy=block, or the journal)",
}
HISTOGRAMS: dict[str, str] = {
    "put_latency_seconds": "Store put call latency (successful puts)",
    "submit_latency_seconds": "Time submit_put spends on the caller's thread",
}
_LATENCY_BUCKETS = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05,
                    0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class WriterMetrics:
    """Thread-safe counters, gauges and latency windows for one writer."""

    def __init__(self, labels: Mapping[str, str] | None = None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self._lock = threading.Lock()
        self.registry = CollectorRegistry()
        self.counts = dict.fromkeys(COUNTERS, 0)
        self._gauge_sources: dict[str, Callable[[], float]] = {}
        self._put_latency: deque[float] = deque(maxlen=_WINDOW)
        self._submit_latency: deque[float] = deque(maxlen=_WINDOW)
        self.store_calls: dict[str, Any] = {}
        self.labels = dict(labels or labels_for("", ""))
        names, values = list(self.labels), list(self.labels.values())

        def child(family: Any) -> Any:
            return family.labels(*values)

        self._counters = {name: child(Counter(f"{PREFIX}_{name}", doc, names, registry=self.registry))
                          for name, doc in COUNTERS.items()}
        self._gauges = {name: child(Gauge(f"{PREFIX}_{name}", doc, names, registry=self.registry))
                        for name, doc in GAUGES.items()}
        self._put_hist, self._submit_hist = (
            child(Histogram(f"{PREFIX}_{name}", doc, names, registry=self.registry,
                            buckets=_LATENCY_BUCKETS))
            for name, doc in HISTOGRAMS.items())
        self.add_source(lambda: self.store_calls, render_store)

    def add_source(self, source: Callable[[], Mapping[str, Any] | None],
                   render: Callable[..., Any]) -> Any:
        """Export ``render(source(), labels)`` at each scrape (e.g. a capture manager's
        ``stats`` with :func:`~fd_routing_replay.capture.render_capture`); returns the
        collector, for :meth:`remove_source`."""
        collector = SnapshotCollector(source, render, self.labels)
        self.registry.register(collector)
        return collector

    def remove_source(self, collector: Any) -> None:
        self.registry.unregister(collector)

    def inc(self, name: str, amount: int = 1) -> None:
        if amount <= 0:
            return
        with self._lock:
            self.counts[name] += amount
        self._counters[name].inc(amount)

    def bind_gauge(self, name: str, source: Callable[[], float]) -> None:
        """Read gauge ``name`` from ``source()`` whenever it is scraped or snapshotted
        (no per-event updates on the hot path)."""
        self._gauge_sources[name] = source
        self._gauges[name].set_function(source)

    def observe_put(self, seconds: float) -> None:
        with self._lock:
            self._put_latency.append(seconds)
        self._put_hist.observe(seconds)

    def add(self, counts: dict[str, int], put_latencies: list[float]) -> None:
        """Apply a batch of counter increments and put latencies at once."""
        for name, amount in counts.items():
            self.inc(name, amount)
        for seconds in put_latencies:
            self.observe_put(seconds)

    def observe_submit(self, seconds: float) -> None:
        with self._lock:
            self._submit_latency.append(seconds)
        self._submit_hist.observe(seconds)

    def set_store_calls(self, snapshot: dict[str, Any]) -> None:
        with self._lock:
            self.store_calls = snapshot

    @staticmethod
    def _quantiles(window: deque[float]) -> tuple[float, float]:
        if not window:
            return float("nan"), float("nan")
        p50, p99 = np.quantile(np.fromiter(window, dtype=np.float64), (0.5, 0.99))
        return float(p50), float(p99)

    def snapshot(self) -> dict[str, Any]:
        """Every counter and gauge by short name, latency percentiles (ms), store calls."""
        gauges = {name: source() for name, source in self._gauge_sources.items()}
        with self._lock:
            out: dict[str, Any] = {**self.counts, **gauges}
            put = self._quantiles(self._put_latency)
            submit = self._quantiles(self._submit_latency)
            out["store_calls"] = dict(self.store_calls)
        out["put_latency_p50_ms"], out["put_latency_p99_ms"] = (v * 1e3 for v in put)
        out["submit_latency_p50_ms"], out["submit_latency_p99_ms"] = (v * 1e3 for v in submit)
        return out

    def serve(self, port: int, addr: str = "0.0.0.0") -> Any:
        """Serve ``/metrics`` on ``addr:port``; returns the server (``shutdown()`` to stop)."""
        from prometheus_client import start_http_server

        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return server
