"""Exception hierarchy shared by every module.

Every error raised on purpose by this package derives from ``RoutingReplayError`` so
callers can catch ours without catching programming errors.  Errors about bad input
also derive from ``ValueError``.
"""

from __future__ import annotations


class RoutingReplayError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(RoutingReplayError, ValueError):
    """A configuration key, type or value is invalid; the message names the key."""


class InvalidRolloutId(RoutingReplayError, ValueError):
    """A rollout id, request id or store key breaks the key grammar."""


class RecordError(RoutingReplayError, ValueError):
    """A routing record is malformed, corrupt, or inconsistent with its header."""


class OpsError(RoutingReplayError, ValueError):
    """A custom-op argument has the wrong dtype, shape or value."""


class StoreError(RoutingReplayError):
    """A store operation failed."""


class TransientStoreError(StoreError):
    """A store failure that may succeed when retried (connection refused, timeout)."""


class PermanentStoreError(StoreError):
    """A store failure that retrying cannot fix (value too large, rejected key)."""


class ProviderUnavailableError(TransientStoreError):
    """The P2PStore provider holding a record is closed, crashed or unreachable.

    ``provider`` is its transport address (``host:port``); the record lives only in
    that process's memory, so it is lost if the process is gone for good.
    """

    def __init__(self, message: str, *, key: str, provider: str) -> None:
        super().__init__(message)
        self.key = key
        self.provider = provider


class UnknownStoreType(StoreError, ValueError):
    """No backend is registered for the requested store type or URL scheme."""
