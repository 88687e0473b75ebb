"""The writer process: ``python -c "from fd_routing_replay.writer.process import main; main()"``.

Started by :class:`~fd_routing_replay.writer.transport.ProcessLink` (fork+exec) with its
pipes, the ring's memfd and the journal lock as inherited descriptors.  It reads the
``init`` message (the :class:`~fd_routing_replay.writer.settings.WorkerSettings`), takes
over the engine's ``sys.path`` and store registrations, attaches the ring and runs one
:class:`~fd_routing_replay.writer.worker.Worker`; its log records go back to the engine,
which logs them there.  SIGINT is ignored (the engine decides when it stops); SIGTERM
stops it like a ``stop`` message.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from multiprocessing.connection import Connection
from typing import Any

from fd_routing_replay.store.registry import register_store
from fd_routing_replay.writer.ring import RingMemory
from fd_routing_replay.writer.settings import WorkerSettings
from fd_routing_replay.writer.transport import PipeChannel, pack, unpack
from fd_routing_replay.writer.worker import Worker

__all__ = ["main"]


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
