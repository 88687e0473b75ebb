"""Throwaway Redis servers for tests and benchmarks: one ``redis-server`` (optionally with
a password or TLS only) and a Redis Cluster of 3+ masters joined by ``redis-cli --cluster``.

Every server binds a free loopback port, lives in its own temporary directory, is ready
when it answers ``PING`` from our own process (polled, never a fixed sleep) and is stopped
by its pid.  A failed start raises with the tail of the server's log.  Nothing is
persisted unless asked: ``restart(keep_data=True)`` saves an RDB snapshot into the
server's directory on shutdown and loads it on start, so a test can take Redis down and
bring it back on the same port with or without its data.

Redis is spoken through redis-py (the ``redis`` / ``test`` extra), imported on first use.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from fdrr_dev.testing.process import (
    DEFAULT_START_TIMEOUT_S,
    ManagedServer,
    find_binary,
    free_port,
    read_log_tail,
)

REDIS_SERVER_CANDIDATES = ("redis-server", "/usr/bin/redis-server")
REDIS_CLI_CANDIDATES = ("redis-cli", "/usr/bin/redis-cli")

__all__ = ["REDIS_CLI_CANDIDATES", "REDIS_SERVER_CANDIDATES", "RedisCluster", "RedisServer",
           "make_tls_files", "pack_commands", "redis_cli_binary", "redis_server_binary"]


def redis_server_binary() -> str | None:
    """Path of ``redis-server`` (PATH first, then the Debian location) or None."""
    return find_binary(REDIS_SERVER_CANDIDATES)


def redis_cli_binary() -> str | None:
    """Path of ``redis-cli`` or None."""
    return find_binary(REDIS_CLI_CANDIDATES)


# -- redis-py ------------------------------------------------------------------------------

def _redis_errors() -> tuple[type[BaseException], ...]:
    """What a command to a server that is starting, stopping or gone may raise."""
    import redis

    return (OSError, redis.RedisError)


def pack_commands(commands: Iterable[Sequence[str | bytes | int]]) -> bytes:
    """Commands in the Redis protocol (redis-py's encoder), e.g. for ``redis-cli --pipe``."""
    import redis

    packer = redis.Connection()  # encodes only; never connects
    return b"".join(chunk for args in commands for chunk in packer.pack_command(*args))


class _PortTaken(Exception):
    """redis-server could not bind its port."""


# -- single server ---------------------------------------------------------------------

class RedisServer(ManagedServer):
    """One ``redis-server`` process on a free loopback port, in its own temp directory.

    ``config`` adds directives (``{"maxmemory": "64mb"}``); ``extra_args`` adds raw
    command-line arguments.  ``password`` sets ``requirepass`` for the default user.
    ``tls`` = ``(cert_file, key_file, ca_file)`` serves TLS only (``rediss://``) on the port.
    Call :meth:`start` (or use it as a context manager) and always :meth:`stop` it.
    """

    def __init__(self, *, port: int | None = None, host: str = "127.0.0.1",
                 config: dict[str, str] | None = None, extra_args: Sequence[str] = (),
                 password: str | None = None, directory: str | os.PathLike | None = None,
                 cluster: bool = False, tls: tuple[str, str, str] | None = None,
                 start_timeout_s: float = DEFAULT_START_TIMEOUT_S) -> None:
        binary = redis_server_binary()
        if binary is None:
            raise FileNotFoundError(
                "redis-server not found on PATH nor at /usr/bin/redis-server; "
                "install the Debian package redis-server")
        self.binary = binary
        self.host = host
        self._auto_port = port is None
        self._started_once = False
        self.port = port or free_port(host, with_cluster_bus=cluster)
        self.cluster = cluster
        self.password = password
        self.config = dict(config or {})
        self.extra_args = list(extra_args)
        self.start_timeout_s = start_timeout_s
        self.tls = tls
        self._own_dir = directory is None
        self.dir = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="fdrr-redis-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.logfile = self.dir / "redis.log"
        self.process: subprocess.Popen | None = None

    # -- addresses ----------------------------------------------------------------
    @property
    def url(self) -> str:
        """``redis[s]://[:password@]host:port/0`` for this server."""
        auth = f":{self.password}@" if self.password else ""
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://{auth}{self.host}:{self.port}/0"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    # -- lifecycle ------------------------------------------------------------------
    def _arguments(self) -> list[str]:
        if self.tls:
            cert, key, ca = self.tls
            ports = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(cert),
                     "--tls-key-file", str(key), "--tls-ca-cert-file", str(ca),
                     "--tls-auth-clients", "no"]
        else:
            ports = ["--port", str(self.port)]
        args = [self.binary, *ports, "--bind", self.host,
                "--dir", str(self.dir), "--logfile", str(self.logfile),
                "--dbfilename", "dump.rdb", "--daemonize", "no",
                "--save", "", "--appendonly", "no", "--protected-mode", "no"]
        if self.password:
            args += ["--requirepass", self.password]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                     "--cluster-node-timeout", "5000"]
        for name, value in self.config.items():
            args += [f"--{name}", str(value)]
        return args + self.extra_args

    def start(self) -> RedisServer:
        """Start the process and wait until it answers PING; raise with its log if not.

        A port picked automatically that another process grabbed in the meantime is
        replaced by a fresh one (first start only; a restart keeps its port).
        """
        if self.running:
            return self
        for _attempt in range(5):
            try:
                return self._start_once()
            except _PortTaken:
                if not self._auto_port or self._started_once:
                    raise RuntimeError(f"port {self.port} is taken; cannot start redis-server "
                                       f"there\n{self.log_tail()}") from None
                self.port = free_port(self.host, with_cluster_bus=self.cluster)
        raise RuntimeError("could not find a free port for redis-server after 5 attempts")

    def _start_once(self) -> RedisServer:
        self.logfile.unlink(missing_ok=True)
        self.process = subprocess.Popen(self._arguments(), stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, cwd=self.dir)
        deadline = time.monotonic() + self.start_timeout_s
        delay = 0.005
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                stderr = self.process.stderr.read().decode(errors="replace") if \
                    self.process.stderr else ""
                self.process = None
                if "Address already in use" in stderr + self.log_tail():
                    raise _PortTaken()
                raise RuntimeError(
                    f"redis-server on {self.address} exited at start-up:\n{stderr}"
                    f"{self.log_tail()}")
            try:
                # PONG from *our* process: another server may own the port we picked.
                if self.command("PING", timeout=1.0) == b"PONG" and \
                        self.info("server").get("process_id") == str(self.process.pid):
                    self._started_once = True
                    return self
            except _redis_errors() as exc:  # LOADING, refused, TLS handshake
                last_error = exc
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
        self._kill()
        raise RuntimeError(f"redis-server on {self.address} did not answer PING within "
                           f"{self.start_timeout_s}s (last error: {last_error})\n"
                           f"{self.log_tail()}")

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, *, save: bool = False) -> None:
        """Shut the server down (``save``: write dump.rdb first).  Idempotent."""
        if not self.running:
            self.process = None
            return
        try:
            self.command("SHUTDOWN", "SAVE" if save else "NOSAVE", timeout=10.0)
        except _redis_errors():
            pass  # SHUTDOWN closes the connection without a reply
        assert self.process is not None
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self._kill()
        if self.process is not None and self.process.stderr:
            self.process.stderr.close()
        self.process = None

    def restart(self, *, keep_data: bool = True) -> RedisServer:
        """Stop and start again on the same port; ``keep_data`` carries data via RDB."""
        self.stop(save=keep_data)
        if not keep_data:
            for name in ("dump.rdb", "appendonly.aof"):
                (self.dir / name).unlink(missing_ok=True)
            shutil.rmtree(self.dir / "appendonlydir", ignore_errors=True)
        return self.start()

    def _kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            if self.process.stderr:
                self.process.stderr.close()
            self.process = None

    def cleanup(self) -> None:
        """Stop the server and remove its directory (when we created it)."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    # -- helpers ----------------------------------------------------------------------
    def client(self, **options: Any) -> Any:
        """A redis-py ``Redis`` for this server (password and TLS applied; ``options`` are
        passed on, e.g. ``decode_responses=True``).  The caller closes it."""
        import redis

        settings: dict[str, Any] = {"host": self.host, "port": self.port,
                                    "password": self.password}
        if self.tls is not None:
            settings.update(ssl=True, ssl_ca_certs=str(self.tls[2]), ssl_cert_reqs="required")
        settings.update(options)
        return redis.Redis(**settings)

    def command(self, *args: str | bytes | int, timeout: float = 5.0) -> Any:
        """Run one command on a fresh connection (authenticated when a password is set) and
        return the server's reply as redis-py parses it, without redis-py's per-command
        post-processing: bulk strings as bytes, simple strings as bytes (``b"OK"``),
        integers, lists.  A fresh connection per call, never retried, so it is safe while
        the server starts, stops or changes its password."""
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        client = self.client(socket_timeout=timeout, socket_connect_timeout=timeout,
                             single_connection_client=True, retry=Retry(NoBackoff(), 0))
        client.response_callbacks.clear()  # the raw reply, whatever the command
        try:
            return client.execute_command(*args)
        finally:
            client.close()

    def load(self, commands: Iterable[Sequence[str | bytes | int]],
             workdir: str | os.PathLike | None = None) -> None:
        """Bulk-load ``commands`` (each a sequence of arguments): through
        ``redis-cli --pipe`` where it exists, else a redis-py pipeline."""
        cli = redis_cli_binary()
        if cli is None or self.tls is not None:
            client = self.client()
            try:
                pipe = client.pipeline(transaction=False)
                for number, args in enumerate(commands, 1):
                    pipe.execute_command(*args)
                    if number % 10_000 == 0:
                        pipe.execute()
                pipe.execute()
            finally:
                client.close()
            return
        with tempfile.NamedTemporaryFile(dir=workdir or self.dir, suffix=".resp") as stream:
            stream.write(pack_commands(commands))
            stream.flush()
            stream.seek(0)
            auth = ["-a", self.password, "--no-auth-warning"] if self.password else []
            result = subprocess.run([cli, "-h", self.host, "-p", str(self.port), *auth,
                                     "--pipe"], stdin=stream, capture_output=True, text=True,
                                    timeout=3600)
        if result.returncode != 0 or "errors: 0" not in result.stdout:
            raise RuntimeError(f"redis-cli --pipe into {self.address} failed: "
                               f"{result.stdout} {result.stderr}\n{self.log_tail()}")

    def flushall(self) -> None:
        self.command("FLUSHALL")

    def info(self, section: str = "") -> dict[str, str]:
        """``INFO section`` parsed into a dict of strings."""
        raw = self.command("INFO", section) if section else self.command("INFO")
        fields = {}
        for line in raw.decode().splitlines():
            if ":" in line and not line.startswith("#"):
                name, _, value = line.partition(":")
                fields[name] = value
        return fields

    def log_tail(self, lines: int = 30) -> str:
        return read_log_tail(self.logfile, "redis", lines)

    def __repr__(self) -> str:
        return f"<RedisServer {self.address} dir={self.dir} running={self.running}>"


def make_tls_files(directory: str | os.PathLike, host: str = "127.0.0.1"
                   ) -> tuple[str, str, str]:
    """A throwaway CA and a server certificate for ``host`` (openssl CLI): (cert, key, ca)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise FileNotFoundError("openssl not found; it is needed to make test certificates")
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = root / "ca.key", root / "ca.crt"
    key, csr, cert = root / "server.key", root / "server.csr", root / "server.crt"
    ext = root / "server.ext"
    ext.write_text(f"subjectAltName=IP:{host},DNS:localhost\n")

    def openssl_run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True, timeout=60)

    openssl_run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                "-subj", "/CN=fdrr-test-ca", "-keyout", str(ca_key), "-out", str(ca_cert))
    openssl_run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={host}",
                "-keyout", str(key), "-out", str(csr))
    openssl_run("x509", "-req", "-in", str(csr), "-CA", str(ca_cert), "-CAkey", str(ca_key),
                "-CAcreateserial", "-days", "2", "-extfile", str(ext), "-out", str(cert))
    return str(cert), str(key), str(ca_cert)


# -- cluster ----------------------------------------------------------------------------

class RedisCluster(ManagedServer):
    """``masters`` cluster-enabled servers on loopback joined by ``redis-cli --cluster``.

    Ready when every node reports ``cluster_state:ok``.  ``url`` is
    ``redis+cluster://host:port`` of the first node; ``nodes`` lists every server.
    """

    def __init__(self, masters: int = 3, *, host: str = "127.0.0.1",
                 start_timeout_s: float = 30.0) -> None:
        if masters < 3:
            raise ValueError(f"a Redis Cluster needs at least 3 masters, got {masters}")
        cli = redis_cli_binary()
        if cli is None:
            raise FileNotFoundError("redis-cli not found; install the Debian package "
                                    "redis-tools")
        self.cli = cli
        self.host = host
        self.masters = masters
        self.start_timeout_s = start_timeout_s
        self.nodes: list[RedisServer] = []

    @property
    def url(self) -> str:
        return f"redis+cluster://{self.nodes[0].host}:{self.nodes[0].port}/0"

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        return [(node.host, node.port) for node in self.nodes]

    def start(self) -> RedisCluster:
        try:
            # Started one after another, so each new node's port pair (p, p + 10000)
            # avoids the ports the earlier nodes already hold.
            for _ in range(self.masters):
                node = RedisServer(host=self.host, cluster=True)
                self.nodes.append(node)
                node.start()
            result = subprocess.run(
                [self.cli, "--cluster", "create", *[n.address for n in self.nodes],
                 "--cluster-replicas", "0", "--cluster-yes"],
                capture_output=True, text=True, timeout=self.start_timeout_s)
            if result.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed ({result.returncode}):"
                                   f"\n{result.stdout}\n{result.stderr}")
            self._wait_ok()
        except BaseException:
            self.cleanup()
            raise
        return self

    def _wait_ok(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            for node in self.nodes:
                info = node.command("CLUSTER", "INFO").decode()
                state = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                              if line.startswith("cluster_state:")), "?")
                states[node.address] = state
            if all(state == "ok" for state in states.values()):
                return
            time.sleep(0.05)
        raise RuntimeError(f"cluster did not reach cluster_state:ok in "
                           f"{self.start_timeout_s}s: {states}")

    def flushall(self) -> None:
        for node in self.nodes:
            node.command("FLUSHALL")

    def client(self, **options: Any) -> Any:
        """A redis-py ``RedisCluster`` on this cluster (``options`` passed on).  The caller
        closes it."""
        import redis

        settings: dict[str, Any] = {"host": self.nodes[0].host, "port": self.nodes[0].port}
        settings.update(options)
        return redis.RedisCluster(**settings)

    def cleanup(self) -> None:
        """Stop every node and remove their directories.  Idempotent."""
        for node in self.nodes:
            node.cleanup()
        self.nodes = []

    stop = cleanup

    def __repr__(self) -> str:
        return f"<RedisCluster {[n.address for n in self.nodes]}>"
