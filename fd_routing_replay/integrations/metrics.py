"""Every metric name the package can export: the capture's, the writer's and the store
calls' tables together (the shipped Grafana dashboard and alert rules are checked against it)."""

from __future__ import annotations

from fd_routing_replay.capture import CAPTURE_COUNTERS, CAPTURE_GAUGES, CAPTURE_PREFIX
from fd_routing_replay.store.metrics import STORE_PREFIX

__all__ = ["metric_names"]


def metric_names() -> set[str]:
    """Every metric name this package can export, as Prometheus sees it (counters with
    ``_total``; histograms with ``_bucket``, ``_sum`` and ``_count``)."""
    from fd_routing_replay.writer.metrics import COUNTERS, GAUGES, HISTOGRAMS, PREFIX

    names = {f"{PREFIX}_{n}_total" for n in COUNTERS} | {f"{PREFIX}_{n}" for n in GAUGES}
    histograms = {f"{PREFIX}_{n}" for n in HISTOGRAMS} | {f"{STORE_PREFIX}_operation_seconds"}
    names |= {f"{CAPTURE_PREFIX}_{n}_total" for n in CAPTURE_COUNTERS}
    names |= {f"{CAPTURE_PREFIX}_{n}" for n in CAPTURE_GAUGES}
    names |= {f"{STORE_PREFIX}_errors_total", f"{STORE_PREFIX}_written_bytes_total",
              f"{STORE_PREFIX}_read_bytes_total"}
    for name in histograms:
        names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return names
