"""The store side of the writer: applies operations in order, retries, spills, replays.

One :class:`Worker` runs per writer generation, in a thread (thread mode) or in its own
process (process mode, :func:`main`).  It owns the store connection and does all the
slow work — encoding, checksums, store I/O, retries, journal and dead-letter files — so
none of it lands on the engine's thread.

Ordering: operations are applied strictly one after another in submission order (a
journal replay included), so operations on one key can never overtake each other.  When
a transient failure outlives ``retry_deadline_s`` the operation is spilled to the journal
and the worker turns *degraded*: everything it receives goes straight to the journal
(behind the spilled one) until a probe write succeeds, after which the journal is
replayed in order before anything newer.  Under ``only_last_turn`` a final put is
followed by its *retirement* (:mod:`fd_routing_replay.writing.turns`: delete turn t-1's
keys, and turn t's own when a later turn is already stored), generated only after the
put has been acknowledged by the store.

Credentials refused by the store (``is_auth_failure``: Redis ``NOAUTH``/``WRONGPASS``
during a password rotation) are retried like transient errors for ``retry_deadline_s``
from the first refusal; past that they count as permanent (dead letters) until a store
call succeeds again.  Repeated journal errors are logged once per interval with a count.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fd_routing_replay.codec import RoutingRecord, decode_record, encode_record_parts, read_header
from fd_routing_replay.errors import RecordError, TransientStoreError
from fd_routing_replay.keys import parse_rollout_id
from fd_routing_replay.setcodec import SetEncodingError
from fd_routing_replay.store.base import RoutingStore
from fd_routing_replay.store.instrumented import InstrumentedStore, StoreMetrics
from fd_routing_replay.writing.journal import DeadLetters, Journal, JournalEntry, entry_name
from fd_routing_replay.writing.logs import RateLimitedLog
from fd_routing_replay.writing.operation import Operation
from fd_routing_replay.writing.prefix import complete_record
from fd_routing_replay.writing.retry import (
    ExponentialBackoff,
    RetryExhausted,
    RetryInterrupted,
    RetryPolicy,
    is_auth_failure,
    is_transient,
)
from fd_routing_replay.writing.transport import PipeChannel, pack, unpack
from fd_routing_replay.writing.turns import Retirement, retire_turn

log = logging.getLogger("fd_routing_replay.writer")

_REPORT_INTERVAL_S = 0.5
_IDLE_WAIT_S = 0.5


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

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(eq=False)
class Op:
    """One operation inside the worker; journal-backed when ``entry`` is set."""

    operation: Operation
    record: RoutingRecord | None = None  # ring-backed put: ids view on the ring
    entry: JournalEntry | None = None
    attempts: int = 0
    encoded: tuple[bytes, memoryview] | None = None
    done: bool = False
    parent_entry: JournalEntry | None = None  # a follow-up removes its put's entry too
    retirement: Retirement | None = None  # what a ``retire`` op did

    @property
    def seq(self) -> int:
        return self.operation.seq

    @property
    def sub(self) -> int:
        return self.operation.sub

    @property
    def kind(self) -> str:
        return self.operation.kind

    @property
    def key(self) -> str:
        return self.operation.key

    @property
    def targets(self) -> list[str]:
        return self.operation.targets

    @property
    def rollout_id(self) -> str:
        return self.operation.rollout_id

    @property
    def fmt(self) -> str:
        return self.operation.fmt

    @property
    def label(self) -> str:
        return self.operation.label

    def sidecar(self, reason: str) -> dict[str, Any]:
        return self.operation.sidecar(reason)


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
        self.store_metrics = StoreMetrics()
        self._store: RoutingStore | None = (
            InstrumentedStore(store, self.store_metrics) if store is not None else None)
        self._clear_pending = settings.clear_on_start
        self.pending: deque[Op] = deque()
        self._fresh: deque[Op] = deque()  # in-memory ops not yet spilled, oldest first
        self.stopping = False
        self.nudged = False
        self.engine_gone = False
        self.resynced = False
        self.degraded = False
        self.probe_failures = 0
        self.next_probe = 0.0
        self._incomplete: set[str] = set()  # rollout ids with a dead-lettered put
        self._queued_entries: set[str] = set()  # journal entries in ``pending``
        self._retries = 0
        self._errors = 0
        self._last_report = 0.0
        self._last_snapshot: dict[str, Any] | None = None
        self._open_error: str | None = None
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
            operation = Operation.from_wire(msg[1])
            record = None
            if operation.kind == "put":
                record = operation.record(operation.ring_view(self.ring))
            self._queue(Op(operation, record=record))
        elif kind == "journal":
            self._adopt_journal_entry(JournalEntry(msg[1], msg[2], entry_name(msg[1], msg[2])))
        elif kind == "nudge":
            self.nudged = True
            self.next_probe = 0.0
        elif kind == "stop":
            self.stopping = True
        elif kind == "resync_done":
            self.resynced = True

    def _queue(self, op: Op) -> None:
        self.pending.append(op)
        self._fresh.append(op)

    def _adopt_journal_entry(self, entry: JournalEntry) -> Op | None:
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
        op = Op(Operation.from_sidecar(entry.seq, entry.sub, sidecar), entry=entry)
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
        snapshot = self.store_metrics.snapshot()
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
            if self._store is not None:
                try:
                    self._store.close()
                except Exception:  # noqa: BLE001 - closing must not mask the real exit
                    pass

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

    # -- store access -------------------------------------------------------------------
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

    def _encoded(self, op: Op) -> tuple[bytes, memoryview]:
        if op.encoded is None:
            op.encoded = self._encode(op.record, op.fmt, op.label)
        return op.encoded

    def _encode(self, record: RoutingRecord, fmt: str, label: str) -> tuple[bytes, memoryview]:
        """rr-v1 parts in the configured encoding — here, in the writer, never on the
        engine's thread.  A record the set encoding cannot hold (a row that is not top_k
        distinct expert ids or all fill value) is written plain, with a log line.  A store
        that converts records (FastDeploy's layouts) gets them plain: it decodes them anyway."""
        converts = self._store is not None and self._store.converts_records()
        if self.settings.encoding == "set" and fmt == "rr-v1" and not converts:
            try:
                return encode_record_parts(record, encoding="set")
            except SetEncodingError as exc:
                self._error_log.log(logging.WARNING, "set-encoding",
                                    "routing writer: %s is written with the plain encoding: %s",
                                    label, exc)
        return encode_record_parts(record)

    def _apply(self, op: Op) -> tuple[int, float]:
        """One attempt at ``op``; returns (bytes written, seconds in the store call)."""
        op.attempts += 1
        if op.attempts > 1:
            self._retries += 1
        store = self.store()
        if op.kind == "retire":
            start = time.perf_counter()
            op.retirement = retire_turn(store, op.rollout_id, op.operation.layer_count)
            return 0, time.perf_counter() - start
        if op.kind == "put" and op.operation.prefix_key:
            return self._apply_tail(op, store)
        if op.kind == "put":
            # A store that converts records itself (FastDeploy's local layout) takes rr-v1.
            whole = op.fmt == "rr-v1" or store.converts_records()
            if op.entry is not None:
                data = self.journal.read_record(op.entry)
                record = decode_record(data, verify=True)
                parts = [data] if whole else [record.ids.reshape(-1).view(np.uint8)]
                if (whole and op.fmt == "rr-v1" and self.settings.encoding != "plain"
                        and read_header(data)["encoding"] == "plain"):  # spilled by the engine
                    parts = list(self._encode(record, op.fmt, op.label))
            else:
                head, payload = self._encoded(op)
                parts = [head, payload] if whole else [payload]
            start = time.perf_counter()
            store.put_parts(op.key, parts)
            return sum(memoryview(p).nbytes for p in parts), time.perf_counter() - start
        start = time.perf_counter()
        if op.kind == "delete":
            store.delete(op.targets)
        else:
            store.delete_prefix(op.targets)
        return 0, time.perf_counter() - start

    def _apply_tail(self, op: Op, store: RoutingStore) -> tuple[int, float]:
        """A put whose ids continue the stored previous turn (prefix omission): read that
        record back, check it is the one the engine meant, store the whole record.  A
        store error while reading is transient (retried); a prefix that is missing or
        not the expected one is a RecordError (dead letter, nothing written wrong)."""
        prefix = op.operation.prefix
        tail = (decode_record(self.journal.read_record(op.entry), verify=True)
                if op.entry is not None else op.record)
        start = time.perf_counter()
        data = store.get(prefix.rollout_id)
        if data is None:
            raise RecordError(f"record of {op.key!r} was handed over without its first "
                              f"{prefix.num_tokens} positions, but the previous turn "
                              f"{prefix.rollout_id!r} is no longer stored")
        full = complete_record(decode_record(data, verify=True), tail, prefix)
        parts = list(self._encode(full, op.fmt, op.label))
        store.put_parts(op.key, parts)
        return sum(memoryview(p).nbytes for p in parts), time.perf_counter() - start

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

    def _succeeded(self, op: Op, nbytes: int, seconds: float) -> None:
        op.record = op.encoded = None
        op.done = True
        if op.kind == "retire":
            self._retired(op)
        if op.kind != "put":
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

    def _retired(self, op: Op) -> None:
        retirement = op.retirement
        if retirement is None or retirement.superseded_by is None:
            return
        turn = parse_rollout_id(op.rollout_id).turn
        log.warning("routing writer: only_last_turn: %s (turn %d) was stored after turn %d of "
                    "the same rollout; deleted it again (%d keys)", op.rollout_id, turn,
                    retirement.superseded_by, retirement.own_deleted)
        self.send("superseded", op.seq)

    def _forget(self, op: Op) -> None:
        """Remove a finished operation's journal entry, if it has one."""
        for entry in (op.entry, op.parent_entry):
            if entry is not None:
                self.journal.remove(entry)
                self._queued_entries.discard(entry.name)

    def _retirement(self, op: Op) -> Op | None:
        """The ``only_last_turn`` follow-up of a final put (turn 0 too: a later turn may
        already be stored)."""
        if not (self.settings.only_last_turn and op.operation.final and op.sub == 0):
            return None
        if op.rollout_id in self._incomplete:
            log.warning("routing writer: not retiring the previous turn of %s: part of this "
                        "turn is in the dead letters", op.rollout_id)
            return None
        return Op(op.operation.retirement())

    # -- spill / dead letters ---------------------------------------------------------------
    def _spill(self, op: Op, reason: str) -> bool:
        """Move an in-memory operation into the journal; True when it is there."""
        if op.entry is not None:
            return True
        name = entry_name(op.seq, op.sub)
        try:
            parts = list(self._encoded(op)) if op.kind == "put" else None
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
        op.record = op.encoded = None
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

    def _dead_letter(self, op: Op, exc: BaseException) -> None:
        reason = f"store rejected {op.kind} of {op.label}"
        try:
            if op.entry is not None:
                sidecar = op.sidecar(reason)
                path = self.dead.adopt(self.journal, op.entry, sidecar, reason, exc)
                self._queued_entries.discard(op.entry.name)
            else:
                parts = None
                if op.kind == "put":
                    try:
                        parts = list(self._encoded(op))
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
        if op.kind == "put":
            self._incomplete.add(op.rollout_id)
        op.record = op.encoded = None
        op.done = True
        self.send("dead", op.seq)
        self.send("done", op.seq)


# -- process entry point --------------------------------------------------------------------

class _ForwardHandler(logging.Handler):
    """Sends the writer process's log records to the engine, which logs them there."""

    def __init__(self, channel: PipeChannel) -> None:
        super().__init__()
        self.channel = channel

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.channel.send(pack(["log", record.levelno, record.name, self.format(record)]))
        except Exception:  # noqa: BLE001 - logging must never take the writer down
            pass


def main(argv: list[str] | None = None) -> None:
    """Writer process: read the init message, then run one :class:`Worker`."""
    from multiprocessing.connection import Connection

    from fd_routing_replay.writing.ring import RingMemory

    parser = argparse.ArgumentParser(prog="fd-routing-replay-writer")
    parser.add_argument("--in", dest="inbox", type=int, required=True)
    parser.add_argument("--out", dest="outbox", type=int, required=True)
    parser.add_argument("--ring", type=int)
    parser.add_argument("--ring-size", type=int, default=0)
    parser.add_argument("--lock", type=int)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine decides when we stop
    channel = PipeChannel(Connection(args.inbox, writable=False),
                          Connection(args.outbox, readable=False))
    root = logging.getLogger("fd_routing_replay")
    root.addHandler(_ForwardHandler(channel))
    root.setLevel(logging.INFO)
    root.propagate = False
    try:
        first = channel.recv(60)
    except (EOFError, OSError):
        first = None
    if first is None:  # the engine went away before saying anything
        return
    kind, raw = unpack(first)
    if kind != "init":
        raise SystemExit(f"writer process: expected an init message, got {kind!r}")
    settings = WorkerSettings(**raw)
    for path in reversed(settings.sys_path):
        if path not in sys.path:
            sys.path.insert(0, path)
    from fd_routing_replay.store import register_store

    for name, target in settings.registrations.items():
        register_store(name, target)
    ring = RingMemory.attach(args.ring, args.ring_size) if args.ring is not None else None
    if ring is not None:
        ring.prefault_in_background()
    worker = Worker(settings, channel, ring.array if ring is not None else None)

    def on_term(signum: int, frame: Any) -> None:
        worker.stopping = True

    signal.signal(signal.SIGTERM, on_term)
    worker.run()
