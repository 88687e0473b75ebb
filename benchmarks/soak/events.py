"""The soak's processes talk through JSON-lines files in the run directory: each process
appends to its own file, the others tail it.

One ``os.write`` per event on an ``O_APPEND`` descriptor, so a process killed at any
moment leaves whole lines behind (a torn last line is ignored until it is complete, and
forever once the writer is gone).  Times are ``time.monotonic()`` (one clock for every
process on the machine).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["EventLog", "StepGate", "Tail", "read_all"]


class EventLog:
    """Appends events to ``path`` (created if missing; a restarted process continues it)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def emit(self, event: str, **fields: Any) -> None:
        line = json.dumps({"e": event, **fields}, separators=(",", ":")) + "\n"
        os.write(self._fd, line.encode())

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class Tail:
    """New complete lines of a JSON-lines file, parsed, each time :meth:`read` is called."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._offset = 0
        self._partial = b""

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as stream:
                stream.seek(self._offset)
                data = stream.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        return [json.loads(line) for line in lines if line.strip()]


def read_all(path: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """Every complete event of ``path`` (none when it does not exist)."""
    tail = Tail(path)
    yield from tail.read()


class StepGate:
    """The highest training step producers may start, from the orchestrator's ``step-gate``
    file: an RL driver does not start rollouts more than a few steps ahead of training, so
    records in flight stay bounded whatever the trainers' pace."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.path = Path(directory) / "step-gate"

    def allow(self, highest: int) -> None:
        temp = self.path.with_suffix(".tmp")
        temp.write_text(str(highest))
        os.replace(temp, self.path)

    def wait(self, step: int, until: float) -> bool:
        """Wait until ``step`` may start (True) or ``until`` (monotonic) passes (False)."""
        import time

        while True:
            try:
                if step <= int(self.path.read_text()):
                    return True
            except (FileNotFoundError, ValueError):
                return True  # no gate: nothing to wait for
            if time.monotonic() >= until:
                return False
            time.sleep(0.01)
