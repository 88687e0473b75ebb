"""The writer's generations and the link to them: start the worker, hear from it, restart it.

A *generation* is one run of the :class:`~fd_routing_replay.writer.worker.Worker`, in a process
of its own (``writer.mode: process``) or a thread (``thread``, ``inline``).  Each one is sent
every operation the ledger still counts as *sent* (what the last generation never
acknowledged) before anything new, so a writer killed mid-way (even SIGKILL) loses nothing;
journal entries are replayed by the worker itself at start.  A receiver thread applies the
worker's results to the ledger; when the link breaks it restarts the worker, backing off (up to
a few seconds) when generations die young.

Control messages are short msgpack lists (:func:`~fd_routing_replay.writer.operation.pack`;
never pickle, never arrays: payloads travel through the ring).  Engine -> writer::

    ["init", settings]              first message of a process generation
    ["op", fields]                  a put, delete or prefix delete: Operation.to_wire(); a
                                    put's ids are at ring[offset:offset+nbytes]
    ["journal", seq, sub]           the engine spilled operation seq into the journal
    ["resync_done"]                 end of the operations re-sent after a restart
    ["nudge"]                       flush() is waiting: retry the store now
    ["stop"]                        spill what is left in memory and exit

Writer -> engine::

    ["started", pid, [[seq, sub, label], ...]]   journal entries found at start
    ["w", seq, nbytes, latency_s]   a put was acknowledged by the store
    ["spilled", seq]                now in the journal; its ring range is free
    ["dead", seq]                   filed as a dead letter
    ["superseded", seq]             the put was older than a stored turn: deleted again
    ["incomplete", n]               records built with tokens lacking routing
    ["done", seq]                   finished (written, deleted or dead-lettered)
    ["errs", retries, store_errors] counter deltas
    ["store", snapshot]             InstrumentedStore counters of the writer's store
    ["log", levelno, logger, text]  a log record from the writer process
    ["stopped", journal_entries]

:class:`ThreadLink` runs the writer in a thread of this process; :class:`ProcessLink` starts
``python -c 'from fd_routing_replay.writer.supervisor import main; main()'`` with
``subprocess`` (fork+exec, the equivalent of multiprocessing's *spawn*: a process with Paddle
threads is never forked without exec), handing it the pipes, the ring's memfd and the journal
lock as inherited descriptors; :func:`main` is that process.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from fd_routing_replay.store.registry import register_store
from fd_routing_replay.writer.metrics import WriterMetrics
from fd_routing_replay.writer.operation import OperationState, pack, unpack
from fd_routing_replay.writer.retry import ExponentialBackoff
from fd_routing_replay.writer.ring import Ledger, RingMemory
from fd_routing_replay.writer.worker import Worker, WorkerSettings

__all__ = ["ProcessLink", "Supervisor", "ThreadLink", "main", "portable_store_registrations"]


_FRAME = struct.Struct("!i")  # multiprocessing.connection's length prefix


def portable_store_registrations() -> dict[str, str]:
    """Store backends registered in this process, as ``module:function`` strings.

    A writer process imports them again (after taking over this process's ``sys.path``),
    so a backend registered with ``register_store`` works in both modes.  Factories that
    cannot be named (lambdas, closures) stay behind; entry points load by themselves.
    """
    from fd_routing_replay.store.registry import registered_stores

    out: dict[str, str] = {}
    for name, target in registered_stores().items():
        if isinstance(target, str):
            out[name] = target
        else:
            module = getattr(target, "__module__", None)
            qualname = getattr(target, "__qualname__", "")
            if module and qualname and "<" not in qualname:
                out[name] = f"{module}:{qualname}"
    return out


class QueueChannel:
    """The writer's end in thread mode."""

    def __init__(self, inbox: queue.SimpleQueue, outbox: queue.SimpleQueue) -> None:
        self._inbox = inbox
        self._outbox = outbox

    def recv(self, timeout: float | None) -> bytes | None:
        try:
            if timeout is not None and timeout > 0:
                data = self._inbox.get(timeout=timeout)
            else:
                data = self._inbox.get_nowait()
        except queue.Empty:
            return None
        if data is None:  # the engine side went away
            raise EOFError
        return data

    def send(self, data: bytes) -> None:
        self._outbox.put(data)


class PipeChannel:
    """The writer's end in process mode; EOFError when the engine process is gone."""

    def __init__(self, inbox: Connection, outbox: Connection) -> None:
        self._inbox = inbox
        self._outbox = outbox
        self._send_lock = threading.Lock()

    def recv(self, timeout: float | None) -> bytes | None:
        if not self._inbox.poll(max(timeout or 0, 0)):
            return None
        return self._inbox.recv_bytes()

    def send(self, data: bytes) -> None:
        with self._send_lock:
            try:
                self._outbox.send_bytes(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the engine is gone; nobody to tell


class ThreadLink:
    """One writer generation running in a daemon thread of this process."""

    mode = "thread"

    def __init__(self, target: Callable[[QueueChannel], None]) -> None:
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._target = target
        self._thread: threading.Thread | None = None
        self.pid = os.getpid()

    def send(self, data: bytes) -> None:
        self._inbox.put(data)

    def start(self) -> None:
        channel = QueueChannel(self._inbox, self._outbox)
        self._thread = threading.Thread(target=self._target, args=(channel,),
                                        name="fd-rr-writer", daemon=True)
        self._thread.start()

    def recv(self, timeout: float) -> list[bytes]:
        """Pending messages ([] after ``timeout``); EOFError once the thread has ended."""
        try:
            first = self._outbox.get(timeout=timeout)
        except queue.Empty:
            if not self.alive():
                raise EOFError from None
            return []
        out = [first]
        while True:
            try:
                out.append(self._outbox.get_nowait())
            except queue.Empty:
                return out

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def join(self, timeout: float) -> bool:
        if self._thread is not None:
            self._thread.join(timeout)
        return not self.alive()

    def kill(self) -> None:
        """Threads cannot be killed; the writer thread is told to stop instead."""
        self._inbox.put(None)

    def close(self) -> None:
        self._inbox.put(None)


class ProcessLink:
    """One writer generation running in its own process (fork+exec, never a bare fork)."""

    mode = "process"

    def __init__(self, ring_fd: int | None, ring_size: int, lock_fd: int | None) -> None:
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        os.set_blocking(in_w, False)
        self._child_fds = [in_r, out_w]
        self._in_w = in_w
        self._from_writer = Connection(out_r, writable=False)
        self._ring_fd = ring_fd
        self._ring_size = ring_size
        self._lock_fd = lock_fd
        self._proc: subprocess.Popen | None = None
        self._queue: deque[bytes] = deque()
        self._cond = threading.Condition()
        self._sending = False
        self._closed = False
        self._broken = False
        self._sender = threading.Thread(target=self._send_loop, name="fd-rr-writer-send",
                                        daemon=True)
        self._sender.start()
        self.pid: int | None = None

    def send(self, data: bytes) -> None:
        """Send ``data`` without ever blocking on a busy or dead writer.

        A message that fits the pipe's atomic-write size goes straight into the pipe when
        nothing is queued before it (no thread hand-off); otherwise the sender thread
        writes it in order.  Framing is ``multiprocessing.connection``'s (``!i`` length).
        """
        frame = _FRAME.pack(len(data)) + data
        with self._cond:
            if self._broken or self._closed:
                return  # writer died (the restart re-sends from the op table) or closing
            if not self._queue and not self._sending and len(frame) <= select.PIPE_BUF:
                try:
                    os.write(self._in_w, frame)  # all or nothing below PIPE_BUF
                    return
                except BlockingIOError:
                    pass
                except OSError:
                    self._broken = True
                    return
            self._queue.append(frame)
            self._cond.notify()

    def _send_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed and not self._queue:
                    break
                batch = list(self._queue)
                self._queue.clear()
                self._sending = True
            try:
                for frame in batch:
                    if self._broken or not self._write_all(frame):
                        break
            finally:
                with self._cond:
                    self._sending = False
        with self._cond:  # send() checks _closed under this lock: no write after close
            try:
                os.close(self._in_w)
            except OSError:
                pass

    def _write_all(self, frame: bytes) -> bool:
        """Write one frame to the non-blocking pipe, waiting while it is full."""
        view = memoryview(frame)
        while view.nbytes:
            try:
                view = view[os.write(self._in_w, view):]
            except BlockingIOError:
                select.select([], [self._in_w], [], 1.0)
            except OSError:
                self._broken = True
                return False
        return True

    def start(self) -> None:
        fds = list(self._child_fds)
        argv = ["--in", str(fds[0]), "--out", str(fds[1])]
        if self._ring_fd is not None:
            fds.append(self._ring_fd)
            argv += ["--ring", str(self._ring_fd), "--ring-size", str(self._ring_size)]
        if self._lock_fd is not None:
            fds.append(self._lock_fd)
            argv += ["--lock", str(self._lock_fd)]
        env = dict(os.environ)
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (package_root, env.get("PYTHONPATH", "")) if p)
        code = "from fd_routing_replay.writer.supervisor import main; main()"
        try:
            self._proc = subprocess.Popen([sys.executable, "-c", code, *argv], pass_fds=fds,
                                          env=env, stdin=subprocess.DEVNULL, close_fds=True)
        finally:
            for fd in self._child_fds:
                os.close(fd)
            self._child_fds = []
        self.pid = self._proc.pid

    def recv(self, timeout: float) -> list[bytes]:
        """Pending messages ([] after ``timeout``); EOFError once the process is gone."""
        if not wait([self._from_writer], timeout):
            if self._proc is not None and self._proc.poll() is not None and \
                    not self._from_writer.poll(0):
                raise EOFError
            return []
        out = [self._from_writer.recv_bytes()]  # EOFError when the writer exited
        while len(out) < 4096 and self._from_writer.poll(0):
            try:
                out.append(self._from_writer.recv_bytes())
            except EOFError:
                break
        return out

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def join(self, timeout: float) -> bool:
        if self._proc is None:
            return True
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()

    def close(self) -> None:
        """Stop the sender (closing our end tells the writer to stop) and reap."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._sender.join(5)
        if self._proc is not None:
            try:
                self._proc.wait(0.1)
            except subprocess.TimeoutExpired:
                pass
        try:
            self._from_writer.close()
        except OSError:
            pass


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


log = logging.getLogger("fd_routing_replay.writer")


_RECV_WAIT_S = 0.25


_RESULTS_PER_LOCK = 32


_YOUNG_S = 10.0  # a generation that dies younger than this is restarted after a delay


class Supervisor:
    """Runs one writer's generations; shares the writer's lock (``cond``) and ledger.

    ``settings`` are the worker's settings as configured; each generation gets its own
    number, the current ``sys.path`` and store registrations, and ``clear_on_start`` only
    for the first one.  Nothing starts before :meth:`start`.
    """

    def __init__(self, *, mode: str, settings: WorkerSettings, cond: threading.Condition,
                 ledger: Ledger, metrics: WriterMetrics, ring_memory: RingMemory,
                 lock_fd: int | None, closing: threading.Event) -> None:
        self.mode = mode
        self._settings = settings
        self._cond = cond
        self._ledger = ledger
        self._metrics = metrics
        self._ring_memory = ring_memory
        self._lock_fd = lock_fd
        self._closing = closing
        self._restart_backoff = ExponentialBackoff(0.1, 5.0, jitter=0.0)
        self.link: ProcessLink | ThreadLink | None = None
        self.generation = 0
        self.started = threading.Event()
        """Set once the current generation said ``started`` (its journal scan is done)."""
        self.exited = threading.Event()
        """Set when the receiver stopped for good (the writer is closing)."""
        self._link_started = 0.0
        self._receiver: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        """Pid of the current writer process (this process's pid in thread mode)."""
        return self.link.pid if self.link is not None else None

    def send(self, data: bytes) -> None:
        """Send a control message to the current generation."""
        if self.link is not None:
            self.link.send(data)

    def _generation_settings(self, initial: bool) -> WorkerSettings:
        return replace(self._settings, generation=self.generation,
                       clear_on_start=initial and self._settings.clear_on_start,
                       registrations=portable_store_registrations(),
                       sys_path=[p or os.getcwd() for p in sys.path])

    def start(self, initial: bool = False) -> bool:
        """Start a generation, re-sending what the last one left; False if closing."""
        with self._cond:
            if self._closing.is_set():
                return False
            self.generation += 1
            settings = self._generation_settings(initial)
            if self.mode == "process":
                link: ProcessLink | ThreadLink = ProcessLink(
                    self._ring_memory.fd, self._ring_memory.capacity, self._lock_fd)
                link.send(pack(["init", settings.to_dict()]))
            else:
                link = ThreadLink(self._thread_target(settings))
            for op in self._ledger.begin_restart():
                link.send(pack(["op", op.to_wire()]))
            link.send(pack(["resync_done"]))
            self.started.clear()
            self.link = link
            self._link_started = time.monotonic()
        link.start()
        return True

    def start_receiving(self) -> None:
        self._receiver = threading.Thread(target=self._receive_loop, name="fd-rr-writer-recv",
                                          daemon=True)
        self._receiver.start()

    def stop(self, deadline: float) -> None:
        """Tell the current generation to stop, kill it when it has not by ``deadline``
        (at least two seconds from now), and close the link.  Call with closing set."""
        link = self.link
        if link is not None:
            link.send(pack(["stop"]))
            if not self.exited.wait(max(deadline - time.monotonic(), 2.0)):
                log.error("routing writer (pid %s) did not stop in time; killing it",
                          link.pid)
                link.kill()
                self.exited.wait(2.0)
        if self._receiver is not None:
            self._receiver.join(2.0)
        if link is not None:
            link.close()

    def _thread_target(self, settings: WorkerSettings) -> Any:
        ring = self._ring_memory.array

        def run(channel: Any) -> None:
            try:
                Worker(settings, channel, ring).run()
            except BaseException:  # noqa: BLE001 - the receiver restarts the worker
                log.exception("routing writer thread crashed; restarting it")

        return run

    def _receive_loop(self) -> None:
        young_deaths = 0
        while True:
            link = self.link
            try:
                messages = link.recv(_RECV_WAIT_S)
            except (EOFError, OSError):
                if self._closing.is_set():
                    self.exited.set()
                    return
                lived = time.monotonic() - self._link_started
                young_deaths = 0 if lived > _YOUNG_S else young_deaths + 1
                with self._cond:
                    unacked = self._ledger.in_order(OperationState.SENT)
                # Applied one at a time in order: only the oldest may have reached the store
                in_doubt = (f"; the oldest, {unacked[0].label}, may have reached the store "
                            "already: it is applied again (a delete of it made meanwhile by "
                            "another process is undone)") if unacked else ""
                log.error("routing writer %s (pid %s) died; restarting it and re-sending %d "
                          "unacknowledged operations%s", self.mode, link.pid, len(unacked),
                          in_doubt)
                link.close()
                self._metrics.inc("restarts")
                delay = self._restart_backoff.compute(young_deaths) if young_deaths else 0.0
                if (delay and self._closing.wait(delay)) or not self.start():
                    self.exited.set()
                    return
                continue
            for start in range(0, len(messages), _RESULTS_PER_LOCK):
                if start:
                    time.sleep(0)  # let a submitting thread have the GIL between chunks
                with self._cond:
                    for data in messages[start:start + _RESULTS_PER_LOCK]:
                        if self._ledger.apply(unpack(data)):
                            self.started.set()
                    self._cond.notify_all()
                self._ledger.publish(self._metrics)  # only this thread applies results
