"""``fd-rr fsck``: check that a store's index and payloads agree and that every record can
be read back; with ``repair``, fix what can be fixed without losing a record.

What it finds, and what ``repair`` does:

* **dangling index entry** — an entry whose payload is gone (a crash between the two
  steps of a delete, or a record deleted by hand).  Repair drops the entry, after checking
  once more that the payload is still absent.
* **expired entry** — an entry whose payload Redis expired (``retention.ttl_s`` applied
  by the store: :mod:`fd_routing_replay.store.redis.expiry`), told from a dangling one by
  the expiry time the put recorded.  Not an inconsistency; repair purges the entry.
* **unindexed payload** — an intact record no prefix delete or ``list`` can see (a crash
  between the two steps of a put; on a cluster also of a delete).  Repair indexes it.
* **invalid index entry** — a member that is not a valid store key (not UTF-8, or breaking
  :func:`~fd_routing_replay.keys.check_key`).  The index never returns one; repair drops it.
* **invalid payload** — a payload under the namespace whose key breaks the key rules
  (``../../evil:0:0``, a newline, not UTF-8).  Never indexed: repair moves it to
  quarantine (where the store supports it), else leaves it and reports it.
* **corrupt record** — a payload that cannot be read back: wrong Redis type, missing chunks,
  a size that does not add up; with ``deep``, also an rr-v1 record whose checksum or header
  is wrong.  Repair quarantines it and drops its entry.
* **unreadable record** (``deep``) — one whose bytes cannot be fetched for a reason
  quarantine cannot fix (a P2PStore provider that is gone).  Reported, not repaired.
* **superseded partial record** — a partial record ``{rollout_id}_partial``
  (``capture.partial_every_tokens``) whose final record (the rollout id, or layer 0 of a
  per-layer record) is stored too: the writer deletes it once the final is durable, so it
  is the debris of a crash in between.  Not an inconsistency; repair deletes it (after
  checking once more that the final is there).  A partial without a final (a running, or
  an aborted, rollout) is counted, never touched.

Everything printed is escaped (:func:`~fd_routing_replay.store.index.members.printable`): a key
with a newline or terminal escapes shows as ``'a\\nb:0:0'``, bytes that are not UTF-8 as
``b'\\xff'``.

A store is checked when it is an :class:`~fd_routing_replay.store.indexed.IndexedStore`
(``index``, ``iter_payload_keys()`` — store keys as ``str``, raw names it cannot map to a
key as ``bytes`` — ``payloads_exist(keys)`` and ``translate_errors(action)``).  Optional
capabilities, announced by the store: ``supports_record_check()`` for
``payload_problems(keys)`` (per key, why the payload cannot be read, or None) and
``supports_quarantine()`` for ``quarantine(items)`` and ``quarantine_hint()``.

``migrate_index`` (``fd-rr fsck --migrate-index``) first moves the index into the
configured number of buckets (``store.redis.index_buckets``; :meth:`PrefixIndex.migrate
<fd_routing_replay.store.index.prefix_index.PrefixIndex.migrate>`), e.g. a single-set index into
buckets spread over a Redis Cluster, then checks as usual.

Finding unindexed payloads scans every key of the database (``SCAN``), and ``deep`` reads
every record, so this is an offline check: a dry run is safe any time, run ``repair`` when
writers are idle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fd_routing_replay.errors import (
    InvalidRolloutId,
    PermanentStoreError,
    ProviderUnavailableError,
    RecordError,
)
from fd_routing_replay.keys import check_key, layer_key, split_partial_key
from fd_routing_replay.store.base import RoutingStore
from fd_routing_replay.store.index.members import printable, split_members
from fd_routing_replay.store.indexed import IndexedStore, as_indexed

_SHOW = 20


@dataclass
class FsckReport:
    """What fsck found (and, with ``repair``, fixed) in one namespace.

    Every string is safe to print (escaped).  ``repaired`` is True when a repair ran and
    fixed everything; ``unresolved`` lists what it could not fix.
    """

    store: str
    namespace: str
    indexed: int = 0
    payloads: int = 0
    dangling: list[str] = field(default_factory=list)
    expired: list[str] = field(default_factory=list)
    unindexed: list[str] = field(default_factory=list)
    invalid_entries: list[str] = field(default_factory=list)
    invalid_payloads: list[str] = field(default_factory=list)
    corrupt: dict[str, str] = field(default_factory=dict)
    unreadable: dict[str, str] = field(default_factory=dict)
    partials: int = 0
    superseded_partials: list[str] = field(default_factory=list)
    layout_checked: bool = False
    deep: bool = False
    verified: int = 0
    unverified: int = 0
    quarantined: dict[str, str] = field(default_factory=dict)
    quarantine_hint: str = ""
    unresolved: list[str] = field(default_factory=list)
    repaired: bool = False
    index_buckets: int = 1
    migrated: int | None = None

    @property
    def consistent(self) -> bool:
        """True when nothing was found."""
        return not (self.dangling or self.unindexed or self.invalid_entries
                    or self.invalid_payloads or self.corrupt or self.unreadable)

    def to_text(self) -> str:
        """A readable multi-line report."""
        lines = [f"fsck {_one_line(self.store)}",
                 f"  index entries    {self.indexed} in {self.index_buckets} bucket(s)"
                 + (f" ({self.migrated} moved into them)" if self.migrated is not None else ""),
                 f"  payloads         {self.payloads}",
                 f"  dangling entries {len(self.dangling)} (index entry, payload missing)",
                 f"  unindexed        {len(self.unindexed)} (payload not in the index)",
                 f"  invalid entries  {len(self.invalid_entries)} (index member that is not "
                 "a valid key)",
                 f"  invalid payloads {len(self.invalid_payloads)} (payload whose key breaks "
                 "the key rules; never indexed)",
                 f"  corrupt records  {len(self.corrupt)} (payload that cannot be read back)"]
        if self.expired:  # retention at work, not an inconsistency
            lines.insert(5, f"  expired entries  {len(self.expired)} (index entry whose payload "
                         "expired by retention.ttl_s: not corruption; "
                         + ("purged)" if self.repaired else "--repair purges them)"))
        if self.partials:  # running or aborted rollouts' routing so far: not an inconsistency
            lines.append(f"  partial records  {self.partials}, {len(self.superseded_partials)} "
                         "superseded by their final record ("
                         + ("deleted)" if self.repaired and self.superseded_partials
                            else "--repair deletes them)" if self.superseded_partials else "none)"))
        if self.deep:
            lines.append(f"  unreadable       {len(self.unreadable)} (record that could not "
                         "be fetched)")
            lines.append(f"  deep check       {self.verified} checksum(s) verified, "
                         f"{self.unverified} record(s) without a checksum (not rr-v1)")
        elif not self.layout_checked:
            lines.append("  record layout    not checked by this backend (--deep reads "
                         "every record)")
        findings = [("superseded partial", self.superseded_partials),
                    ("dangling", self.dangling), ("unindexed", self.unindexed),
                    ("invalid entry", self.invalid_entries),
                    ("invalid payload", self.invalid_payloads),
                    ("corrupt", [f"{key}: {why}" for key, why in self.corrupt.items()]),
                    ("unreadable", [f"{key}: {why}" for key, why in self.unreadable.items()])]
        for label, items in findings:
            for item in items[:_SHOW]:
                lines.append(f"    {label}: {_one_line(item)}")
            if len(items) > _SHOW:
                lines.append(f"    ... and {len(items) - _SHOW} more {label}")
        moved = list(self.quarantined.items())
        for name, where in moved[:_SHOW]:
            lines.append(f"    quarantined: {name} -> {where}")
        if len(moved) > _SHOW:
            lines.append(f"    ... and {len(moved) - _SHOW} more quarantined")
        for item in self.unresolved[:_SHOW]:
            lines.append(f"    not repaired: {_one_line(item)}")
        if len(self.unresolved) > _SHOW:
            lines.append(f"    ... and {len(self.unresolved) - _SHOW} more not repaired")
        if self.quarantine_hint and (moved or (not self.repaired and (
                self.invalid_payloads or self.corrupt))):
            prefix = "" if moved else "with --repair, "
            lines.append(f"  quarantine: {prefix}{_one_line(self.quarantine_hint)}")
        if self.consistent:
            lines.append("  result: consistent")
        elif self.repaired:
            lines.append("  result: repaired (dangling and invalid entries dropped, payloads "
                         "indexed, invalid and corrupt payloads quarantined)")
        elif self.unresolved:
            lines.append(f"  result: INCONSISTENT, {len(self.unresolved)} problem(s) left after "
                         "the repair (listed above)")
        else:
            lines.append("  result: INCONSISTENT (run with --repair to fix)")
        return "\n".join(lines)


def fsck(store: RoutingStore, repair: bool = False, *, batch: int = 1000,
         deep: bool = False, migrate_index: bool = False) -> FsckReport:
    """Compare a store's index with its payloads and check every record; with ``repair``,
    fix what can be fixed.  ``deep`` also reads every record and verifies rr-v1 checksums;
    ``migrate_index`` first moves the index into the configured number of buckets."""
    indexed = as_indexed(store)  # the backend itself, also inside the metrics wrapper
    if indexed is None:
        raise TypeError(f"fsck needs a store with an index (an IndexedStore, declared with "
                        f"the 'indexed' capability); {store.describe()} has no 'index'")
    store = indexed
    with store.translate_errors("fsck"):
        migrated = store.index.migrate(batch=batch) if migrate_index else None
        report = _Fsck(store, batch, deep).run(repair)
        report.index_buckets = store.index.reload_layout().buckets
        report.migrated = migrated
        return report


class _Fsck:
    """One fsck run: the report plus what a repair needs (raw members, items)."""

    def __init__(self, store: IndexedStore, batch: int, deep: bool) -> None:
        self.store = store
        self.batch = batch
        self.deep = deep
        self.problems = store.payload_problems if store.supports_record_check() else None
        self.report = FsckReport(store=store.describe(), namespace=store.namespace, deep=deep,
                                 layout_checked=self.problems is not None,
                                 quarantine_hint=store.quarantine_hint()
                                 if store.supports_quarantine() else "")
        self.invalid_members: list[bytes] = []
        self.invalid_items: list[str | bytes] = []
        self.corrupt_keys: list[str] = []
        self.partial_keys: list[str] = []

    def run(self, repair: bool) -> FsckReport:
        self._check_index()
        self._check_payloads()
        report = self.report
        report.dangling.sort()
        report.unindexed.sort()
        report.invalid_entries.sort()
        report.invalid_payloads.sort()
        report.expired.sort()
        self._check_partials()
        if repair and (not report.consistent or report.expired or report.superseded_partials):
            self._repair()
            report.repaired = not report.unresolved
        return report

    # -- 1. the index: invalid members, dangling entries ------------------------------------
    def _check_index(self) -> None:
        for members in self.store.index.raw_pages(self.batch):
            self.report.indexed += len(members)
            keys, invalid = split_members(members)
            self.invalid_members.extend(invalid)
            self.report.invalid_entries.extend(printable(member) for member in invalid)
            if keys:
                present = self.store.payloads_exist(keys)
                missing = [key for key, found in zip(keys, present, strict=True) if not found]
                expired = set(_expired_entries(self.store, missing))
                self.report.expired.extend(key for key in missing if key in expired)
                self.report.dangling.extend(key for key in missing if key not in expired)

    # -- 2. the payloads: invalid keys, corrupt records, unindexed payloads -----------------
    def _check_payloads(self) -> None:
        page: list[str] = []
        for item in self.store.iter_payload_keys():
            self.report.payloads += 1
            key = _valid_key(item)
            if key is None:
                self.invalid_items.append(item)
                self.report.invalid_payloads.append(printable(item))
                continue
            page.append(key)
            if split_partial_key(key) is not None:
                self.partial_keys.append(key)
            if len(page) >= self.batch:
                self._check_page(page)
                page = []
        if page:
            self._check_page(page)

    def _check_page(self, keys: list[str]) -> None:
        intact = []
        for key, (kind, why) in zip(keys, self._records(keys), strict=True):
            if kind == "corrupt":
                self.report.corrupt[key] = why
                self.corrupt_keys.append(key)
            elif kind == "unreadable":
                self.report.unreadable[key] = why
            else:
                intact.append(key)
        indexed = self.store.index.present(intact)
        self.report.unindexed.extend(key for key, found in zip(intact, indexed, strict=True)
                                     if not found)

    def _records(self, keys: list[str], count: bool = True) -> list[tuple[str, str]]:
        """Per key ``(kind, why)``: kind ``ok``, ``corrupt`` or ``unreadable``."""
        problems = self.problems(keys) if self.problems is not None else [None] * len(keys)
        result = []
        for key, problem in zip(keys, problems, strict=True):
            if problem is not None:
                result.append(("corrupt", problem))
            elif self.deep:
                result.append(self._read_back(key, count))
            else:
                result.append(("ok", ""))
        return result

    def _read_back(self, key: str, count: bool) -> tuple[str, str]:
        from fd_routing_replay.codec import MAGIC, decode_record

        try:
            value = self.store.get(key)
        except ProviderUnavailableError as exc:
            return "unreadable", str(exc)
        except PermanentStoreError as exc:
            return "corrupt", str(exc)
        if value is None:
            return "ok", ""  # deleted since the scan
        view = memoryview(value)
        if bytes(view[:len(MAGIC)]) != MAGIC:
            self.report.unverified += count
            return "ok", ""
        try:
            decode_record(view, verify=True)
        except RecordError as exc:
            return "corrupt", f"rr-v1 record does not verify: {exc}"
        self.report.verified += count
        return "ok", ""

    # -- 3. partial records whose final record is stored -------------------------------------
    def _check_partials(self) -> None:
        self.report.partials = len(self.partial_keys)
        self.report.superseded_partials = sorted(self._superseded(self.partial_keys))

    def _superseded(self, keys: list[str]) -> list[str]:
        """Those of the partial ``keys`` whose final record's payload exists."""
        found = []
        for start in range(0, len(keys), self.batch):
            page = keys[start:start + self.batch]
            finals = [split_partial_key(key).text for key in page]
            fused = self.store.payloads_exist(finals)
            layered = self.store.payloads_exist([layer_key(final, 0) for final in finals])
            found += [key for key, a, b in zip(page, fused, layered, strict=True) if a or b]
        return found

    # -- repair --------------------------------------------------------------------------------
    def _repair(self) -> None:
        store, index, report = self.store, self.store.index, self.report
        for start in range(0, len(report.dangling), self.batch):
            page = report.dangling[start:start + self.batch]
            # A writer may have re-created a payload since the scan: keep those entries.
            still_missing = [key for key, found in zip(page, store.payloads_exist(page),
                                                       strict=True) if not found]
            index.remove(still_missing)
        index.remove(self.invalid_members)
        if report.expired:
            store.purge_expired(report.expired)  # re-checks each payload is still gone
        index.add(report.unindexed)
        still = self._superseded(report.superseded_partials)   # a final gone meanwhile: keep
        if still:
            store.delete(still)
        self._quarantine()
        report.unresolved.extend(f"{key}: unreadable ({why}); delete it with `fd-rr rm` if "
                                 "it is lost" for key, why in report.unreadable.items())

    def _quarantine(self) -> None:
        report = self.report
        # A corrupt record may have been written again since the scan: check once more.
        still = [key for key, (kind, _) in zip(self.corrupt_keys,
                                               self._records(self.corrupt_keys, count=False),
                                               strict=True) if kind == "corrupt"]
        items: list[tuple[str | bytes, str | None]] = [(item, None) for item in
                                                       self.invalid_items]
        items += [(key, key) for key in still]
        if not items:
            return
        if not self.store.supports_quarantine():
            cannot = f"{self.store.describe()} cannot quarantine"
            report.unresolved.extend(
                f"{printable(item)}: left in place and not indexed ({cannot})" if key is None
                else f"{key}: left in place ({cannot}); `fd-rr rm {key}` deletes it"
                for item, key in items)
            return
        outcomes = self.store.quarantine([item for item, _ in items])
        moved_keys = []
        for (item, key), (moved, where) in zip(items, outcomes, strict=True):
            if moved:
                report.quarantined[printable(item)] = where
                if key is not None:
                    moved_keys.append(key)
            else:
                report.unresolved.append(f"{printable(item)}: {where}")
        self.store.index.remove(moved_keys)


def _expired_entries(store: IndexedStore, missing: list[str]) -> list[str]:
    """Those of ``missing`` (entries without payload) whose payload the store expired."""
    if not missing or not store.supports_expiry():
        return []
    return store.expired_entries(missing)  # type: ignore[attr-defined]


def _valid_key(item: str | bytes) -> str | None:
    if not isinstance(item, str):
        return None
    try:
        return check_key(item)
    except InvalidRolloutId:
        return None


def _one_line(text: str) -> str:
    """``text`` with every unprintable character escaped (messages may quote stored data)."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)
