"""The store's raw limit: a plain client writing the same bytes as the soak, as fast as it
can, with no index, no journal, no checksum and no framing.

``python -m benchmarks.soak.raw CONFIG.json``: one process of N (the scenario runs as many
as it has producers, at the same time).  Each first generates a pool of 16 records of the
soak's size mix (:mod:`.workload`, untimed), then writes them round and round under fresh
keys for ``duration_s`` and deletes each key once 8 newer ones are written (the soak's
store does not fill up either):

* ``local``: ``open(path, "wb").write(ids)`` into a directory on the store's filesystem;
* ``redis`` / ``redis-cluster``: a redis-py pipeline of ``SET``s (up to 16 MB a round trip);
* ``mooncake``: ``MooncakeDistributedStore.put`` on a client set up like the store's;
* ``p2pstore``: ``P2PClient.put`` of the bytes (TCP transport).

Writes ``{"bytes", "records", "seconds"}`` to ``raw{index}.json`` in the run directory.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.soak.workload import make_ids, rollout_id, spec_for

__all__ = ["main"]

_POOL = 16
_KEEP = 8
_PIPELINE_BYTES = 16 << 20


def _pool(index: int) -> list[bytes]:
    kinds = "ae"
    return [make_ids(spec_for(rollout_id("raw", 0, index, kinds[n % 2], n, 0))).tobytes()
            for n in range(_POOL)]


def _local(config: dict[str, Any]) -> tuple[Callable, Callable]:
    directory = Path(config["root"]) / f"raw{config['index']}"
    directory.mkdir(parents=True, exist_ok=True)

    def put(keys: list[str], values: list[bytes]) -> None:
        for key, value in zip(keys, values, strict=True):
            with open(directory / key, "wb") as stream:
                stream.write(value)

    def delete(keys: list[str]) -> None:
        for key in keys:
            os.unlink(directory / key)
    return put, delete


def _redis(config: dict[str, Any]) -> tuple[Callable, Callable]:
    import redis

    if config.get("cluster"):
        host, port = config["url"].split("//", 1)[1].split("/")[0].split(":")
        client: Any = redis.RedisCluster(host=host, port=int(port))
    else:
        client = redis.Redis.from_url(config["url"])

    def put(keys: list[str], values: list[bytes]) -> None:
        pipe = client.pipeline(transaction=False)
        for key, value in zip(keys, values, strict=True):
            pipe.set(key, value)
        pipe.execute()

    def delete(keys: list[str]) -> None:
        for key in keys:  # one key per call: a cluster refuses multi-slot DEL
            client.unlink(key)
    return put, delete


def _mooncake(config: dict[str, Any]) -> tuple[Callable, Callable]:
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    code = client.setup({"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
                         "global_segment_size": 0, "local_buffer_size": 40 << 20,
                         "protocol": "tcp", "rdma_devices": "",
                         "master_server_addr": config["master_server"]})
    if code != 0:
        raise RuntimeError(f"MooncakeDistributedStore.setup returned {code}")

    def put(keys: list[str], values: list[bytes]) -> None:
        for key, value in zip(keys, values, strict=True):
            code = client.put(key, value)
            if code != 0:
                raise RuntimeError(f"mooncake put {key}: {code}")

    def delete(keys: list[str]) -> None:
        for key in keys:
            client.remove(key, True)
    return put, delete


def _p2pstore(config: dict[str, Any]) -> tuple[Callable, Callable]:
    os.environ.setdefault("P2P_LOG_DIR", config["log_dir"])
    from p2pstore import P2PClient, P2PConfig

    from fdrr_dev.testing.process import free_port

    client = P2PClient(P2PConfig(metadata_server=config["metadata_server"], protocol="tcp",
                                 local_host=f"127.0.0.1:{free_port()}"))
    loop = asyncio.new_event_loop()

    def put(keys: list[str], values: list[bytes]) -> None:
        for key, value in zip(keys, values, strict=True):
            if not loop.run_until_complete(client.put(key, value)):
                raise RuntimeError(f"p2pstore put {key} failed")

    def delete(keys: list[str]) -> None:
        loop.run_until_complete(client.delete_batch(keys))
    return put, delete


CLIENTS = {"local": _local, "redis": _redis, "redis-cluster": _redis, "mooncake": _mooncake,
           "p2pstore": _p2pstore}


def run(config: dict[str, Any]) -> dict[str, Any]:
    index = int(config["index"])
    pool = _pool(index)
    put, delete = CLIENTS[config["kind"]](config)
    written: deque[str] = deque()
    total = records = 0
    number = 0
    began = time.monotonic()
    stop_at = began + float(config["duration_s"])
    while time.monotonic() < stop_at:
        keys, values, size = [], [], 0
        while not values or (config["kind"].startswith("redis") and size < _PIPELINE_BYTES
                             and len(values) < 4):
            value = pool[number % _POOL]
            keys.append(f"raw{config['tag']}_{index}_{number}")
            values.append(value)
            size += len(value)
            number += 1
        put(keys, values)
        total += size
        records += len(values)
        written.extend(keys)
        if len(written) > _KEEP:
            old = [written.popleft() for _ in range(len(written) - _KEEP)]
            delete(old)
    seconds = time.monotonic() - began
    delete(list(written))
    return {"bytes": total, "records": records, "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    with open(args[0]) as stream:
        config = json.load(stream)
    result = run(config)
    Path(config["dir"], f"raw{config['index']}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
