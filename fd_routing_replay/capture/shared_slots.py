"""A host slot cache in POSIX shared memory, shared by an engine and its workers.

FastDeploy 2.6 splits routing replay across processes: the worker captures each step
and scatters its rows by KV slot into a host buffer; the engine process assembles a
finished request from that buffer through the request's block table.  This is our
buffer for that split: ``[num_slots, num_layers, top_k]`` in the routing dtype, filled
with the fill value, named per engine instance (one per DP rank) so several servers on
one host never share it.  The engine creates and owns it (and unlinks it on close); a
worker attaches by name.

The segment's name is the caller's choice: FastDeploy's engine side names it
FastDeploy's own ``routing_host_buffer.<port>`` when FastDeploy's views of that buffer
read it exactly as we write it (so FastDeploy's PD and KV-swap code moves its rows; see
:mod:`fd_routing_replay.integrations.fastdeploy.engine`), else :func:`shared_slots_name`
(``fdrr_routing_slots.<suffix>``), which FastDeploy never attaches to.

After the slots, the segment holds one row of capture counters per worker (TP rank):
the workers run no writer, so they :meth:`~SharedSlotCache.publish` their ``stats()``
there and the engine exports them with its own metrics (:meth:`~SharedSlotCache.rank_stats`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import numpy as np

from fd_routing_replay.capture.host_cache import HostSlotCache, checked_layer_columns
from fd_routing_replay.errors import ConfigError

__all__ = ["STAT_FIELDS", "SharedSlotCache", "shared_slots_name"]

logger = logging.getLogger(__name__)

_PREFIX = "fdrr_routing_slots."
#: The worker-side capture counters a worker publishes (StepRoutingCapturer.stats() keys).
STAT_FIELDS = ("steps", "tokens_offloaded", "invalid_slots", "damaged_steps", "host_missing_steps",
               "errors", "offload_seconds", "hook_calls", "hook_seconds", "hook_errors",
               "hook_mismatches", "bad_expert_ids", "missing_layer_steps")
_CREATED_HERE: set[str] = set()     # segments this process owns (tracked by its resource tracker)


def shared_slots_name(suffix: str | int) -> str:
    """The shared-memory name of the slot cache of one engine instance."""
    text = str(suffix)
    if not text or not all(c.isalnum() or c in "-_." for c in text) or len(text) > 64:
        raise ConfigError(f"shared slot cache suffix must be 1-64 characters of [A-Za-z0-9._-], got {text!r}")
    return _PREFIX + text


class SharedSlotCache(HostSlotCache):
    """A :class:`HostSlotCache` whose array lives in a named shared-memory segment,
    followed by ``stat_ranks`` rows of :data:`STAT_FIELDS` counters."""

    def __init__(self, name: str, num_slots: int, num_layers: int, top_k: int, dtype: np.dtype,
                 fill_value: int, *, create: bool, stat_ranks: int = 1,
                 layer_columns: Sequence[int] | None = None) -> None:
        self.name = name
        self.layer_columns = checked_layer_columns(layer_columns, int(num_layers))
        self.dtype = np.dtype(dtype)
        self.fill_value = int(fill_value)
        shape = (int(num_slots), int(num_layers), int(top_k))
        if min(shape) <= 0 or stat_ranks <= 0:
            raise ConfigError(f"shared slot cache {name}: sizes must be positive, got {shape} "
                              f"and {stat_ranks} ranks")
        slots_size = int(np.prod(shape)) * self.dtype.itemsize
        stats_offset = -(-slots_size // 8) * 8
        # column 0: 1 once the rank has published
        stats_shape = (int(stat_ranks), 1 + len(STAT_FIELDS))
        size = stats_offset + int(np.prod(stats_shape)) * 8
        self._owner = create
        if create:
            self._shm = self._create(name, size)
            _CREATED_HERE.add(name)
        else:
            self._shm = shared_memory.SharedMemory(name=name, create=False)
            # Python < 3.13 registers attached segments with the resource tracker, which
            # would unlink the engine's segment when this worker exits.
            if name not in _CREATED_HERE:
                try:
                    resource_tracker.unregister(self._shm._name, "shared_memory")  # type: ignore[attr-defined]
                except Exception:  # pragma: no cover - tracker internals differ by version
                    pass
            if self._shm.size < size:
                actual = self._shm.size
                self._shm.close()
                raise ConfigError(
                    f"shared slot cache {name} holds {actual} bytes but {shape} {self.dtype} needs {size}; "
                    "the engine and the worker disagree on the capture geometry")
        self.array = np.ndarray(shape, dtype=self.dtype, buffer=self._shm.buf)
        self._stats = np.ndarray(stats_shape, dtype=np.float64, buffer=self._shm.buf,
                                 offset=stats_offset)
        if create:
            self.array[...] = self.fill_value
            self._stats[...] = 0

    def publish(self, rank: int, stats: Mapping[str, Any]) -> None:
        """Store a worker's counters (the :data:`STAT_FIELDS` of its ``stats()``) in its row."""
        if not 0 <= rank < self._stats.shape[0]:
            raise ValueError(f"shared slot cache {self.name}: rank {rank} outside 0..{self._stats.shape[0] - 1}")
        row = np.fromiter((float(stats.get(key, 0) or 0) for key in STAT_FIELDS), dtype=np.float64,
                          count=len(STAT_FIELDS))
        self._stats[rank, 1:] = row
        self._stats[rank, 0] = 1.0

    def publish_values(self, rank: int, values: Sequence[float]) -> None:
        """Store a worker's counters given in :data:`STAT_FIELDS` order (every step: no dict)."""
        if not 0 <= rank < self._stats.shape[0]:
            raise ValueError(f"shared slot cache {self.name}: rank {rank} outside 0..{self._stats.shape[0] - 1}")
        self._stats[rank, 1:] = values
        self._stats[rank, 0] = 1.0

    def rank_stats(self) -> dict[int, dict[str, float]]:
        """``{rank: {field: value}}`` for every rank that has published."""
        rows = self._stats.copy()
        return {rank: dict(zip(STAT_FIELDS, row[1:].tolist(), strict=True))
                for rank, row in enumerate(rows) if row[0] == 1.0}

    @staticmethod
    def _create(name: str, size: int) -> shared_memory.SharedMemory:
        try:
            return shared_memory.SharedMemory(name=name, create=True, size=size)
        except FileExistsError:
            # A previous engine with the same suffix died without unlinking it.
            stale = shared_memory.SharedMemory(name=name, create=False)
            stale.close()
            stale.unlink()
            logger.warning("routing replay: removed a stale shared slot cache %s left by a previous "
                           "engine", name)
            return shared_memory.SharedMemory(name=name, create=True, size=size)

    @property
    def owner(self) -> bool:
        return self._owner

    def close(self) -> None:
        """Detach; the owner also unlinks the segment."""
        shm, self._shm = getattr(self, "_shm", None), None
        if shm is None:
            return
        self.array = np.empty((0,) + self.array.shape[1:], dtype=self.dtype)
        self._stats = np.zeros((0, self._stats.shape[1]), dtype=np.float64)
        shm.close()
        if self._owner:
            _CREATED_HERE.discard(self.name)
            try:
                shm.unlink()
            except FileNotFoundError:
                pass
