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
replayed in order before anything newer.  ``only_last_turn`` deletes of turn t-1 are
generated only after turn t's put has been acknowledged by the store.
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

from fd_routing_replay.codec import RoutingRecord, decode_record, encode_record_parts
from fd_routing_replay.errors import InvalidRolloutId, TransientStoreError
from fd_routing_replay.keys import parse_rollout_id, previous_turn
from fd_routing_replay.store.base import RoutingStore
from fd_routing_replay.store.instrumented import InstrumentedStore, StoreMetrics
from fd_routing_replay.writing.journal import (
    DeadLetters,
    Journal,
    JournalEntry,
    entry_name,
    make_sidecar,
)
from fd_routing_replay.writing.retry import (
    ExponentialBackoff,
    RetryExhausted,
    RetryInterrupted,
    RetryPolicy,
)
from fd_routing_replay.writing.transport import PipeChannel, pack, unpack

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

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(eq=False)
class Op:
    """One operation inside the worker; journal-backed when ``entry`` is set."""

    seq: int
    sub: int
    kind: str  # put | delete | delete_prefix
    key: str = ""
    targets: list[str] = field(default_factory=list)  # keys or prefixes
    rollout_id: str = ""
    final: bool = False
    fmt: str = "rr-v1"
    record: RoutingRecord | None = None  # ring-backed put: ids view on the ring
    entry: JournalEntry | None = None
    attempts: int = 0
    encoded: tuple[bytes, memoryview] | None = None
    done: bool = False
    parent_entry: JournalEntry | None = None  # a follow-up removes its put's entry too

    @property
    def label(self) -> str:
        return self.key or ",".join(self.targets[:3])

    def sidecar(self, reason: str) -> dict[str, Any]:
        return make_sidecar(self.kind, self.seq, self.sub, reason, key=self.key,
                            rollout_id=self.rollout_id, final=self.final, fmt=self.fmt,
                            targets=self.targets)


def _op_from_sidecar(entry: JournalEntry, sidecar: dict[str, Any]) -> Op:
    kind = sidecar["op"]
    if kind == "put":
        return Op(entry.seq, entry.sub, kind, key=sidecar["key"],
                  rollout_id=sidecar["rollout_id"], final=bool(sidecar.get("final", False)),
                  fmt=str(sidecar.get("format", "rr-v1")), entry=entry)
    targets = sidecar["keys" if kind == "delete" else "prefixes"]
    return Op(entry.seq, entry.sub, kind, targets=list(targets), entry=entry)


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
        self.policy = RetryPolicy(backoff, settings.retry_deadline_s)
        self.probe_policy = RetryPolicy(backoff, 0.0)
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
        if kind == "put":
            (_, seq, offset, nbytes, key, rollout_id, dtype, shape, num_experts, fill,
             metadata, final, fmt, layers, convention) = msg
            ids = self.ring[offset:offset + nbytes].view(np.dtype(dtype)).reshape(shape)
            record = RoutingRecord(rollout_id, ids, num_experts, fill, metadata, layers=layers,
                                   token_convention=convention)
            self._queue(Op(seq, 0, "put", key=key, rollout_id=rollout_id, final=final,
                           fmt=fmt, record=record))
        elif kind in ("delete", "delete_prefix"):
            self._queue(Op(msg[1], 0, kind, targets=list(msg[2])))
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
        op = _op_from_sidecar(entry, sidecar)
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
        self._spill_in_memory()
        left = sum(1 for op in self.pending if op.entry is not None)
        self._report(force=True)
        self.send("stopped", left)

    # -- store access -------------------------------------------------------------------
    def store(self) -> RoutingStore:
        """The store, opened on first use; any failure to open is transient (spill)."""
        if self._store is None:
            from fd_routing_replay.store import open_store

            try:
                self._store = InstrumentedStore(open_store(self.settings.store),
                                                self.store_metrics)
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
            op.encoded = encode_record_parts(op.record)
        return op.encoded

    def _apply(self, op: Op) -> tuple[int, float]:
        """One attempt at ``op``; returns (bytes written, seconds in the store call)."""
        op.attempts += 1
        if op.attempts > 1:
            self._retries += 1
        store = self.store()
        if op.kind == "put":
            # A store that converts records itself (FastDeploy's local layout) takes rr-v1.
            whole = op.fmt == "rr-v1" or store.converts_records()
            if op.entry is not None:
                data = self.journal.read_record(op.entry)
                record = decode_record(data, verify=True)
                parts = [data] if whole else [record.ids.reshape(-1).view(np.uint8)]
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

    # -- the head operation ---------------------------------------------------------------
    def _run_head(self) -> None:
        op = self.pending[0]
        policy = self.probe_policy if self.degraded else self.policy
        try:
            nbytes, seconds = policy.call(lambda: self._apply(op), sleep=self._sleep,
                                          on_failure=self._on_failure)
        except (RetryExhausted, RetryInterrupted) as exc:
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
            self._dead_letter(op, exc)
            return
        self.pending.popleft()
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
        if op.kind != "put":
            self._forget(op)
            self.send("done", op.seq)
            return
        follow = self._previous_turn_delete(op)
        if follow is None:
            self._forget(op)
            self.send("done", op.seq, nbytes, seconds)
            return
        self.send("w", op.seq, nbytes, seconds)  # written; "done" after the follow-up
        if op.entry is not None:  # keep the follow-up durable before dropping the put
            if self._spill(follow, "previous-turn delete of a replayed put"):
                self._forget(op)
            else:
                follow.parent_entry = op.entry
        self.pending.appendleft(follow)

    def _forget(self, op: Op) -> None:
        """Remove a finished operation's journal entry, if it has one."""
        for entry in (op.entry, op.parent_entry):
            if entry is not None:
                self.journal.remove(entry)
                self._queued_entries.discard(entry.name)

    def _previous_turn_delete(self, op: Op) -> Op | None:
        if not (self.settings.only_last_turn and op.final and op.sub == 0):
            return None
        if op.rollout_id in self._incomplete:
            log.warning("routing writer: not deleting the previous turn of %s: part of this "
                        "turn is in the dead letters", op.rollout_id)
            return None
        try:
            previous = previous_turn(parse_rollout_id(op.rollout_id))
        except InvalidRolloutId:
            return None
        if previous is None:
            return None
        return Op(op.seq, 1, "delete_prefix", targets=[previous.text])

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
            log.error("routing writer: cannot spill %s (seq %d) to %s: %s; keeping it in "
                      "memory", op.label, op.seq, self.journal.directory, exc)
            return False
        except ValueError as exc:  # the record cannot be encoded: nothing to retry
            if op in self.pending:
                self.pending.remove(op)
            self._dead_letter(op, exc)
            return False
        op.entry = JournalEntry(op.seq, op.sub, name)
        self._queued_entries.add(name)
        op.record = op.encoded = None
        self.send("spilled", op.seq)
        return True

    def _spill_in_memory(self) -> None:
        """Journal every operation still held in memory (the ring), oldest first."""
        while self._fresh:
            op = self._fresh[0]
            if not op.done and op.entry is None and not self._spill(op, "store unavailable"):
                if not op.done:
                    return  # the disk refuses too; try again at the next probe
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
                    except ValueError:
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
