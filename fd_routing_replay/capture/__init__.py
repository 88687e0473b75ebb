"""Capture: the device step buffer and hooks, the host slot cache, and the hand-off of a
request's rows to the writer -- one module per FastDeploy generation on top.

* :mod:`~fd_routing_replay.capture.device`: the step buffer, the MoE-layer hooks, verification mode;
* :mod:`~fd_routing_replay.capture.slots`: the host slot cache (in shared memory for 2.6), the geometry;
* :mod:`~fd_routing_replay.capture.handoff`: a request's rows straight into the writer's ring;
* :mod:`~fd_routing_replay.capture.fd25`: FastDeploy 2.5 / develop's routing-table manager;
* :mod:`~fd_routing_replay.capture.fd26`: FastDeploy 2.6's worker capturer and engine side.

This module holds the capture's metric table: what the ``stats()`` counters and gauges of
those components mean, and how a capture snapshot (one manager's, or FastDeploy 2.6's
engine with its workers') renders.  Importing it imports neither Paddle nor a submodule.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["CAPTURE_COUNTERS", "CAPTURE_GAUGES", "CAPTURE_PREFIX", "render_capture"]

CAPTURE_PREFIX = "fd_rr_capture"
# stats() key of a capture component (the table-API manager, 2.6's worker capturer and engine
# side, their hand-off) -> help text.
# Keys a given manager does not report are not exported by it.
CAPTURE_COUNTERS: dict[str, str] = {
    "registered": "Requests registered for capture",
    "re_registered": "Registrations of a request already registered (next chunk of a chunked prefill)",
    "cleared": "Requests FastDeploy cleared before they finished (preempted or aborted)",
    "records_submitted": "Finished requests whose rows were handed to the writer",
    "records_returned": "Records attached to the response (FastDeploy response mode)",
    "references_returned": "References to a stored record attached to the response (response.routes: "
                           "reference)",
    "references_failed": "Records of response.routes: reference the writer did not take (the response "
                         "carries no routes; each is logged)",
    "records_failed": "Finished requests whose routing was lost: damaged during capture, not "
                      "gathered, or dropped by the writer (writer.full_policy); each is logged",
    "invalid_request_ids": "Requests whose id carries no valid rollout id (not recorded)",
    "prefix_omitted": "Turns handed over without the stored previous turn's rows (prefix omission)",
    "prefix_fallbacks": "Turns t > 0 handed over whole although prefix omission is on (previous "
                        "turn not stored yet, or other tokens)",
    "partials_submitted": "Partial records of running requests handed to the writer "
                          "(capture.partial_every_tokens)",
    "partials_failed": "Partial records that could not be built or handed on (the next one, or "
                       "the final record, still comes)",
    "slot_conflicts": "Registrations of a batch slot still held by another request",
    "hook_calls": "MoE-layer hook calls",
    "hook_errors": "MoE-layer hook calls that failed (the step's routing is marked damaged)",
    "hook_mismatches": "MoE-layer hook calls whose routed rows did not match the step's tokens "
                       "(the step's routing is marked lost)",
    "hook_seconds": "CPU seconds spent in the MoE-layer hook",
    "bad_expert_ids": "Expert ids out of range seen by the record kernel (not recorded)",
    "errors": "Capture calls that failed (counted and logged; the engine step goes on)",
    "steps": "Engine steps captured",
    "tokens_offloaded": "Token rows copied from the device to the host slot cache",
    "unmapped_positions": "Token rows without a KV slot (table API: their requests' records are "
                          "not written)",
    "suspended_skips": "Records not written while FD_SUSPEND_ROUTING_REPLAY=1",
    "damaged_steps": "Steps whose routing was lost or damaged (FastDeploy 2.6 step buffer)",
    "missing_layer_steps": "Steps in which a MoE layer did not record its rows (that layer's rows "
                           "of the step's tokens are stored as unknown, the fill value)",
    "invalid_slots": "Token rows of a step whose KV slot was outside the slot cache (skipped; "
                     "FastDeploy 2.6 worker)",
    "host_missing_steps": "Steps captured before the engine's shared slot cache existed",
    "capture_seconds": "CPU seconds spent capturing on the engine thread",
    "offload_seconds": "Seconds spent copying rows to the host slot cache",
}
CAPTURE_GAUGES: dict[str, str] = {
    "host_cache_bytes": "Bytes of the host slot cache",
    "capture_device_bytes": "Device memory held by the capture (step buffer and counters)",
    "step_buffer_rows": "Token rows of the device step buffer",
}


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
