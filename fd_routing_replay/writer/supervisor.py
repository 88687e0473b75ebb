"""The writer's generations: start the worker, hear from it, restart it when it dies.

A *generation* is one run of the :class:`~fd_routing_replay.writer.worker.Worker`, in a
process of its own (``writer.mode: process``) or a thread (``thread``).  Each one is sent
every operation the ledger still counts as *sent* (what the last generation never
acknowledged) before anything new, so a writer killed mid-way (even SIGKILL) loses
nothing; journal entries are replayed by the worker itself at start.  A receiver thread
applies the worker's results to the ledger; when the link breaks it restarts the
worker, backing off (up to a few seconds) when generations die young.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import replace
from typing import Any

from fd_routing_replay.writer.ledger import Ledger
from fd_routing_replay.writer.metrics import WriterMetrics
from fd_routing_replay.writer.operation import OperationState
from fd_routing_replay.writer.retry import ExponentialBackoff
from fd_routing_replay.writer.ring import RingMemory
from fd_routing_replay.writer.settings import WorkerSettings
from fd_routing_replay.writer.transport import (
    ProcessLink,
    ThreadLink,
    pack,
    portable_store_registrations,
    unpack,
)
from fd_routing_replay.writer.worker import Worker

__all__ = ["Supervisor"]

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
