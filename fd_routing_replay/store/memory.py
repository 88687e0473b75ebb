"""In-process store: a sorted key list per namespace, for tests and single-process use.

Stores opened with the same ``memory://NAME`` share data within the process (so two
namespaces can be checked for isolation); nothing survives the process.
Prefix operations bisect the sorted key list: O(log N + matched).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable
from urllib.parse import urlsplit

from fd_routing_replay.keys import SEPARATORS, check_key, check_prefix
from fd_routing_replay.store.base import Buffer, RoutingStore

_SPACES: dict[tuple[str, str], _Space] = {}
_SPACES_LOCK = threading.Lock()


class _Space:
    """The data of one (name, namespace) pair: values plus a sorted key list."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.values: dict[str, bytes] = {}
        self.sorted_keys: list[str] = []

    def insert(self, key: str, value: bytes) -> None:
        if key not in self.values:
            bisect.insort(self.sorted_keys, key)
        self.values[key] = value

    def remove(self, key: str) -> bool:
        if self.values.pop(key, None) is None:
            return False
        index = bisect.bisect_left(self.sorted_keys, key)
        del self.sorted_keys[index]
        return True

    def matching(self, prefix: str) -> list[str]:
        """Keys matching ``prefix`` boundary-safely: O(log N + matched).

        The matches are the key equal to the prefix plus the contiguous ranges that start
        with ``prefix + sep`` for each separator, so ``x:1`` never scans ``x:10…``.
        """
        if prefix.endswith(SEPARATORS):
            return self._range(prefix)
        exact = [prefix] if prefix in self.values else []
        ranges = [self._range(prefix + sep) for sep in SEPARATORS]
        return sorted(exact + [k for r in ranges for k in r])

    def _range(self, raw_prefix: str) -> list[str]:
        keys = self.sorted_keys
        start = bisect.bisect_left(keys, raw_prefix)
        end = start
        while end < len(keys) and keys[end].startswith(raw_prefix):
            end += 1
        return keys[start:end]


class MemoryStore(RoutingStore):
    """Process-local store; thread-safe."""

    scheme = "memory"

    def __init__(self, name: str = "default", namespace: str = "routing_replay") -> None:
        super().__init__(namespace)
        self.name = name
        with _SPACES_LOCK:
            self._space = _SPACES.setdefault((name, self.namespace), _Space())

    def supports_list_namespaces(self) -> bool:
        return True

    def list_namespaces(self) -> list[str]:
        with _SPACES_LOCK:
            return sorted(ns for (name, ns), space in _SPACES.items() if name == self.name and space.values)

    def put(self, key: str, value: Buffer) -> None:
        key = check_key(key)
        data = bytes(value)
        with self._space.lock:
            self._space.insert(key, data)

    def get(self, key: str) -> bytes | None:
        key = check_key(key)
        with self._space.lock:
            return self._space.values.get(key)

    def exists(self, key: str) -> bool:
        key = check_key(key)
        with self._space.lock:
            return key in self._space.values

    def delete(self, keys: Iterable[str]) -> int:
        checked = self._keys(keys)
        with self._space.lock:
            return sum(self._space.remove(k) for k in checked)

    def delete_prefix(self, prefixes: Iterable[str]) -> dict[str, int]:
        counts: dict[str, int] = {}
        for prefix in self._prefixes(prefixes):
            with self._space.lock:
                matched = self._space.matching(prefix)
                for key in matched:
                    self._space.remove(key)
            counts[prefix] = counts.get(prefix, 0) + len(matched)
        return counts

    def list(self, prefix: str | None = None) -> list[str]:
        with self._space.lock:
            if prefix is None:
                return list(self._space.sorted_keys)
            return self._space.matching(check_prefix(prefix))

    def clear(self) -> int:
        with self._space.lock:
            count = len(self._space.values)
            self._space.values.clear()
            self._space.sorted_keys.clear()
            return count

    def describe(self) -> str:
        return f"memory://{self.name} (namespace {self.namespace})"


def open_memory_store(store_config) -> MemoryStore:  # noqa: ANN001 - StoreConfig
    """Factory for ``type: memory`` / ``memory://NAME``."""
    name = "default"
    if store_config.url:
        name = urlsplit(store_config.url).netloc or "default"
    return MemoryStore(name=name, namespace=store_config.namespace)

"""In-process only: no config section, no capabilities beyond the required interface."""
