"""Start and stop FastDeploy's real OpenAI API server on a CPU, with the stand-ins and the plugin.

A CPU test rig with fake CUDA, not a deployment: FastDeploy 2.6's API server, engine,
scheduler, prefix cache, token processor and worker process run their own Python; only
compiled kernels are stood in (``tests/fdcpu``), installed in every process of the server
by ``tests/live/site/sitecustomize.py`` (``FDRR_LIVE_RIG=1``).

The server is started as FastDeploy's CI starts it (tests/test_EB_Lite_serving_R3.py:
``python -m fastdeploy.entrypoints.openai.api_server`` in a new session), on loopback ports
chosen here.  FastDeploy launches its worker through ``paddle.distributed.launch`` in a
session of its own (engine/engine.py:689, ``preexec_fn=os.setsid``), so :meth:`LiveServer.stop`
finds every process of the rig by a marker in its environment, not by process group,
terminates them, and removes what FastDeploy left in ``/dev/shm`` (names carrying the rig's
ports).  A server that does not come up in time, or dies, fails with every process's log tail.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .model_dir import write_model_dir

__all__ = ["LiveServer", "RigError", "ServerOptions", "free_port", "rig_processes"]

REPO = Path(__file__).resolve().parents[2]
SITE = Path(__file__).resolve().parent / "site"
# FastDeploy's sources; a relative FD_SOURCE_DIR (the Makefile's) is resolved now, before a test changes directory
FD_SOURCE = Path(os.environ.get("FD_SOURCE_DIR") or REPO.parent / "shared" / "fastdeploy" / "2.6").resolve()
MARKER = "FDRR_LIVE_RIG_ID"


class RigError(RuntimeError):
    """The rig failed (start-up, a dead process, shutdown); the message carries the log tails.
    ``killed``: the processes stopping it needed SIGKILL for."""

    killed: list[str] = []


def free_port() -> int:
    """A free TCP port on loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rig_processes(rig_id: str, root: int | None = None, session: int | None = None) -> list[int]:
    """PIDs of every live process of the rig: those whose environment carries
    ``FDRR_LIVE_RIG_ID=rig_id``, every process of the session ``session`` (the rig starts the
    API server in a session of its own) and every descendant of ``root``.  The environment
    alone misses a process that renamed itself with setproctitle (FastDeploy's API server
    processes and gunicorn's): /proc no longer shows its environment, and once its parent is
    gone it is no one's descendant -- the session still holds it.  FastDeploy starts its
    worker in a session of its own; it keeps the marker."""
    needle = f"{MARKER}={rig_id}".encode()
    found, parents = set(), {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()   # state, ppid, pgrp, session, ...
            if fields[0] == b"Z":
                continue
            parents[int(entry)] = int(fields[1])
            if session is not None and int(fields[3]) == session:
                found.add(int(entry))
            with open(f"/proc/{entry}/environ", "rb") as handle:
                if needle in handle.read().split(b"\0"):
                    found.add(int(entry))
        except OSError:
            continue
    if root is not None and root in parents:
        found.add(root)
    grew = True
    while grew:                                   # and everything they started
        grew = False
        for pid, parent in parents.items():
            if parent in found and pid not in found:
                found.add(pid)
                grew = True
    return sorted(found)


@dataclass
class ServerOptions:
    """How to start one server (FastDeploy's CLI flags, our plugin's settings)."""

    plugin: bool = True                          # FD_PLUGINS names fd_routing_replay
    routing: dict[str, Any] | None = field(default_factory=lambda: {"enable_routing_replay": True})
    rr_env: dict[str, str] = field(default_factory=dict)    # FD_RR_* settings of the plugin
    max_model_len: int = 2048
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 128
    num_gpu_blocks: int = 160
    block_size: int = 16
    prefix_caching: bool = True
    overlap: bool = True
    zmq_output: bool = False                     # FD_USE_GET_SAVE_OUTPUT_V1=1 (no preemption: fdcpu/output_ops.py)
    plants: bool = True                          # planted bugs installed, switched by LiveServer.plant
    model: dict[str, Any] = field(default_factory=dict)    # config.json overrides
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)   # e.g. FDRR_LIVE_HANG (tests/live/plants.py)
    start_timeout_s: float = 240.0


class LiveServer:
    """One FastDeploy API server on loopback; use as a context manager."""

    def __init__(self, workdir: Path, options: ServerOptions | None = None, *,
                 fd_source: Path | None = None, python: str | None = None) -> None:
        self.workdir = Path(workdir)
        self.options = options or ServerOptions()
        self.fd_source = Path(fd_source).resolve() if fd_source else FD_SOURCE
        self.python = python or sys.executable
        self.rig_id = uuid.uuid4().hex
        self.proc: subprocess.Popen | None = None
        self.port = self.engine_port = self.cache_port = 0
        self.log_dir = self.workdir / "log"
        self.model_dir = self.workdir / "model"
        self.weights_path = self.workdir / "weights.npz"

    # ------------------------------------------------------------------ addresses
    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, **kwargs: Any) -> Any:
        import openai

        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="EMPTY", max_retries=0,
                             timeout=kwargs.pop("timeout", 120.0), **kwargs)

    # ------------------------------------------------------------------ start
    def command(self) -> list[str]:
        o = self.options
        cmd = [self.python, "-m", "fastdeploy.entrypoints.openai.api_server",
               "--model", str(self.model_dir), "--host", "127.0.0.1", "--port", str(self.port),
               "--workers", "1", "--engine-worker-queue-port", str(self.engine_port),
               "--cache-queue-port", str(self.cache_port), "--tensor-parallel-size", "1",
               "--max-model-len", str(o.max_model_len), "--max-num-seqs", str(o.max_num_seqs),
               "--max-num-batched-tokens", str(o.max_num_batched_tokens),
               "--num-gpu-blocks-override", str(o.num_gpu_blocks), "--block-size", str(o.block_size),
               "--load-choices", "dummy", "--graph-optimization-config", '{"use_cudagraph": false}']
        if not o.prefix_caching:
            cmd.append("--no-enable-prefix-caching")
        if not o.overlap:
            cmd.append("--no-enable-overlap-schedule")
        if o.routing is not None:
            cmd += ["--routing-replay-config", json.dumps(o.routing)]
        return cmd + list(o.extra_args)

    def environment(self) -> dict[str, str]:
        env = {key: value for key, value in os.environ.items()
               if not key.startswith(("FD_RR_", "FD_PLUGINS", "FD_ROUTING_REPLAY_CONFIG", "CUDA_VISIBLE"))}
        path = [str(SITE), str(REPO), str(self.fd_source)] + [p for p in env.get("PYTHONPATH", "").split(":") if p]
        plugins = "fdrr_live_model,fd_routing_replay" if self.options.plugin else "fdrr_live_model"
        env.update({
            "PYTHONPATH": ":".join(path), "FDRR_LIVE_RIG": "1", MARKER: self.rig_id,
            "FD_PLUGINS": plugins, "CUDA_VISIBLE_DEVICES": "0", "FD_LOG_DIR": str(self.log_dir),
            "FD_USE_GET_SAVE_OUTPUT_V1": "1" if self.options.zmq_output else "0",
            "FD_ENABLE_TOP_P_ONE_OPT": "0", "DO_NOT_TRACK": "1",
            "PROMETHEUS_MULTIPROC_DIR": str(self.workdir / "prometheus"), "FD_CONFIG_ROOT": str(self.workdir),
            "FDRR_LIVE_WEIGHTS": str(self.weights_path), "OMP_NUM_THREADS": "1",
            "FLAGS_use_system_allocator": "1", "PYTHONUNBUFFERED": "1", "HOME": str(self.workdir),
        })
        if self.options.plants:
            env["FDRR_LIVE_PLANT_FILE"] = str(self.plant_file)
        env["FD_RR_STORE__LOCAL__ROOT"] = str(self.store_root)
        env.update(self.options.rr_env)
        env.update(self.options.extra_env)
        return env

    @property
    def store_root(self) -> Path:
        """The local store's root (``store.local.root``) unless ``rr_env`` names another store."""
        return self.workdir / "store"

    @property
    def store_url(self) -> str:
        """The URL a reader opens to read what this server stores."""
        rr = self.options.rr_env
        if rr.get("FD_RR_STORE__TYPE") == "redis":
            return rr["FD_RR_STORE__REDIS__URL"]
        return f"local://{rr.get('FD_RR_STORE__LOCAL__ROOT', self.store_root)}"

    def cached_tokens(self, rollout_id: str) -> int | None:
        """Prefix-cache tokens FastDeploy reports for the request of ``rollout_id`` (its
        per-request line ``CachedDetail={"CachedToken": N, ...}`` in log/fastdeploy.log,
        output/token_processor.py:1125-1140; the OpenAI usage field reads another key for
        completions); None when the line is not there (yet)."""
        found = None
        uuid_re = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
        pattern = re.compile(r"Request=(?:chat)?cmpl-(?P<user>.+)-" + uuid_re +
                             r"_\d+, .*?CachedDetail=\{\"CachedToken\": (?P<n>\d+)")
        log = self.log_dir / "fastdeploy.log"
        if log.exists():
            for line in log.read_text(errors="replace").splitlines():
                match = pattern.search(line)
                if match and match.group("user") == rollout_id:
                    found = int(match.group("n"))
        return found

    @property
    def plant_file(self) -> Path:
        return self.workdir / "plant"

    def plant(self, name: str | None) -> None:
        """Switch a planted bug on (``tests/live/plants.py``) or all off (None); call between
        requests (every rig process reads the switch at each call of a planted function)."""
        from .plants import PLANTS

        if name is None:
            self.plant_file.unlink(missing_ok=True)
            return
        if name not in PLANTS or not self.options.plants:
            raise ValueError(f"unknown plant {name!r} (known: {', '.join(PLANTS)}) or plants not installed")
        self.plant_file.write_text(name)

    def start(self) -> LiveServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(exist_ok=True)
        (self.workdir / "prometheus").mkdir(exist_ok=True)
        write_model_dir(self.model_dir, **self.options.model)
        self.port, self.engine_port, self.cache_port = free_port(), free_port(), free_port()
        with open(self.workdir / "server.log", "wb") as log:
            self.proc = subprocess.Popen(self.command(), cwd=self.workdir, env=self.environment(), stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self._wait_ready()
        except BaseException as exc:
            tails = self.log_tails()
            killed = self.stop()
            error = RigError(f"FastDeploy did not come up on {self.base_url} ({exc}):\n{tails}")
            error.killed = killed
            raise error from None
        return self

    def _wait_ready(self) -> None:
        began = time.monotonic()
        while time.monotonic() < began + self.options.start_timeout_s:   # read each round: a test may shorten it
            if self.proc.poll() is not None:
                raise RigError(f"the API server exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/v1/models", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"no answer from {self.base_url} in {self.options.start_timeout_s} s")

    def check_alive(self) -> None:
        """Raise with the log tails when the server process has died."""
        if self.proc is not None and self.proc.poll() is not None:
            raise RigError(f"the API server exited with {self.proc.returncode}:\n{self.log_tails()}")

    # ------------------------------------------------------------------ logs
    def log_files(self) -> list[Path]:
        """The server's output, the rig's ``stop.log`` and every log FastDeploy wrote (its dated copies of
        ``name.log`` -- ``name.log.YYYY-MM-DD`` and a ``YYYY-MM-DD/`` folder -- left out)."""
        files = [self.workdir / "server.log", self.workdir / "stop.log"]
        if self.log_dir.exists():
            files += sorted(p for p in self.log_dir.iterdir()
                            if p.is_file() and not re.search(r"\.log\.\d{4}-\d{2}-\d{2}$", p.name))
        return [p for p in files if p.exists()]

    def log_tails(self, lines: int = 30) -> str:
        out = []
        for path in self.log_files():
            try:
                text = path.read_text(errors="replace").splitlines()
            except OSError:
                continue
            if text:
                out.append(f"----- {path.relative_to(self.workdir)} (last {min(lines, len(text))} lines)")
                out.extend(text[-lines:])
        return "\n".join(out)

    # ------------------------------------------------------------------ stop
    def processes(self) -> list[int]:
        """Every live process of this server (see :func:`rig_processes`)."""
        if self.proc is None:
            return rig_processes(self.rig_id)
        root = self.proc.pid if self.proc.poll() is None else None
        return rig_processes(self.rig_id, root, session=self.proc.pid)    # start_new_session: sid = pid

    def shm_entries(self) -> list[str]:
        """What FastDeploy and the plugin left in /dev/shm for this server (names carrying its ports)."""
        tags = {str(p) for p in (self.engine_port, self.cache_port, self.port) if p}
        out = []
        for name in os.listdir("/dev/shm"):
            if any(tag in name for tag in tags):
                out.append(name)
        return sorted(out)

    def _note_stop(self, line: str) -> None:
        """What each stop signal left running, in ``stop.log`` (a slow stop's reason)."""
        try:
            with open(self.workdir / "stop.log", "a") as handle:
                handle.write(f"{time.strftime('%H:%M:%S')} {line}\n")
        except OSError:
            pass

    def stop(self, timeout_s: float = 10.0) -> list[str]:
        """Terminate every process of the rig (SIGINT, SIGTERM, then SIGKILL, ``timeout_s`` each),
        remove its /dev/shm entries and message queue; returns the processes that needed
        SIGKILL (``pid: cmdline``).  FastDeploy's engine process sometimes outlives SIGINT by
        more than 30 s (seen in 2 of 9 stops of one run; ``stop.log``) and goes at SIGTERM."""
        killed: list[str] = []
        if self.proc is not None:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
                pids = self.processes()
                if not pids:
                    break
                if sig == signal.SIGKILL:
                    killed = [f"{pid}: {_cmdline(pid)}" for pid in pids]
                for pid in pids:
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
                began = time.monotonic()
                deadline = began + (timeout_s if sig != signal.SIGKILL else 10.0)
                while time.monotonic() < deadline and self.processes():
                    time.sleep(0.2)
                left = self.processes()
                self._note_stop(f"{signal.Signals(sig).name} to {len(pids)} processes; {len(left)} left after "
                                f"{time.monotonic() - began:.1f} s" + "".join(f"\n  {p}: {_cmdline(p)}" for p in left))
            self.proc.wait(timeout=10)
        for name in self.shm_entries():
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except OSError:
                pass
        if self.engine_port:
            from tests.fdcpu.output_ops import remove_queue

            remove_queue(self.engine_port)        # System V queues outlive their processes
        return killed

    def __enter__(self) -> LiveServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "?"
