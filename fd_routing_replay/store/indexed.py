"""``IndexedStore``: the base of every store whose keys are listed by the Redis prefix index
(:mod:`.index`) — redis, p2pstore, mooncake.

``delete``, ``delete_prefix``, ``clear`` and ``list`` are implemented once, over the index
and the backend's payload deleter, so every indexed backend gets the same boundary-safe,
O(log N + matched) semantics and the same race protocol (entries first, then payloads,
re-checked: :meth:`PrefixIndex.remove_then_delete
<fd_routing_replay.store.index.prefix_index.PrefixIndex.remove_then_delete>`).  A backend
provides:

* ``index`` — its :class:`~fd_routing_replay.store.index.prefix_index.PrefixIndex`;
* :meth:`_delete_payloads` — delete the payloads of some keys, one flag per key (was it
  there), or override :meth:`_remove_keys` when entries and payloads can change together
  (the redis store on one node: one ``MULTI`` per page);
* :meth:`payloads_exist` and :meth:`iter_payload_keys` — what ``fd-rr fsck`` and
  ``fd-rr doctor`` compare the index with;
* :meth:`translate_errors` — a context manager turning client errors into
  ``TransientStoreError`` / ``PermanentStoreError``;
* optionally, for ``fd-rr fsck``: :meth:`payload_problems` (announced by
  :meth:`supports_record_check`) and :meth:`quarantine` / :meth:`quarantine_hint`
  (announced by :meth:`supports_quarantine`).

:func:`as_indexed` is how fsck and doctor recognise such a store (metrics wrapper or not).
"""

from __future__ import annotations

import contextlib
from abc import abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from fd_routing_replay.store.base import RoutingStore


class IndexedStore(RoutingStore):
    """A :class:`RoutingStore` whose keys live in a prefix index in Redis."""

    index: Any
    delete_batch: int = 1000
    """Keys per page of a delete (entries and payloads)."""

    # -- what a backend provides ----------------------------------------------------------
    def _delete_payloads(self, keys: list[str]) -> list[bool]:
        """Delete the payloads of ``keys``; one flag per key: was it there."""
        raise NotImplementedError(f"{type(self).__name__} must implement _delete_payloads "
                                  "or override _remove_keys")

    def _remove_keys(self, keys: list[str]) -> tuple[int, int]:
        """Remove one page of keys, index entries and payloads: ``(entries, payloads)``
        removed.  Default: entries first, then payloads, re-checked against racing puts."""
        return self.index.remove_then_delete(keys, self._delete_payloads)

    @abstractmethod
    def payloads_exist(self, keys: Sequence[str]) -> list[bool]:
        """For each key, whether its payload exists (fsck, doctor, the put re-check)."""

    @abstractmethod
    def iter_payload_keys(self) -> Iterator[str | bytes]:
        """Every store key with a payload in this namespace (a raw name it cannot map to a
        key as bytes); O(all payloads), for fsck."""

    def translate_errors(self, action: str) -> contextlib.AbstractContextManager[None]:
        """Turn client exceptions raised inside into Transient/PermanentStoreError (Redis
        errors by default; backends with another client extend it)."""
        from fd_routing_replay.store.redis_client import translating_errors

        return translating_errors(self, action)

    # -- optional capabilities (fsck) ----------------------------------------------------------
    def supports_record_check(self) -> bool:
        """True when :meth:`payload_problems` can tell a payload that cannot be read back
        without reading it (fsck's layout check)."""
        return False

    def payload_problems(self, keys: Sequence[str]) -> list[str | None]:
        """Per key, why its payload cannot be read back (wrong type, missing chunks), or None."""
        raise NotImplementedError(f"{self.describe()} does not check record layouts")

    def supports_quarantine(self) -> bool:
        """True when :meth:`quarantine` can move bad payloads aside (fsck's repair)."""
        return False

    def quarantine(self, items: Sequence[str | bytes]) -> list[tuple[bool, str]]:
        """Move the payloads of ``items`` (keys, or raw names that are no valid key) out of
        the namespace; per item ``(moved, where or why not)``."""
        raise NotImplementedError(f"{self.describe()} cannot quarantine")

    def quarantine_hint(self) -> str:
        """One line telling an operator where quarantined payloads go and how to drop them."""
        return ""

    # -- implemented once -----------------------------------------------------------------
    def delete(self, keys: Iterable[str]) -> int:
        unique = list(dict.fromkeys(self._keys(keys)))
        removed = 0
        with self.translate_errors("delete keys"):
            for start in range(0, len(unique), self.delete_batch):
                removed += self._remove_keys(unique[start:start + self.delete_batch])[1]
        return removed

    def delete_prefix(self, prefixes: Iterable[str]) -> dict[str, int]:
        checked = self._prefixes(prefixes)
        with self.translate_errors(f"delete prefixes {checked[:3]!r}"):
            return self.index.delete_prefixes(checked, batch=self.delete_batch,
                                              remove_page=self._remove_entries)

    def clear(self) -> int:
        """Delete every indexed key of this namespace (never another namespace's, never a
        backend's store-wide wipe)."""
        with self.translate_errors("clear"):
            return self.index.clear(batch=self.delete_batch, remove_page=self._remove_entries)

    def list(self, prefix: str | None = None) -> list[str]:
        if prefix is not None:
            prefix = self._prefixes([prefix])[0]
        with self.translate_errors("list keys"):
            return list(self.index.match(prefix) if prefix is not None else self.index.all())

    def _remove_entries(self, keys: list[str]) -> int:
        return self._remove_keys(keys)[0]


def as_indexed(store: RoutingStore) -> IndexedStore | None:
    """``store`` (or the backend inside a metrics wrapper) when it is an IndexedStore."""
    from fd_routing_replay.store.instrumented import InstrumentedStore

    bare = store.inner if isinstance(store, InstrumentedStore) else store
    return bare if isinstance(bare, IndexedStore) else None
