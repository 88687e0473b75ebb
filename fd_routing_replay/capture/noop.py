"""The manager to install when routing replay is off: same interface, does nothing.

FastDeploy's MoE layers bind the capture hook only when ``get_routing_table()`` returns
a table, so returning ``None`` here removes every per-layer cost; the runner calls the
other methods unconditionally and they return at once.  No ``if enabled`` checks are
needed anywhere on the hot path.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fd_routing_replay.capture.positions import StepPositions

__all__ = ["NoopRoutingReplayManager"]


class NoopRoutingReplayManager:
    """Drop-in for :class:`~fd_routing_replay.capture.manager.RoutingReplayManager` when off."""

    enabled = False
    fdrr_manager = True
    pending_update_positions: StepPositions | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.routing_batch_to_request: dict[int, str] = {}

    def get_routing_table(self) -> None:
        return None

    def register_request(self, batch_id: int, request_id: str) -> None:
        return None

    def clear_request(self, batch_id: int) -> None:
        return None

    def get_token_positions(self, seq_lens_decoder: Any, seq_lens_this_time: Any) -> None:
        return None

    def compute_slot_mapping(self, positions: Any) -> np.ndarray:
        return np.zeros(0, dtype=np.int64)

    def update_host_cache(self, positions: Any, slot_mapping: Any) -> None:
        return None

    def put_finished_batch(self, finished_batch_ids: Any, seq_lens_decoder: Any = None) -> None:
        return None

    def clear_all_request(self) -> None:
        return None

    def enable_partials(self, every_tokens: int) -> None:
        return None

    def update_suspend_routing_replay(self) -> None:
        return None

    def flush(self, timeout: float | None = None) -> bool:
        return True

    def wait_finished(self, timeout: float | None = None) -> bool:
        return True

    def close(self, timeout: float | None = None) -> None:
        return None

    def stats(self) -> dict[str, Any]:
        return {"enabled": False}
