"""Control messages between the engine side and the writer, and the two ways to run it.

Messages are short msgpack lists (never pickle, never arrays: payloads travel through
the ring).  Engine -> writer::

    ["init", settings]              first message of a process generation
    ["op", fields]                  a put, delete or prefix delete: Operation.to_wire()
                                    (writer/operation.py); a put's ids are at
                                    ring[offset:offset+nbytes]
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
    ["done", seq]                   finished (written, deleted or dead-lettered)
    ["errs", retries, store_errors] counter deltas
    ["store", snapshot]             InstrumentedStore counters of the writer's store
    ["log", levelno, logger, text]  a log record from the writer process
    ["stopped", journal_entries]

:class:`ThreadLink` runs the writer in a thread of this process; :class:`ProcessLink`
starts ``python -c 'from fd_routing_replay.writer.process import main; main()'`` with
``subprocess`` (fork+exec, the equivalent of multiprocessing's *spawn*: a process with
Paddle threads is never forked without exec), handing it the pipes, the ring's memfd
and the journal lock as inherited descriptors.
"""

from __future__ import annotations

import os
import queue
import select
import struct
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import msgpack

_FRAME = struct.Struct("!i")  # multiprocessing.connection's length prefix

__all__ = ["ProcessLink", "ThreadLink", "pack", "portable_store_registrations", "unpack"]


def pack(message: list[Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(data: bytes) -> list[Any]:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


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


# -- writer side -----------------------------------------------------------------------

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


# -- engine side -----------------------------------------------------------------------

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
        code = "from fd_routing_replay.writer.process import main; main()"
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
