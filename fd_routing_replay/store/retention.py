"""Time- and size-based retention: a sweeper that works on any store, and stores that
apply the TTL themselves.

``retention.ttl_s`` deletes records whose ``created`` time (the rr-v1 header) is more
than ``ttl_s`` seconds in the past; ``retention.max_bytes`` then deletes the oldest
records until the namespace holds at most that many bytes.  Records whose age cannot be
told (FastDeploy's own formats: no ``created``) are never deleted by age or size; they
are counted.  The writer of rank dp0-tp0 runs :func:`apply_retention` every
``retention.sweep_interval_s``; ``fd-rr rm --older-than 2h [--dry-run]`` runs
:func:`sweep` by hand.

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
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from fd_routing_replay.codec import MAGIC, read_header
from fd_routing_replay.errors import ConfigError, RecordError

__all__ = ["RecordAge", "SweepReport", "apply_retention", "parse_duration", "record_ages",
           "sweep"]

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


def sweep(store: Any, *, ttl_s: float = 0.0, max_bytes: int = 0, prefix: str | None = None,
          dry_run: bool = False, clock: Callable[[], float] = time.time) -> SweepReport:
    """Delete what ``ttl_s`` (0: no limit) and ``max_bytes`` (0: no limit) say to.

    Never deletes a record younger than ``ttl_s`` for age, and only records of known age
    for size (oldest first).  ``clock`` gives "now" (tests pass a fake one).
    """
    if ttl_s < 0 or max_bytes < 0:
        raise ValueError(f"ttl_s and max_bytes must be >= 0, got {ttl_s!r} and {max_bytes!r}")
    report = SweepReport(dry_run=dry_run)
    now = clock()
    known: list[RecordAge] = []
    for age in record_ages(store, prefix):
        report.examined += 1
        report.bytes_before += age.size
        if age.created is None:
            report.unknown_age += 1
        else:
            known.append(age)
    known.sort(key=lambda age: (age.created, age.key))
    doomed: list[RecordAge] = []
    if ttl_s > 0:
        cutoff = now - ttl_s
        expired = [age for age in known if age.created < cutoff]
        report.expired = [age.key for age in expired]
        doomed += expired
    if max_bytes > 0:
        total = report.bytes_before - sum(age.size for age in doomed)
        for age in known[len(doomed):]:
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
        log.info("retention: deleted %d records from %s (%d expired, %d over max_bytes)",
                 report.deleted, store.describe(), len(report.expired), len(report.evicted))
    return report


def apply_retention(store: Any, *, ttl_s: float = 0.0, max_bytes: int = 0,
                    clock: Callable[[], float] = time.time) -> SweepReport:
    """The periodic retention pass over a namespace (the writer's sweeper).

    Where the store expires records itself (``supports_expiry()``), the TTL is its job:
    this purges the index entries of expired records (``report.purged``) and applies only
    ``max_bytes``.  Elsewhere it is :func:`sweep` with both limits.
    """
    if not store.supports_expiry():
        return sweep(store, ttl_s=ttl_s, max_bytes=max_bytes, clock=clock)
    purged = store.purge_expired() if ttl_s > 0 else 0
    report = sweep(store, max_bytes=max_bytes, clock=clock) if max_bytes > 0 else SweepReport()
    report.purged = purged
    if purged:
        log.info("retention: purged the index entries of %d expired records from %s", purged,
                 store.describe())
    return report
