"""What every throwaway test server shares: a free loopback port, its binary, the tail of
its log for a failing test's message, stopping it by pid, and the context-manager shape
(``with Server() as server:`` starts it and always cleans it up).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path

DEFAULT_START_TIMEOUT_S = 15.0

__all__ = ["DEFAULT_START_TIMEOUT_S", "ManagedServer", "find_binary", "free_port",
           "read_log_tail", "terminate"]


def find_binary(candidates: Sequence[str]) -> str | None:
    """The first candidate found on PATH or as an executable path, else None."""
    for candidate in candidates:
        found = shutil.which(candidate)
        if found:
            return found
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def free_port(host: str = "127.0.0.1", *, with_cluster_bus: bool = False) -> int:
    """A TCP port free on ``host`` right now (and port + 10000 too, for a cluster bus)."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        if not with_cluster_bus:
            return port
        if port + 10000 > 65535:
            continue
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((host, port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no free port pair (p, p+10000) found on {host}")


def read_log_tail(path: Path, name: str, lines: int) -> str:
    """The last ``lines`` of a server's log, for a failing test's message ("" if unreadable)."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return f"--- {name} log tail ---\n" + "\n".join(text[-lines:])


def terminate(process: subprocess.Popen) -> None:
    """SIGTERM by pid, then SIGKILL if it lingers (a no-op once it has exited)."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


class ManagedServer:
    """A context manager over ``start()`` and ``cleanup()``, which each server defines."""

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
