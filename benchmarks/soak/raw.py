"""The store's raw limit: a plain client writing the same bytes as the soak, as fast as it
can, with no index, no journal, no checksum and no framing.

``python -m benchmarks.soak.raw CONFIG.json``: one process of several run at once.  Two
ways, both with one writer per soak producer:

* ``alone`` (the store's raw limit): each writer first generates a pool of 16 records of
  the soak's size mix (:mod:`.workload`, untimed), then writes them round and round under
  fresh keys for ``duration_s``, deleting each key once 8 newer ones are written;
* ``with_rig`` (the same work around the store as the soak does): each writer generates
  every record as a producer does (fresh rollout ids, the same generator) and writes it;
  one reader per writer gets each key as it appears, regenerates the record, compares
  every byte and deletes it; a writer waits while 8 of its keys are unread.

Clients: ``local``: ``open(path, "wb").write(ids)`` on the store's filesystem;
``redis`` / ``redis-cluster``: redis-py ``SET`` (``alone``: a pipeline of up to 4 records,
16 MB a round trip), ``GET``, ``UNLINK``; ``mooncake``: ``MooncakeDistributedStore.put`` /
``get`` / ``remove`` on a client set up like the store's; ``p2pstore``: ``P2PClient.put`` /
``get`` / ``delete_batch`` (TCP transport).

Writes ``{"bytes", "records", "seconds"}`` to ``raw{role}{index}.json`` in the run directory.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

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

    def get(key: str) -> bytes | None:
        try:
            with open(directory / key, "rb") as stream:
                return stream.read()
        except FileNotFoundError:
            return None

    def delete(keys: list[str]) -> None:
        for key in keys:
            os.unlink(directory / key)
    return put, get, delete, lambda key: (directory / key).exists()


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
    return put, client.get, delete, lambda key: bool(client.exists(key))


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

    def get(key: str) -> bytes | None:
        value = client.get(key)
        return value if value else None  # Mooncake answers b"" for a missing key

    def delete(keys: list[str]) -> None:
        for key in keys:
            client.remove(key, True)
    return put, get, delete, lambda key: client.is_exist(key) == 1


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

    def get(key: str) -> bytes | None:
        return loop.run_until_complete(client.get(key))

    def delete(keys: list[str]) -> None:
        loop.run_until_complete(client.delete_batch(keys))

    def exists(key: str) -> bool:
        return bool(loop.run_until_complete(client.exists(key)))
    return put, get, delete, exists


CLIENTS = {"local": _local, "redis": _redis, "redis-cluster": _redis, "mooncake": _mooncake,
           "p2pstore": _p2pstore}


def _key(config: dict[str, Any], number: int) -> str:
    return f"raw{config['tag']}_{config['index']}_{number}"


def _alone(config: dict[str, Any], put: Callable, delete: Callable) -> dict[str, Any]:
    index = int(config["index"])
    pool = _pool(index)
    written: deque[str] = deque()
    total = records = number = 0
    began = time.monotonic()
    stop_at = began + float(config["duration_s"])
    while time.monotonic() < stop_at:
        keys, values, size = [], [], 0
        while not values or (config["kind"].startswith("redis") and size < _PIPELINE_BYTES
                             and len(values) < 4):
            value = pool[number % _POOL]
            keys.append(_key(config, number))
            values.append(value)
            size += len(value)
            number += 1
        put(keys, values)
        total += size
        records += len(values)
        written.extend(keys)
        if len(written) > _KEEP:
            delete([written.popleft() for _ in range(len(written) - _KEEP)])
    seconds = time.monotonic() - began
    delete(list(written))
    return {"bytes": total, "records": records, "seconds": seconds}


def _rig_rid(config: dict[str, Any], number: int) -> str:
    return rollout_id(f"raw{config['tag']}", number // 4, int(config["index"]),
                      "ae"[number % 2], number, 0)


def _writer_with_rig(config: dict[str, Any], put: Callable, exists: Callable) -> dict[str, Any]:
    total = records = number = 0
    began = time.monotonic()
    stop_at = began + float(config["duration_s"])
    while time.monotonic() < stop_at:
        value = make_ids(spec_for(_rig_rid(config, number))).tobytes()
        while number >= _KEEP and exists(_key(config, number - _KEEP)):
            if time.monotonic() >= stop_at:
                break
            time.sleep(0.001)  # the reader is behind: this many unread is the limit
        put([_key(config, number)], [value])
        total += len(value)
        records += 1
        number += 1
    seconds = time.monotonic() - began
    Path(config["dir"], f"rawdone{config['index']}").write_text(str(number))
    deadline = time.monotonic() + 120  # P2PStore: a record lives as long as its writer
    while number and exists(_key(config, number - 1)) and time.monotonic() < deadline:
        time.sleep(0.01)
    return {"bytes": total, "records": records, "seconds": seconds}


def _reader_with_rig(config: dict[str, Any], get: Callable, delete: Callable,
                     exists: Callable) -> dict[str, Any]:
    done = Path(config["dir"], f"rawdone{config['index']}")
    number = total = 0
    began = time.monotonic()
    while True:
        spec = spec_for(_rig_rid(config, number))
        value = get(_key(config, number)) if exists(_key(config, number)) else None
        if value is not None and len(value) < spec.nbytes:
            value = None  # a plain file being written: not all there yet
        if value is None:
            if done.exists() and number >= int(done.read_text()):
                break
            time.sleep(0.001)
            continue
        want = make_ids(spec).reshape(-1)
        if not np.array_equal(np.frombuffer(value, dtype=np.uint8), want):
            raise RuntimeError(f"raw reader: {_key(config, number)} is not what was written")
        delete([_key(config, number)])
        total += len(value)
        number += 1
    return {"bytes": total, "records": number, "seconds": time.monotonic() - began}


def run(config: dict[str, Any]) -> dict[str, Any]:
    put, get, delete, exists = CLIENTS[config["kind"]](config)
    role = config.get("role", "alone")
    if role == "alone":
        return _alone(config, put, delete)
    if role == "writer":
        return _writer_with_rig(config, put, exists)
    return _reader_with_rig(config, get, delete, exists)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    with open(args[0]) as stream:
        config = json.load(stream)
    result = run(config)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    result["cpu_s"] = usage.ru_utime + usage.ru_stime
    Path(config["dir"], f"raw{config.get('role', 'alone')}{config['index']}.json").write_text(
        json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
