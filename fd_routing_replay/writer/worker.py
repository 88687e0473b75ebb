"""The store side of the writer: a worker generation applies operations in order, retries,
spills and replays; :class:`StoreApplier` makes one attempt at one operation.

One :class:`Worker` runs per writer generation, in a thread (thread and inline modes) or in its
own process (process mode, :mod:`fd_routing_replay.writer.supervisor`), started with its
:class:`WorkerSettings`.  It does all the slow work -- building and encoding records
(:func:`~fd_routing_replay.writer.record.build_record`), checksums, store I/O, retries, journal
and dead-letter files -- so none of it lands on the engine's thread.

Ordering: operations are applied strictly one after another in submission order (a journal
replay included), so operations on one key can never overtake each other.  When a transient
failure outlives ``retry_deadline_s`` the operation is spilled to the journal and the worker
turns *degraded*: everything it receives goes straight to the journal (behind the spilled one)
until a probe write succeeds, after which the journal is replayed in order before anything
newer.  Under ``only_last_turn`` a final put is followed by its *retirement*
(:func:`~fd_routing_replay.writer.record.retire_turn`), generated only after the put has been
acknowledged by the store; with partial records the follow-up also deletes the turn's own
partial record, so a partial is never deleted before its final is durable.

The applier owns the generation's store connection (opened on first use; failing to open is
transient, so records wait in the journal until it opens).  A put replayed from the journal is
built from its ``.rr`` file (the record as submitted); a put of a tail (prefix omission) is
completed from the stored previous turn first.  Credentials refused by the store (Redis
``NOAUTH``/``WRONGPASS`` during a password rotation) are retried like transient errors for
``retry_deadline_s`` from the first refusal; past that they count as permanent (dead letters)
until a store call succeeds again.  Repeated journal errors are logged once per interval.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fd_routing_replay.codec import RecordFormat, RoutingRecord, decode_record, encode_record_parts
from fd_routing_replay.core.logs import RateLimitedLog
from fd_routing_replay.errors import TransientStoreError
from fd_routing_replay.keys import parse_rollout_id
from fd_routing_replay.store.base import RoutingStore
from fd_routing_replay.store.instrumented import InstrumentedStore
from fd_routing_replay.store.metrics import StoreMetrics
from fd_routing_replay.writer.journal import DeadLetters, Journal, JournalEntry, entry_name
from fd_routing_replay.writer.operation import Operation, OperationKind, pack, unpack
from fd_routing_replay.writer.record import (
    build_record,
    encode_for_store,
    partial_keys,
    retire_turn,
)
from fd_routing_replay.writer.retry import (
    ExponentialBackoff,
    RetryExhausted,
    RetryInterrupted,
    RetryPolicy,
    is_auth_failure,
    is_transient,
)

__all__ = ["StoreApplier", "Worker", "WorkerSettings"]


@dataclass
class WorkerSettings:
    """Everything a writer generation needs; plain data so it crosses a pipe as msgpack."""

    store: dict[str, Any]
    journal_dir: str
    dead_letter_dir: str
    retry_deadline_s: float
    retry_initial_backoff_s: float
    retry_max_backoff_s: float
    only_last_turn: bool = False
    clear_on_start: bool = False
    generation: int = 1
    registrations: dict[str, str] = field(default_factory=dict)
    sys_path: list[str] = field(default_factory=list)
    encoding: str = "plain"  # capture.encoding of the rr-v1 records this worker writes
    record_ttl_s: float = 0.0  # retention.ttl_s, for a store that expires records itself
    partials: bool = False  # capture.partial_every_tokens > 0: a final put retires its partial

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


log = logging.getLogger("fd_routing_replay.writer")


class StoreApplier:
    """Applies operations to the store of one writer generation (see the module docstring).

    ``store`` injects an already open store (tests); otherwise ``settings.store`` is
    opened on first use.  ``store_metrics`` counts the store calls for the engine side.
    """

    def __init__(self, settings: WorkerSettings, journal: Journal, *,
                 store: RoutingStore | None = None) -> None:
        self.settings = settings
        self.journal = journal
        self.store_metrics = StoreMetrics()
        self._store: RoutingStore | None = (
            InstrumentedStore(store, self.store_metrics) if store is not None else None)
        self._clear_pending = settings.clear_on_start
        self._open_error: str | None = None
        self._error_log = RateLimitedLog(log)
        self.incomplete = 0    # records built with tokens lacking routing, not yet reported

    def close(self) -> None:
        """Close the store if it was opened; never raises (it must not mask the real exit)."""
        if self._store is not None:
            with contextlib.suppress(Exception):  # closing must not mask the real exit
                self._store.close()

    def store(self) -> RoutingStore:
        """The store, opened on first use; any failure to open is transient (spill)."""
        if self._store is None:
            from fd_routing_replay.store import open_store

            try:
                opened = open_store(self.settings.store, instrument=False)
                if self.settings.record_ttl_s > 0 and opened.supports_expiry():
                    opened.expire_records_after(self.settings.record_ttl_s)
                self._store = InstrumentedStore(opened, self.store_metrics)
            except Exception as exc:  # noqa: BLE001 - fixable later; never dead-letter for it
                message = f"cannot open the store: {type(exc).__name__}: {exc}"
                if message != self._open_error:
                    log.error("routing writer: %s; records are kept in %s until it opens",
                              message, self.journal.directory)
                    self._open_error = message
                raise TransientStoreError(message) from exc
            self._open_error = None
        if self._clear_pending:
            try:
                removed = self._store.clear()
            except Exception as exc:  # noqa: BLE001 - not the operation's fault: retry
                raise TransientStoreError(f"clear_on_start failed: {exc}") from exc
            self._clear_pending = False
            log.warning("routing writer: clear_on_start removed %d records from namespace %s",
                        removed, self._store.namespace)
        return self._store

    def raw(self, op: Operation) -> RoutingRecord:
        """The record as submitted: around the ring's ids, or read back from the journal."""
        if op.entry is not None:
            return decode_record(self.journal.read_record(op.entry), verify=True)
        return op.view if op.view is not None else op.record()

    def raw_parts(self, op: Operation) -> list[memoryview | bytes]:
        """The rr-v1 parts of the record as submitted, for the journal or a dead letter (the
        record is built again when it is replayed)."""
        return list(encode_record_parts(self.raw(op)))

    def encoded(self, op: Operation, store: RoutingStore) -> list[tuple[str, list[Any]]]:
        """``(key, parts)`` of every record the put stores, built (:func:`build_record`) and
        encoded once for all its attempts; the stored previous turn a tail continues is
        read from ``store`` (a store error there is transient; a previous turn that is gone
        or not the one the engine meant is a RecordError: dead letter, nothing written wrong)."""
        if op.encoded is None:
            previous = None
            if op.prefix_key:
                data = store.get(op.prefix_key)
                previous = None if data is None else decode_record(data, verify=True)
            records = build_record(op, self.raw(op), previous)
            whole = op.fmt == RecordFormat.RR_V1 or store.converts_records()
            out = []
            for key, record in records:
                if whole:
                    out.append((key, list(self.encode(record, op.fmt, op.label, store))))
                else:            # FastDeploy's raw bytes (already padded by the build)
                    out.append((key, [record.ids.reshape(-1).view(np.uint8)]))
            missing = records[0][1].metadata.get("missing_tokens") if op.rows else None
            if missing:
                self.incomplete += 1
                log.warning("routing replay: rollout %s has %d of %d tokens without routing "
                            "(stored with the fill value)", op.rollout_id, missing,
                            records[0][1].metadata.get("num_tokens", records[0][1].num_tokens))
            op.encoded = out
        return op.encoded

    def encode(self, record: RoutingRecord, fmt: str, label: str,
               store: RoutingStore | None = None) -> tuple[bytes, memoryview]:
        """rr-v1 parts in the configured encoding — here, in the writer, never on the
        engine's thread (:func:`~fd_routing_replay.writer.record.encode_for_store`; a
        record the set encoding cannot hold is written plain, with a log line)."""
        def fallback(exc: Exception) -> None:
            self._error_log.log(logging.WARNING, "set-encoding",
                                "routing writer: %s is written with the plain encoding: %s", label, exc)

        return encode_for_store(record, encoding=self.settings.encoding, record_format=fmt,
                                converts=store is not None and store.converts_records(), on_fallback=fallback)

    def apply(self, op: Operation) -> tuple[int, float]:
        """One attempt at ``op``; returns (bytes written, seconds in the store calls)."""
        store = self.store()
        start = time.perf_counter()
        if op.kind == OperationKind.RETIRE:
            op.retired = retire_turn(store, op.rollout_id, op.layer_count,
                                     partials=self.settings.partials)
            return 0, time.perf_counter() - start
        if op.kind == OperationKind.PUT:
            encoded = self.encoded(op, store)
            start = time.perf_counter()
            for key, parts in encoded:
                store.put_parts(key, parts)
            return (sum(memoryview(p).nbytes for _, parts in encoded for p in parts),
                    time.perf_counter() - start)
        if op.kind == OperationKind.DELETE:
            store.delete(op.targets)
        else:
            store.delete_prefix(op.targets)
        return 0, time.perf_counter() - start


_REPORT_INTERVAL_S = 0.5
_IDLE_WAIT_S = 0.5


class Worker:
    """Applies operations to the store; see the module docstring."""

    def __init__(self, settings: WorkerSettings, channel: Any, ring: np.ndarray | None,
                 *, store: RoutingStore | None = None) -> None:
        self.settings = settings
        self.channel = channel
        self.ring = ring
        self.journal = Journal(settings.journal_dir)
        self.dead = DeadLetters(settings.dead_letter_dir)
        backoff = ExponentialBackoff(settings.retry_initial_backoff_s, settings.retry_max_backoff_s)
        self.policy = RetryPolicy(backoff, settings.retry_deadline_s, classify=self._retryable)
        self.probe_policy = RetryPolicy(backoff, 0.0, classify=self._retryable)
        self.backoff = backoff
        self.applier = StoreApplier(settings, self.journal, store=store)
        self.pending: deque[Operation] = deque()
        self._fresh: deque[Operation] = deque()  # in-memory ops not yet spilled, oldest first
        self.stopping = self.nudged = self.engine_gone = self.resynced = self.degraded = False
        self.probe_failures = 0
        self.next_probe = 0.0
        self._incomplete: set[str] = set()  # rollout ids with a dead-lettered put
        self._queued_entries: set[str] = set()  # journal entries in ``pending``
        self._retries = 0
        self._errors = 0
        self._last_report = 0.0
        self._last_snapshot: dict[str, Any] | None = None
        self._auth_failing_since: float | None = None
        self._spill_retry_at = 0.0  # the journal refused a write: wait before the next try
        self._spill_failures = 0
        self._error_log = RateLimitedLog(log)

    # -- messaging ------------------------------------------------------------------------
    def send(self, *message: Any) -> None:
        self.channel.send(pack(list(message)))

    def _receive(self, timeout: float) -> None:
        """Read what the engine sent (waiting up to ``timeout`` for the first message)."""
        wait = timeout
        for _ in range(10_000):
            try:
                data = self.channel.recv(wait)
            except (EOFError, OSError):
                self.engine_gone = True
                self.stopping = True
                return
            if data is None:
                return
            self._handle(unpack(data))
            wait = 0

    def _handle(self, msg: list[Any]) -> None:
        kind = msg[0]
        if kind == "op":
            op = Operation.from_wire(msg[1])
            if op.kind == OperationKind.PUT:
                op.view = op.record(op.ring_view(self.ring))
            self._queue(op)
        elif kind == "journal":
            self._adopt_journal_entry(JournalEntry(msg[1], msg[2], entry_name(msg[1], msg[2])))
        elif kind == "nudge":
            self.nudged = True
            self.next_probe = 0.0
        elif kind == "stop":
            self.stopping = True
        elif kind == "resync_done":
            self.resynced = True

    def _queue(self, op: Operation) -> None:
        self.pending.append(op)
        self._fresh.append(op)

    def _adopt_journal_entry(self, entry: JournalEntry) -> Operation | None:
        """Queue a journal entry (once); a corrupt one goes to the dead letters."""
        if entry.name in self._queued_entries:
            return None
        try:
            sidecar = self.journal.load_op(entry)
        except FileNotFoundError:
            return None  # already applied (a duplicate announcement)
        except ValueError as exc:  # RecordError: unreadable sidecar
            self.dead.adopt(self.journal, entry, None, "journal entry unreadable", exc)
            log.error("journal entry %s is unreadable and was moved to %s: %s",
                      entry.name, self.dead.directory, exc)
            self.send("dead", entry.seq)
            self.send("done", entry.seq)
            return None
        op = Operation.from_sidecar(entry.seq, entry.sub, sidecar)
        op.entry = entry
        self.pending.append(op)
        self._queued_entries.add(entry.name)
        return op

    def _report(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_report < _REPORT_INTERVAL_S:
            return
        self._last_report = now
        if self._retries or self._errors:
            self.send("errs", self._retries, self._errors)
            self._retries = self._errors = 0
        snapshot = self.applier.store_metrics.snapshot()
        if snapshot != self._last_snapshot:
            self._last_snapshot = snapshot
            self.send("store", snapshot)

    # -- lifecycle ----------------------------------------------------------------------
    def run(self) -> None:
        """Start up (resync + journal scan), apply operations until stopped, shut down."""
        try:
            self._startup()
            while not self.stopping:
                self._step()
            self._shutdown()
        finally:
            self.applier.close()

    def _startup(self) -> None:
        deadline = time.monotonic() + 60
        while not self.resynced and not self.stopping and time.monotonic() < deadline:
            self._receive(_IDLE_WAIT_S)
        resent, self.pending = list(self.pending), deque()
        for entry in self.journal.scan():
            self._adopt_journal_entry(entry)
        on_disk = {(op.seq, op.sub) for op in self.pending}
        for op in resent:
            if op.entry is None and (op.seq, op.sub) in on_disk:
                op.done = True
                self.send("spilled", op.seq)  # spilled by the previous generation
            else:
                self.pending.append(op)
        self.pending = deque(sorted(self.pending, key=lambda o: (o.seq, o.sub)))
        found = [[op.seq, op.sub, op.label] for op in self.pending if op.entry is not None]
        self.send("started", os.getpid(), found)
        if found:
            log.info("routing writer: replaying %d journal entries from %s", len(found),
                     self.journal.directory)

    def _step(self) -> None:
        self._receive(0)
        self._report()
        if not self.pending:
            self._receive(_IDLE_WAIT_S)
            return
        if self.degraded and time.monotonic() < self.next_probe:
            self._spill_in_memory()
            self._receive(min(self.next_probe - time.monotonic(), _IDLE_WAIT_S))
            return
        self._run_head()

    def _shutdown(self) -> None:
        self._spill_in_memory(force=True)
        left = sum(1 for op in self.pending if op.entry is not None)
        self._report(force=True)
        self.send("stopped", left)

    def _apply(self, op: Operation) -> tuple[int, float]:
        """One attempt at ``op`` (counted); returns (bytes written, seconds in the store)."""
        op.attempts += 1
        if op.attempts > 1:
            self._retries += 1
        return self.applier.apply(op)

    def _sleep(self, seconds: float) -> bool:
        """Wait between retries while still reading messages; False when stopping."""
        deadline = time.monotonic() + seconds
        while not self.stopping:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.nudged:
                self.nudged = False
                return True
            self._receive(min(remaining, _IDLE_WAIT_S))
        return False

    def _on_failure(self, failures: int, exc: BaseException) -> None:
        self._errors += 1
        self._report()

    def _retryable(self, exc: BaseException) -> bool:
        """Transient errors, and refused credentials within ``retry_deadline_s`` of the
        first refusal (a rotation in progress); see the module docstring."""
        if is_transient(exc):
            return True
        if not is_auth_failure(exc):
            return False
        now = time.monotonic()
        if self._auth_failing_since is None:
            self._auth_failing_since = now
            log.warning("routing writer: the store refused our credentials (%s: %s); retrying "
                        "for up to %.1fs (writer.retry_deadline_s) in case they are being "
                        "rotated", type(exc).__name__, exc, self.settings.retry_deadline_s)
        return self._auth_window_open(now)

    def _auth_window_open(self, now: float | None = None) -> bool:
        if self._auth_failing_since is None:
            return False
        now = time.monotonic() if now is None else now
        return now - self._auth_failing_since < self.settings.retry_deadline_s

    # -- the head operation ---------------------------------------------------------------
    def _run_head(self) -> None:
        op = self.pending[0]
        policy = self.probe_policy if self.degraded else self.policy
        try:
            nbytes, seconds = policy.call(lambda: self._apply(op), sleep=self._sleep,
                                          on_failure=self._on_failure)
        except (RetryExhausted, RetryInterrupted) as exc:
            if isinstance(exc, RetryExhausted) and not is_transient(exc.last_error) and \
                    not self._auth_window_open():
                self.pending.popleft()  # refused credentials outlived the retry window
                self.degraded = False
                self._dead_letter(op, exc.last_error)
                return
            if not self.degraded and isinstance(exc, RetryExhausted):
                log.warning("routing writer: store unavailable for %.1fs (%s); spilling to %s "
                            "and replaying when it is back", self.policy.deadline_s,
                            exc.last_error, self.journal.directory)
            self.degraded = True
            self.probe_failures += 1
            self.next_probe = time.monotonic() + self.backoff.compute(self.probe_failures)
            self._spill(op, f"store unavailable: {exc.last_error}")
            return
        except Exception as exc:  # noqa: BLE001 - permanent: keep the record, say why
            self.pending.popleft()
            if is_auth_failure(exc):
                self.degraded = False  # the store answers; it refuses us: no probe pacing
            self._dead_letter(op, exc)
            return
        self.pending.popleft()
        if self._auth_failing_since is not None:
            log.warning("routing writer: the store accepts our credentials again")
            self._auth_failing_since = None
        if self.degraded:
            waiting = sum(1 for o in self.pending if o.entry is not None)
            log.warning("routing writer: store reachable again; replaying %d journal entries",
                        waiting)
            self.degraded = False
            self.probe_failures = 0
        self._succeeded(op, nbytes, seconds)

    def _succeeded(self, op: Operation, nbytes: int, seconds: float) -> None:
        op.view = op.encoded = None
        op.done = True
        if self.applier.incomplete:           # counted before the put is reported done
            self.send("incomplete", self.applier.incomplete)
            self.applier.incomplete = 0
        if op.kind == OperationKind.RETIRE:
            self._retired(op)
        if op.kind != OperationKind.PUT:
            self._forget(op)
            self.send("done", op.seq)
            return
        follow = self._retirement(op)
        if follow is None:
            self._forget(op)
            self.send("done", op.seq, nbytes, seconds)
            return
        self.send("w", op.seq, nbytes, seconds)  # written; "done" after the follow-up
        if op.entry is not None:  # keep the follow-up durable before dropping the put
            if self._spill(follow, "only_last_turn retirement of a replayed put"):
                self._forget(op)
            else:
                follow.parent_entry = op.entry
        else:
            self._fresh.appendleft(follow)  # journaled with the ring's ops at shutdown
        self.pending.appendleft(follow)

    def _retired(self, op: Operation) -> None:
        retirement = op.retired
        if retirement is None or retirement.superseded_by is None:
            return
        turn = parse_rollout_id(op.rollout_id).turn
        log.warning("routing writer: only_last_turn: %s (turn %d) was stored after turn %d of "
                    "the same rollout; deleted it again (%d keys)", op.rollout_id, turn,
                    retirement.superseded_by, retirement.own_deleted)
        self.send("superseded", op.seq)

    def _forget(self, op: Operation) -> None:
        """Remove a finished operation's journal entry, if it has one."""
        for entry in (op.entry, op.parent_entry):
            if entry is not None:
                self.journal.remove(entry)
                self._queued_entries.discard(entry.name)

    def _retirement(self, op: Operation) -> Operation | None:
        """The follow-up of a final put: its ``only_last_turn`` retirement (turn 0 too: a
        later turn may already be stored; with partial records it deletes the turn's own
        partial too), or with partial records alone the delete of that partial, superseded
        by the final now durable."""
        if not ((self.settings.only_last_turn or self.settings.partials) and op.final
                and op.sub == 0):
            return None
        if op.rollout_id in self._incomplete:
            log.warning("routing writer: not retiring the previous turn (or the partial record) of "
                        "%s: part of this turn is in the dead letters", op.rollout_id)
            return None
        if self.settings.only_last_turn:
            return op.retirement()
        targets = partial_keys(op.rollout_id)
        return Operation(OperationKind.DELETE, seq=op.seq, sub=1, targets=targets) if targets else None

    # -- spill / dead letters ---------------------------------------------------------------
    def _spill(self, op: Operation, reason: str) -> bool:
        """Move an in-memory operation into the journal; True when it is there."""
        if op.entry is not None:
            return True
        name = entry_name(op.seq, op.sub)
        try:
            parts = self.applier.raw_parts(op) if op.kind == OperationKind.PUT else None
            self.journal.write(name, op.sidecar(reason), parts)
        except OSError as exc:
            self._spill_failures += 1
            self._spill_retry_at = time.monotonic() + self.backoff.compute(self._spill_failures)
            self._error_log.log(logging.ERROR, "spill",
                                "routing writer: cannot spill %s (seq %d) to %s: %s; keeping it "
                                "in memory", op.label, op.seq, self.journal.directory, exc)
            return False
        except Exception as exc:  # noqa: BLE001 - the record cannot be encoded: never retry
            if op in self.pending:
                self.pending.remove(op)
            self._dead_letter(op, exc)
            return False
        if self._spill_failures:
            suppressed = self._error_log.reset("spill")
            log.warning("routing writer: the journal %s takes writes again (%d failed "
                        "attempts, %d log lines suppressed)", self.journal.directory,
                        self._spill_failures, suppressed)
            self._spill_failures = 0
        op.entry = JournalEntry(op.seq, op.sub, name)
        self._queued_entries.add(name)
        op.view = op.encoded = None
        self.send("spilled", op.seq)
        return True

    def _spill_in_memory(self, force: bool = False) -> None:
        """Journal every operation still held in memory (the ring), oldest first.

        After the journal refused a write, waits out a backoff before trying again
        (``force`` at shutdown tries regardless)."""
        if not force and time.monotonic() < self._spill_retry_at:
            return
        while self._fresh:
            op = self._fresh[0]
            if not op.done and op.entry is None and not self._spill(op, "store unavailable"):
                if not op.done:
                    return  # the disk refuses too; try again after the backoff
            self._fresh.popleft()

    def _dead_letter(self, op: Operation, exc: BaseException) -> None:
        reason = f"store rejected {op.kind} of {op.label}"
        try:
            if op.entry is not None:
                sidecar = op.sidecar(reason)
                path = self.dead.adopt(self.journal, op.entry, sidecar, reason, exc)
                self._queued_entries.discard(op.entry.name)
            else:
                parts = None
                if op.kind == OperationKind.PUT:
                    try:
                        parts = self.applier.raw_parts(op)
                    except Exception as encode_error:  # noqa: BLE001 - keep the sidecar
                        log.error("routing writer: the record of %s cannot be encoded (%s); "
                                  "its dead letter has no .rr", op.label, encode_error)
                        parts = None
                path = self.dead.add(entry_name(op.seq, op.sub), op.sidecar(reason), reason,
                                     error=exc, parts=parts)
            log.error("routing writer: %s (rollout %s): %s: %s; kept as dead letter %s",
                      reason, op.rollout_id or "-", type(exc).__name__, exc, path)
        except OSError as write_error:
            log.error("routing writer: %s: %s; and the dead letter could not be written "
                      "to %s: %s", reason, exc, self.dead.directory, write_error)
        if op.kind == OperationKind.PUT:
            self._incomplete.add(op.rollout_id)
        op.view = op.encoded = None
        op.done = True
        self.send("dead", op.seq)
        self.send("done", op.seq)
