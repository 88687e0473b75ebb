"""The stores a soak runs against, each on throwaway servers of its own (fdrr_dev.testing):
start them, give the ``store`` section of the configuration, their pids (memory) and Redis
nodes (command latency, faults), stop them.

* ``local``: one directory (on a tmpfs of ``tmpfs_bytes`` when asked: the disk-full fault);
* ``redis``: one ``redis-server`` (``persist=True``: append-only file, so a node killed and
  started again keeps what it acknowledged);
* ``redis-cluster``: three masters joined by ``redis-cli --cluster``;
* ``mooncake``: a ``mooncake_master``, a ``mooncake_client`` holding the memory segment
  records live in (so they outlive the writer processes), and a Redis for the index;
* ``p2pstore``: a Redis as metadata server, TCP transport; records live in the memory of
  the writer process that put them (P2PStore's design).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

from fdrr_dev.testing.mooncake import MooncakeMaster, MooncakeSegmentHolder
from fdrr_dev.testing.redis import RedisCluster, RedisServer

__all__ = ["STORES", "StoreUnderTest", "TmpfsUnavailable"]

STORES = ("local", "redis", "redis-cluster", "mooncake", "p2pstore")
MiB = 2**20


class TmpfsUnavailable(RuntimeError):
    """A small tmpfs could not be mounted (not root, or no mount(8))."""


def _redis_config(persist: bool) -> dict[str, str]:
    config = {"slowlog-max-len": "20000"}
    if persist:
        # appendfsync no: the AOF write reaches the kernel before the reply, so a killed
        # (not power-cut) server keeps every acknowledged write without an fsync per put.
        config.update({"appendonly": "yes", "appendfsync": "no",
                       "auto-aof-rewrite-percentage": "0"})
    return config


class StoreUnderTest:
    """One store's servers for one scenario (see the module docstring)."""

    def __init__(self, kind: str, workdir: Path, *, persist: bool = False,
                 tmpfs_bytes: int = 0, mooncake_segment: str = "2GB") -> None:
        if kind not in STORES:
            raise ValueError(f"unknown store {kind!r}; expected one of {', '.join(STORES)}")
        self.kind = kind
        self.workdir = Path(workdir)
        self.persist = persist
        self.tmpfs_bytes = tmpfs_bytes
        self.mooncake_segment = mooncake_segment
        self.redis: RedisServer | None = None
        self.cluster: RedisCluster | None = None
        self.master: MooncakeMaster | None = None
        self.holder: MooncakeSegmentHolder | None = None
        self.root: Path | None = None
        self._mounted = False

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> StoreUnderTest:
        try:
            if self.kind == "local":
                self.root = self.workdir / "store"
                self.root.mkdir(parents=True, exist_ok=True)
                if self.tmpfs_bytes:
                    self._mount_tmpfs(self.root, self.tmpfs_bytes)
            elif self.kind == "redis-cluster":
                self.cluster = RedisCluster(3).start()
                for node in self.cluster.nodes:
                    for name, value in _redis_config(self.persist).items():
                        node.config[name] = value  # kept when the node is started again
                        node.command("CONFIG", "SET", name, value)
            else:
                self.redis = RedisServer(config=_redis_config(self.persist)).start()
                if self.kind == "mooncake":
                    self.master = MooncakeMaster().start()
                    self.holder = MooncakeSegmentHolder(self.master,
                                                        segment=self.mooncake_segment).start()
        except BaseException:
            self.stop()
            raise
        return self

    def _mount_tmpfs(self, path: Path, size: int) -> None:
        mount = shutil.which("mount")
        if mount is None:
            raise TmpfsUnavailable("mount(8) not found")
        result = subprocess.run([mount, "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise TmpfsUnavailable(f"mount -t tmpfs failed: {result.stderr.strip()}")
        self._mounted = True

    def stop(self) -> None:
        if self.holder is not None:
            self.holder.stop()
            self.holder = None
        if self.master is not None:
            self.master.cleanup()
            self.master = None
        if self.redis is not None:
            self.redis.cleanup()
            self.redis = None
        if self.cluster is not None:
            self.cluster.cleanup()
            self.cluster = None
        if self._mounted and self.root is not None:
            subprocess.run(["umount", "-l", str(self.root)], capture_output=True)
            self._mounted = False

    # -- what the rig needs ------------------------------------------------------------
    def config(self, namespace: str) -> dict[str, Any]:
        """The ``store`` section for ``namespace``."""
        if self.kind == "local":
            return {"type": "local", "namespace": namespace, "local": {"root": str(self.root)}}
        if self.kind == "redis":
            return {"type": "redis", "namespace": namespace, "redis": {"url": self.redis.url}}
        if self.kind == "redis-cluster":
            return {"type": "redis", "namespace": namespace,
                    "redis": {"url": self.cluster.url, "cluster": True, "index_buckets": 16}}
        if self.kind == "mooncake":
            return {"type": "mooncake", "namespace": namespace, "mooncake": {
                "master_server": self.master.address, "index_url": self.redis.url,
                "master_http": self.master.admin, "global_segment_size": 0,
                "local_buffer_size": 40 * MiB, "protocol": "tcp"}}
        return {"type": "p2pstore", "namespace": namespace, "p2pstore": {
            "metadata_server": self.redis.url, "protocol": "tcp",
            "log_dir": str(self.workdir / "p2pstore-logs")}}

    def redis_nodes(self) -> list[RedisServer]:
        """Every Redis server of this store (data, index or metadata)."""
        if self.cluster is not None:
            return list(self.cluster.nodes)
        return [self.redis] if self.redis is not None else []

    def pids(self) -> dict[str, int]:
        """Server processes by role, for the memory samples."""
        out: dict[str, int] = {}
        for number, node in enumerate(self.redis_nodes()):
            if node.process is not None:
                out[f"redis{number}"] = node.process.pid
        if self.master is not None and self.master.process is not None:
            out["mooncake_master"] = self.master.process.pid
        if self.holder is not None and self.holder.process is not None:
            out["mooncake_holder"] = self.holder.process.pid
        return out

    def redis_url(self) -> str | None:
        """The URL of the Redis this store keeps data, index or metadata in."""
        if self.cluster is not None:
            return self.cluster.url
        return self.redis.url if self.redis is not None else None
