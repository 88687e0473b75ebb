"""Background writer: records reach the store without touching the engine's step time.

The engine calls :meth:`RoutingWriter.submit_put` when a request finishes.  On the
caller's thread that costs validation, one copy of the ids into a shared-memory ring
and a short control message — no encoding, checksum, store I/O or retry.  A writer
process (or thread, ``writer.mode: thread``) does the rest; see
:mod:`fd_routing_replay.writing.worker` for ordering, retries, the journal and the
previous-turn deletes of ``only_last_turn``.

Guarantees (docs/operations.md has the operator's view):

* operations on one key apply in submission order;
* capacity is counted in bytes; when full, ``full_policy`` applies: ``spill`` (journal
  the record, replay later), ``block`` (wait up to ``block_timeout_s``, then spill) or
  ``drop`` (counted, one log line per key) — nothing disappears without both;
* if the writer process dies (even SIGKILL) it is restarted and every operation it had
  not acknowledged is sent again; journal entries are replayed at start;
* nothing is cleared at start unless ``clear_on_start`` is set;
* :meth:`close` (also run at interpreter exit) flushes with a timeout, spills what is
  left and logs it.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable
from typing import Any

import numpy as np

from fd_routing_replay.codec import RoutingRecord, encode_record_parts
from fd_routing_replay.config import (
    RoutingReplayConfig,
    StoreConfig,
    WriterConfig,
    config_from_dict,
    config_to_dict,
)
from fd_routing_replay.errors import (
    ConfigError,
    InvalidRolloutId,
    RecordError,
    RoutingReplayError,
)
from fd_routing_replay.keys import check_key, check_prefix
from fd_routing_replay.store import store_config_from
from fd_routing_replay.store.registry import resolve_factory, store_type_of
from fd_routing_replay.writing.directories import RankIdentity, resolve_writer_directories
from fd_routing_replay.writing.journal import (
    DeadLetters,
    DirectoryLock,
    Journal,
    entry_name,
    make_sidecar,
)
from fd_routing_replay.writing.ledger import JOURNAL, SENT, SPILLING, Ledger, Pending
from fd_routing_replay.writing.metrics import WriterMetrics
from fd_routing_replay.writing.ring import Block, RingAllocator, RingMemory
from fd_routing_replay.writing.transport import (
    ProcessLink,
    ThreadLink,
    pack,
    portable_store_registrations,
    unpack,
)
from fd_routing_replay.writing.validation import as_list, validate_put
from fd_routing_replay.writing.worker import Worker, WorkerSettings

__all__ = ["RECORD_FORMATS", "RoutingWriter"]

log = logging.getLogger("fd_routing_replay.writer")

RECORD_FORMATS = ("rr-v1", "fastdeploy-raw")
_LOCK_WAIT_S = 10.0
_RECV_WAIT_S = 0.25
_RESULTS_PER_LOCK = 32
_MAX_RESTART_DELAY_S = 5.0
_LEFTOVER_KEYS_SHOWN = 20
_live_writers: weakref.WeakSet[RoutingWriter] = weakref.WeakSet()


class RoutingWriter:
    """Puts and deletes routing records in the background; see the module docstring.

    ``store_config`` is a ``StoreConfig`` (or anything ``open_store`` accepts: a URL, a
    type name, a dict, a full config); ``writer_config`` a ``WriterConfig`` or a dict of
    its keys.  ``record_format`` is ``rr-v1`` or ``fastdeploy-raw`` (raw padded bytes,
    for trainers that read FastDeploy's layout).  ``identity`` says which rank this writer
    serves; it picks (or fills the placeholders of) the journal and dead-letter
    directories, so writers of different ranks never share one (see
    :mod:`fd_routing_replay.writing.directories`; unset fields come from the environment).
    Thread-safe.
    """

    def __init__(self, store_config: Any, writer_config: WriterConfig | dict | None = None,
                 *, only_last_turn: bool = False, record_format: str = "rr-v1",
                 identity: RankIdentity | None = None) -> None:
        self._store_config: StoreConfig = store_config_from(store_config)
        resolve_factory(store_type_of(self._store_config))  # unknown backend: fail now
        if writer_config is None or isinstance(writer_config, dict):
            writer_config = config_from_dict({"writer": writer_config or {}},
                                             source="RoutingWriter(writer_config=...)").writer
        if not isinstance(writer_config, WriterConfig):
            raise TypeError(f"writer_config must be a WriterConfig or a dict, got "
                            f"{type(writer_config).__name__}")
        if record_format not in RECORD_FORMATS:
            raise ConfigError(f"capture.record_format: invalid value {record_format!r}; "
                              f"allowed: {', '.join(RECORD_FORMATS)}")
        self.config = writer_config
        self.only_last_turn = bool(only_last_turn)
        self.record_format = record_format
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
        self._metrics = WriterMetrics()
        self._ring_memory = RingMemory(writer_config.capacity_bytes,
                                       shared=self.mode == "process")
        self._ring_memory.prefault_in_background()
        self._ring = RingAllocator(writer_config.capacity_bytes)
        self._cond = threading.Condition(threading.Lock())
        self._ledger = Ledger(self._ring)
        self._blocked = 0
        self._spill_items: deque[tuple[int, tuple[Any, ...], int]] = deque()
        self._spill_bytes = 0
        self._spill_thread: threading.Thread | None = None
        self._spill_taken_over = False
        self._closed = False
        self._closing = threading.Event()
        self._started = threading.Event()
        self._link_exited = threading.Event()
        self._generation = 0
        self._link: ProcessLink | ThreadLink | None = None
        self._server = None
        for name, source in (
                ("queue_bytes", lambda: self._ring.used_bytes + self._spill_bytes),
                ("pending_ops", lambda: len(self._ledger.ops)),
                ("journal_entries", lambda: self._ledger.journal_count),
                ("blocked_submits", lambda: self._blocked)):
            self._metrics.bind_gauge(name, source)
        try:
            if writer_config.metrics_port:
                try:
                    self._server = self._metrics.serve(writer_config.metrics_port)
                except OSError as exc:
                    raise ConfigError(f"writer.metrics_port: cannot serve metrics on port "
                                      f"{writer_config.metrics_port}: {exc}") from exc
            self._start_generation(initial=True)
        except BaseException:
            self._release_resources()
            raise
        self._receiver = threading.Thread(target=self._receive_loop, name="fd-rr-writer-recv",
                                          daemon=True)
        self._receiver.start()
        _live_writers.add(self)

    @classmethod
    def from_config(cls, config: RoutingReplayConfig, *,
                    identity: RankIdentity | None = None) -> RoutingWriter:
        """A writer for a whole configuration (store, writer, retention, capture format)."""
        return cls(config.store, config.writer, only_last_turn=config.retention.only_last_turn,
                   record_format=config.capture.record_format, identity=identity)

    # -- submit -------------------------------------------------------------------------
    def submit_put(self, key: str, record: RoutingRecord, *, final: bool | None = None) -> bool:
        """Queue ``record`` for the store under ``key``; returns False only when dropped.

        ``key`` is the record's rollout id (fused) or ``{rollout_id}_{layer}``.  ``final``
        marks the put that completes the rollout's turn for ``only_last_turn``; by default
        True for a fused key and, for a per-layer key, True when ``record.metadata
        ["num_layers"]`` says this is the last layer.  Bad records and keys raise
        ``RecordError`` / ``InvalidRolloutId`` and leave the writer untouched.
        """
        start = time.perf_counter()
        self._check_open()
        try:
            rollout_id, final = validate_put(key, record, final)
        except (RecordError, InvalidRolloutId):
            self._metrics.inc("rejected")
            raise
        ids = record.ids
        nbytes = ids.nbytes
        layers = None if record.layers is None else list(record.layer_map)
        convention = record.token_convention
        policy = self.config.full_policy
        with self._cond:
            block = None
            if not self._spill_items:
                block = self._ring.alloc(nbytes)
                if block is None and policy == "block" and self._ring.fits_ever(nbytes):
                    block = self._wait_for_room(nbytes)
            if block is not None:
                seq = self._take_seq()
                np.copyto(self._ring_memory.view(block.offset, nbytes, ids.dtype, ids.shape), ids)
                message = pack(["put", seq, block.offset, nbytes, key, rollout_id, ids.dtype.str,
                                list(ids.shape), record.num_experts, record.fill_value,
                                record.metadata, final, self.record_format, layers,
                                convention])
                self._ledger.add(Pending(seq, "put", key, message, block))
                self._link.send(message)
            elif policy == "drop":
                self._metrics.inc("dropped")
                queued, capacity = self._ring.used_bytes, self._ring.capacity
            else:
                self._wait_for_spill_memory(nbytes)
                seq = self._take_seq()
                item = ("put", key, rollout_id, np.array(ids, copy=True), record.num_experts,
                        record.fill_value, dict(record.metadata), final, layers, convention)
                self._enqueue_spill(seq, item, nbytes, key)
        self._metrics.inc("submitted")
        if block is None and policy == "drop":
            log.warning("routing writer full (%d of %d bytes queued): dropped record %s "
                        "(%d bytes) under writer.full_policy=drop", queued, capacity, key, nbytes)
            return False
        self._metrics.observe_submit(time.perf_counter() - start)
        return True

    def submit_delete(self, keys: Iterable[str] | str) -> None:
        """Queue the deletion of exact store keys (ordered after earlier puts to them)."""
        self._check_open()
        try:
            targets = [check_key(k) for k in as_list(keys, "keys")]
        except InvalidRolloutId:
            self._metrics.inc("rejected")
            raise
        self._submit_delete("delete", targets)

    def submit_delete_prefix(self, prefixes: Iterable[str] | str) -> None:
        """Queue boundary-safe prefix deletes (``exp:1`` never touches ``exp:10``)."""
        self._check_open()
        try:
            targets = [check_prefix(p) for p in as_list(prefixes, "prefixes")]
        except InvalidRolloutId:
            self._metrics.inc("rejected")
            raise
        self._submit_delete("delete_prefix", targets)

    def _submit_delete(self, kind: str, targets: list[str]) -> None:
        if not targets:
            return
        with self._cond:
            seq = self._take_seq()
            if self._spill_items:  # keep order behind records still being journaled
                self._enqueue_spill(seq, (kind, targets), 0, ",".join(targets[:3]))
            else:
                message = pack([kind, seq, targets])
                self._ledger.add(Pending(seq, kind, ",".join(targets[:3]), message))
                self._link.send(message)
        self._metrics.inc("submitted")

    def _check_open(self) -> None:
        if self._closed:
            raise RoutingReplayError("this RoutingWriter is closed; create a new one")

    def _take_seq(self) -> int:
        seq = self._next_seq
        self._next_seq += 1
        return seq

    def _wait_for_room(self, nbytes: int) -> Block | None:
        """full_policy=block: wait up to block_timeout_s for ring space (lock held)."""
        deadline = time.monotonic() + self.config.block_timeout_s
        self._blocked += 1
        try:
            while True:
                if not self._spill_items:
                    block = self._ring.alloc(nbytes)
                    if block is not None:
                        return block
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed:
                    return None
                self._cond.wait(remaining)
        finally:
            self._blocked -= 1

    # -- engine-side spill ----------------------------------------------------------------
    def _wait_for_spill_memory(self, nbytes: int) -> None:
        """Bound copies waiting for the disk to ``capacity_bytes``: past that, the disk
        itself is slower than the engine, and waiting is the only lossless answer."""
        while self._spill_bytes and self._spill_bytes + nbytes > self._ring.capacity \
                and not self._closed:
            self._cond.wait(1.0)

    def _enqueue_spill(self, seq: int, item: tuple[Any, ...], nbytes: int, label: str) -> None:
        self._ledger.add(Pending(seq, item[0], label, state=SPILLING))
        self._spill_items.append((seq, item, nbytes))
        self._spill_bytes += nbytes
        if self._spill_thread is None or not self._spill_thread.is_alive():
            self._spill_thread = threading.Thread(target=self._spill_loop,
                                                  name="fd-rr-writer-spill", daemon=True)
            self._spill_thread.start()
        self._cond.notify_all()

    def _write_spill(self, seq: int, item: tuple[Any, ...], reason: str) -> None:
        name = entry_name(seq)
        if item[0] == "put":
            _, key, rollout_id, ids, num_experts, fill, metadata, final, layers, convention = item
            record = RoutingRecord(rollout_id, ids, num_experts, fill, metadata, layers=layers,
                                   token_convention=convention)
            sidecar = make_sidecar("put", seq, 0, reason, key=key, rollout_id=rollout_id,
                                   final=final, fmt=self.record_format)
            self._journal.write(name, sidecar, list(encode_record_parts(record)))
        else:
            kind, targets = item
            self._journal.write(name, make_sidecar(kind, seq, 0, reason, targets=targets))

    def _spill_loop(self) -> None:
        failures = 0
        while True:
            with self._cond:
                while not self._spill_items and not self._closing.is_set():
                    self._cond.wait(1.0)
                if not self._spill_items or self._spill_taken_over:
                    return
                seq, item, nbytes = self._spill_items[0]
            reason = f"writer full (capacity {self._ring.capacity} bytes)"
            try:
                self._write_spill(seq, item, reason)
            except OSError as exc:
                failures += 1
                if failures == 1 or failures % 60 == 0:
                    log.error("routing writer: cannot write %s to the journal %s: %s; holding "
                              "it in memory and retrying", item[1], self._journal.directory, exc)
                if self._closing.wait(min(0.05 * 2 ** failures, 1.0)):
                    return
                continue
            failures = 0
            with self._cond:
                if not self._spill_items or self._spill_items[0][0] != seq:
                    return  # close() took over the queue meanwhile
                self._spill_items.popleft()
                self._spill_bytes -= nbytes
                op = self._ledger.get(seq)
                if op is not None:
                    self._ledger.set_state(op, JOURNAL)
                self._link.send(pack(["journal", seq, 0]))
                self._cond.notify_all()
            self._metrics.inc("spilled")

    # -- flush / close -------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted operation is in the store (or dead-lettered).

        Spilled records count as not yet written.  Returns False when ``timeout``
        (default ``writer.close_timeout_s``) passes first.
        """
        timeout = self.config.close_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        if not self._started.wait(timeout):
            return False
        with self._cond:
            if self._link is not None and not self._closed:
                self._link.send(pack(["nudge"]))
            while self._ledger:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, 1.0))
        return True

    def close(self, timeout: float | None = None) -> None:
        """Flush for up to ``timeout`` seconds, then stop; whatever is left stays in the
        journal (replayed by the next writer) and is logged.  Idempotent."""
        if self._closed:
            return
        timeout = self.config.close_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            while self._spill_items and time.monotonic() < deadline:
                self._cond.wait(max(min(deadline - time.monotonic(), 1.0), 0.01))
            self._closing.set()
            self._cond.notify_all()
            link = self._link
        if self._spill_thread is not None:
            self._spill_thread.join(5.0)
        if link is not None:
            link.send(pack(["stop"]))
            if not self._link_exited.wait(max(deadline - time.monotonic(), 2.0)):
                log.error("routing writer (pid %s) did not stop in time; killing it", link.pid)
                link.kill()
                self._link_exited.wait(2.0)
        self._receiver.join(2.0)
        if link is not None:
            link.close()
        self._spill_leftovers()
        self._log_leftovers()
        self._release_resources()
        _live_writers.discard(self)

    def _spill_leftovers(self) -> None:
        """Journal what the writer never acknowledged (it was killed or hung)."""
        with self._cond:
            leftovers = self._ledger.in_order(SENT)
            spill_items = list(self._spill_items)
            self._spill_items.clear()
            self._spill_bytes = 0
            self._spill_taken_over = True
        for op in leftovers:
            msg = unpack(op.message)
            try:
                if msg[0] == "put":
                    (_, seq, offset, nbytes, key, rollout_id, dtype, shape, num_experts, fill,
                     metadata, final, _fmt, layers, convention) = msg
                    ids = self._ring_memory.view(offset, nbytes, np.dtype(dtype), tuple(shape))
                    item = ("put", key, rollout_id, ids, num_experts, fill, metadata, final,
                            layers, convention)
                else:
                    item = (msg[0], msg[2])
                self._write_spill(op.seq, item, "writer stopped before the store acknowledged")
                self._ledger.set_state(op, JOURNAL)
            except (OSError, ValueError) as exc:
                self._metrics.inc("dropped")
                log.error("routing writer: LOST %s at close: it could not be journaled in %s: "
                          "%s", op.label, self._journal.directory, exc)
                self._ledger.finish(op.seq)
        for seq, item, _ in spill_items:
            op = self._ledger.get(seq)
            try:
                self._write_spill(seq, item, "writer full at close")
                if op is not None:
                    self._ledger.set_state(op, JOURNAL)
            except OSError as exc:
                self._metrics.inc("dropped")
                log.error("routing writer: LOST %s at close: the journal %s is not writable: %s",
                          item[1], self._journal.directory, exc)
                self._ledger.finish(seq)

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
        if not self._started.wait(max(deadline - time.monotonic(), 0)):
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

    @property
    def worker_pid(self) -> int | None:
        """Pid of the current writer process (this process's pid in thread mode)."""
        return self._link.pid if self._link is not None else None

    @property
    def journal(self) -> Journal:
        return self._journal

    @property
    def dead_letters(self) -> DeadLetters:
        return self._dead

    # -- generations ---------------------------------------------------------------------
    def _settings(self, initial: bool) -> WorkerSettings:
        cfg = self.config
        sys_path = [p or os.getcwd() for p in sys.path]
        return WorkerSettings(
            store=config_to_dict(self._store_config),
            journal_dir=str(self._journal.directory), dead_letter_dir=str(self._dead.directory),
            retry_deadline_s=cfg.retry_deadline_s,
            retry_initial_backoff_s=cfg.retry_initial_backoff_s,
            retry_max_backoff_s=cfg.retry_max_backoff_s, only_last_turn=self.only_last_turn,
            clear_on_start=initial and cfg.clear_on_start, generation=self._generation,
            registrations=portable_store_registrations(), sys_path=sys_path)

    def _start_generation(self, initial: bool = False) -> bool:
        """Start a writer generation, re-sending what the last one left; False if closing."""
        with self._cond:
            if self._closing.is_set():
                return False
            self._generation += 1
            settings = self._settings(initial)
            if self.mode == "process":
                link: ProcessLink | ThreadLink = ProcessLink(
                    self._ring_memory.fd, self._ring_memory.capacity, self._dir_lock.fd)
                link.send(pack(["init", settings.to_dict()]))
            else:
                link = ThreadLink(self._thread_target(settings))
            for message in self._ledger.begin_restart():
                link.send(message)
            link.send(pack(["resync_done"]))
            self._started.clear()
            self._link = link
            self._link_started = time.monotonic()
        link.start()
        return True

    def _thread_target(self, settings: WorkerSettings) -> Any:
        ring = self._ring_memory.array

        def run(channel: Any) -> None:
            try:
                Worker(settings, channel, ring).run()
            except BaseException:  # noqa: BLE001 - the receiver restarts the worker
                log.exception("routing writer thread crashed; restarting it")

        return run

    def _receive_loop(self) -> None:
        restart_delay = 0.0
        while True:
            link = self._link
            try:
                messages = link.recv(_RECV_WAIT_S)
            except (EOFError, OSError):
                if self._closing.is_set():
                    self._link_exited.set()
                    return
                lived = time.monotonic() - self._link_started
                restart_delay = 0.0 if lived > 10 else min(max(restart_delay * 2, 0.1),
                                                           _MAX_RESTART_DELAY_S)
                with self._cond:
                    unacked = len(self._ledger.in_order(SENT))
                log.error("routing writer %s (pid %s) died; restarting it and re-sending %d "
                          "unacknowledged operations", self.mode, link.pid, unacked)
                link.close()
                self._metrics.inc("restarts")
                if (restart_delay and self._closing.wait(restart_delay)) or \
                        not self._start_generation():
                    self._link_exited.set()
                    return
                continue
            for start in range(0, len(messages), _RESULTS_PER_LOCK):
                if start:
                    time.sleep(0)  # let a submitting thread have the GIL between chunks
                with self._cond:
                    for data in messages[start:start + _RESULTS_PER_LOCK]:
                        if self._ledger.apply(unpack(data)):
                            self._started.set()
                    self._cond.notify_all()
                self._ledger.publish(self._metrics)  # only this thread applies results


@atexit.register
def _close_writers_at_exit() -> None:
    """Flush and close every writer still open when the interpreter exits."""
    for writer in list(_live_writers):
        try:
            writer.close()
        except Exception:  # noqa: BLE001 - keep closing the others
            log.exception("routing writer: close at exit failed")
