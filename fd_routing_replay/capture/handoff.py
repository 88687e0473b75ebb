"""Finishing work off the engine's thread: records are built, encoded and handed on by one
background thread.

When a request finishes, the engine thread does only what cannot wait: it maps the
request's positions to KV slots and gathers their rows out of the host slot cache with
the compiled pack (the slots may be reused by the very next step).  Everything after that
-- building the record, counting rows without routing, stamping provenance, encoding and
writing it (:class:`~fd_routing_replay.capture.sink.StoreSink`) or queueing it for the
background writer (:class:`~fd_routing_replay.capture.sink.WriterSink`) -- is a job for
:class:`FinishingThread`, which runs jobs one at a time in the order they were submitted
(so ``only_last_turn`` and the writer see the same order as before).

Nothing is dropped: when more than ``max_pending_bytes`` of packed rows wait, ``submit``
waits for the thread (as an inline write would have) instead of discarding; a job that
raises is counted and logged.  ``flush`` waits until every job submitted so far is done,
which is what :meth:`~fd_routing_replay.capture.sink.RecordSink.flush` callers rely on.
With ``inline=True`` jobs run on the caller's thread (``response`` mode needs the encoded
record in the call).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["DEFAULT_MAX_PENDING_BYTES", "FinishingThread", "flush_after"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_PENDING_BYTES = 256 << 20
"""Packed rows allowed to wait for the thread before ``submit`` waits (256 MiB: about
seventeen 32k-token records of 60 layers x top-8 in uint8)."""

IDLE_EXIT_S = 2.0
"""A finishing thread with nothing to do for this long ends; the next job starts a new one."""

Job = Callable[[], None]


class FinishingThread:
    """One daemon thread that runs submitted jobs in order (see the module docstring)."""

    def __init__(self, *, name: str = "fdrr-finish", max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
                 inline: bool = False) -> None:
        if max_pending_bytes <= 0:
            raise ValueError(f"max_pending_bytes must be positive, got {max_pending_bytes!r}")
        self.name = name
        self.inline = bool(inline)
        self.max_pending_bytes = int(max_pending_bytes)
        self._jobs: collections.deque[tuple[Job, int]] = collections.deque()
        self._cond = threading.Condition()
        self._pending_bytes = 0
        self._busy = False            # the thread is running a job it took off the queue
        self._closed = False
        self._thread: threading.Thread | None = None
        self.counters: dict[str, float] = {"jobs": 0, "job_errors": 0, "submit_waits": 0,
                                           "submit_wait_seconds": 0.0, "max_pending_bytes_seen": 0}

    # ------------------------------------------------------------------ engine side
    def submit(self, job: Job, nbytes: int = 0) -> None:
        """Run ``job`` on the thread after every job submitted before it.

        ``nbytes``: memory the job holds until it runs (the packed rows), for the bound.
        Waits while the bound is exceeded; after :meth:`close` the job runs inline.
        """
        if self.inline or self._closed:
            self._run(job)
            return
        nbytes = max(int(nbytes), 0)
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()
            if self._pending_bytes and self._pending_bytes + nbytes > self.max_pending_bytes:
                started = time.perf_counter()
                self.counters["submit_waits"] += 1
                while self._pending_bytes and self._pending_bytes + nbytes > self.max_pending_bytes:
                    self._cond.wait()
                self.counters["submit_wait_seconds"] += time.perf_counter() - started
            self._jobs.append((job, nbytes))
            self._pending_bytes += nbytes
            self.counters["max_pending_bytes_seen"] = max(self.counters["max_pending_bytes_seen"],
                                                          self._pending_bytes)
            self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every job submitted so far has run; False if ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._jobs or self._busy:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def close(self, timeout: float | None = None) -> bool:
        """Run what is queued, then stop the thread; later jobs run inline.  False when
        ``timeout`` passed with jobs still queued (they keep running on the daemon thread)."""
        done = self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if done and thread is not None:
            thread.join(timeout)
        return done

    @property
    def pending(self) -> int:
        """Jobs submitted and not finished yet."""
        with self._cond:
            return len(self._jobs) + int(self._busy)

    def stats(self) -> dict[str, Any]:
        with self._cond:
            out: dict[str, Any] = dict(self.counters)
            out["pending_jobs"] = len(self._jobs) + int(self._busy)
            out["pending_bytes"] = self._pending_bytes
        return out

    # ------------------------------------------------------------------ the thread
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    if not self._cond.wait(IDLE_EXIT_S) and not self._jobs:
                        # idle: end the thread (the next submit starts another), so an owner
                        # that is gone leaves no thread behind
                        self._thread = None
                        return
                if not self._jobs:
                    return
                job, nbytes = self._jobs.popleft()
                self._busy = True
            try:
                self._run(job)
            finally:
                del job           # nothing of the job outlives it (its rows, its record)
                with self._cond:
                    self._busy = False
                    self._pending_bytes -= nbytes
                    self._cond.notify_all()

    def _run(self, job: Job) -> None:
        try:
            job()
        except Exception as exc:  # a job handles its own errors; this is the last guard
            self.counters["job_errors"] += 1
            logger.error("routing replay: a finishing job failed (counted): %r", exc)
        finally:
            self.counters["jobs"] += 1


def flush_after(wait: Callable[[float | None], bool], sink: Any, timeout: float | None) -> bool:
    """``wait(timeout)`` (records handed to the sink), then ``sink.flush`` (durable) with
    what is left of ``timeout``; False when either runs out of time."""
    deadline = None if timeout is None else time.monotonic() + timeout
    if not wait(timeout):
        return False
    if sink is None:
        return True
    return bool(sink.flush(None if deadline is None else max(deadline - time.monotonic(), 0.0)))
