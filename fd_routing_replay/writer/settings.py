"""The settings one writer generation starts with.

Built by the engine side from the writer's configuration and handed to each generation:
in the ``init`` message in process mode (so they are plain data), directly in thread mode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["WorkerSettings"]


@dataclass
class WorkerSettings:
    """Everything a writer generation needs; plain data so it crosses a pipe as msgpack."""

    store: dict[str, Any]
    journal_dir: str
    dead_letter_dir: str
    retry_deadline_s: float
    retry_initial_backoff_s: float
    retry_max_backoff_s: float
    only_last_turn: bool = False
    clear_on_start: bool = False
    generation: int = 1
    registrations: dict[str, str] = field(default_factory=dict)
    sys_path: list[str] = field(default_factory=list)
    encoding: str = "plain"  # capture.encoding of the rr-v1 records this worker writes
    record_ttl_s: float = 0.0  # retention.ttl_s, for a store that expires records itself
    partials: bool = False  # capture.partial_every_tokens > 0: a final put retires its partial

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)
