"""Time- and size-based retention: a sweeper that works on any store, and stores that
apply the TTL themselves.

``retention.ttl_s`` deletes records whose ``created`` time (the rr-v1 header) is more
than ``ttl_s`` seconds in the past; ``retention.max_bytes`` then deletes the oldest
records until the namespace holds at most that many bytes.  Records whose age cannot be
told (FastDeploy's own formats: no ``created``) are never deleted by age or size; they
are counted.  The writer of rank dp0-tp0 runs :func:`apply_retention` every
``retention.sweep_interval_s`` on a :class:`Sweeper` thread of its own (its own store
connection, so it never waits behind the writer's queue; a failing sweep is logged, rate
limited, and tried again at the next interval); ``fd-rr rm --older-than 2h [--dry-run]``
runs :func:`sweep` by hand.

A store that can expire records itself (``store.supports_expiry()``: the redis store,
``PEXPIREAT`` at ``created + ttl_s`` set at write time,
:mod:`fd_routing_replay.store.redis.expiry`) is told the TTL by the writer; the periodic
pass then only purges the index entries of what expired (``store.purge_expired()``) and
applies ``max_bytes`` — no reading of every header.  Records such a store holds without
an expiry (written before ``ttl_s`` was set) are left to ``fd-rr rm --older-than``.

Headers are read with the store's ``read_ranges`` where it has it (4 KiB per record),
else the whole value.  A record is re-checked just before it is deleted, so one that a
writer replaced in the meantime (newer ``created``) is kept; the store has no conditional
delete, so a replacement landing in the instant between that check and the delete can
still be lost — run the sweeper with a TTL well above a rollout's lifetime.

Partial records (``{rollout_id}_partial``, ``capture.partial_every_tokens``) age like any
record: a running rollout rewrites its partial every N positions, so only a stalled,
aborted or crashed rollout's partial grows old.  The sweeper (``partials=True``, what
:func:`apply_retention` passes) also deletes a *superseded* partial — one whose final
record (its rollout id, or layer 0 of a per-layer record) is stored and was created no
earlier — which the writer normally deletes itself once the final is durable; it is left
behind only when that delete never ran (a crash in between).  A partial newer than the
stored final (the rollout id sent again) is kept.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from fd_routing_replay.codec import MAGIC, read_header
from fd_routing_replay.core.logs import RateLimitedLog
from fd_routing_replay.errors import ConfigError, RecordError
from fd_routing_replay.keys import layer_key, split_partial_key

__all__ = ["RecordAge", "SweepReport", "Sweeper", "apply_retention", "parse_duration", "record_ages",
           "superseded_partials", "sweep"]

log = logging.getLogger(__name__)

_HEAD_BYTES = 4096
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_RE = re.compile(r"([0-9]+(?:\.[0-9]+)?)([smhd]?)")


def parse_duration(text: str) -> float:
    """Seconds in ``90``, ``90s``, ``30m``, ``2h``, ``7d`` (ASCII digits, one unit)."""
    match = _DURATION_RE.fullmatch(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise ConfigError(f"invalid duration {text!r}: use a number of seconds or a number "
                          "with one unit s, m, h or d (e.g. 90s, 30m, 2h, 7d)")
    return float(match.group(1)) * _UNITS[match.group(2) or "s"]


@dataclass(frozen=True)
class RecordAge:
    """One stored value: when it was created (None: unknown) and its size in bytes."""

    key: str
    created: float | None
    size: int


@dataclass
class SweepReport:
    """What a sweep found and did (``deleted`` is empty on a dry run)."""

    examined: int = 0
    unknown_age: int = 0
    bytes_before: int = 0
    expired: list[str] = field(default_factory=list)
    evicted: list[str] = field(default_factory=list)
    superseded: list[str] = field(default_factory=list)
    deleted: int = 0
    kept_replaced: int = 0
    purged: int = 0
    dry_run: bool = False

    _removed_bytes: int = field(default=0, repr=False)

    @property
    def bytes_after(self) -> int:
        """Bytes left once the deletions are done (what a dry run would leave)."""
        return self.bytes_before - self._removed_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"examined": self.examined, "unknown_age": self.unknown_age,
                "bytes_before": self.bytes_before, "bytes_after": self.bytes_after,
                "expired": list(self.expired), "evicted": list(self.evicted),
                "superseded": list(self.superseded),
                "deleted": self.deleted, "kept_replaced": self.kept_replaced,
                "purged": self.purged, "dry_run": self.dry_run}


def _head(store: Any, key: str) -> bytes | None:
    read_ranges = getattr(store, "read_ranges", None)
    if read_ranges is not None:
        parts = read_ranges(key, [(0, _HEAD_BYTES)])
        return None if parts is None else parts[0]
    value = store.get(key)
    return None if value is None else bytes(memoryview(value)[:_HEAD_BYTES])


def _age(store: Any, key: str) -> RecordAge | None:
    head = _head(store, key)
    if head is None:
        return None                                   # deleted meanwhile
    if head[:4] != MAGIC:
        return RecordAge(key, None, len(head))
    try:
        header = read_header(head, require_payload=False)
    except RecordError:
        return RecordAge(key, None, len(head))        # fsck's business, not the sweeper's
    size = header.payload_offset + header.payload_length
    return RecordAge(key, header.created, size)


def record_ages(store: Any, prefix: str | None = None) -> Iterable[RecordAge]:
    """``created`` and size of every value under ``prefix`` (headers only)."""
    for key in store.list(prefix):
        age = _age(store, key)
        if age is not None:
            yield age


def superseded_partials(ages: Iterable[RecordAge]) -> list[RecordAge]:
    """The partial records among ``ages`` whose final record is among them too, created no
    earlier (see the module docstring)."""
    by_key = {age.key: age for age in ages}
    found = []
    for key, age in by_key.items():
        rollout = split_partial_key(key)
        if rollout is None:
            continue
        final = by_key.get(rollout.text) or by_key.get(layer_key(rollout.text, 0))
        if final is not None and (age.created is None or final.created is None
                                  or final.created >= age.created):
            found.append(age)
    return sorted(found, key=lambda age: age.key)


def sweep(store: Any, *, ttl_s: float = 0.0, max_bytes: int = 0, prefix: str | None = None,
          dry_run: bool = False, clock: Callable[[], float] = time.time,
          partials: bool = False) -> SweepReport:
    """Delete what ``ttl_s`` (0: no limit) and ``max_bytes`` (0: no limit) say to, and with
    ``partials`` the superseded partial records (:func:`superseded_partials`).

    Never deletes a record younger than ``ttl_s`` for age, and only records of known age
    for size (oldest first).  ``clock`` gives "now" (tests pass a fake one).
    """
    if ttl_s < 0 or max_bytes < 0:
        raise ValueError(f"ttl_s and max_bytes must be >= 0, got {ttl_s!r} and {max_bytes!r}")
    report = SweepReport(dry_run=dry_run)
    now = clock()
    ages = list(record_ages(store, prefix))
    doomed: list[RecordAge] = superseded_partials(ages) if partials else []
    report.superseded = [age.key for age in doomed]
    gone = set(report.superseded)
    known: list[RecordAge] = []
    for age in ages:
        report.examined += 1
        report.bytes_before += age.size
        if age.created is None:
            report.unknown_age += 1
        elif age.key not in gone:
            known.append(age)
    known.sort(key=lambda age: (age.created, age.key))
    kept = known
    if ttl_s > 0:
        cutoff = now - ttl_s
        expired = [age for age in known if age.created < cutoff]
        report.expired = [age.key for age in expired]
        doomed += expired
        kept = known[len(expired):]
    if max_bytes > 0:
        total = report.bytes_before - sum(age.size for age in doomed)
        for age in kept:
            if total <= max_bytes:
                break
            doomed.append(age)
            report.evicted.append(age.key)
            total -= age.size
    for age in doomed:
        report._removed_bytes += age.size
    if dry_run or not doomed:
        return report
    for age in doomed:
        current = _age(store, age.key)               # replaced since it was listed: keep it
        if current is None:
            continue
        if current.created != age.created:
            report.kept_replaced += 1
            report._removed_bytes -= age.size
            continue
        report.deleted += store.delete([age.key])
    if report.deleted:
        log.info("retention: deleted %d records from %s (%d expired, %d over max_bytes, %d "
                 "superseded partial records)", report.deleted, store.describe(),
                 len(report.expired), len(report.evicted), len(report.superseded))
    return report


def apply_retention(store: Any, *, ttl_s: float = 0.0, max_bytes: int = 0,
                    clock: Callable[[], float] = time.time) -> SweepReport:
    """The periodic retention pass over a namespace (the writer's sweeper).

    Where the store expires records itself (``supports_expiry()``), the TTL is its job:
    this purges the index entries of expired records (``report.purged``) and applies only
    ``max_bytes``.  Elsewhere it is :func:`sweep` with both limits.  Every sweep also
    deletes superseded partial records.
    """
    if not store.supports_expiry():
        return sweep(store, ttl_s=ttl_s, max_bytes=max_bytes, clock=clock, partials=True)
    purged = store.purge_expired() if ttl_s > 0 else 0
    report = sweep(store, max_bytes=max_bytes, clock=clock, partials=True) if max_bytes > 0 \
        else SweepReport()
    report.purged = purged
    if purged:
        log.info("retention: purged the index entries of %d expired records from %s", purged,
                 store.describe())
    return report


class Sweeper:
    """A daemon thread sweeping the namespace every ``retention.sweep_interval_s``."""

    def __init__(self, store_config: Any, retention: Any) -> None:
        self.store_config = store_config
        self.retention = retention
        self.sweeps = 0
        self.deleted = 0
        self.purged = 0
        self._stop = threading.Event()
        self._errors = RateLimitedLog(log)
        self._thread = threading.Thread(target=self._run, name="fd-rr-retention", daemon=True)

    @classmethod
    def start_for(cls, store_config: Any, retention: Any, identity: Any) -> Sweeper | None:
        """A started sweeper when retention asks for one and this is rank dp0-tp0."""
        if retention is None or not (retention.ttl_s or retention.max_bytes):
            return None
        if (identity.dp_rank, identity.tp_rank) != (0, 0):
            return None
        sweeper = cls(store_config, retention)
        sweeper._thread.start()
        return sweeper

    def _run(self) -> None:
        from fd_routing_replay.store import open_store

        store = None
        while not self._stop.wait(self.retention.sweep_interval_s):
            try:
                if store is None:
                    store = open_store(self.store_config)
                report = apply_retention(store, ttl_s=self.retention.ttl_s,
                                         max_bytes=self.retention.max_bytes)
                self.sweeps += 1
                self.deleted += report.deleted
                self.purged += report.purged
            except Exception as exc:  # noqa: BLE001 - retried at the next interval
                self._errors.log(logging.ERROR, "retention", "routing writer: retention sweep of "
                                 "%s failed (retried in %g s): %r", self.store_config.namespace,
                                 self.retention.sweep_interval_s, exc)
        if store is not None:
            store.close()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
