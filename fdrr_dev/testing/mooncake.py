"""Throwaway Mooncake Store processes for tests and benchmarks: a ``mooncake_master`` on
free loopback ports, and a ``mooncake_client`` that mounts a memory segment on it so
records outlive the processes that put them.

Both come from the Mooncake wheel (the ``mooncake`` extra); each is ready when the
master's HTTP admin server says so (``/health``, ``/get_all_segments``; polled, never a
fixed sleep) and is stopped by its pid.  These helpers need no redis-py.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from fdrr_dev.testing.process import (
    ManagedServer,
    find_binary,
    free_port,
    read_log_tail,
    terminate,
)

__all__ = ["MooncakeMaster", "MooncakeSegmentHolder", "mooncake_master_binary"]


class _PortTaken(Exception):
    """mooncake_master could not bind one of its ports."""


def mooncake_master_binary() -> str | None:
    """``mooncake_master`` from the Mooncake wheel (beside the venv's python, or inside the
    ``mooncake`` package), else on PATH, else None."""
    import importlib.util
    import sys

    candidates = [os.path.join(os.path.dirname(sys.executable), "mooncake_master")]
    spec = importlib.util.find_spec("mooncake")
    if spec is not None and spec.submodule_search_locations:
        candidates += [os.path.join(path, "mooncake_master")
                       for path in spec.submodule_search_locations]
    candidates.append("mooncake_master")
    return find_binary(candidates)


class MooncakeMaster(ManagedServer):
    """One ``mooncake_master`` on free loopback ports: RPC, HTTP metadata server and its
    HTTP admin/metrics server (``/health``, ``/get_all_keys``).

    Ready when ``/health`` answers ``"status":"ok"`` (polled, never a fixed sleep).  Stopped
    by its pid (:meth:`stop`; :meth:`kill` for a crash).  :meth:`restart` brings it back on
    the same ports — with no data: the master keeps its metadata in memory only.
    """

    def __init__(self, *, host: str = "127.0.0.1", extra_args: Sequence[str] = (),
                 start_timeout_s: float = 30.0) -> None:
        binary = mooncake_master_binary()
        if binary is None:
            raise FileNotFoundError("mooncake_master not found (pip install "
                                    "'fd-routing-replay[mooncake]')")
        self.binary = binary
        self.host = host
        self.rpc_port = free_port(host)
        self.http_port = free_port(host)
        self.metrics_port = free_port(host)
        self.extra_args = list(extra_args)
        self.start_timeout_s = start_timeout_s
        self.dir = Path(tempfile.mkdtemp(prefix="fdrr-mooncake-"))
        self.logfile = self.dir / "master.log"
        self.process: subprocess.Popen | None = None
        self._started_once = False

    @property
    def address(self) -> str:
        """``host:port`` of the RPC port (``store.mooncake.master_server``)."""
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://{self.host}:{self.http_port}/metadata"

    @property
    def admin(self) -> str:
        """``host:port`` of the HTTP admin server (``store.mooncake.master_http``)."""
        return f"{self.host}:{self.metrics_port}"

    def _arguments(self) -> list[str]:
        return [self.binary, f"--rpc_port={self.rpc_port}", f"--rpc_address={self.host}",
                "--enable_http_metadata_server=true",
                f"--http_metadata_server_host={self.host}",
                f"--http_metadata_server_port={self.http_port}",
                f"--metrics_host={self.host}", f"--metrics_port={self.metrics_port}",
                "--enable_metric_reporting=false", *self.extra_args]

    def start(self) -> MooncakeMaster:
        """Start it and wait until it is healthy.  Ports picked at random that another
        process took meanwhile ("Address already in use") are picked again, at the first
        start only: :meth:`restart` keeps the ports clients know."""
        if self.running:
            return self
        for _attempt in range(5):
            try:
                return self._start_once()
            except _PortTaken:
                if self._started_once:
                    raise RuntimeError(f"mooncake_master's ports on {self.host} are taken; "
                                       f"cannot start it there again\n{self.log_tail()}") \
                        from None
                self.rpc_port, self.http_port, self.metrics_port = (
                    free_port(self.host) for _ in range(3))
        raise RuntimeError("could not find free ports for mooncake_master after 5 attempts")

    def _start_once(self) -> MooncakeMaster:
        offset = self.logfile.stat().st_size if self.logfile.exists() else 0
        log = open(self.logfile, "ab")  # noqa: SIM115 - handed to the child
        try:
            self.process = subprocess.Popen(self._arguments(), stdout=log,
                                            stderr=subprocess.STDOUT, cwd=self.dir)
        finally:
            log.close()
        deadline = time.monotonic() + self.start_timeout_s
        delay = 0.01
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.process = None
                with open(self.logfile, "rb") as stream:
                    stream.seek(offset)
                    if b"Address already in use" in stream.read():
                        raise _PortTaken()
                raise RuntimeError(f"mooncake_master exited at start-up:\n{self.log_tail()}")
            if self.healthy():
                self._started_once = True
                return self
            time.sleep(delay)
            delay = min(delay * 2, 0.2)
        self.kill()
        raise RuntimeError(f"mooncake_master on {self.address} was not healthy within "
                           f"{self.start_timeout_s}s\n{self.log_tail()}")

    def healthy(self) -> bool:
        """``/health`` answers ``status: ok`` and the RPC port accepts connections."""
        import json
        import urllib.request

        try:
            with urllib.request.urlopen(f"http://{self.admin}/health", timeout=1) as answer:
                ok = json.loads(answer.read()).get("status") == "ok"
            with socket.create_connection((self.host, self.rpc_port), timeout=1):
                pass
            return ok
        except (OSError, ValueError):
            return False

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        """SIGTERM by pid, then SIGKILL if it lingers.  Idempotent."""
        if self.process is not None:
            terminate(self.process)
        self.process = None

    def kill(self) -> None:
        """SIGKILL by pid (a crash).  Idempotent."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None

    def restart(self) -> MooncakeMaster:
        self.stop()
        return self.start()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def log_tail(self, lines: int = 30) -> str:
        return read_log_tail(self.logfile, "mooncake_master", lines)


class MooncakeSegmentHolder:
    """A dedicated ``mooncake_client`` process that mounts ``segment`` bytes of memory on a
    master, so records outlive the processes that put them.  Ready when the master lists
    its segment; stopped by pid."""

    def __init__(self, master: MooncakeMaster, *, segment: str = "64MB",
                 start_timeout_s: float = 30.0) -> None:
        binary = find_binary([os.path.join(os.path.dirname(master.binary), "mooncake_client"),
                              "mooncake_client"])
        if binary is None:
            raise FileNotFoundError("mooncake_client not found beside mooncake_master")
        self.master = master
        self.port = free_port(master.host)
        self.logfile = master.dir / f"holder-{self.port}.log"
        self.args = [binary, f"--master_server_address={master.address}",
                     "--metadata_server=P2PHANDSHAKE", f"--host={master.host}",
                     f"--global_segment_size={segment}", "--local_buffer_size=16MB",
                     "--protocol=tcp", f"--port={self.port}"]
        self.start_timeout_s = start_timeout_s
        self.process: subprocess.Popen | None = None

    def segments(self) -> list[str]:
        import urllib.request

        with urllib.request.urlopen(f"http://{self.master.admin}/get_all_segments",
                                    timeout=2) as answer:
            return [line for line in answer.read().decode().split("\n") if line]

    def start(self) -> MooncakeSegmentHolder:
        before = set(self.segments())
        log = open(self.logfile, "ab")  # noqa: SIM115 - handed to the child
        try:
            self.process = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT)
        finally:
            log.close()
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mooncake_client exited at start-up: "
                                   f"{self.logfile.read_text(errors='replace')[-2000:]}")
            if set(self.segments()) - before:
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("mooncake_client's segment did not appear on the master")

    def stop(self) -> None:
        if self.process is not None:
            terminate(self.process)
        self.process = None
