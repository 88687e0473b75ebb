"""Process-level plumbing for the P2PStore backend: import side effects, the event loop
its async API runs on, the provider probe, the transport's listening socket, the choice of
transport and the metadata server's Redis client.

Kept apart from :mod:`.store` so the store module reads as store logic only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import io
import json
import logging
import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fd_routing_replay.errors import ConfigError

log = logging.getLogger("fd_routing_replay.store.p2pstore")

_import_lock = threading.Lock()


class LogWriter(io.TextIOBase):
    """A stdout stand-in that sends P2PStore's ``print`` output to our log at DEBUG."""

    def write(self, text: str) -> int:
        if text.strip():
            log.debug("p2pstore says: %s", text.rstrip())
        return len(text)


def default_log_dir() -> Path:
    """Where P2PStore's logs go when neither the config nor ``$P2P_LOG_DIR`` says."""
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    return Path(tempfile.gettempdir()) / f"fd-routing-replay-{uid}" / "p2pstore-logs"


def resolve_log_dir(configured: str | None) -> Path:
    """``store.p2pstore.log_dir``, else ``$P2P_LOG_DIR``, else :func:`default_log_dir`.

    The directory is created and exported as ``P2P_LOG_DIR``: P2PStore reads the variable
    when it creates each logger (at import and at each client), and falls back to
    ``./p2pstorelog`` in the working directory without it.
    """
    chosen = configured or os.environ.get("P2P_LOG_DIR", "").strip() or str(default_log_dir())
    path = Path(chosen).expanduser().absolute()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        from fd_routing_replay.errors import ConfigError

        raise ConfigError(f"store.p2pstore.log_dir {str(path)!r} cannot be created: {exc}") \
            from exc
    os.environ["P2P_LOG_DIR"] = str(path)
    return path


def import_p2pstore(log_dir: Path) -> Any:
    """Import ``p2pstore`` with its logs under ``log_dir`` and its prints captured.

    ``P2PSTORE_LOG_LEVEL`` defaults to WARNING (P2PStore logs every put, get and the full
    key list of every batch delete at INFO).
    """
    with _import_lock:
        if "p2pstore" not in sys.modules:
            os.environ["P2P_LOG_DIR"] = str(log_dir)
            os.environ.setdefault("P2PSTORE_LOG_LEVEL", "WARNING")
        elif not os.environ.get("P2P_LOG_DIR"):
            log.warning("p2pstore was imported before fd_routing_replay could set "
                        "P2P_LOG_DIR; its first logs went to ./p2pstorelog")
        try:
            with contextlib.redirect_stdout(LogWriter()):
                import p2pstore
        except ImportError as exc:
            from fd_routing_replay.errors import PermanentStoreError

            raise PermanentStoreError(
                f"the p2pstore store needs the p2pstore client: {exc}; install "
                "'fd-routing-replay[p2pstore]' (p2pstore, mooncake-transfer-engine-non-cuda "
                "on machines without CUDA, and Debian's libibverbs1)") from exc
    return p2pstore


class AsyncBridge:
    """One event loop in a daemon thread; :meth:`run` calls a coroutine from any thread.

    P2PStore's API is ``async``; a store is called from the writer's and the trainer's
    plain threads.
    """

    def __init__(self, name: str = "p2pstore-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coroutine: Any, timeout: float | None) -> Any:
        """Run ``coroutine`` on the loop and wait; ``TimeoutError`` after ``timeout`` s."""
        if self._closed:
            coroutine.close()
            raise RuntimeError("the P2PStore event loop is closed")
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError as exc:
            future.cancel()
            raise TimeoutError(f"no result within {timeout}s") from exc

    def close(self) -> None:
        """Cancel what is left, stop the loop and join its thread.  Idempotent."""
        if self._closed:
            return
        self._closed = True

        async def _finish() -> None:
            current = asyncio.current_task()
            for task in asyncio.all_tasks():
                if task is not current:
                    task.cancel()
            await self.loop.shutdown_default_executor()

        try:
            asyncio.run_coroutine_threadsafe(_finish(), self.loop).result(10)
        except Exception as exc:  # noqa: BLE001 - best effort
            log.debug("P2PStore event loop shutdown: %s", exc)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self.loop.close()


def free_port(host: str) -> int:
    """A TCP port free on ``host`` now (P2PStore's TCP transport needs ``host:port``)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


PROBE_KEY = "__fd_rr_probe__"


def probe_provider(address: str, timeout_s: float, *, speak_tcp_transport: bool) -> str | None:
    """None when the provider at ``host:port`` answers, else what went wrong.

    For P2PStore's TCP transport the probe asks for a key that does not exist and expects
    its one-line JSON answer; for RDMA (Mooncake's RPC port) it only connects.
    """
    import socket

    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return f"unusable provider address {address!r}"
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    with sock:
        if not speak_tcp_transport:
            return None
        try:
            sock.sendall(json.dumps({"key": PROBE_KEY}).encode() + b"\n")
            reply = b""
            while not reply.endswith(b"\n") and len(reply) < 4096:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                reply += chunk
        except OSError as exc:
            return f"{type(exc).__name__} while probing: {exc}"
    try:
        status = json.loads(reply.decode("utf-8", "replace").strip() or "null")
    except json.JSONDecodeError:
        status = None
    if not isinstance(status, dict) or status.get("status") not in ("ok", "error"):
        return f"unexpected answer {reply[:80]!r}"
    return None


def close_tcp_listeners(client: Any) -> None:
    """Stop the listening socket of P2PStore's TCP transports (its close leaves them open)."""
    import socket

    for transport in getattr(client, "transports", []) or []:
        server = getattr(transport, "_server_socket", None)
        if type(transport).__name__ != "TCPTransport" or server is None:
            continue
        transport._running = False
        with contextlib.suppress(OSError):
            server.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
        with contextlib.suppress(OSError):
            server.close()
        transport._server_socket = None


def choose_transport(protocol: str, device: str) -> tuple[str, str]:
    """(protocol, device) to give P2PStore: RDMA when a NIC is usable, else its TCP."""
    if protocol == "tcp":
        return "tcp", ""
    from fd_routing_replay.rdma.devices import choose_device

    choice = choose_device(device)
    if choice.protocol == "rdma":
        log.info("P2PStore transport: rdma (%s)", choice.reason)
        return "rdma", choice.device or ""
    if not choice.ok and choice.candidates:
        raise ConfigError(f"store.p2pstore.device={device!r}: {choice.reason}")
    log.warning("P2PStore: %s; using its TCP transport instead of RDMA", choice.reason)
    return "tcp", ""


@contextlib.contextmanager
def trusted_device(protocol: str, device: str) -> Iterator[None]:
    """Make P2PStore use the device we checked.

    Its own check drops any NIC under 400 Gb/s (and its fallback only knows mlx5
    Ethernet devices) unless ``P2P_RDMA_DEVICE`` is set; set it while the client starts,
    unless the user set it.
    """
    if protocol != "rdma" or not device or os.environ.get("P2P_RDMA_DEVICE"):
        yield
        return
    os.environ["P2P_RDMA_DEVICE"] = device
    try:
        yield
    finally:
        os.environ.pop("P2P_RDMA_DEVICE", None)


def local_host(configured: str, protocol: str) -> str:
    host = configured or os.environ.get("POD_IP", "").strip() or "127.0.0.1"
    if protocol == "tcp" and ":" not in host:
        host = f"{host}:{free_port(host)}"  # its TCP transport needs host:port
    return host


def metadata_client(p2p_config: Any, timeout_s: float) -> Any:
    """A redis-py client on P2PStore's metadata server (from its parsed config)."""
    import redis

    from fd_routing_replay.store.redis_client import retry_policy, sentinel_master

    common = {"socket_connect_timeout": timeout_s, "password": p2p_config.redis_password,
              "username": p2p_config.redis_username, "retry": retry_policy()}
    if p2p_config.redis_mode == "sentinel":
        return sentinel_master(p2p_config.redis_sentinel_nodes, p2p_config.redis_sentinel_service,
                               db=p2p_config.redis_db, timeout_s=timeout_s, **common)
    return redis.Redis(host=p2p_config.redis_host, port=p2p_config.redis_port,
                       db=p2p_config.redis_db, socket_timeout=timeout_s, **common)
