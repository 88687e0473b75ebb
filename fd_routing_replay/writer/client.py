"""The writer's client: what the engine calls, on the engine's threads.

The engine calls :meth:`RoutingWriter.submit_put` when a request finishes.  On the
caller's thread that costs validation, one copy of the ids into a shared-memory ring
and a short control message — no encoding, checksum, store I/O or retry.  A writer
process (or thread, ``writer.mode: thread``; :mod:`fd_routing_replay.writer.supervisor`)
does the rest; see :mod:`fd_routing_replay.writer.worker` for ordering, retries, the
journal and the retirement of turns under ``only_last_turn``
(:mod:`fd_routing_replay.writer.record`).  What the ring cannot take is journaled by
:mod:`fd_routing_replay.writer.ring`.

Guarantees (docs/operations.md has the operator's view):

* operations on one key apply in submission order;
* capacity is counted in bytes; when full, ``full_policy`` applies: ``spill`` (journal
  the record, replay later), ``block`` (wait up to ``block_timeout_s``, then spill) or
  ``drop`` (counted, one log line per key) — nothing disappears without both;
* a submit never waits longer than ``block_timeout_s``: when the journal cannot keep up
  either (store down and disk full), the record is dropped, counted and logged by key;
* every record is checked on the caller's thread (:meth:`Operation.for_put
  <fd_routing_replay.writer.operation.Operation.for_put>`, the rr-v1 header size
  included), so nothing the writer accepts can fail to encode later;
* if the writer process dies (even SIGKILL) it is restarted and every operation it had
  not acknowledged is sent again; journal entries are replayed at start;
* nothing is cleared at start unless ``clear_on_start`` is set;
* :meth:`close` (also run at interpreter exit) flushes with a timeout, spills what is
  left and logs it.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from fd_routing_replay.codec import ENCODINGS, RecordFormat, RoutingRecord
from fd_routing_replay.config import (
    RoutingReplayConfig,
    StoreConfig,
    WriterConfig,
    config_from_dict,
    config_to_dict,
)
from fd_routing_replay.core.paths import RankIdentity
from fd_routing_replay.errors import (
    ConfigError,
    InvalidRolloutId,
    RecordError,
    RoutingReplayError,
)
from fd_routing_replay.keys import check_key, check_prefix, parse_rollout_id
from fd_routing_replay.metrics import labels_for, rank_label
from fd_routing_replay.store import store_config_from
from fd_routing_replay.store.registry import resolve_factory, store_type_of
from fd_routing_replay.store.retention import Sweeper
from fd_routing_replay.writer.journal import (
    DeadLetters,
    DirectoryLock,
    Journal,
    resolve_writer_directories,
)
from fd_routing_replay.writer.metrics import WriterMetrics
from fd_routing_replay.writer.operation import (
    Operation,
    OperationKind,
    OperationState,
    as_list,
    check_sidecar,
    pack,
)
from fd_routing_replay.writer.record import TurnPrefix
from fd_routing_replay.writer.ring import (
    Backpressure,
    Ledger,
    RingAllocator,
    RingMemory,
    SpillQueue,
)
from fd_routing_replay.writer.supervisor import Supervisor
from fd_routing_replay.writer.worker import WorkerSettings

__all__ = ["RoutingWriter"]

log = logging.getLogger("fd_routing_replay.writer")

_LOCK_WAIT_S = 10.0
_LEFTOVER_KEYS_SHOWN = 20
_live_writers: weakref.WeakSet[RoutingWriter] = weakref.WeakSet()


class RoutingWriter:
    """Puts and deletes routing records in the background; see the module docstring.

    ``store_config`` is a ``StoreConfig`` (or anything ``open_store`` accepts: a URL, a
    type name, a dict, a full config); ``writer_config`` a ``WriterConfig`` or a dict of
    its keys.  ``record_format`` is a :class:`~fd_routing_replay.codec.RecordFormat`:
    ``rr-v1``, or ``fastdeploy-raw`` (raw padded bytes, for trainers that read FastDeploy's
    layout); ``encoding`` the rr-v1 payload encoding
    (``plain`` or ``set``, applied in the writer process).  ``identity`` says which rank this writer
    serves; it picks (or fills the placeholders of) the journal and dead-letter
    directories, so writers of different ranks never share one (see
    :mod:`fd_routing_replay.writer.journal`; unset fields come from the environment).
    ``retention`` (a ``RetentionConfig``) with ``ttl_s`` or ``max_bytes`` set makes the
    writer of rank dp0-tp0 sweep the namespace (:mod:`fd_routing_replay.store.retention`); a
    store that expires records itself (Redis) gets ``ttl_s`` at write time.  ``partials``
    (``capture.partial_every_tokens`` > 0): a final put also retires its partial record.
    Thread-safe.
    """

    def __init__(self, store_config: Any, writer_config: WriterConfig | dict | None = None,
                 *, only_last_turn: bool = False, record_format: str = RecordFormat.RR_V1,
                 identity: RankIdentity | None = None, encoding: str = "plain",
                 retention: Any = None, partials: bool = False) -> None:
        self._store_config: StoreConfig = store_config_from(store_config)
        resolve_factory(store_type_of(self._store_config))  # unknown backend: fail now
        if writer_config is None or isinstance(writer_config, dict):
            writer_config = config_from_dict({"writer": writer_config or {}},
                                             source="RoutingWriter(writer_config=...)").writer
        if not isinstance(writer_config, WriterConfig):
            raise TypeError(f"writer_config must be a WriterConfig or a dict, got "
                            f"{type(writer_config).__name__}")
        if record_format not in tuple(RecordFormat):
            raise ConfigError(f"capture.record_format: invalid value {record_format!r}; "
                              f"allowed: {', '.join(RecordFormat)}")
        self.config = writer_config
        self.only_last_turn, self.partials = bool(only_last_turn), bool(partials)
        if encoding not in ENCODINGS or (encoding != "plain"
                                         and record_format != RecordFormat.RR_V1):
            raise ConfigError(f"capture.encoding: invalid value {encoding!r} with record_format "
                              f"{record_format!r}; allowed: {', '.join(ENCODINGS)} (rr-v1 only)")
        self.record_format = record_format
        self.encoding = encoding  # applied by the worker (writer process), not here
        # retention.ttl_s: a store that can expire records itself does so at write time.
        self.record_ttl_s = float(getattr(retention, "ttl_s", 0.0) or 0.0)
        self.mode = writer_config.mode
        directories = resolve_writer_directories(self._store_config, writer_config, identity)
        self._journal = Journal(directories.journal)
        self._dead = DeadLetters(directories.dead_letter)
        log.info("routing writer: journal %s, dead letters %s", self._journal.directory,
                 self._dead.directory)
        self._dir_lock = DirectoryLock(self._journal.directory)
        self._dir_lock.acquire(_LOCK_WAIT_S)
        self._journal.remove_debris()
        self._next_seq = max(time.time_ns() // 1000, self._journal.max_seq() + 1)
        self._metrics = WriterMetrics(labels_for(
            self._store_config.namespace, store_type_of(self._store_config),
            rank_label((identity or RankIdentity()).resolved())))
        self._ring_memory = RingMemory(writer_config.capacity_bytes,
                                       shared=self.mode == "process")
        self._ring_memory.prefault_in_background()
        self._ring = RingAllocator(writer_config.capacity_bytes)
        self._cond = threading.Condition(threading.Lock())
        self._ledger = Ledger(self._ring)
        self._closed = False
        self._closing = threading.Event()
        self._supervisor = Supervisor(
            mode=self.mode, settings=self._worker_settings(), cond=self._cond,
            ledger=self._ledger, metrics=self._metrics, ring_memory=self._ring_memory,
            lock_fd=self._dir_lock.fd, closing=self._closing)
        self._spill = SpillQueue(cond=self._cond, ledger=self._ledger, journal=self._journal,
                                 dead=self._dead, metrics=self._metrics,
                                 capacity=self._ring.capacity, closing=self._closing,
                                 send=self._supervisor.send)
        self._backpressure = Backpressure(
            cond=self._cond, ring=self._ring, spill=self._spill, metrics=self._metrics,
            block_timeout_s=writer_config.block_timeout_s, journal_dir=self._journal.directory,
            closed=lambda: self._closed)
        self._server = None
        for name, source in (
                ("queue_bytes", lambda: self._ring.used_bytes + self._spill.bytes),
                ("pending_ops", lambda: len(self._ledger.ops)),
                ("journal_entries", lambda: self._ledger.journal_count),
                ("blocked_submits", lambda: self._backpressure.blocked)):
            self._metrics.bind_gauge(name, source)
        try:
            if writer_config.metrics_port:
                try:
                    self._server = self._metrics.serve(writer_config.metrics_port,
                                                       writer_config.metrics_addr)
                except OSError as exc:
                    raise ConfigError(f"writer.metrics_port: cannot serve metrics on "
                                      f"{writer_config.metrics_addr} port "
                                      f"{writer_config.metrics_port}: {exc}") from exc
            self._supervisor.start(initial=True)
        except BaseException:
            self._release_resources()
            raise
        self._supervisor.start_receiving()
        self._sweeper = Sweeper.start_for(self._store_config, retention,
                                          (identity or RankIdentity()).resolved())
        _live_writers.add(self)

    @property
    def store_config(self) -> StoreConfig:
        """The store this writer writes to."""
        return self._store_config

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        """``(host, port)`` the Prometheus metrics are served on; None when not served."""
        return None if self._server is None else tuple(self._server.server_address[:2])

    @property
    def sweeper(self) -> Sweeper | None:
        """The retention sweeper this writer runs (one rank per store runs it), or None."""
        return self._sweeper

    @classmethod
    def from_config(cls, config: RoutingReplayConfig, *,
                    identity: RankIdentity | None = None) -> RoutingWriter:
        """A writer for a whole configuration (store, writer, retention, capture format)."""
        return cls(config.store, config.writer, only_last_turn=config.retention.only_last_turn,
                   record_format=config.capture.record_format, identity=identity,
                   encoding=config.capture.encoding, retention=config.retention,
                   partials=config.capture.partial_every_tokens > 0)

    # -- submit -------------------------------------------------------------------------
    def submit_put(self, key: str, record: RoutingRecord, *, final: bool | None = None,
                   prefix: TurnPrefix | None = None) -> bool:
        """Queue ``record`` for the store under ``key``; returns False only when dropped.

        ``key`` is the record's rollout id (fused) or ``{rollout_id}_{layer}``.  ``final``
        marks the put that completes the rollout's turn for ``only_last_turn``; by default
        True for a fused key and, for a per-layer key, True when ``record.metadata
        ["num_layers"]`` says this is the last layer.  Bad records and keys (a header over
        the rr-v1 limit included) raise ``RecordError`` / ``InvalidRolloutId`` and leave
        the writer untouched.  Waits at most ``writer.block_timeout_s`` (``full_policy``
        ``block``, or a journal that cannot keep up); past that the record is dropped,
        counted and logged by key.

        ``prefix`` (from :meth:`durable_prefix`) says ``record`` holds only the positions
        after that stored previous turn: the writer prepends its rows before storing
        (:mod:`fd_routing_replay.writer.record`).
        """
        start = time.perf_counter()
        self._check_open()
        try:
            op = Operation.for_put(key, record, final=final, fmt=self.record_format, prefix=prefix)
        except (RecordError, InvalidRolloutId):
            self._metrics.inc("rejected")
            raise
        ids = record.ids
        return self.submit(op, lambda out: np.copyto(out, ids), start=start)

    def resubmit(self, sidecar: dict[str, Any], record: RoutingRecord | None = None) -> bool:
        """Queue again the operation a journal or dead-letter sidecar describes (``fd-rr
        dead-letters replay``); a put comes with ``record``, its ``.rr`` file, and is built as
        first described (an engine's rows with their padding and per-layer split, a tail
        with the turn it continues).  RecordError for a malformed sidecar; False only when
        dropped."""
        op = Operation.from_sidecar(0, 0, check_sidecar(sidecar, "sidecar"))
        if op.kind == OperationKind.PUT:
            if record is None:
                raise RecordError(f"put of {op.key!r}: the sidecar comes without its record")
            if not op.rows:
                return self.submit_put(op.key, record, final=op.final, prefix=op.prefix)
            if op.fmt != self.record_format:
                raise RecordError(f"put of {op.key!r} is {op.fmt!r}, this writer writes {self.record_format!r}")
            ids = record.ids
            return self.submit(op.around(record), lambda out: np.copyto(out, ids))
        if op.kind == OperationKind.RETIRE:
            self.submit_retire(op.rollout_id, op.layer_count)
        elif op.kind == OperationKind.DELETE:
            self.submit_delete(op.targets)
        else:
            self.submit_delete_prefix(op.targets)
        return True

    def submit(self, op: Operation, fill: Callable[[np.ndarray], Any], *,
               start: float | None = None) -> bool:
        """Queue a put described by ``op`` (:meth:`Operation.for_rows
        <fd_routing_replay.writer.operation.Operation.for_rows>` for an engine's rows);
        ``fill(out)`` writes its ids into ``out`` (``op``'s shape and dtype): the writer's
        ring, or under ``full_policy`` spill a copy for the journal.  This is the engine's
        hand-off: a finished request's rows are gathered straight into the ring, and the
        writer builds the record.  Returns False only when dropped (counted and logged by
        key); waits at most ``writer.block_timeout_s``.
        """
        start = time.perf_counter() if start is None else start
        self._check_open()
        nbytes = op.nbytes
        dtype, shape = np.dtype(op.dtype), tuple(op.shape)
        policy = self.config.full_policy
        deadline = time.monotonic() + self.config.block_timeout_s
        dropped: str | None = None
        with self._cond:
            block = None
            if not self._spill:
                block = self._ring.alloc(nbytes)
                if block is None and policy == "block" and self._ring.fits_ever(nbytes):
                    block = self._backpressure.wait_for_room(nbytes, deadline)
            if block is not None:
                op.offset = block.offset
                op.block = block
                try:
                    fill(self._ring_memory.view(block.offset, nbytes, dtype, shape))
                except BaseException:
                    self._ring.free(block)
                    raise
                op.seq = self._take_seq()
                message = pack(["op", op.to_wire()])
                self._ledger.add(op)
                self._supervisor.send(message)
            elif policy == "drop":
                self._metrics.inc("dropped")
                dropped = (f"routing writer full ({self._ring.used_bytes} of "
                           f"{self._ring.capacity} bytes queued): dropped record {op.key} "
                           f"({nbytes} bytes) under writer.full_policy=drop")
            else:
                problem = self._backpressure.wait_for_spill_memory(nbytes, deadline)
                if problem is None:
                    ids = np.empty(shape, dtype)
                    fill(ids)
                    op.seq = self._take_seq()
                    op.ids = ids
                    self._spill.enqueue(op)
                else:
                    self._metrics.inc("dropped")
                    self._metrics.inc("dropped_journal_full")
                    dropped = (f"routing writer: dropped record {op.key} (rollout {op.rollout_id}, "
                               f"{nbytes} bytes): {problem}")
        self._metrics.inc("submitted")
        if dropped is not None:
            if policy == "drop":
                log.warning("%s", dropped)
            else:
                log.error("%s", dropped)
            return False
        self._metrics.observe_submit(time.perf_counter() - start)
        if self.mode == "inline":
            self._wait_done(op.seq)
        return True

    def submit_delete(self, keys: Iterable[str] | str) -> None:
        """Queue the deletion of exact store keys (ordered after earlier puts to them)."""
        self._check_open()
        try:
            targets = [check_key(k) for k in as_list(keys, "keys")]
        except InvalidRolloutId:
            self._metrics.inc("rejected")
            raise
        self._submit_delete(OperationKind.DELETE, targets)

    def submit_delete_prefix(self, prefixes: Iterable[str] | str) -> None:
        """Queue boundary-safe prefix deletes (``exp:1`` never touches ``exp:10``)."""
        self._check_open()
        try:
            targets = [check_prefix(p) for p in as_list(prefixes, "prefixes")]
        except InvalidRolloutId:
            self._metrics.inc("rejected")
            raise
        self._submit_delete(OperationKind.DELETE_PREFIX, targets)

    def submit_retire(self, rollout_id: str, layer_count: int = 0) -> None:
        """Queue the ``only_last_turn`` retirement of a turn that is already stored:
        delete turn t-1's keys, and turn t's own when a later turn is stored
        (:mod:`fd_routing_replay.writer.record`).  The writer does this by itself after
        every final put; this is for replaying a retirement that was dead-lettered.
        ``layer_count`` is how many per-layer keys ``{rollout_id}_{n}`` to consider."""
        self._check_open()
        try:
            parse_rollout_id(rollout_id)
        except InvalidRolloutId:
            self._metrics.inc("rejected")
            raise
        if isinstance(layer_count, bool) or not isinstance(layer_count, int) or layer_count < 0:
            self._metrics.inc("rejected")
            raise RecordError(f"layer_count must be a non-negative int, got {layer_count!r}")
        self._submit_op(Operation(OperationKind.RETIRE, rollout_id=rollout_id,
                                  layer_count=layer_count))

    def _submit_delete(self, kind: OperationKind, targets: list[str]) -> None:
        if not targets:
            return
        self._submit_op(Operation.for_delete(kind, targets))

    def _submit_op(self, op: Operation) -> None:
        """Queue a delete, prefix delete or retirement in submission order."""
        with self._cond:
            op.seq = self._take_seq()
            if self._spill:  # keep order behind records still being journaled
                self._spill.enqueue(op)
            else:
                message = pack(["op", op.to_wire()])
                self._ledger.add(op)
                self._supervisor.send(message)
        self._metrics.inc("submitted")
        if self.mode == "inline":
            self._wait_done(op.seq)

    def _wait_done(self, seq: int) -> None:
        """``writer.mode: inline``: return once operation ``seq`` is done (stored, or
        journaled or dead-lettered after the retries)."""
        with self._cond:
            if not self._closed:
                self._supervisor.send(pack(["nudge"]))
            while not self._closed:
                op = self._ledger.get(seq)
                if op is None or op.state == OperationState.JOURNAL:
                    return
                self._cond.wait(1.0)

    def _check_open(self) -> None:
        if self._closed:
            raise RoutingReplayError("this RoutingWriter is closed; create a new one")

    def _take_seq(self) -> int:
        seq = self._next_seq
        self._next_seq += 1
        return seq

    # -- flush / close -------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted operation is in the store (or dead-lettered).

        Spilled records count as not yet written.  Returns False when ``timeout``
        (default ``writer.close_timeout_s``) passes first.
        """
        timeout = self.config.close_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        if not self._supervisor.started.wait(timeout):
            return False
        with self._cond:
            if not self._closed:
                self._supervisor.send(pack(["nudge"]))
            while self._ledger:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, 1.0))
        return True

    def close(self, timeout: float | None = None) -> None:
        """Flush for up to ``timeout`` seconds, then stop; whatever is left stays in the
        journal (replayed by the next writer) and is logged.  Idempotent; the journal
        lock and the ring are released even when something fails on the way."""
        if self._closed:
            return
        timeout = self.config.close_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        try:
            self.flush(timeout)
            with self._cond:
                self._closed = True
                self._cond.notify_all()
                while self._spill and time.monotonic() < deadline:
                    self._cond.wait(max(min(deadline - time.monotonic(), 1.0), 0.01))
                self._closing.set()
                self._cond.notify_all()
            self._spill.join(5.0)
            self._supervisor.stop(deadline)
            self._spill.journal_leftovers(self._ring_memory)
            self._log_leftovers()
        finally:
            self._closed = True
            self._closing.set()
            self._release_resources()
            _live_writers.discard(self)

    def _log_leftovers(self) -> None:
        if not self._ledger:
            return
        labels = [op.label for op in self._ledger.in_order()]
        shown = ", ".join(labels[:_LEFTOVER_KEYS_SHOWN])
        more = f" and {len(labels) - _LEFTOVER_KEYS_SHOWN} more" if len(labels) > \
            _LEFTOVER_KEYS_SHOWN else ""
        log.warning("routing writer closed with %d operations not yet in the store; they are "
                    "in the journal %s and are replayed when a writer starts there: %s%s",
                    len(labels), self._journal.directory, shown, more)

    def _release_resources(self) -> None:
        sweeper, self._sweeper = getattr(self, "_sweeper", None), None
        if sweeper is not None:
            sweeper.stop()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self._ring_memory.close()
        self._dir_lock.release()

    def __enter__(self) -> RoutingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- introspection -------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters, gauges and latency percentiles; the same numbers as the metrics."""
        out = self._metrics.snapshot()
        out.update(mode=self.mode, worker_pid=self.worker_pid,
                   capacity_bytes=self._ring.capacity, full_policy=self.config.full_policy,
                   journal_dir=str(self._journal.directory),
                   dead_letter_dir=str(self._dead.directory))
        return out

    def ready(self, timeout: float | None = None) -> bool:
        """Wait until the writer has started and the ring's pages are pre-faulted.

        Optional: submits work before that, the first lap around the ring just pays page
        faults.  Call it at engine start-up before latency-sensitive work.
        """
        deadline = time.monotonic() + (self.config.close_timeout_s if timeout is None else timeout)
        if not self._supervisor.started.wait(max(deadline - time.monotonic(), 0)):
            return False
        thread = self._ring_memory.prefault_thread
        if thread is not None:
            thread.join(max(deadline - time.monotonic(), 0))
            return not thread.is_alive()
        return True

    @property
    def metrics_registry(self) -> Any:
        """This writer's ``prometheus_client.CollectorRegistry``."""
        return self._metrics.registry

    def durable_prefix(self, rollout_id: str) -> TurnPrefix | None:
        """The stored previous turn a put of ``rollout_id`` may continue (prefix
        omission): turn ``t − 1`` of the same base and segment, acknowledged by the store
        with a tokens hash, while no other put of ``rollout_id`` is in flight.  None
        otherwise (turn 0, not stored yet, forgotten, or a rr-v1-less format).

        A turn this writer deleted (:meth:`submit_delete`, :meth:`submit_delete_prefix`,
        a retirement) is forgotten once the delete is acknowledged, and is not offered
        while such a delete is still pending either: the turn is then handed over whole
        (:mod:`fd_routing_replay.writer.record`)."""
        if self.record_format != RecordFormat.RR_V1:
            return None
        if parse_rollout_id(rollout_id).turn == 0:
            return None
        with self._cond:
            return self._ledger.durable.prefix(rollout_id, self._ledger.ops.values())

    def export_metrics(self, stats: Callable[[], dict[str, Any]],
                       render: Callable[[Any, Any], Iterable[Any]]) -> Any:
        """Export another component's ``stats()`` (read at each scrape) with this writer's
        metrics: ``render(snapshot, labels)`` turns them into Prometheus families labelled
        like the writer's (the capture manager's: ``capture.render_capture``).
        Returns a handle for :meth:`remove_metrics`."""
        return self._metrics.add_source(stats, render)

    def remove_metrics(self, handle: Any) -> None:
        """Stop exporting what :meth:`export_metrics` added."""
        self._metrics.remove_source(handle)

    @property
    def worker_pid(self) -> int | None:
        """Pid of the current writer process (this process's pid in thread mode)."""
        return self._supervisor.pid

    @property
    def journal(self) -> Journal:
        return self._journal

    @property
    def dead_letters(self) -> DeadLetters:
        return self._dead

    def _worker_settings(self) -> WorkerSettings:
        """What every generation of the worker is started with (see Supervisor)."""
        cfg = self.config
        return WorkerSettings(
            store=config_to_dict(self._store_config),
            journal_dir=str(self._journal.directory), dead_letter_dir=str(self._dead.directory),
            retry_deadline_s=cfg.retry_deadline_s,
            retry_initial_backoff_s=cfg.retry_initial_backoff_s,
            retry_max_backoff_s=cfg.retry_max_backoff_s, only_last_turn=self.only_last_turn,
            clear_on_start=cfg.clear_on_start, encoding=self.encoding,
            record_ttl_s=self.record_ttl_s, partials=self.partials)


@atexit.register
def _close_writers_at_exit() -> None:
    """Flush and close every writer still open when the interpreter exits."""
    for writer in list(_live_writers):
        try:
            writer.close()
        except Exception:  # noqa: BLE001 - keep closing the others
            log.exception("routing writer: close at exit failed")
