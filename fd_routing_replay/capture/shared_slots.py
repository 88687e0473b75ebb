"""A host slot cache in POSIX shared memory, shared by an engine and its workers.

FastDeploy 2.6 splits routing replay across processes: the worker captures each step
and scatters its rows by KV slot into a host buffer; the engine process assembles a
finished request from that buffer through the request's block table.  This is our
buffer for that split: ``[num_slots, num_layers, top_k]`` in the routing dtype, filled
with the fill value, named per engine instance (one per DP rank) so several servers on
one host never share it.  The engine creates and owns it (and unlinks it on close); a
worker attaches by name.

The name is ours (``fdrr_routing_slots.<suffix>``), not FastDeploy's
``routing_host_buffer.<port>``, so FastDeploy's own views never attach to it with a
shape of their own.
"""

from __future__ import annotations

import logging
from multiprocessing import resource_tracker, shared_memory

import numpy as np

from fd_routing_replay.capture.host_cache import HostSlotCache
from fd_routing_replay.errors import ConfigError

__all__ = ["SharedSlotCache", "shared_slots_name"]

logger = logging.getLogger(__name__)

_PREFIX = "fdrr_routing_slots."
_CREATED_HERE: set[str] = set()     # segments this process owns (tracked by its resource tracker)


def shared_slots_name(suffix: str | int) -> str:
    """The shared-memory name of the slot cache of one engine instance."""
    text = str(suffix)
    if not text or not all(c.isalnum() or c in "-_." for c in text) or len(text) > 64:
        raise ConfigError(f"shared slot cache suffix must be 1-64 characters of [A-Za-z0-9._-], got {text!r}")
    return _PREFIX + text


class SharedSlotCache(HostSlotCache):
    """A :class:`HostSlotCache` whose array lives in a named shared-memory segment."""

    def __init__(self, name: str, num_slots: int, num_layers: int, top_k: int, dtype: np.dtype,
                 fill_value: int, *, create: bool) -> None:
        self.name = name
        self.dtype = np.dtype(dtype)
        self.fill_value = int(fill_value)
        shape = (int(num_slots), int(num_layers), int(top_k))
        if min(shape) <= 0:
            raise ConfigError(f"shared slot cache {name}: sizes must be positive, got {shape}")
        size = int(np.prod(shape)) * self.dtype.itemsize
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
        if create:
            self.array[...] = self.fill_value

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
        shm.close()
        if self._owner:
            _CREATED_HERE.discard(self.name)
            try:
                shm.unlink()
            except FileNotFoundError:
                pass
