"""A real local store with switchable faults, for writer tests.

Registered as store type ``faulty`` by module path, so the writer *process* can open it
too.  Faults are driven by files named in ``store.options`` so the test process can flip
them while another process uses the store:

* ``down_flag``: while this file exists every call raises ``TransientStoreError``
  (a store that refuses connections);
* ``gate``: while this file exists, puts wait for it to disappear (a hung store);
* ``applied_gate``: while this file exists, a put that was applied (and logged) waits
  before it returns (a store whose reply has not come back yet);
* ``poison``: puts of keys containing this text raise ``PermanentStoreError``;
* ``crash_flag``: the next put that finds this file removes it and raises ``SystemExit``
  (the writer thread or process dies in the middle of a put);
* ``event_log``: one JSON line per applied put / delete / delete_prefix, appended with
  ``O_APPEND`` (atomic for short lines); a put records ``metadata["i"]`` of the record.
  A delete records which of its keys existed; a delete or prefix delete of a rollout id
  ``{base}:{t}:{s}`` records whether ``{base}:{t+1}:{s}`` was readable at that moment.
* ``auth_flag``: while this file exists every call raises ``PermanentStoreError`` from a
  ``redis.exceptions.AuthenticationError`` (``WRONGPASS``), as the Redis store does while
  a password is being rotated.

"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Sequence

from fd_routing_replay.codec import read_header
from fd_routing_replay.errors import PermanentStoreError, RecordError, TransientStoreError
from fd_routing_replay.keys import parse_rollout_id
from fd_routing_replay.store.base import Buffer, RoutingStore
from fd_routing_replay.store.local import LocalStore

_GATE_POLL_S = 0.002


def _metadata_i(parts: Sequence[Buffer]) -> object:
    """``metadata["i"]`` of an rr-v1 record being put (tests number their records)."""
    try:
        return read_header(parts[0], require_payload=False).metadata.get("i")
    except (RecordError, IndexError):
        return None


class FaultyStore(RoutingStore):
    """Delegates to a LocalStore, injecting the faults its options switch on."""

    scheme = "faulty"

    def __init__(self, inner: LocalStore, options: dict) -> None:
        super().__init__(inner.namespace)
        self.inner = inner
        self.down_flag = options.get("down_flag")
        self.gate = options.get("gate")
        self.poison = options.get("poison")
        self.event_log = options.get("event_log")
        self.crash_flag = options.get("crash_flag")
        self.auth_flag = options.get("auth_flag")
        self.applied_gate = options.get("applied_gate")

    def _check_up(self) -> None:
        if self.down_flag and os.path.exists(self.down_flag):
            raise TransientStoreError(f"faulty store: down ({self.down_flag} exists)")
        if self.auth_flag and os.path.exists(self.auth_flag):
            from redis.exceptions import AuthenticationError

            try:
                raise AuthenticationError("WRONGPASS invalid username-password pair or user "
                                          "is disabled.")
            except AuthenticationError as exc:  # what RedisStore.translate_error makes of it
                raise PermanentStoreError(f"faulty store: cannot put: AuthenticationError: "
                                          f"{exc} (check the ACL user name and password)") from exc

    def _wait_gate(self) -> None:
        while self.gate and os.path.exists(self.gate):
            time.sleep(_GATE_POLL_S)  # the store itself hangs; the test flips the file

    def _log(self, event: dict) -> None:
        if self.event_log:
            line = (json.dumps(event) + "\n").encode()
            fd = os.open(self.event_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)

    def put(self, key: str, value: Buffer) -> None:
        self.put_parts(key, [value])

    def put_parts(self, key: str, parts: Sequence[Buffer]) -> None:
        self._check_up()
        self._wait_gate()
        self._check_up()
        if self.crash_flag and os.path.exists(self.crash_flag):
            os.unlink(self.crash_flag)
            raise SystemExit(3)
        if self.poison and self.poison in key:
            raise PermanentStoreError(f"faulty store: key {key!r} is poisoned")
        self.inner.put_parts(key, parts)
        self._log({"op": "put", "key": key, "pid": os.getpid(), "i": _metadata_i(parts)})
        while self.applied_gate and os.path.exists(self.applied_gate):
            time.sleep(_GATE_POLL_S)

    def get(self, key: str):  # noqa: ANN201
        return self.inner.get(key)

    def delete(self, keys: Iterable[str]) -> int:
        self._check_up()
        keys = list(keys)
        existed = [key for key in keys if self.inner.exists(key)]
        successors = self._successors(keys)
        count = self.inner.delete(keys)
        self._log({"op": "delete", "keys": keys, "existed": existed,
                   "successor_readable": successors})
        return count

    def _successors(self, keys: list[str]) -> dict[str, bool]:
        """For each rollout id among ``keys``: is turn t+1 of it readable right now?"""
        successors = {}
        for key in keys:
            try:
                rollout = parse_rollout_id(key)
            except ValueError:
                continue
            successor = f"{rollout.base}:{rollout.turn + 1}:{rollout.segment}"
            successors[key] = self.inner.exists(successor)
        return successors

    def delete_prefix(self, prefixes: Iterable[str]) -> dict[str, int]:
        self._check_up()
        prefixes = list(prefixes)
        successors = self._successors(prefixes)
        counts = self.inner.delete_prefix(prefixes)
        self._log({"op": "delete_prefix", "prefixes": prefixes, "counts": counts,
                   "successor_readable": successors})
        return counts

    def list(self, prefix: str | None = None) -> list[str]:
        self._check_up()
        return self.inner.list(prefix)

    def clear(self) -> int:
        self._check_up()
        return self.inner.clear()

    def supports_cross_process(self) -> bool:
        return True


def open_faulty_store(store_config) -> FaultyStore:  # noqa: ANN001 - StoreConfig
    """Factory registered as ``faulty``: the local store at ``store.local.root``."""
    inner = LocalStore(store_config.local.root, store_config.namespace)
    return FaultyStore(inner, dict(store_config.options))
