"""What every live scenario checks: each record against the independent recompute."""

from __future__ import annotations

import time
from typing import Any

from fd_routing_replay import RoutingReader

from .client import Choice
from .reference import TinyReference

__all__ = ["Context"]

RECORD_TIMEOUT_S = 20.0


class Context:
    """A live server, a reader of its store and the tiny model's recompute."""

    def __init__(self, server: Any, *, reader: Any = None) -> None:
        self.server = server
        self.reader = reader or RoutingReader(server.store_url)
        self._reference: TinyReference | None = None

    @property
    def reference(self) -> TinyReference:
        """The recompute from the weights the worker exported at its first forward pass."""
        if self._reference is None:
            deadline = time.monotonic() + RECORD_TIMEOUT_S
            while not self.server.weights_path.exists():
                self.server.check_alive()
                if time.monotonic() > deadline:
                    raise AssertionError(f"the worker never exported its weights to {self.server.weights_path}")
                time.sleep(0.1)
            self._reference = TinyReference(self.server.weights_path)
        return self._reference

    def wait_record(self, rollout_id: str, timeout: float = RECORD_TIMEOUT_S) -> Any:
        """The record of ``rollout_id`` once the engine's writer stored it, else None."""
        deadline = time.monotonic() + timeout
        while True:
            record = self.reader.get(rollout_id)
            if record is not None or time.monotonic() > deadline:
                return record
            self.server.check_alive()
            time.sleep(0.05)

    def assert_rows_exact(self, ids: Any, token_ids: list[int], what: str) -> None:
        """``ids`` ``[layers, n, top_k]`` are the routes of ``token_ids``' first n positions."""
        comparison = self.reference.compare(ids, token_ids)
        assert comparison.exact, f"{what}: {comparison.describe()}"
        assert len(comparison.near_ties) * 100 <= max(comparison.rows, 100), \
            f"{what}: {len(comparison.near_ties)} near ties in {comparison.rows} rows (expected a rare few)"

    def assert_exact(self, choice: Choice, timeout: float = RECORD_TIMEOUT_S) -> Any:
        """The record of ``choice`` holds every forwarded position (prompt + generated - 1)
        and each row is what the model routed; returns the record."""
        record = self.wait_record(choice.rollout_id, timeout)
        assert record is not None, f"no record stored for {choice.rollout_id} within {timeout} s"
        assert record.ids.shape[1] == choice.forwarded, \
            f"{choice.rollout_id}: record has {record.ids.shape[1]} positions, the request forwarded {choice.forwarded}"
        assert list(record.layers) == self.reference.moe_layers, f"{choice.rollout_id}: layer map {record.layers}"
        self.assert_rows_exact(record.ids, choice.token_ids, choice.rollout_id)
        return record

    def assert_no_record(self, rollout_id: str, barrier: Choice) -> None:
        """No final record for ``rollout_id``: checked once the record of ``barrier`` (a request
        sent after it) is stored, since the engine hands records to its writer in order."""
        assert self.wait_record(barrier.rollout_id) is not None, f"barrier record {barrier.rollout_id} never came"
        assert self.reader.get(rollout_id) is None, f"a record was stored for {rollout_id}"

    def wait_gone(self, rollout_id: str, timeout: float = RECORD_TIMEOUT_S) -> bool:
        deadline = time.monotonic() + timeout
        while self.reader.get(rollout_id) is not None:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True
