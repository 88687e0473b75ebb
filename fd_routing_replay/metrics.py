"""Prometheus export for every part of the pipeline, from snapshots read at scrape time.

Capture, writer and store keep plain counters (cheap to bump on their own threads) and
expose them as a ``stats()``/``snapshot()`` dict.  A :class:`SnapshotCollector` turns such
a dict into metric families when Prometheus scrapes, so the hot path never touches
``prometheus_client`` and a snapshot shipped from another process (the writer process's
store calls) exports exactly like a local one.

Every family carries the labels :data:`LABELS`: ``namespace`` (the store namespace),
``store`` (the backend type) and ``rank`` (``dp{N}-tp{M}`` for a writer; empty for a
reader or the CLI).  :func:`metric_names` lists every family name this package can export;
the shipped Grafana dashboard and alert rules are checked against it.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

log = logging.getLogger(__name__)

LABELS = ("namespace", "store", "rank")

CAPTURE_PREFIX = "fd_rr_capture"
# stats() key of a capture manager (or FastDeploy 2.6's engine-side assembler) -> help text.
# Keys a given manager does not report are not exported by it.
CAPTURE_COUNTERS: dict[str, str] = {
    "registered": "Requests registered for capture",
    "re_registered": "Registrations of a request already registered (next chunk of a chunked prefill)",
    "cleared": "Requests cleared (finished, preempted or aborted)",
    "records_submitted": "Records handed to the writer (or the store)",
    "records_returned": "Records attached to the response (FastDeploy response mode)",
    "records_failed": "Finished requests whose record could not be built or submitted (lost)",
    "records_incomplete": "Records not written because part of their routing was missing or damaged",
    "invalid_request_ids": "Requests whose id carries no valid rollout id (not recorded)",
    "prefix_omitted": "Turns handed over without the stored previous turn's rows (prefix omission)",
    "prefix_fallbacks": "Turns t > 0 handed over whole although prefix omission is on (previous "
                        "turn not stored yet, or other tokens)",
    "slot_conflicts": "Registrations of a batch slot still held by another request",
    "hook_calls": "MoE-layer hook calls",
    "hook_errors": "MoE-layer hook calls that failed (the step's routing is marked damaged)",
    "hook_mismatches": "MoE-layer hook calls whose buffer did not match the bound geometry",
    "hook_seconds": "CPU seconds spent in the MoE-layer hook",
    "bad_expert_ids": "Expert ids out of range seen by the record kernel (not recorded)",
    "errors": "Capture steps that failed (counted, the engine step goes on)",
    "steps": "Engine steps captured",
    "tokens_offloaded": "Token rows copied from the device to the host slot cache",
    "unmapped_positions": "Token rows without a KV slot (not kept)",
    "suspended_skips": "Records not written while FD_SUSPEND_ROUTING_REPLAY=1",
    "damaged_steps": "Steps whose routing was lost or damaged (FastDeploy 2.6 step buffer)",
    "missing_layer_steps": "Steps in which a MoE layer did not record its rows (their requests "
                           "are marked incomplete)",
    "invalid_slots": "Slots marked unknown after a damaged step",
    "host_missing_steps": "Steps captured before the engine's shared slot cache existed",
    "capture_seconds": "CPU seconds spent capturing on the engine thread",
    "offload_seconds": "Seconds spent copying rows to the host slot cache",
}
CAPTURE_GAUGES: dict[str, str] = {
    "host_cache_bytes": "Bytes of the host slot cache",
    "capture_device_bytes": "Device memory held by the capture (step buffer and counters)",
    "step_buffer_rows": "Token rows of the device step buffer",
}

STORE_PREFIX = "fd_rr_store"
STORE_LATENCY_BUCKETS = (1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)


def labels_for(namespace: str, store: str, rank: str = "") -> dict[str, str]:
    """The label values every family of one component carries."""
    return {"namespace": namespace, "store": store, "rank": rank}


def rank_label(identity: Any) -> str:
    """``dp{N}-tp{M}`` for a resolved :class:`RankIdentity`; empty without one."""
    if identity is None:
        return ""
    return f"dp{identity.dp_rank}-tp{identity.tp_rank}"


def render_capture(snapshot: Mapping[str, Any], labels: Mapping[str, str]) -> Iterator[Any]:
    """Families for a capture ``stats()`` dict (only the keys it reports).

    ``snapshot["ranks"]`` (FastDeploy 2.6's engine: ``{rank label: stats}`` of its
    workers) adds one series per worker, labelled with that rank.
    """
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    sources = [(dict(labels), snapshot)]
    sources += [({**labels, "rank": rank}, stats)
                for rank, stats in sorted((snapshot.get("ranks") or {}).items())]
    for keys, kind in ((CAPTURE_COUNTERS, CounterMetricFamily), (CAPTURE_GAUGES, GaugeMetricFamily)):
        for key, doc in keys.items():
            family = None
            for series_labels, stats in sources:
                value = stats.get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    if family is None:
                        family = kind(f"{CAPTURE_PREFIX}_{key}", doc, labels=list(labels))
                    family.add_metric([series_labels[name] for name in labels], float(value))
            if family is not None:
                yield family


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


class SnapshotCollector:
    """A ``prometheus_client`` collector that renders ``source()`` at each scrape.

    A failing source is logged once and exports nothing (a scrape never fails for it).
    """

    def __init__(self, source: Callable[[], Mapping[str, Any] | None],
                 render: Callable[[Mapping[str, Any], Mapping[str, str]], Iterator[Any]],
                 labels: Mapping[str, str]) -> None:
        self._source = source
        self._render = render
        self._labels = dict(labels)
        self._failed = False

    def collect(self) -> Iterator[Any]:
        try:
            snapshot = self._source()
        except Exception as exc:  # noqa: BLE001 - a scrape must not take the component down
            if not self._failed:
                self._failed = True
                log.warning("metrics: reading %s failed, its metrics are left out: %r",
                            getattr(self._source, "__qualname__", self._source), exc)
            return iter(())
        if snapshot is None:
            return iter(())
        return self._render(snapshot, self._labels)

    def describe(self) -> Iterator[Any]:
        # Names are only known from a snapshot; describing nothing keeps registration cheap
        # and lets several collectors share a registry.
        return iter(())


class StoreMetricsHub:
    """One :class:`~fd_routing_replay.store.instrumented.StoreMetrics` per label set in one
    registry: stores opened with the same namespace and backend add to the same counters,
    so they stay monotonic when a store is closed and another one opened."""

    def __init__(self, registry: Any) -> None:
        self._lock = threading.Lock()
        self._metrics: dict[tuple[str, ...], Any] = {}
        self._registry = registry

    def metrics_for(self, labels: Mapping[str, str]) -> Any:
        from fd_routing_replay.store.instrumented import StoreMetrics

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


def metric_names() -> set[str]:
    """Every metric name this package can export, as Prometheus sees it (counters with
    ``_total``; histograms with ``_bucket``, ``_sum`` and ``_count``)."""
    from fd_routing_replay.writing.metrics import COUNTERS, GAUGES, HISTOGRAMS, PREFIX

    names = {f"{PREFIX}_{n}_total" for n in COUNTERS} | {f"{PREFIX}_{n}" for n in GAUGES}
    histograms = {f"{PREFIX}_{n}" for n in HISTOGRAMS} | {f"{STORE_PREFIX}_operation_seconds"}
    names |= {f"{CAPTURE_PREFIX}_{n}_total" for n in CAPTURE_COUNTERS}
    names |= {f"{CAPTURE_PREFIX}_{n}" for n in CAPTURE_GAUGES}
    names |= {f"{STORE_PREFIX}_errors_total", f"{STORE_PREFIX}_written_bytes_total",
              f"{STORE_PREFIX}_read_bytes_total"}
    for name in histograms:
        names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return names
