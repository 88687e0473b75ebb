"""The store interface every backend implements.

A store holds encoded routing records (opaque bytes) under rollout-level keys, inside
one namespace.  Keys are validated with :func:`fd_routing_replay.keys.check_key`; prefix
operations follow the boundary-safe semantics of :func:`~fd_routing_replay.keys.prefix_matches`.
Required methods are few; optional capabilities are announced by ``supports_*`` methods
that default to False.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import ClassVar

from fd_routing_replay.keys import check_key, check_namespace, check_prefix

Buffer = bytes | bytearray | memoryview


class RoutingStore(ABC):
    """Byte store for routing records, scoped to one namespace.

    Errors: ``InvalidRolloutId`` for a bad key or prefix, ``TransientStoreError`` for a
    failure a retry may fix, ``PermanentStoreError`` for the rest.
    """

    scheme: ClassVar[str] = ""

    def __init__(self, namespace: str) -> None:
        self.namespace = check_namespace(namespace)

    # -- required -----------------------------------------------------------------
    @abstractmethod
    def put(self, key: str, value: Buffer) -> None:
        """Store ``value`` under ``key``, replacing any previous value atomically."""

    @abstractmethod
    def get(self, key: str) -> bytes | memoryview | None:
        """Return the value stored under ``key``, or None when there is none."""

    @abstractmethod
    def delete(self, keys: Iterable[str]) -> int:
        """Remove the given keys; return how many existed.  Missing keys are not errors."""

    @abstractmethod
    def delete_prefix(self, prefixes: Iterable[str]) -> dict[str, int]:
        """Remove every key matching each prefix; return the count removed per prefix."""

    @abstractmethod
    def list(self, prefix: str | None = None) -> list[str]:
        """Return the sorted keys of this namespace, optionally those matching ``prefix``."""

    @abstractmethod
    def clear(self) -> int:
        """Remove every key of this namespace (never another's); return the count."""

    # -- with defaults --------------------------------------------------------------
    def exists(self, key: str) -> bool:
        """True when ``key`` holds a value."""
        return self.get(key) is not None

    def put_parts(self, key: str, parts: Sequence[Buffer]) -> None:
        """Store the concatenation of ``parts``; backends override it to avoid the join."""
        self.put(key, b"".join(parts))

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release connections and handles.  Idempotent."""

    def describe(self) -> str:
        """One line naming the backend and where its data lives, for logs and the CLI."""
        return f"{self.scheme or type(self).__name__}(namespace={self.namespace})"

    # -- optional capabilities -------------------------------------------------------
    def supports_fsync(self) -> bool:
        """True when a successful put is durable across a power loss."""
        return False

    def supports_cross_process(self) -> bool:
        """True when another process opening the same config sees the same data."""
        return False

    def supports_list_namespaces(self) -> bool:
        """True when :meth:`list_namespaces` can enumerate the namespaces beside this one."""
        return False

    def list_namespaces(self) -> list[str]:
        """Namespaces holding data in this store's location (``fd-rr ls --namespaces``)."""
        raise NotImplementedError(f"{self.describe()} cannot list its namespaces")

    def supports_expiry(self) -> bool:
        """True when the store can apply ``retention.ttl_s`` itself, at write time
        (:meth:`expire_records_after`); the retention sweeper covers the others."""
        return False

    def expire_records_after(self, ttl_s: float) -> None:
        """Make every rr-v1 record put from now on expire ``ttl_s`` seconds after its
        ``created`` time (0: no expiry).  Only where :meth:`supports_expiry`."""
        raise NotImplementedError(f"{self.describe()} cannot expire records by itself")

    def converts_records(self) -> bool:
        """True when ``put`` takes rr-v1 records and stores them in a format of its own
        (FastDeploy's ``.pdtensor`` files): writers hand such a store rr-v1 records
        whatever ``capture.record_format`` says, since raw bytes carry no dtype or shape."""
        return False

    # -- helpers for backends --------------------------------------------------------
    @staticmethod
    def _keys(keys: Iterable[str]) -> list[str]:
        if isinstance(keys, str):
            keys = [keys]
        return [check_key(k) for k in keys]

    @staticmethod
    def _prefixes(prefixes: Iterable[str]) -> list[str]:
        if isinstance(prefixes, str):
            prefixes = [prefixes]
        return [check_prefix(p) for p in prefixes]

    def __enter__(self) -> RoutingStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.describe()}>"
