"""Prometheus export helpers shared by every component, from snapshots read at scrape time.

Capture, writer and store keep plain counters (cheap to bump on their own threads) and
expose them as a ``stats()``/``snapshot()`` dict.  A :class:`SnapshotCollector` turns such
a dict into metric families when Prometheus scrapes, so the hot path never touches
``prometheus_client`` and a snapshot shipped from another process (the writer process's
store calls) exports exactly like a local one.

Every family carries the labels :data:`LABELS`: ``namespace`` (the store namespace),
``store`` (the backend type) and ``rank`` (``dp{N}-tp{M}`` for a writer; empty for a
reader or the CLI).  Each component owns its metric table and renderer: the capture's
(:mod:`fd_routing_replay.capture`), the store calls' (:mod:`fd_routing_replay.store.metrics`)
and the writer's (:mod:`fd_routing_replay.writer.metrics`); :func:`fd_routing_replay.integrations.
metrics.metric_names` lists every family name the package can export.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

log = logging.getLogger(__name__)

LABELS = ("namespace", "store", "rank")

__all__ = ["LABELS", "SnapshotCollector", "labels_for", "rank_label"]

def labels_for(namespace: str, store: str, rank: str = "") -> dict[str, str]:
    """The label values every family of one component carries."""
    return {"namespace": namespace, "store": store, "rank": rank}


def rank_label(identity: Any) -> str:
    """``dp{N}-tp{M}`` for a resolved :class:`RankIdentity`; empty without one."""
    if identity is None:
        return ""
    return f"dp{identity.dp_rank}-tp{identity.tp_rank}"


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
