"""A second process holding a P2PStore store, driven by JSON lines on stdin.

Tests start it with :class:`Peer` to have a writer (provider) or reader in another process
than the test.  Commands (one JSON object per line, one JSON answer per line):

* ``{"op": "put_records", "seed": S, "keys": [...], "shape": [L, T, K], "experts": E}`` —
  put one rr-v1 record per key, ids drawn from ``numpy.random.default_rng(S + i)``;
* ``{"op": "get", "key": K}`` — answers the sha256 of the value (or null);
* ``{"op": "delete", "keys": [...]}``, ``{"op": "provider_bytes"}``, ``{"op": "close"}``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from typing import Any

import numpy as np


def record_ids(seed: int, index: int, shape: list[int], experts: int) -> np.ndarray:
    """The ids of record ``index`` of a ``put_records`` call (the test's reference)."""
    rng = np.random.default_rng(seed + index)
    return rng.integers(0, experts, size=tuple(shape), dtype=np.uint8)


def _serve(config: dict[str, Any]) -> None:
    from fd_routing_replay.codec import RoutingRecord, encode_record
    from fd_routing_replay.store import open_store

    store = open_store(config)
    print(json.dumps({"ready": True, "describe": store.describe()}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        try:
            if op == "put_records":
                for index, key in enumerate(command["keys"]):
                    ids = record_ids(command["seed"], index, command["shape"], command["experts"])
                    store.put(key, encode_record(RoutingRecord(key, ids, command["experts"])))
                answer: Any = len(command["keys"])
            elif op == "get":
                value = store.get(command["key"])
                answer = None if value is None else hashlib.sha256(value).hexdigest()
            elif op == "delete":
                answer = store.delete(command["keys"])
            elif op == "provider_bytes":
                answer = store.provider_bytes()
            elif op == "close":
                store.close()
                answer = True
            else:
                raise ValueError(f"unknown op {op!r}")
            print(json.dumps({"ok": True, "result": answer}), flush=True)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
        if op == "close":
            return


class Peer:
    """The peer process; always :meth:`stop` it (it is killed if still running)."""

    def __init__(self, config: dict[str, Any], cwd: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.store.p2p_peer", json.dumps(config)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            cwd=cwd or root, env={**(env or os.environ), "PYTHONPATH": root})
        self.hello = self._read()

    def _read(self) -> dict[str, Any]:
        line = self.process.stdout.readline()
        if not line:
            self.process.wait(30)
            raise RuntimeError(f"p2p peer exited ({self.process.returncode}):\n"
                               f"{self.process.stderr.read()[-3000:]}")
        return json.loads(line)

    def call(self, op: str, **arguments: Any) -> Any:
        self.process.stdin.write(json.dumps({"op": op, **arguments}) + "\n")
        self.process.stdin.flush()
        answer = self._read()
        if not answer["ok"]:
            raise RuntimeError(f"peer {op} failed: {answer['error']}")
        return answer["result"]

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self) -> str:
        """Close stdin, wait, kill if needed; return its stderr."""
        if self.process.poll() is None:
            try:
                self.process.stdin.close()
                self.process.wait(20)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait(10)
        return self.process.stderr.read() if self.process.stderr else ""


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]))
