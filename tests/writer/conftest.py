"""Fixtures for writer tests: a real local store with switchable faults, in both modes.

``rig`` builds writers over the ``faulty`` store (tests/writer/faulty_store.py, opened by
module path so the writer process can use it) and reads results back through a plain
LocalStore on the same directory.  Faults are files the rig creates and removes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fd_routing_replay.codec import RoutingRecord, decode_record
from fd_routing_replay.store import register_store
from fd_routing_replay.store.local import LocalStore
from fd_routing_replay.writer import RoutingWriter

NAMESPACE = "wt"
# Generous: a condition that holds is seen in milliseconds; the bound only stops a hang.
WAIT_S = 60.0


def wait_until(predicate: Callable[[], Any], what: str, timeout: float = WAIT_S) -> Any:
    """Poll ``predicate`` until it is truthy; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.005)


class Rig:
    """Paths, fault switches and a writer factory for one test."""

    def __init__(self, tmp_path: Path, mode: str) -> None:
        self.mode = mode
        self.root = tmp_path / "store"
        self.journal_dir = tmp_path / "journal"
        self.dead_dir = tmp_path / "dead"
        self.down_flag = tmp_path / "down.flag"
        self.gate = tmp_path / "gate.flag"
        self.event_log = tmp_path / "events.jsonl"
        self.writers: list[RoutingWriter] = []
        self.reader = LocalStore(self.root, NAMESPACE)

    def store_config(self, **options: Any) -> dict[str, Any]:
        opts = {"down_flag": str(self.down_flag), "gate": str(self.gate),
                "event_log": str(self.event_log), **options}
        return {"type": "faulty", "namespace": NAMESPACE, "local": {"root": str(self.root)},
                "options": opts}

    def writer_config(self, **overrides: Any) -> dict[str, Any]:
        config = {"mode": self.mode, "journal_dir": str(self.journal_dir),
                  "dead_letter_dir": str(self.dead_dir), "capacity_bytes": 8 << 20,
                  "retry_deadline_s": 0.3, "retry_initial_backoff_s": 0.01,
                  "retry_max_backoff_s": 0.1, "close_timeout_s": 30.0}
        config.update(overrides)
        return config

    def writer(self, *, store_options: dict[str, Any] | None = None, only_last_turn: bool = False,
               record_format: str = "rr-v1", **overrides: Any) -> RoutingWriter:
        writer = RoutingWriter(self.store_config(**(store_options or {})),
                               self.writer_config(**overrides), only_last_turn=only_last_turn,
                               record_format=record_format)
        self.writers.append(writer)
        return writer

    # -- faults ------------------------------------------------------------------------
    def down(self) -> None:
        self.down_flag.touch()

    def up(self) -> None:
        self.down_flag.unlink(missing_ok=True)

    def close_gate(self) -> None:
        self.gate.touch()

    def open_gate(self) -> None:
        self.gate.unlink(missing_ok=True)

    def events(self) -> list[dict[str, Any]]:
        if not self.event_log.exists():
            return []
        return [json.loads(line) for line in self.event_log.read_text().splitlines()]

    # -- reading back -------------------------------------------------------------------
    def read(self, key: str) -> RoutingRecord | None:
        value = self.reader.get(key)
        return None if value is None else decode_record(value)

    def cleanup(self) -> None:
        self.up()
        self.open_gate()
        for writer in self.writers:
            writer.close(timeout=10)


@pytest.fixture(scope="session", autouse=True)
def _faulty_store_registered():
    """Register the ``faulty`` backend by module path (the writer process imports it)."""
    register_store("faulty", "tests.writer.faulty_store:open_faulty_store")


@pytest.fixture(params=["thread", "process"])
def mode(request) -> str:
    return request.param


@pytest.fixture
def rig(tmp_path, mode):
    rig = Rig(tmp_path, mode)
    try:
        yield rig
    finally:
        rig.cleanup()


@pytest.fixture
def np_rng(seed) -> np.random.Generator:
    return np.random.default_rng(seed)


def make_record(np_rng: np.random.Generator, rollout_id: str, shape=(2, 16, 4),
                num_experts: int = 64, dtype=np.uint8, metadata=None) -> RoutingRecord:
    """A random record whose ids are valid expert ids."""
    ids = np_rng.integers(0, num_experts, size=shape, dtype=np.int64).astype(dtype)
    return RoutingRecord(rollout_id, ids, num_experts, metadata=metadata or {})
