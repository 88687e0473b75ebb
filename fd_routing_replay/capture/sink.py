"""Where finished records go: the background writer, or a store directly.

The manager only calls ``put(key, record)``; what "durable", "retry" and
``only_last_turn`` mean is the sink's business.  :class:`WriterSink` hands records to the
background :class:`~fd_routing_replay.writer.RoutingWriter` (the production path: the
engine step never waits for the store).  :class:`StoreSink` encodes and writes inline —
for tests, tools and single-process use — and applies ``only_last_turn`` itself, after
the put returned, so the previous turn is only deleted once the new one is stored (and, with
partial records, a turn's partial record once its final one is).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

from fd_routing_replay.capture.metrics import render_capture
from fd_routing_replay.codec import RecordFormat, RoutingRecord, encode_fastdeploy_raw
from fd_routing_replay.errors import RecordError
from fd_routing_replay.keys import parse_rollout_id
from fd_routing_replay.writer.encoding import encode_for_store
from fd_routing_replay.writer.turns import retire_turn
from fd_routing_replay.writer.validation import check_partial, completes_turn, turn_layer_count

__all__ = ["RecordSink", "StoreSink", "WriterSink", "open_sink"]

logger = logging.getLogger(__name__)


class RecordSink(Protocol):
    """What the capture manager needs from a record consumer."""

    def put(self, key: str, record: RoutingRecord) -> None:
        """Take ownership of ``record`` to be stored under ``key`` (must not block long)."""

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything put so far is durable; False on timeout."""

    def close(self, timeout: float | None = None) -> None:
        """Flush and release resources."""

    def stats(self) -> dict[str, Any]:
        """Counters for the summary and metrics."""


class StoreSink:
    """Encode and write synchronously into a :class:`~fd_routing_replay.store.RoutingStore`.

    ``record_format`` is a :class:`~fd_routing_replay.codec.RecordFormat`: ``rr-v1``, or
    ``fastdeploy-raw`` (raw bytes padded to ``max_model_len``, FastDeploy's own format);
    ``encoding`` is the rr-v1 payload encoding (``plain`` or ``set``; a record the set
    encoding cannot hold is written plain, with a warning).  With ``only_last_turn`` the
    record of turn t-1 (exactly its key and its per-layer keys, never another rollout's) is
    deleted after the put that completes turn t succeeded, and turn t itself is deleted
    again when a later turn of the same rollout is already stored
    (:mod:`fd_routing_replay.writer.turns`).  Which put completes a turn and how a record
    is encoded are the background writer's own rules
    (:func:`~fd_routing_replay.writer.validation.completes_turn`,
    :func:`~fd_routing_replay.writer.encoding.encode_for_store`), so both sinks store the
    same records.  ``partials``: partial records (``{rollout_id}_partial``, rr-v1 only) are
    put like any record, and the put that completes a turn then deletes its partial.
    """

    def __init__(self, store: Any, *, only_last_turn: bool = False,
                 record_format: str = RecordFormat.RR_V1, max_model_len: int | None = None,
                 owns_store: bool = False, encoding: str = "plain", partials: bool = False) -> None:
        if record_format not in tuple(RecordFormat):
            raise ValueError(f"record_format must be 'rr-v1' or 'fastdeploy-raw', got "
                             f"{record_format!r}")
        if record_format == RecordFormat.FASTDEPLOY_RAW and not max_model_len:
            raise ValueError("record_format 'fastdeploy-raw' needs max_model_len")
        self.store = store
        self.only_last_turn = only_last_turn
        self.partials = partials
        self.record_format = record_format
        self.max_model_len = max_model_len
        self.encoding = encoding
        self._owns_store = owns_store
        self._stats = {"puts": 0, "bytes": 0, "deleted_previous_turns": 0, "superseded": 0,
                       "deleted_partials": 0, "put_seconds": []}

    def put(self, key: str, record: RoutingRecord) -> None:
        started = time.perf_counter()
        if check_partial(key, record) and self.record_format != RecordFormat.RR_V1:
            raise RecordError(f"cannot store partial record {key!r}: partial records are rr-v1, "
                              f"this sink writes {self.record_format!r}")
        if self.record_format == RecordFormat.RR_V1 or self.store.converts_records():
            header, payload = self._encode(record)
            self.store.put_parts(key, (header, payload))
            size = len(header) + payload.nbytes
        else:
            ids = record.ids[0] if "layer" in record.metadata else record.ids
            value = encode_fastdeploy_raw(ids, self.max_model_len, record.fill_value)
            self.store.put(key, value)
            size = len(value)
        self._stats["puts"] += 1
        self._stats["bytes"] += size
        self._stats["put_seconds"].append(time.perf_counter() - started)
        if (self.only_last_turn or self.partials) and completes_turn(key, record):
            retired = retire_turn(self.store, record.rollout_id, turn_layer_count(key, record),
                                  only_last_turn=self.only_last_turn, partials=self.partials)
            self._stats["deleted_previous_turns"] += retired.previous_deleted
            self._stats["deleted_partials"] += retired.partial_deleted
            if retired.superseded_by is not None:
                self._stats["superseded"] += 1
                logger.warning("only_last_turn: turn %d of %s was stored after turn %d of the "
                               "same rollout; deleted it again", parse_rollout_id(
                                   record.rollout_id).turn, record.rollout_id,
                               retired.superseded_by)

    def _encode(self, record: RoutingRecord) -> tuple[bytes, memoryview]:
        def fallback(exc: Exception) -> None:
            logger.warning("routing replay: %s is written with the plain encoding: %s",
                           record.rollout_id, exc)

        return encode_for_store(record, encoding=self.encoding, record_format=self.record_format,
                                converts=self.store.converts_records(), on_fallback=fallback)

    def flush(self, timeout: float | None = None) -> bool:
        return True

    def close(self, timeout: float | None = None) -> None:
        if self._owns_store:
            self.store.close()

    def stats(self) -> dict[str, Any]:
        out = dict(self._stats)
        out["put_seconds"] = list(self._stats["put_seconds"])
        return out


class WriterSink:
    """Hand records to the background writer (``submit_put`` never waits for the store)."""

    def __init__(self, writer: Any, *, owns_writer: bool = True) -> None:
        self.writer = writer
        self._owns_writer = owns_writer

    def put(self, key: str, record: RoutingRecord, *, prefix: Any = None) -> bool:
        """``prefix`` (:meth:`durable_prefix`): ``record`` holds only the positions after it.
        False when the writer dropped the record (``submit_put``; counted and logged there)."""
        return bool(self.writer.submit_put(key, record, prefix=prefix))

    def durable_prefix(self, rollout_id: str) -> Any:
        """The stored previous turn a tail of ``rollout_id`` may continue, or None."""
        return self.writer.durable_prefix(rollout_id)

    def flush(self, timeout: float | None = None) -> bool:
        return bool(self.writer.flush(timeout))

    def close(self, timeout: float | None = None) -> None:
        if self._owns_writer:
            self.writer.close(timeout)

    def stats(self) -> dict[str, Any]:
        return dict(self.writer.stats())

    def export_metrics(self, stats: Any) -> None:
        """Serve a capture component's ``stats()`` with the writer's metrics (Prometheus
        counters ``fd_rr_capture_*``, read at each scrape, labelled like the writer's)."""
        self.writer.export_metrics(stats, render_capture)


def open_sink(config: Any, *, max_model_len: int | None = None, inline: bool = False,
              identity: Any = None) -> RecordSink:
    """The sink a :class:`~fd_routing_replay.config.RoutingReplayConfig` asks for.

    The background writer by default; ``inline=True`` writes from the calling thread.
    ``identity`` (a :class:`~fd_routing_replay.core.paths.RankIdentity`) names
    the writer's rank, which picks its own journal and dead-letter directories.
    """
    if not inline:
        from fd_routing_replay.writer import RoutingWriter

        return WriterSink(RoutingWriter.from_config(config, identity=identity))
    from fd_routing_replay.store import open_store

    return StoreSink(open_store(config.store), only_last_turn=config.retention.only_last_turn,
                     record_format=config.capture.record_format, max_model_len=max_model_len,
                     owns_store=True, encoding=config.capture.encoding,
                     partials=config.capture.partial_every_tokens > 0)
